"""Per-step observation for the training loop: spans on every rank, gathered on report steps.

    observer = StepObserver(cfg.log, grid, device, is_logger)
    observer.attach(chunks, engine)             # recompute reruns, TP collectives, ZeRO-3 gathers get timed
    observer.begin_step(step)
    with observer.phase("data_wait"): ...       # the block's time counts as data_wait
    executor.run(..., spans=observer.recorder)  # F/B/W and pipeline p2p
    fields = observer.end_step(engine)          # -> merged into the metrics.jsonl line

With log.spans false the recorder is None, span() hands out one shared null context and
end_step() returns {} without any communication: off costs nothing.

On: each rank sums its category seconds and the bytes and calls of every group it belongs to,
step by step, on the host. On report steps (every log.interval steps, the last step, traced steps)
one gather brings every rank's per-step means since the last report to the logging rank (O(world)
bytes there, rarely; O(1) on every other rank), which writes their mean and max into metrics.jsonl
(`time_s`, `comm_bytes`, `comm_calls`, over `span_steps` steps) and every rank's detail into
spans.jsonl (`steps`: how many steps the line averages), with its `links`: the seconds per step it
spent in each group's collectives and with each pipeline neighbour (observe/links.py), a fixed
number of columns whatever the world size. The observer's own gathers fall between
two steps and are counted in neither. On the steps in log.trace_steps the ranks' spans go to the
logging rank (one gather of Python objects) and into trace.json, and the blocking cost of the
step's data-parallel collectives is measured by replaying them (`dp_comm_serial_s`), and so is
that of ZeRO's parameter all-gathers (`dp_gather_serial_s`, with `dp_gather_hidden`: one minus the
traced step's waits for them, its "zero-1/2 gather" and "zero-3 gather" spans, over that replay,
per rank) and of the context-parallel ring's exchanges (`cp_comm_serial_s`, with `cp_hidden`: the
fraction of it that the step did not wait for), outside the timed step.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch

from threefold.distributed import comm
from threefold.observe.links import LinkClock, links_of, pipeline_neighbours
from threefold.observe.spans import CATEGORIES, SpanRecorder
from threefold.observe.trace import TraceFile

GROUPS = ("tp", "cp", "pp", "dp", "ep", "edp", "expert_dp", "embed", "world")
"""Groups whose bytes (the logical tensor size of each collective or send) and calls are reported.
"dp" is where dense gradients are reduced: the dp group, or dp x cp under context parallelism."""

_UNTIMED = contextlib.nullcontext()
_HEAD = 7
"""A rank's summed row opens with wall, dp replay, cp replay, the traced step's cp wait and that
wait once the peers had posted, the parameter gathers' replay and the traced step's waits for
them, then the categories' seconds, then each group's bytes and calls."""


def _gather_waits(events: list) -> float:
    """Seconds a traced step's spans waited for ZeRO's parameter gathers."""
    from threefold.distributed.data_parallel.gather import LABELS

    return sum(duration for category, label, _, duration, _ in events if category == "dp_exposed" and label in LABELS)


class _Phase:
    __slots__ = ("recorder", "category")

    def __init__(self, recorder: SpanRecorder, category: str):
        self.recorder, self.category = recorder, category

    def __enter__(self):
        self.recorder.phase(self.category)
        return self

    def __exit__(self, *exc):
        self.recorder.phase("other")
        return False


TRACE_AUTO = "auto"
"""log.trace_steps' default: one late step, auto_trace_step(train.steps, log.interval), in a job
of at most TRACE_AUTO_MAX_WORLD ranks."""
TRACE_AUTO_MAX_WORLD = 64
"""A trace gathers every rank's spans to rank 0 into one trace.json: at a few nodes that is a
timeline to read; at thousands of ranks it is a large gather and file nobody asked for, so there
tracing is opt-in (log.trace_steps with step numbers)."""


def auto_trace_step(steps: int, interval: int) -> int:
    """The step log.trace_steps 'auto' traces: the last report step (a multiple of log.interval)
    before the last step, or the last step when there is none (a run of log.interval steps or
    fewer). Late, past start-up and warm-up; already a report step, so the report windows stay as
    they are (a traced step reports, and any other step would split a window); and not the last
    step, which holds the final save and evaluation (a save of minutes would flatten the
    timeline to a sliver) whenever the run is long enough to have another."""
    before_last = (steps - 1) // interval * interval
    return before_last if before_last >= 1 else steps


def parse_trace_steps(text: str) -> set[int]:
    """'5,6' -> {5, 6}; raises ValueError on anything else (validate.py turns it into one line).
    'auto' -> none here: validate.py replaces it with auto_trace_step(...), so only an unvalidated
    config, whose last step this cannot know, reaches this with it."""
    if text.strip() == TRACE_AUTO:
        return set()
    out = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        step = int(part)
        if step < 1:
            raise ValueError(f"step {step} is not >= 1")
        out.add(step)
    return out


class StepObserver:
    def __init__(self, log_cfg, grid, device: torch.device, is_logger: bool):
        self.grid, self.device, self.is_logger = grid, torch.device(device), is_logger
        self.recorder = SpanRecorder(self.device) if log_cfg.spans else None
        self.trace_steps = parse_trace_steps(log_cfg.trace_steps) if self.recorder else set()
        self.log_dir = Path(log_cfg.dir)
        self._groups = [getattr(grid, name, None) for name in GROUPS]
        self._groups[GROUPS.index("dp")] = getattr(grid, "dp_cp", None) or getattr(grid, "dp", None)
        self._counts0 = [0] * (2 * len(GROUPS))
        # Per-group and per-pipeline-neighbour communication seconds (observe/links.py): the
        # row's last columns, what the slow-link detector compares.
        if self.recorder is None:
            LinkClock.detach(grid)
            self.links = None
        else:
            self.links = LinkClock(
                self._groups, GROUPS, getattr(grid, "pp", None), getattr(grid, "global_rank", 0), self.device
            )
        self._step = 0
        self._detail = None
        self._trace = None
        self._coords = None
        self._sums: list[float] | None = None  # this rank's seconds and counts since the last report
        self._steps_summed = 0
        self.bands = self._band_check(log_cfg)
        self.last_ranks: list[dict] | None = None  # rank 0's rows of the newest report
        self.last_steps = 0

    def _band_check(self, log_cfg):
        """log.bands: every rank reads the file, so a bad one fails all of them alike; only the
        logging rank checks (observe/bands.py)."""
        path = getattr(log_cfg, "bands", "")
        if not path:
            return None
        from threefold.errors import ConfigError
        from threefold.observe.bands import BandCheck, read_bands

        if self.recorder is None:
            raise ConfigError("log.bands", "needs log.spans true", "set --log.spans true")
        bands = read_bands(path)
        self._quiet = getattr(log_cfg, "quiet", False)
        return BandCheck(bands) if self.is_logger else None

    def attach(self, chunks, engine=None) -> None:
        """Time activation recomputation, the tensor-, context- and expert-parallel collectives of these
        chunks, and ZeRO's parameter gathers (their exposed wait) when `engine` shards optimizer state."""
        # None detaches a recorder a previous run left on the grid.
        self.grid.tp.spans = self.grid.cp.spans = self.grid.ep.spans = self.recorder
        if self.recorder is None:
            return
        for part in engine.parts if engine is not None else []:  # MoE: dense + experts
            if part.zero == 3:
                part.store.spans = self.recorder
            elif getattr(part, "param_gather", None) is not None:  # ZeRO 1/2: the next forward's waits
                part.param_gather.spans = self.recorder
        for chunk in chunks:
            for module in chunk.modules():
                if getattr(module, "recomputed", False):
                    module.spans = self.recorder

    def span(self, category: str, label=None):
        return _UNTIMED if self.recorder is None else self.recorder.span(category, label)

    def phase(self, category: str):
        """A block of the step whose time counts as `category` (exclusive of the spans inside
        it). Phases follow one another at the top of the step; they do not nest."""
        return _UNTIMED if self.recorder is None else _Phase(self.recorder, category)

    def begin_step(self, step: int) -> None:
        """`step` counts from 0; log.trace_steps counts as metrics.jsonl does, from 1."""
        if self.recorder is None:
            return
        self._step = step + 1
        self._counts0 = self._counts()
        tracing = self._step in self.trace_steps
        self.recorder.begin_step(trace=tracing)
        cp = getattr(self.grid, "cp", None)
        if cp is not None and cp.size > 1:  # the ring's exchanges, replayed alone after the step
            cp.p2p_log = [] if tracing else None

    def end_step(self, engine=None, report: bool = True) -> dict:
        """Close the step: its seconds and comm counts join this rank's running sums (host
        floats, no communication). On a `report` step (collective over the world) the sums since
        the last report go to the logging rank, which gets the fields for its metrics line
        (per-step means over those steps); every other call returns {}."""
        if self.recorder is None:
            return {}
        tracing = self._step in self.trace_steps
        # On CUDA the timelines come one step late (no wait for the device), all of them by a
        # report step: the sums then cover the same steps as the counts.
        timelines = self.recorder.end_step_late(flush=report or tracing)
        serial = engine.time_serial_comm(repeats=1) if tracing and engine is not None else 0.0
        gather_serial = engine.time_serial_gather(repeats=1) if tracing and engine is not None else 0.0
        cp_serial, cp_own = self._replay_cp() if tracing else (0.0, -1.0)
        counts = [now - then for now, then in zip(self._counts(), self._counts0)]  # bytes..., calls...
        self.links.end_step(flush=report or tracing)
        mine = [0.0, serial, cp_serial, 0.0, cp_own, gather_serial, 0.0, *([0.0] * len(CATEGORIES)), *counts]
        for timeline in timelines:
            mine[0] += timeline.wall_s
            for i, c in enumerate(CATEGORIES):
                mine[_HEAD + i] += timeline.seconds[c]
        self._sums = mine if self._sums is None else [a + b for a, b in zip(self._sums, mine)]
        self._steps_summed += 1
        if not (report or tracing):
            return {}
        n = self._steps_summed
        means = torch.tensor(self._sums + self.links.take(), dtype=torch.float64) / n
        # Each ring's hop round trip, measured now (not a mean over the window's steps).
        means = torch.cat([means, torch.tensor(self.links.probe(), dtype=torch.float64)])
        # The replays are measured on this (traced) step only, not means; so is the exposed cp
        # wait they are compared with.
        means[1], means[2], means[4], means[5] = serial, cp_serial, cp_own, gather_serial
        means[3] = timelines[-1].seconds["cp_comm"] if tracing else 0.0
        means[6] = _gather_waits(timelines[-1].events) if tracing else 0.0
        self._sums, self._steps_summed = None, 0
        world = self.grid.world
        link, world.link = world.link, None  # the report's own gather is no step's communication
        try:
            rows = comm.gather_dim0(means.view(1, -1).to(self.device), world)
        finally:
            world.link = link
        per_rank = self._gather_events(timelines[-1].events) if tracing else None
        if not self.is_logger:
            return {}
        return self._write(rows.cpu(), per_rank, n)

    def _replay_cp(self) -> tuple[float, float]:
        """(seconds the traced step's cp exchanges, the ring's KV and gradient blocks, take
        alone; seconds this rank waited on them once their peers had posted, -1 where host
        clocks cannot say: CUDA, or ranks on several hosts). Zeros without exchanges.
        Collective over the cp group, outside the timed step."""
        from threefold.distributed.context_parallel.overlap import exposed_after_peers, replay_p2p

        cp = getattr(self.grid, "cp", None)
        if cp is None or cp.p2p_log is None:
            return 0.0, -1.0
        log, cp.p2p_log = cp.p2p_log, None
        one_host = os.environ.get("LOCAL_WORLD_SIZE", "1") == os.environ.get("WORLD_SIZE", "1")
        own = exposed_after_peers(log, cp) if self.device.type == "cpu" and one_host else -1.0
        return replay_p2p(log, cp), own

    def _counts(self) -> list[int]:
        """Bytes, then calls, recorded so far on each of GROUPS (0 for a group this rank lacks)."""
        stats = [g.stats if g is not None else None for g in self._groups]
        return [s.total_bytes if s else 0 for s in stats] + [s.total_calls if s else 0 for s in stats]

    def _gather_events(self, events: list) -> list | None:
        return comm.gather_objects(events, self.grid.world)

    def _write(self, rows: torch.Tensor, per_rank: list | None, steps: int) -> dict:
        n, g = len(CATEGORIES), len(GROUPS)
        wall, serial, cp_serial, cp_exposed, cp_own = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3], rows[:, 4]
        gather_serial, gather_waits = rows[:, 5], rows[:, 6]
        h, w = _HEAD, self.links.width
        seconds, nbytes, calls = rows[:, h : h + n], rows[:, h + n : h + n + g], rows[:, h + n + g : -w]
        links = rows[:, -w:].tolist()
        if self._detail is None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._detail = open(self.log_dir / "spans.jsonl", "a", encoding="utf-8")
        if self._coords is None:  # rank 0's table of every rank's coordinates, built on first use
            self._coords = [self.grid.layout.coords(r) for r in range(self.grid.layout.world_size)]
            lay = self.grid.layout
            self._neighbours = [
                pipeline_neighbours(lay.group_of(r, ("pp",)), r) if lay.pp > 1 else (None, None)
                for r in range(lay.world_size)
            ]
        ranks = []
        for r in range(rows.shape[0]):
            ranks.append(
                {
                    "rank": r,
                    **{k: v for k, v in self._coords[r].items() if k in ("tp", "pp", "dp", "ep")},
                    "wall_s": float(wall[r]),
                    "time_s": {c: float(seconds[r, i]) for i, c in enumerate(CATEGORIES)},
                    "comm_bytes": {g: int(nbytes[r, i]) for i, g in enumerate(GROUPS)},
                    "comm_calls": {g: int(calls[r, i]) for i, g in enumerate(GROUPS)},
                    "links": links_of(links[r], GROUPS, *self._neighbours[r]),
                }
            )
        self.last_ranks, self.last_steps = ranks, steps  # the diagnosis' view (report_view)
        self._detail.write(json.dumps({"step": self._step, "steps": steps, "ranks": ranks}) + "\n")
        self._detail.flush()
        if per_rank is not None:
            if self._trace is None:
                self._trace = TraceFile(self.log_dir, list(enumerate(self._coords)))
            self._trace.add_step(self._step, list(enumerate(per_rank)), float(wall.max()))
        fields = {
            "span_steps": steps,
            "span_step_s": {"mean": float(wall.mean()), "max": float(wall.max())},
            "time_s": {
                "mean": {c: float(seconds[:, i].mean()) for i, c in enumerate(CATEGORIES)},
                "max": {c: float(seconds[:, i].max()) for i, c in enumerate(CATEGORIES)},
            },
            "comm_bytes": {g: float(nbytes[:, i].mean()) for i, g in enumerate(GROUPS)},
            "comm_calls": {g: float(calls[:, i].mean()) for i, g in enumerate(GROUPS)},
        }
        if per_rank is not None:
            fields["dp_comm_serial_s"] = float(serial.max())
        if per_rank is not None and float(gather_serial.min()) > 0:
            # Each rank's waits for its parameter gathers against its own replay of them.
            hidden = (1 - gather_waits / gather_serial).clamp(0.0, 1.0)
            fields["dp_gather_serial_s"] = float(gather_serial.max())
            fields["dp_gather_exposed_s"] = float(gather_waits.max())
            fields["dp_gather_hidden"] = {"mean": float(hidden.mean()), "min": float(hidden.min())}
        if per_rank is not None and float(cp_serial.min()) > 0:
            # Each rank's exposed wait against its own replay; the wait also holds any time spent
            # on a slower cp peer, so the fraction is a lower bound of what the overlap hid.
            hidden = (1 - cp_exposed / cp_serial).clamp(0.0, 1.0)
            fields["cp_comm_serial_s"] = float(cp_serial.max())
            fields["cp_hidden"] = {"mean": float(hidden.mean()), "min": float(hidden.min())}
            if float(cp_own.min()) >= 0:  # the same without the waits for a slower peer
                # A part of the exposed wait, read on the waits' own clocks: a preempted read
                # there must not make the part exceed the whole the spans measured.
                own = (1 - torch.minimum(cp_own, cp_exposed) / cp_serial).clamp(0.0, 1.0)
                fields["cp_hidden_own"] = {"mean": float(own.mean()), "min": float(own.min())}
        if self.bands is not None:
            self._check_bands(fields, ranks, steps)
        return fields

    def report_view(self, record: dict, layers: dict | None = None):
        """Rank 0's ReportView (observe/diagnose.py) of the report just written; None elsewhere,
        or with spans off."""
        if self.recorder is None or not self.is_logger or self.last_ranks is None:
            return None
        from threefold.observe.diagnose import ReportView

        ranks, self.last_ranks = self.last_ranks, None
        # Ranks per node: the launcher's (torchrun's LOCAL_WORLD_SIZE); 0 leaves it to the
        # detector (parallel.devices_per_node, else one node).
        extra = {"local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)}
        return ReportView(self._step, self.last_steps, ranks, self.grid.layout, record, layers, extra)

    def _check_bands(self, fields: dict, ranks: list[dict], steps: int) -> None:
        from threefold.observe.bands import alert_text, critical_shares

        alerts = self.bands.check(self._step, steps, critical_shares(ranks))
        if alerts is None:
            return
        fields["band_alerts"] = alerts
        for a in alerts:
            if a["lines"] == self.bands.persist and not self._quiet:  # once per excursion
                print(f"threefold: step {self._step}: {alert_text(a)}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._detail is not None:
            self._detail.close()
            self._detail = None
