"""Per-layer time on traced steps, and the slow-layer detector.

    clock = LayerClock(chunks, cfg, grid, device, is_logger)
    clock.begin_step(step)                  # on a traced step: hooks on every block of this rank
    ...                                     # the step: forward and backward of every micro-batch
    fields, table = clock.end_step(step)    # traced steps: one gather of objects over the world

On the steps of log.trace_steps (with log.spans and log.layer_times on) each transformer block
of this rank gets a forward pre/post hook and a full backward pre/post hook for that step only,
and loses them at its end: every other step runs without a hook (off costs nothing). Each hook
stamps one edge: perf_counter() on CPU; on CUDA a torch.cuda.Event on the current stream (the
host returns from a launch long before the device is done), read at end_step, which comes after
the loop has waited for the step anyway (a traced step is a report step, read at once): no
synchronization per layer. Forward counts only calls with gradients on (an evaluation's forward
under no_grad is not training time); activation recomputation reruns a block's forward through
its inner function, not through the module call, so the rerun fires no forward hook and lands
inside that block's backward interval (backward_s then includes the recompute). Per layer and
direction the clock keeps every micro-batch's interval: their sum is the layer's time; the
detector's figure (`typical_*`) is the shortest interval times the count, of the device's time:
CUDA's events, or on CPU (where the device is the host) the process's CPU time, which a busy
host's other processes cannot inflate the way they inflate the wall time of whichever layer they
preempt. A slow layer is slow in every micro-batch; noise lands on some.

end_step sends rank 0 this rank's {layer: (forward_s, backward_s, the typical two, calls)}: one gather
of Python objects over the world, on traced steps only (O(layers on this rank) bytes per rank;
O(world) on rank 0, which only a traced step pays). Rank 0 takes the median over the tensor- and
data-parallel ranks that hold each layer and builds the table the ReportView carries:

    {"step": 20, "layers": {3: {"forward_s", "backward_s", "time_s", "typical_forward_s",
     "typical_backward_s", "typical_s", "calls", "kind", "stage", "ranks"}},
     "stage_layers": [[0, 1], [2, 3]], "stage_time_s": [...]}

and `layer_time_s` {layer: forward + backward seconds} for its metrics line.

The detector compares each layer with its siblings (the other layers of its kind, MoE or dense:
an MoE block is no sibling of a dense one) and names one whose typical time exceeds their median
by RATIO and by FLOOR_S, with what explains it where the record knows: a hot expert of an MoE
layer (the expert-load table, training/expert_load.py), a pipeline stage holding more layers
than the others (the partition).
"""

from __future__ import annotations

import statistics
import time

import torch

from threefold.distributed import comm
from threefold.distributed.pipeline.partition import stage_layer_ids
from threefold.model.moe import is_moe_layer
from threefold.observe.findings import Finding

RATIO = 1.5
"""A layer is named when its time exceeds its siblings' median by this factor ..."""
FLOOR_S = 0.002
"""... and by at least this many seconds (below that, a host's scheduling noise)."""
MIN_SIBLINGS = 2
"""A median of fewer other layers of the same kind says nothing: compare with every layer."""


def _traced(text: str) -> set[int]:
    """log.trace_steps as validate.py leaves it ('5,10'; 'auto' is resolved there, and means
    none in a config it has not seen). observer.parse_trace_steps reads the same text; this
    module cannot import the observer (it imports the diagnosis, which imports this)."""
    return {int(p) for p in text.replace(" ", "").split(",") if p.isdigit()}


class _Stamps:
    """Intervals of one layer in one direction: (start, end) marks, read at the end. On CPU a
    mark is (wall, process CPU time); on CUDA an event on the current stream."""

    __slots__ = ("cuda", "open", "pairs")

    def __init__(self, cuda: bool):
        self.cuda, self.open, self.pairs = cuda, None, []

    def mark(self):
        if not self.cuda:
            return time.perf_counter(), time.process_time()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.open = self.mark()

    def stop(self) -> None:
        if self.open is not None:
            self.pairs.append((self.open, self.mark()))
            self.open = None

    def seconds(self) -> tuple[list[float], list[float]]:
        """Every interval's (wall seconds, the detector's seconds): on CPU the second is the
        process's CPU time (the device is the host: a busy host's other processes inflate the
        wall time of whichever layer they preempt, never its CPU time); on CUDA both are the
        events' (the first read waits for the step's last event)."""
        if not self.cuda:
            return [b[0] - a[0] for a, b in self.pairs], [b[1] - a[1] for a, b in self.pairs]
        out = []
        for a, b in self.pairs:
            b.synchronize()  # the first waits for the device; the rest return at once
            out.append(a.elapsed_time(b) / 1e3)
        return out, out


