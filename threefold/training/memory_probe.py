"""Per-rank memory of one real training step, measured next to the formulas (`threefold memory`).

Measured, on every rank:
  params / grads / optimizer   live tensors of the data-parallel engine(s), each storage once,
                               after the optimizer step and before zero_grad (ZeRO's point)
  activations                  the peak bytes held for backward at any moment of the step's
                               pipeline schedule (LiveActivationMeter): what autograd saved, and
                               the stage outputs the executor keeps (until sent, or until their
                               backward without parallel.free_sent_outputs); parameters excluded
  zero3_params                 ZeRO 3: the parameter shard plus the units whole or being
                               gathered at the step's worst moment, against shard + root +
                               (parallel.zero3_prefetch + 1) blocks (data_parallel/memory.py)
Predicted:
  params / grads / optimizer   ZeRO's formulas on this rank's parameter count
                               (data_parallel/memory.py: 2P + 4P + 12P, ..., 18P/N under bf16)
  activations                  the per-layer formula of model/activations.py for this model,
                               times the layers of each chunk and the micro-batches the schedule
                               keeps in flight at its worst moment, plus the last stage's norm,
                               head input and logits. MoE layers are not covered by the
                               formula: their ranks show measured activations only.
Start-up (measured only):
  startup_peak                 the most tensor bytes allocated at once from the probe's creation
                               (just before the Trainer is built) to the start of the first
                               measured step: model construction and initialization, the
                               engine's buffers and optimizer state (AllocationPeak). ZeRO 3
                               builds one unit at a time, so its peak is about this rank's
                               shards plus one unit (docs/data_parallel.md).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from threefold.config import Config
from threefold.distributed import comm
from threefold.distributed.data_parallel.memory import CATEGORIES, measure_memory, zero3_param_peak
from threefold.distributed.pipeline.schedules import build_schedule
from threefold.model.activations import LiveActivationMeter, layer_activation_elements


def peak_inflight_layers(actions, layers_per_chunk: list[int]) -> int:
    """Most layer-micro-batches whose activations a rank holds at once under its schedule:
    a forward adds its chunk's layers, the backward of that micro-batch frees them."""
    live = peak = 0
    for a in actions:
        if a.kind == "F":
            live += layers_per_chunk[a.chunk]
            peak = max(peak, live)
        elif a.kind == "B":
            live -= layers_per_chunk[a.chunk]
    return peak


def peak_inflight(actions, chunks: set[int]) -> int:
    """Most micro-batches in flight at once over `chunks` (0 if the set is empty)."""
    live = peak = 0
    for a in actions:
        if a.chunk in chunks and a.kind in ("F", "B"):
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
    return peak


def predicted_activation_bytes(cfg: Config, grid, chunks: list[nn.Module], element_size: int) -> float | None:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if m.num_experts:
        return None
    # Context parallelism: every token-local activation is of this rank's seq/cp tokens, and the
    # cp attention keeps only local q, k, v, output and log-sum-exp (the ring re-sends the other
    # ranks' k/v in backward; a2a's head-sharded copies are as large as the local ones).
    s, b, h = m.seq_len // p.cp, t.micro_batch, m.hidden
    per_layer = layer_activation_elements(s, b, h, m.heads, m.kv_heads, m.ffn_hidden, p.tp, p.sp, t.recompute)
    actions = build_schedule(p.schedule, p.pp, p.microbatches, p.vpp)[grid.pp_rank]
    layers = [len(c.layers) for c in chunks]
    heads = {i for i, c in enumerate(chunks) if c.head is not None}
    # Last stage per micro-batch: final-norm input and output (sbh each, sequence-split under SP)
    # and the logits the loss keeps, in the working dtype (sbV/t: the chunked loss upcasts one
    # chunk at a time and saves none of it).
    sbh = s * b * h / (p.tp if p.sp else 1) * element_size
    head = 2 * sbh + element_size * s * b * m.vocab / p.tp
    # A chunk that sends its output keeps it until its backward; with parallel.free_sent_outputs
    # only until it is sent, so at the peak (the end of a forward) just the output being made.
    senders = set(range(len(chunks))) - heads
    held = (min(1, len(senders)) if p.free_sent_outputs else peak_inflight(actions, senders)) * sbh
    return (
        peak_inflight_layers(actions, layers) * per_layer * element_size + peak_inflight(actions, heads) * head + held
    )


