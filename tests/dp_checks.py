"""Helpers of the data-parallel tests (module level: spawned ranks import them): the small run's
config and grid, the engine's training loop through the Trainer, and the references it is
compared with (single-process torch AdamW, torch DDP)."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from threefold.config import build_config
from threefold.data import GlobalBatchSampler, load_tokens
from threefold.distributed.data_parallel import measure_memory
from threefold.distributed.grid import Grid, Group
from threefold.distributed.parallelize import build_model
from threefold.training.optim import build_optimizer, clip_gradients, global_grad_norm, lr_at
from threefold.training.trainer import Trainer
from threefold.validate import validate

from harness import CALM_LR

SMALL = {
    "model.preset": "tiny",
    "model.layers": 2,
    "model.seq_len": 64,
    "train.global_batch": 8,
    "train.micro_batch": 2,
    "train.warmup_steps": 5,
    "train.steps": 20,
    "train.lr": CALM_LR,
    "parallel.bucket_mb": 1.0,
}
STEPS = 20
CPU = torch.device("cpu")


def make_cfg(data: str, **extra):
    """SMALL on the stdlib corpus's token file `data` (see the `data` fixture), validated; logs
    (rank 0's) next to the data. Set parallel.dp to the data-parallel group it trains on."""
    pairs = {
        **SMALL,
        "data.path": data,
        "data.vocab": 256,
        "log.quiet": True,
        "log.dir": os.path.join(os.path.dirname(data), "logs"),
        **extra,
    }
    return validate(build_config(None, [(k, str(v)) for k, v in pairs.items()]))


def make_grid(dp_ranks: list[int] | None = None, dp_pg=None) -> Grid:
    """A grid whose only non-trivial group is dp (sub-groups of one spawned world): its world
    is that group too (the loss and the step's agreement are reduced over the grid's world)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if dp_ranks and len(dp_ranks) > 1:
        return Grid.alone(rank, dp=Group("dp", dp_ranks, dp_pg), world=Group("world", dp_ranks, dp_pg))
    return Grid.alone(rank)


def open_data(cfg):
    tokens = load_tokens(cfg.data.path, cfg.data.vocab, cfg.data.dtype, cfg.data.cache_dir)
    return tokens, GlobalBatchSampler(len(tokens.tokens), cfg.model.seq_len, cfg.train.global_batch, cfg.train.seed)


class _MemoryAfterStep:
    """A Trainer probe: the engine's memory after the update, before zero_grad."""

    def watch(self, chunks):
        return contextlib.nullcontext()

    def after_step(self, engine) -> None:
        self.report = measure_memory(engine)


def train_engine(cfg, grid: Grid, steps: int = STEPS, snapshot_at: int | None = None, measure: bool = False) -> dict:
    """threefold's Trainer on `grid`: per step the loss, whether the update was applied and the
    loss scale it ran with (+ the parameters after `snapshot_at`, the memory after the last update)."""
    probe = _MemoryAfterStep() if measure else None
    trainer = Trainer(cfg, grid, CPU, log=lambda *args: None, probe=probe)
    out = {"losses": [], "applied": [], "scales": [], "engine": trainer.engine}
    for step in range(steps):
        out["scales"].append(trainer.engine.loss_scale)
        result = trainer.train_step(step)
        out["losses"].append(result.loss)
        out["applied"].append(result.applied)
        if snapshot_at == step + 1:
            out["params"] = trainer.engine.full_parameters()
    if probe is not None:
        out["memory"] = probe.report
    return out


def train_reference(cfg, steps: int = STEPS) -> list[float]:
    """The pre-existing single-process loop: torch AdamW, global_grad_norm, clip_gradients."""
    t = cfg.train
    model = build_model(cfg, make_grid(), CPU)
    optimizer = build_optimizer(model, t)
    tokens, sampler = open_data(cfg)
    per_step = t.global_batch * cfg.model.seq_len
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, t)
        total = 0.0
        for x, y in sampler.microbatches(tokens.tokens, step, 0, 1, t.micro_batch):
            loss = model(x, y)
            (loss / per_step).backward()
            total += loss.item()
        clip_gradients(model, t.grad_clip, global_grad_norm(model, []))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / per_step)
    return losses


def train_ddp(cfg, grid: Grid, steps: int) -> dict[str, torch.Tensor]:
    """torch DistributedDataParallel + torch.optim.AdamW + clip_grad_norm_ on the same data."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    t = cfg.train
    model = build_model(cfg, grid, CPU)
    ddp = DDP(model, process_group=grid.dp.pg)
    optimizer = build_optimizer(model, t)
    tokens, sampler = open_data(cfg)
    local_tokens = t.global_batch * cfg.model.seq_len / grid.dp.size  # DDP averages over ranks
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, t)
        batches = sampler.microbatches(tokens.tokens, step, grid.dp_rank, grid.dp.size, t.micro_batch)
        for i, (x, y) in enumerate(batches):
            with ddp.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
                (ddp(x, y) / local_tokens).backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_delta(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def rank_pairs():
    """Sub-groups {0,1} and {2,3} of a 4-rank world (every rank creates every group)."""
    groups = {(0, 1): dist.new_group([0, 1]), (2, 3): dist.new_group([2, 3])}
    pair = (0, 1) if dist.get_rank() < 2 else (2, 3)
    return make_grid(list(pair), groups[pair]), make_grid([0, 1, 2, 3], dist.group.WORLD)


def flat_params(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([params[n].float().reshape(-1) for n in sorted(params)])


def quiet_trainer(data: str, root, steps: int, **extra) -> Trainer:
    """A single-process Trainer of the small run for `steps` steps: logs under root/log, no
    checkpoints, no traced steps, one report at most."""
    cfg = make_cfg(
        data,
        **{
            "train.steps": steps,
            "log.interval": 100,
            "log.trace_steps": "",
            "log.dir": str(root / "log"),
            "checkpoint.dir": "",
            **extra,
        },
    )
    return Trainer(cfg, make_grid(), torch.device("cpu"), log=lambda *args: None)
