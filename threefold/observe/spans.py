"""Where one step's time went on this rank: a timeline of nested, named spans.

    rec = SpanRecorder(device)
    rec.begin_step(trace=True)
    with rec.span("forward", label):      # F of micro-batch 3 ...
        with rec.span("tp_comm"):         # ... pauses "forward" while it communicates
            ...
    timeline = rec.end_step()             # exclusive seconds per category + the trace events

Each span's *exclusive* time (its duration minus its children's) goes to its category, and the
whole step is itself the outermost span, whose exclusive time is "other" (what no named span
covers). The categories therefore partition the step by construction: they sum to the step's
wall time exactly, on every rank.

The recorder is an object passed to the code it times (the pipeline executor, the recompute
wrapper, a process group, an MoE layer): there is no module-level recorder. Code that may run
without one takes `spans=None` and skips the `with`, so recording that is off costs nothing.

During a step a span only appends a mark (category, label, stamp) to a list; the arithmetic
happens in end_step. Stamps are perf_counter() on CPU. On CUDA they are torch.cuda.Events
recorded on the current stream: the host returns from a kernel launch or NCCL's wait() long
before the device is done, so only events on the stream say when the device reached each edge.
The training loop reads them one step late (end_step_late), when the device is past them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

COMPUTE = ("forward", "backward", "weight_grad", "recompute")
COMM = ("tp_comm", "cp_comm", "pp_p2p", "pp_bubble", "dp_exposed", "ep_a2a", "sync")
HOST = ("data_wait", "optimizer", "checkpoint", "eval", "other")
CATEGORIES = COMPUTE + COMM + HOST
"""Every category, in report order. What each one covers (docs/observability.md):
forward/backward/weight_grad: the pipeline's F, B (input and, outside zb, weight gradients) and
zb's W actions; recompute: activation recomputation inside backward; tp_comm: tensor-parallel
collectives; cp_comm: context-parallel attention transfers left waiting (ring blocks not hidden
behind attention, Ulysses all-to-alls); pp_p2p: posting pipeline sends/receives and finishing
sends; pp_bubble: blocked on a pipeline receive (the bubble plus transfer time not hidden);
dp_exposed: data-parallel gradient reduction left after backward; ep_a2a: expert-parallel
all-to-all; sync: the step's small global reductions (loss, tied embedding, metrics); data_wait:
waiting for the next batch; optimizer: gradient norm, clipping, AdamW and ZeRO's parameter
gather; checkpoint: a save blocking the step; other: the rest of the step (Python between spans)."""
OWN = COMPUTE + ("data_wait", "checkpoint", "eval", "other")
"""A rank's own work (not waiting for another rank): a slow rank's extra time lands here, where its
peers' waits land in the communication categories."""


INDEX = {c: i for i, c in enumerate(CATEGORIES)}


@dataclass
class StepTimeline:
    """One rank's step: wall seconds, exclusive seconds per category, and (when traced) every
    span as (category, label, start_s, duration_s, depth), start relative to the step's start."""

    wall_s: float
    seconds: dict[str, float]
    events: list[tuple[str, str, float, float, int]] = field(default_factory=list)


class _Span:
    __slots__ = ("rec", "category", "label")

    def __init__(self, rec: SpanRecorder, category: str, label):
        self.rec, self.category, self.label = rec, category, label

    def __enter__(self):
        self.rec._mark(True, self.category, self.label)
        return self

    def __exit__(self, *exc):
        self.rec._mark(False, self.category, self.label)
        return False


