"""`threefold eval --checkpoint DIR [--json] [--config FILE] [--data.* / --parallel.* / --train.* ...]`.

The model comes from the checkpoint (its shape; only model.seq_len, the window length, may be
changed); data.* keys default to the ones the run trained with, so the held-out part is the
run's own; the layout (parallel.*) is free: any layout evaluates any checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from threefold.config import Config, ModelConfig, load_toml, parse_overrides, set_key
from threefold.errors import ConfigError

USAGE = """threefold eval --checkpoint DIR [--json] [--section.key VALUE ...]
  e.g. threefold eval --checkpoint ckpt --data.val_fraction 0.01 --parallel.tp 2"""


def eval_config(checkpoint_config: dict, config_file: str | None, overrides: list[tuple[str, str]]) -> Config:
    """Checkpoint model and data sections <- TOML file <- command line; the shape stays the checkpoint's."""
    cfg = Config()
    cfg.model = ModelConfig(**checkpoint_config["model"])
    for key, value in checkpoint_config.get("data", {}).items():
        if hasattr(cfg.data, key):
            setattr(cfg.data, key, value)
    if config_file:
        load_toml(cfg, config_file)
    for key, value in overrides:
        set_key(cfg, key, value)
    saved = ModelConfig(**checkpoint_config["model"])
    for f in dataclasses.fields(ModelConfig):
        # A GPT-2 position table has seq_len rows: its windows cannot be longer or shorter.
        free = f.name == "seq_len" and saved.arch == "llama"
        if not free and getattr(cfg.model, f.name) != getattr(saved, f.name):
            raise ConfigError(
                f"model.{f.name}",
                "the model's shape comes from the checkpoint",
                "only model.seq_len may be set, and only for llama-style models",
            )
    return cfg


def check_eval_config(cfg: Config, world_size: int | None) -> None:
    from threefold.validate import _validate_eval, validate_model, validate_parallel

    validate_model(cfg)
    validate_parallel(cfg, world_size)
    _validate_eval(cfg)
    if cfg.train.micro_batch <= 0:
        raise ConfigError("train.micro_batch", f"must be > 0, got {cfg.train.micro_batch}")
    stages = cfg.parallel.pp * cfg.parallel.vpp
    if stages > cfg.model.layers:
        raise ConfigError(
            "parallel.pp",
            f"pp*vpp = {stages} stages but the model has {cfg.model.layers} layers",
            "each stage needs at least one layer",
        )


def eval_worker(cfg_dict: dict, checkpoint: str) -> dict:
    """One evaluation process (in-process, spawned, or under torchrun)."""
    from threefold.distributed.grid import Grid
    from threefold.distributed.runtime import WorkerEnv, shutdown_distributed
    from threefold.errors import UserError
    from threefold.inference.evaluate import HeldOut
    from threefold.inference.load import build_chunks, checkpoint_model_config, load_model
    from threefold.train.worker import join_group, layout_of

    cfg = Config.from_dict(cfg_dict)
    try:
        device = join_group(cfg, WorkerEnv.from_environ())
        grid = Grid.build(layout_of(cfg), device=device)
        directory, manifest, _ = checkpoint_model_config(checkpoint)
        chunks = build_chunks(cfg, grid, device)
        load_model(chunks, cfg, directory, manifest)
        result = HeldOut(cfg).evaluate(chunks, grid, cfg)
        shutdown_distributed()
        return result
    except UserError as err:
        print(f"threefold: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)


def run_eval(cfg: Config, checkpoint: str) -> dict:
    from threefold.distributed.runtime import under_launcher

    if under_launcher():
        check_eval_config(cfg, int(os.environ["WORLD_SIZE"]))
        return eval_worker(cfg.to_dict(), checkpoint)
    check_eval_config(cfg, None)
    world = cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp
    if world == 1:
        return eval_worker(cfg.to_dict(), checkpoint)
    from threefold.distributed.launch import WorkersFailed, launch

    try:
        return launch(eval_worker, (cfg.to_dict(), checkpoint), world, cfg.train.threads, 0, cfg.train.timeout_s)
    except WorkersFailed as err:
        raise SystemExit(err.exit_code) from None


def eval_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="threefold eval", usage=USAGE)
    parser.add_argument("--checkpoint", required=True, help="a checkpoint directory, or a root holding some")
    parser.add_argument("--json", action="store_true", help='print {"loss": ..., "perplexity": ..., "tokens": ...}')
    parser.add_argument("--config", help="TOML file whose [data], [parallel], [train] tables apply")
    args, rest = parser.parse_known_args(argv)
    from threefold.data import load_tokens
    from threefold.data.tokenizer import check_vocab, open_tokenizer
    from threefold.inference.load import checkpoint_model_config

    _, manifest, _ = checkpoint_model_config(args.checkpoint)
    cfg = eval_config(manifest.config, args.config, parse_overrides(rest))
    check_eval_config(cfg, None if not os.environ.get("WORLD_SIZE") else int(os.environ["WORLD_SIZE"]))
    d, m = cfg.data, cfg.model
    if d.tokenizer:
        check_vocab(open_tokenizer(d.tokenizer), m.vocab, f"data.tokenizer {d.tokenizer}")
    stream = load_tokens(d.path, d.vocab, d.dtype, d.cache_dir, d.tokenizer)  # tokenize once, before spawning
    if stream.vocab_size > m.vocab:
        from threefold.errors import DataError

        raise DataError(
            f"{stream.source}: token ids go up to vocab {stream.vocab_size} but the checkpoint's "
            f"model.vocab is {m.vocab}"
        )
    result = run_eval(cfg, args.checkpoint)
    if int(os.environ.get("RANK", 0)) != 0:  # under torchrun every process runs this command
        return 0
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"val loss {result['loss']:.4f}  perplexity {result['perplexity']:.2f}  on {result['tokens']:,} "
            f"held-out tokens ({stream.source})"
        )
    return 0
