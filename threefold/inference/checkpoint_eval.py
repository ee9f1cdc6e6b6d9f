"""Evaluating a checkpoint on the held-out data (what `threefold eval` runs).

The model comes from the checkpoint (its shape; only model.seq_len, the window length, may be
changed); data.* keys default to the ones the run trained with, so the held-out part is the
run's own; the layout (parallel.*) is free: any layout evaluates any checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from threefold.config import Config, ModelConfig, load_toml, set_key
from threefold.errors import ConfigError


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
    from threefold.distributed.runtime import WorkerEnv, join_group, layout_of, shutdown_distributed
    from threefold.errors import UserError
    from threefold.inference.evaluate import HeldOutEval
    from threefold.inference.load import build_chunks, checkpoint_model_config, load_model

    cfg = Config.from_dict(cfg_dict)
    try:
        device = join_group(cfg, WorkerEnv.from_environ())
        grid = Grid.build(layout_of(cfg), device=device)
        directory, manifest, _ = checkpoint_model_config(checkpoint)
        chunks = build_chunks(cfg, grid, device)
        load_model(chunks, cfg, directory, manifest)
        result = HeldOutEval(cfg).evaluate(chunks, grid, cfg)
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
