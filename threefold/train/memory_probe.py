"""Per-rank memory of one real training step, measured next to the formulas (`threefold memory`).

Measured, on every rank:
  params / grads / optimizer   live tensors of the data-parallel engine(s), each storage once,
                               after the optimizer step and before zero_grad (ZeRO's point)
  activations                  the peak bytes held for backward at any moment of the step's
                               pipeline schedule (LiveActivationMeter): what autograd saved, and
                               the stage outputs the executor keeps (until sent, or until their
                               backward without parallel.free_sent_outputs); parameters excluded
Predicted:
  params / grads / optimizer   ZeRO's formulas on this rank's parameter count
                               (data_parallel/memory.py: 2P + 2P + 12P, ..., 16P/N)
  activations                  the per-layer formula of observe/activations.py for this model,
                               times the layers of each chunk and the micro-batches the schedule
                               keeps in flight at its worst moment, plus the last stage's norm,
                               head input and fp32 logits. MoE layers are not covered by the
                               formula: their ranks show measured activations only.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from threefold.config import Config
from threefold.distributed import comm
from threefold.distributed.data_parallel.memory import CATEGORIES, measure_memory
from threefold.distributed.pipeline.schedules import build_schedule
from threefold.observe.activations import LiveActivationMeter, layer_activation_elements


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
    s, b, h = m.seq_len, t.micro_batch, m.hidden
    per_layer = layer_activation_elements(s, b, h, m.heads, m.kv_heads, m.ffn_hidden, p.tp, p.sp, t.recompute)
    actions = build_schedule(p.schedule, p.pp, p.microbatches, p.vpp)[grid.pp_rank]
    layers = [len(c.layers) for c in chunks]
    heads = {i for i, c in enumerate(chunks) if c.head is not None}
    # Last stage per micro-batch: final-norm input and output (sbh each, sequence-split under SP)
    # and the fp32 logits the loss keeps (sbV/t).
    sbh = s * b * h / (p.tp if p.sp else 1) * element_size
    head = 2 * sbh + 4 * s * b * m.vocab / p.tp
    # A chunk that sends its output keeps it until its backward; with parallel.free_sent_outputs
    # only until it is sent, so at the peak (the end of a forward) just the output being made.
    senders = set(range(len(chunks))) - heads
    held = (min(1, len(senders)) if p.free_sent_outputs else peak_inflight(actions, senders)) * sbh
    return (
        peak_inflight_layers(actions, layers) * per_layer * element_size + peak_inflight(actions, heads) * head + held
    )


class MemoryProbe:
    """Hooks the training loop calls on the step it measures."""

    def __init__(self):
        self.activations = 0
        self.state: dict[str, dict[str, float]] = {}

    @contextlib.contextmanager
    def watch(self, chunks: list[nn.Module]):
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

    def gather(self, cfg: Config, grid, chunks: list[nn.Module], dtype: torch.dtype) -> list[dict] | None:
        """Collective over the world: every rank's row, on rank 0 (None elsewhere)."""
        size = torch.empty((), dtype=dtype).element_size()
        row = {
            "rank": grid.global_rank,
            "tp": grid.tp_rank,
            "pp": grid.pp_rank,
            "dp": grid.dp_rank,
            "ep": grid.ep_rank,
            "measured": {**self.state["measured"], "activations": self.activations},
            "predicted": {
                **self.state["predicted"],
                "activations": predicted_activation_bytes(cfg, grid, chunks, size),
            },
        }
        rows = comm.all_gather_objects(row, grid.world)
        return rows if grid.global_rank == 0 else None