def _robust(intervals: list[float]) -> float:
    """The shortest interval times their count: the layer's time without the noise that lands
    on some micro-batches only (a slow layer is slow in every one of them)."""
    return min(intervals) * len(intervals) if intervals else 0.0


class LayerClock:
    def __init__(self, chunks, cfg, grid, device, is_logger: bool):
        log = cfg.log
        on = log.spans and getattr(log, "layer_times", True)
        self.trace_steps = _traced(log.trace_steps) if on else set()
        self.grid, self.is_logger = grid, is_logger
        self.cuda = torch.device(device).type == "cuda"
        self.blocks = [(int(i), block) for chunk in chunks for i, block in getattr(chunk, "layers", {}).items()]
        self.kinds = {i: "moe" if is_moe_layer(cfg.model, i) else "dense" for i, _ in self.blocks}
        self.ep = cfg.parallel.ep
        p, v = cfg.parallel.pp, cfg.parallel.vpp
        virtual = stage_layer_ids(cfg.model, p, v, cfg.parallel.stage_layers)
        # Virtual stage s lives on pipeline rank s % pp (partition.py): a rank's layers, in order.
        self.stage_layers = [sorted(i for s in range(p * v) if s % p == r for i in virtual[s]) for r in range(p)]
        self._handles: list = []
        self._stamps: dict[int, tuple[_Stamps, _Stamps]] = {}
        self._step: int | None = None

    def begin_step(self, step: int) -> None:
        """`step` counts from 0 (every rank, every step); log.trace_steps counts from 1."""
        if step + 1 not in self.trace_steps or not self.blocks:
            return
        self._remove()
        self._step = step
        for i, block in self.blocks:
            fwd, bwd = _Stamps(self.cuda), _Stamps(self.cuda)
            self._stamps[i] = (fwd, bwd)
            self._handles += [
                block.register_forward_pre_hook(self._forward_pre(fwd)),
                block.register_forward_hook(self._forward_post(fwd)),
                block.register_full_backward_pre_hook(lambda _m, _g, s=bwd: s.start()),
                block.register_full_backward_hook(lambda _m, _gi, _go, s=bwd: s.stop()),
            ]

    @staticmethod
    def _forward_pre(stamps: _Stamps):
        def hook(_module, _args):
            if torch.is_grad_enabled():  # not an evaluation's forward
                stamps.start()

        return hook

    @staticmethod
    def _forward_post(stamps: _Stamps):
        def hook(_module, _args, _out):
            stamps.stop()

        return hook

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._stamps = [], {}

    def end_step(self, step: int) -> tuple[dict, dict | None]:
        """Every rank, every step once its spans are closed (collective over the world on traced
        steps only): (fields for the metrics line, rank 0's per-layer table for the ReportView or
        None)."""
        if step + 1 not in self.trace_steps or not self.blocks:
            return {}, None
        mine = {}
        if self._step == step:
            for i, (fwd, bwd) in self._stamps.items():
                (f, f_own), (b, b_own) = fwd.seconds(), bwd.seconds()
                mine[i] = (sum(f), sum(b), _robust(f_own), _robust(b_own), len(f))
        self._remove()
        self._step = None
        every = comm.gather_objects(mine, self.grid.world)
        if not self.is_logger or every is None:
            return {}, None
        table = self._table(step + 1, every)
        return {"layer_time_s": {str(i): round(row["time_s"], 6) for i, row in table["layers"].items()}}, table

    def _table(self, step: int, every: list[dict]) -> dict:
        """Rank 0: each layer's medians over the ranks that hold it, and each stage's sum."""
        held: dict[int, list[tuple[int, tuple]]] = {}
        for rank, rows in enumerate(every):
            for i, row in (rows or {}).items():
                held.setdefault(int(i), []).append((rank, row))
        stage_of = {i: s for s, ids in enumerate(self.stage_layers) for i in ids}
        layers = {}
        for i in sorted(held):
            rows = [r for _, r in held[i]]
            kind = self.kinds.get(i, "dense")
            # The ranks that hold a dense layer compute the same thing: their median is the
            # layer's time. Under expert parallelism the members of an ep group hold different
            # experts, and the all-to-all holds them all to the busiest (a hot expert's rank):
            # its time is the MoE layer's.
            pick = max if kind == "moe" and self.ep > 1 else statistics.median
            fwd, bwd = pick(r[0] for r in rows), pick(r[1] for r in rows)
            own_f, own_b = pick(r[2] for r in rows), pick(r[3] for r in rows)
            layers[i] = {
                "forward_s": fwd,
                "backward_s": bwd,
                "time_s": fwd + bwd,
                "typical_forward_s": own_f,
                "typical_backward_s": own_b,
                "typical_s": own_f + own_b,
                "calls": max(r[4] for r in rows),
                "kind": kind,
                "stage": stage_of.get(i, 0),
                "ranks": [rank for rank, _ in held[i]],
            }
        stage_time = [sum(layers[i]["time_s"] for i in ids if i in layers) for ids in self.stage_layers]
        return {"step": step, "layers": layers, "stage_layers": self.stage_layers, "stage_time_s": stage_time}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}" if seconds >= 0.01 else f"{seconds * 1e3:.1f}"


