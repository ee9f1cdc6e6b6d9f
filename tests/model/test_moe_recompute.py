"""Full recompute of MoE blocks: the rerun in backward saves what the forward saved, so the
gradients equal those without recompute (the grouped-GEMM probe's first call, made inside the
checkpointed forward, must not add saved tensors of its own)."""

from __future__ import annotations

import torch

from threefold.distributed.parallelize import build_model
from threefold.model.moe import grouped_mm_supported

from tp_checks import model_config, reference_grid

MOE = {"model.preset": "tiny", "model.layers": 2, "model.seq_len": 32, "model.num_experts": 4, "model.moe_every": 2}


def _grads(recompute: str) -> dict[str, torch.Tensor]:
    model = build_model(model_config({**MOE, "train.recompute": recompute}), reference_grid(), torch.device("cpu"))
    tokens = torch.randint(0, model.cfg.vocab, (32, 2), generator=torch.Generator().manual_seed(0))
    model(tokens, tokens).sum().backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def test_full_recompute_of_moe_blocks_gives_the_plain_gradients():
    plain = _grads("none")
    grouped_mm_supported.cache_clear()  # first asked inside the checkpointed forward, as in a fresh run
    recomputed = _grads("full")
    assert recomputed.keys() == plain.keys() and any("experts" in name for name in plain)
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=0, atol=0, msg=name)
