"""One optimizer step as every rank agrees on it, and the metrics.jsonl record made from it.

result = trainer.train_step(step)                 # a StepResult
queued = trainer.queue_step(step)                 # a QueuedStep: on the device, not read yet
result = trainer.read_step(queued)                # ... read (on CUDA after the next step is queued)
record = step_record(result, throughput)          # the fields of one metrics.jsonl line
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from threefold.observe.peak import mfu


@dataclass
class StepResult:
    """What one step did: the same values on every rank (reduced over the world where they differ)."""

    step: int
    """The step just taken, counted from 1 as metrics.jsonl counts."""
    loss: float
    """Mean loss per token of the global batch (summed over micro-batches and ranks in fp64)."""
    grad_norm: float
    """Global gradient norm before clipping (NaN when the step was skipped for a non-finite value)."""
    lr: float
    applied: bool
    """False when the step was skipped (an fp16 overflow or a NaN/Inf on any rank)."""
    step_time_s: float
    """This rank's wall time of the step, data wait included."""
    data_wait_s: float
    """The slowest rank's wait for its micro-batches."""
    peak_mem_bytes: int
    """The largest peak device memory of any rank."""
    pp_idle_s: float
    """The most any rank waited for pipeline receives (on CUDA, and whenever steps are read one
    step late, in the newest step read before this one was queued: its events are read without
    waiting for the device, as is the compute time stragglers are judged by)."""
    pp_idle_fraction: float
    tp_comm_bytes: int
    """Bytes this rank's tensor-parallel collectives carried in the step."""
    dp_exposed_s: float
    """Data-parallel reduction left after backward on this rank."""
    loss_scale: float
    """The loss scale after the step (1 without loss scaling)."""
    extra: dict = field(default_factory=dict)
    """Further fields of the line: expert load (MoE), held-out loss, health, goodput, spans."""


@dataclass
class QueuedStep:
    """A step whose work is queued on the device and whose scalars are not read yet."""

    step: int
    """The step, counted from 0."""
    lr: float
    started: float
    """perf_counter() when the host began the step."""
    scalars: torch.Tensor
    """fp64 on the run's device: the loss sum over the world, the gradient norm, applied, the
    loss scale after the step (decided on the device), then the health vector reduced over the
    world (flags, then the slowest rank's values)."""
    tp_comm_bytes: int
    timers: dict
    """The step's exposed-communication timers (distributed/timer.py) by metric name, each a list (one
    per engine), unread: on CUDA a read waits for the device, so read_step reads them."""
    schedule: object
    """The schedule's timers (the pipeline executor's PipelineStats), unread, as `timers`."""
    extra: dict = field(default_factory=dict)
    """Fields the step's record gets besides StepResult's (expert load, held-out loss)."""


@dataclass(frozen=True)
class Throughput:
    """What turns a step time into throughput figures."""

    tokens_per_step: int
    flops_per_step: float
    world: int
    peak_flops: float | None
    """Per-device peak (None: unknown device, no MFU)."""
    bubble_theory: float


def step_record(result: StepResult, throughput: Throughput, now: float) -> dict:
    """The metrics.jsonl line of `result` (`now`: wall-clock time of the record)."""
    t = throughput
    tflops = t.flops_per_step / t.world / result.step_time_s / 1e12
    record = {
        "step": result.step,
        "time": now,
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "lr": result.lr,
        "tokens": result.step * t.tokens_per_step,
        "step_time_s": result.step_time_s,
        "tokens_per_s": t.tokens_per_step / result.step_time_s,
        "model_tflops_per_device": tflops,
        "mfu": mfu(tflops * 1e12, t.peak_flops),
        "peak_mem_bytes": result.peak_mem_bytes,
        "data_wait_s": result.data_wait_s,
        "tp_comm_bytes": result.tp_comm_bytes,
        "pp_idle_s": result.pp_idle_s,
        "pp_idle_fraction": result.pp_idle_fraction,
        "pp_bubble_theory": t.bubble_theory,
        "dp_exposed_s": result.dp_exposed_s,
        "loss_scale": result.loss_scale,
        "step_skipped": not result.applied,
    }
    record.update(result.extra)
    return record