UNEVEN = 1.25
"""A slow MoE layer's busiest expert is named as its reason from this load relative to the
layer's mean, below the expert-load table's own 'hot' mark: under expert parallelism the layer
runs at its busiest rank's pace, so a milder imbalance already shows in its time."""


def _hot_experts(record: dict, layer: int) -> tuple[list[int], float]:
    """The hot experts of `layer` in the record's expert-load table (else its busiest one, if
    UNEVEN or more), and the hottest one's load relative to its layer's mean."""
    hot = [int(h.split("/E")[1]) for h in record.get("moe_hot_experts", ()) if h.split("/E")[0] == f"L{layer}"]
    tokens = record.get("moe_expert_tokens", {}).get(str(layer))
    if not tokens:
        return hot, 0.0
    mean = sum(tokens) / len(tokens)
    if not mean:
        return hot, 0.0
    if not hot:
        busiest = max(range(len(tokens)), key=tokens.__getitem__)
        hot = [busiest] if tokens[busiest] >= UNEVEN * mean else []
    return hot, max((tokens[e] for e in hot), default=0.0) / mean


class SlowLayers:
    """Rank 0's slow-layer detector over the per-layer table of traced steps."""

    def __init__(self):
        self.since: dict[int, int] = {}
        self.last: list[Finding] = []
        """The newest traced step's findings: they stand on the report steps in between, which
        measure no layer (a layer is cleared when a traced step no longer names it)."""
        self.first_step: int | None = None
        """The attempt's first step: its layers pay first-call costs (lazy initialisation, the
        allocator's growth, compilation) in the order they run, so its table names nothing."""

    def on_step(self, step: int, record: dict) -> list[Finding]:
        if self.first_step is None:
            self.first_step = step
        return []

    def on_report(self, view) -> list[Finding]:
        table = getattr(view, "layers", None)
        if not table or view.step == self.first_step:
            return list(self.last)
        self.last = self._named(view, table)
        named = {f.layer for f in self.last}
        self.since = {i: s for i, s in self.since.items() if i in named}  # a layer named again is new
        return list(self.last)

    def _named(self, view, table: dict) -> list[Finding]:
        layers = table["layers"]
        if len(layers) < 2:
            return []
        found = []
        for i, row in layers.items():
            siblings = [j for j in layers if j != i and layers[j]["kind"] == row["kind"]]
            if len(siblings) < MIN_SIBLINGS:
                siblings = [j for j in layers if j != i]
            base = statistics.median(layers[j]["typical_s"] for j in siblings)
            t = row["typical_s"]
            if t > RATIO * base and t - base > FLOOR_S:
                found.append(self._finding(view, i, row, base, len(siblings), table))
        return found

    def _finding(self, view, i: int, row: dict, base: float, siblings: int, table: dict) -> Finding:
        step = view.step
        since = self.since.setdefault(i, step)
        f, b = row["typical_forward_s"], row["typical_backward_s"]
        text = (
            f"slow layer: layer {i} takes {_ms(f + b)} ms (forward {_ms(f)} + backward {_ms(b)}) vs {_ms(base)} ms "
            f"median of {siblings} layers, on step {step}"
        )
        extra = {"forward_s": row["forward_s"], "backward_s": row["backward_s"], "kind": row["kind"]}
        hot, load = _hot_experts(view.record or {}, i)
        if hot:
            extra["hot_experts"], extra["expert_load"] = hot, load
            experts = ", ".join(str(e) for e in hot)
            text += f"; MoE: expert{'s' if len(hot) > 1 else ''} {experts} {'take' if len(hot) > 1 else 'takes'} "
            text += f"{load:.1f}x the layer's mean load"
        stages = table.get("stage_layers") or []
        counts = [len(ids) for ids in stages]
        stage = row["stage"]
        if len(counts) > 1 and counts[stage] > statistics.median(counts):
            extra["stage_layers"] = counts
            text += f"; stage {stage} holds {counts[stage]} of {sum(counts)} layers"
        category = "backward" if b >= f else "forward"
        return Finding(
            kind="slow_layer",
            key=f"layer {i}",
            text=text,
            step=step,
            since=since,
            ranks=tuple(row["ranks"]),
            stage=stage,
            layer=i,
            category=category,
            value=f + b,
            baseline=base,
            extra=extra,
        )


def detector(cfg, grid):
    """The slow-layer detector, or None where no step times its layers."""
    log = cfg.log
    if not (log.spans and getattr(log, "layer_times", True) and _traced(log.trace_steps)):
        return None
    return SlowLayers()
