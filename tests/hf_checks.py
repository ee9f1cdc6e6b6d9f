"""Helpers of tests/checkpoint/test_hf_interop.py: tiny random Hugging Face models, and the check that runs
inside spawned ranks (logits of an imported checkpoint in a tensor/pipeline-parallel layout)."""

from __future__ import annotations

import torch

from threefold.config import Config, ModelConfig
from threefold.distributed.grid import Grid, RankLayout
from threefold.distributed.runtime import init_distributed, shutdown_distributed


def tiny_hf_model(kind: str, out_dir: str, **overrides):
    """A small randomly initialized transformers model of `kind`, saved with save_pretrained."""
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=96, n_positions=32, bos_token_id=0, eos_token_id=0, **overrides
        )
        model = transformers.GPT2LMHeadModel(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            vocab_size=96,
            max_position_embeddings=32,
            tie_word_embeddings=True,
            **overrides,
        )
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random (not zero) q/k/v biases, so their conversion is tested
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        cfg = transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=96,
            max_position_embeddings=32,
            rope_theta=5000.0,
            bos_token_id=0,
            eos_token_id=0,
            **overrides,
        )
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms away from 1 and biases away from 0: a swapped tensor shows
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(out_dir)
    return model


def layout_logits(jobs: list[tuple[str, dict]], tokens: torch.Tensor) -> list:
    """In each rank: for every (checkpoint, parallel overrides) job, load the checkpoint into
    that layout and return the whole-vocabulary logits [batch, seq, vocab] (last stage) or None."""
    from threefold.checkpoint import open_checkpoint
    from threefold.inference.forward import gather_vocab, pipeline_forward
    from threefold.inference.load import build_chunks, load_model

    init_distributed(torch.device("cpu"), timeout_s=120)
    grids: dict = {}
    out = []
    for path, parallel in jobs:
        directory, manifest = open_checkpoint(path)
        cfg = Config()
        cfg.model = ModelConfig(**manifest.config["model"])
        for key, value in parallel.items():
            setattr(cfg.parallel, key, value)
        p = cfg.parallel
        layout = RankLayout(tp=p.tp, cp=1, ep=1, dp=p.dp, pp=p.pp, order=p.order)
        if layout not in grids:
            grids[layout] = Grid.build(layout)
        grid = grids[layout]
        chunks = build_chunks(cfg, grid, torch.device("cpu"))
        load_model(chunks, cfg, directory, manifest)
        logits = pipeline_forward(chunks, grid, tokens, None, cfg.model.hidden, p.sp)
        # numpy, not torch: tensors would travel back through shared memory of an exiting process
        out.append(None if logits is None else gather_vocab(logits, grid).transpose(0, 1).numpy().copy())
    shutdown_distributed()
    return out