class SpanRecorder:
    """Records the spans of one step at a time on `device` (a torch.device or its name)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._marks: list[tuple] = []
        self._open = False
        self._phase = None
        self.tracing = False
        self.late = self._cuda
        """end_step_late holds each step's marks until the next step (on CUDA; settable for tests)."""
        self._held: tuple[list[tuple], bool] | None = None  # the last step's marks, read late

    def span(self, category: str, label=None) -> _Span:
        """Context manager timing a region as `category`; `label` names it in the trace (any
        object: formatted with str() only for traced steps)."""
        return _Span(self, category, label)

    def record(self, category: str, label=None) -> _Span:
        """Same as span(): the name an MoE layer or other caller may prefer
        (`with spans.record("ep_a2a"): ...`)."""
        return _Span(self, category, label)

    def phase(self, category: str) -> None:
        """Flat alternative to nesting at the top of a step: from now until the next phase()
        (or the end of the step) time counts as `category`; "other" ends the current phase.
        Call it only where no span() is open."""
        if self._phase is not None:
            self._mark(False, self._phase, None)
        self._phase = None if category == "other" else category
        if self._phase is not None:
            self._mark(True, category, None)

    def _stamp(self):
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def _mark(self, opening: bool, category: str, label) -> None:
        if self._open:  # spans outside begin_step/end_step (e.g. set-up) are not recorded
            self._marks.append((opening, category, label, self._stamp()))

    def begin_step(self, trace: bool = False) -> None:
        """Start a step; `trace` keeps every span for the trace file, not just the totals."""
        self._marks = []
        self._phase = None
        self.tracing = trace
        self._open = True
        self._mark(True, "other", "step")

    def end_step(self) -> StepTimeline:
        """Close the step and resolve its spans (on CUDA: waits for the device to reach its end)."""
        marks, tracing = self._close()
        return resolve(marks, self._times(marks), tracing)

    def end_step_late(self, flush: bool) -> list[StepTimeline]:
        """Close the step; return the timelines resolved now. On CUDA a step's events are read
        at the end of the next step, when the device is past them, so recording costs the host
        no wait; `flush` (a report or traced step, which waits for the device anyway) resolves
        this step too. On CPU every step is resolved at once."""
        closed = self._close()
        if not self.late:
            return [resolve(closed[0], self._times(closed[0]), closed[1])]
        ready, self._held = ([self._held] if self._held else []), None
        if flush:
            ready.append(closed)
        else:
            self._held = closed
        return [resolve(marks, self._times(marks), tracing) for marks, tracing in ready]

    def _close(self) -> tuple[list[tuple], bool]:
        self.phase("other")
        self._mark(False, "other", "step")
        self._open = False
        marks, self._marks = self._marks, []
        return marks, self.tracing

    def _times(self, marks: list[tuple]) -> list[float]:
        if not self._cuda:
            t0 = marks[0][3]
            return [m[3] - t0 for m in marks]
        marks[-1][3].synchronize()  # the last edge: every earlier event on the stream is done
        first = marks[0][3]
        return [first.elapsed_time(m[3]) / 1e3 for m in marks]


def _label(category: str, label) -> str:
    if label is None:
        return category
    if isinstance(label, tuple):  # e.g. a batch of pipeline sends/receives
        return f"{category} " + " ".join(map(str, label))
    return str(label)


def resolve(marks: list[tuple], times: list[float], keep_events: bool) -> StepTimeline:
    """Exclusive seconds per category from balanced open/close marks (the first mark opens the
    step, the last closes it)."""
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    stack: list[list] = []
    events = []
    for (opening, category, label, _), t in zip(marks, times):
        if opening:
            if category not in INDEX:
                raise ValueError(f"span category {category!r} is unknown (valid: {', '.join(CATEGORIES)})")
            stack.append([category, label, t, 0.0])
            continue
        cat, lab, start, children = stack.pop()
        if cat != category:
            raise RuntimeError(f"span {category!r} closed while {cat!r} was open: spans must nest")
        duration = max(0.0, t - start)
        seconds[cat] += max(0.0, duration - children)
        if stack:
            stack[-1][3] += duration
        if keep_events:
            events.append((cat, _label(cat, lab), start, duration, len(stack)))
    if stack:
        raise RuntimeError(f"span {stack[-1][0]!r} was still open at the end of the step")
    wall = times[-1] - times[0] if times else 0.0
    events.sort(key=lambda e: (e[2], e[4]))
    return StepTimeline(wall, seconds, events)