class AllocationPeak:
    """Peak bytes of tensor memory allocated on `device` between start() and stop(), above what
    was allocated at start().

    cuda: the caching allocator's own counters (max_memory_allocated). cpu: torch's CPU
    allocator reports every allocation and free to the profiler while memory profiling is on,
    storage resizes included (ZeRO 3 frees a unit by resizing its storage to zero); the peak is
    the running maximum of those reports, in time order. Frees of memory allocated before
    start() are not reported, so they never lower the figure. Only the threads the profiler
    follows (the one that called start()) are seen on cpu."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._prof = None
        self._base = 0

    def start(self) -> AllocationPeak:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        # kineto prints a line to stderr at every start and stop; above level 5 it is quiet.
        # It reads the level when a profiler first starts, so setting it here is in time.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self._prof.start()
        return self

    def stop(self) -> int:
        """The peak bytes since start()."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device) - self._base)
        self._prof.stop()
        cpu = torch._C._autograd.DeviceType.CPU
        events = [
            (e.start_ns(), e.nbytes())
            for e in self._prof.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type() == cpu
        ]
        live = peak = 0
        for _, nbytes in sorted(events, key=lambda e: e[0]):  # stable: same-time reports keep their order
            live += nbytes
            peak = max(peak, live)
        self._prof = None
        return peak


class MemoryProbe:
    """Hooks the training loop calls on the step it measures. Create it just before the
    Trainer: the start-up peak is tracked from then until the first measured step."""

    def __init__(self, device: torch.device | str):
        """`device`: the run's device, whose allocator the start-up peak is read from."""
        self.activations = 0
        self.state: dict[str, dict[str, float]] = {}
        self.zero3: dict | None = None
        self._startup: AllocationPeak | None = AllocationPeak(torch.device(device)).start()
        self.startup_peak: int | None = None
        self.replica: dict | None = None
        """Memory replicas: host bytes held and a snapshot's stall (checkpoint/replicas.py measure)."""

    @contextlib.contextmanager
    def watch(self, chunks: list[nn.Module]):
        if self._startup is not None:
            self.startup_peak, self._startup = self._startup.stop(), None
        with LiveActivationMeter(nn.ModuleList(chunks)) as meter:
            yield meter
        self.activations = meter.peak_bytes

    def after_step(self, engine) -> None:
        measured, predicted = dict.fromkeys(CATEGORIES, 0), dict.fromkeys(CATEGORIES, 0.0)
        for part in engine.parts:  # dense + expert engines of an MoE model
            report = measure_memory(part)
            for c in CATEGORIES:
                measured[c] += report.measured[c]
                predicted[c] += report.predicted[c]
        self.state = {"measured": measured, "predicted": predicted}
        peaks = [z for z in (zero3_param_peak(part) for part in engine.parts) if z is not None]
        if peaks:  # dense + experts: summed, one formula each
            self.zero3 = {
                "measured": sum(z["measured"] for z in peaks),
                "predicted": sum(z["predicted"] for z in peaks),
                "formula": " + ".join(f"({z['formula']})" if len(peaks) > 1 else z["formula"] for z in peaks),
            }

    def gather(self, cfg: Config, grid, chunks: list[nn.Module], dtype: torch.dtype) -> list[dict] | None:
        """Collective over the world: every rank's row, on rank 0 (None elsewhere)."""
        size = torch.empty((), dtype=dtype).element_size()
        row = {
            "rank": grid.global_rank,
            "tp": grid.tp_rank,
            "pp": grid.pp_rank,
            "dp": grid.dp_rank,
            "cp": grid.cp_rank,
            "ep": grid.ep_rank,
            "measured": {**self.state["measured"], "activations": self.activations},
            "startup_peak": self.startup_peak,
            "zero3_params": self.zero3,
            "replica": self.replica,
            "predicted": {
                **self.state["predicted"],
                "activations": predicted_activation_bytes(cfg, grid, chunks, size),
            },
        }
        rows = comm.all_gather_objects(row, grid.world)
        return rows if grid.global_rank == 0 else None
