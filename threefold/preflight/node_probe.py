"""The node probe: every rank times the same GEMM and memory copy at once, and rank 0 names the
ranks that fall more than a margin below the median of the ranks on the same kind of device.

Each rank measures (collective over the world, every rank at the same time):

1. a fixed square GEMM in the run's dtype, sized to the device (`gemm_size`);
2. a memory copy through a buffer several times the device's private cache (`copy_bytes`), so
   it streams from beyond the cache a core or SM owns;
3. on CPU with more than one torch thread, both again at one thread (torch.set_num_threads(1),
   restored after): a slow core hides behind a wide thread pool, a bad thread setting behind
   one core.

Each kernel runs a few times to warm up, then `repeats` times, in `rounds` rounds of both
kernels; the figure kept is the best. The ranks of a 2-core test host share cores (4 ranks on 2
cores, beside other jobs), and a rank preempted mid-kernel reads slow for reasons that are not
its device: the best of many short kernels (shorter than a scheduler slice), spread over the
whole probe, is what the device does when it runs, and a device that is really slow is slow on
every repeat. Each round of a kernel starts on a barrier, so every rank times the same kernel
while its neighbours run it too. A rank named by this first pass is confirmed by a second one
(probe_node).

The slowdevice drill (`slow_factor`) stretches each timed kernel by (factor - 1) times its time
before the clock stops, sleeping, then waiting the last SLEEP_SLACK_S out on the clock (a sleep
wakes late by as much as a small kernel lasts, which would overstate the factor): the rank looks,
from inside, like a device that is that much slower. The comparison never sees the factor.

Rank 0 receives one fixed-size record per rank (RECORD values, float64) and compares:
- each rank with the median of the ranks on the same kind of device (device type and name):
  named when a figure is below (1 - margin) x that median;
- on CUDA, each kind's median GEMM with the datasheet peak (observe/peak.py): named when under
  PEAK_FLOOR of it. On CPU there is no datasheet: the "peak" of observe/peak.py is itself a
  matmul measured earlier on this host under unknown load (and measuring it here would run a
  0.35 s benchmark on every rank under the same contention), so the CPU check rests on the
  median alone and the record says why the peak is null.
"""

from __future__ import annotations

import hashlib
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from threefold.distributed import comm
from threefold.observe.host import cpu_model
from threefold.observe.peak import cuda_peak_flops
from threefold.preflight.nodes import node_index, where

MARGIN = 0.25
"""A rank is named when a figure is more than this fraction below its kind's median."""
PEAK_FLOOR = 0.25
"""CUDA: a kind whose median GEMM is under this fraction of the datasheet peak is named."""
SLEEP_SLACK_S = 2e-4
"""The slowdevice drill sleeps to this much short of its mark and waits out the rest."""
MAX_LINES = 16
"""Ranks named one line each; beyond, one line lists the rest."""
CPU_PEAK_NOTE = "cpu: no datasheet peak; observe/peak.py measures one on this host, so the median alone decides"

# The record each rank sends to rank 0: its figures (NaN: not measured), then who it is.
FIGURES = ("gemm_flops", "copy_bytes_per_s", "gemm_flops_1t", "copy_bytes_per_s_1t")
RECORD = (*FIGURES, "kind", "device_type", "node", "peak_flops", "threads")
DEVICE_TYPES = ("cpu", "cuda", "other")


@dataclass
class NodeReport:
    named: bool
    """Whether any rank was named (the same on every rank)."""
    lines: list[str] = field(default_factory=list)
    """One line per finding (rank 0; [] elsewhere)."""
    record: dict = field(default_factory=dict)
    """JSON-able: every rank's figures, the medians per kind, the named ranks (rank 0); this rank's
    own figures elsewhere."""


@dataclass(frozen=True)
class ProbePlan:
    """What every rank runs: the same sizes and counts on every rank of a device type."""

    gemm_size: int
    copy_bytes: int
    warmup: int
    """Untimed runs of a kernel before each round's timed ones."""
    repeats: int
    """Timed runs of each kernel per round."""
    rounds: int


def _private_cache_bytes() -> int:
    """The largest CPU cache one core has to itself (sysfs), else 2 MiB."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            shared = (index / "shared_cpu_list").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if shared.isdigit() and size.endswith("K"):
            best = max(best, int(size[:-1]) * 1024)
    return best or 2 * 2**20


def plan_for(device: torch.device) -> ProbePlan:
    """CUDA: an 8192 GEMM (milliseconds on a datacenter part) and a copy of 16x the L2, from 256
    MiB to 2 GiB. CPU: a 256 GEMM (well under a 4 ms scheduler slice at one core's rate) and a
    copy of 4x the private cache, from 4 to 64 MiB: beyond what the core keeps to itself, yet
    short enough that most repeats run unpreempted on a shared host."""
    if device.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 50 * 2**20
        return ProbePlan(8192, min(max(16 * l2, 256 * 2**20), 2 * 2**30), warmup=3, repeats=5, rounds=2)
    return ProbePlan(256, min(max(4 * _private_cache_bytes(), 4 * 2**20), 64 * 2**20), warmup=2, repeats=10, rounds=3)


def _kind_id(device: torch.device) -> int:
    """A 48-bit id (exact in float64) of the device type and name: ranks with equal ids are
    compared with each other."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    digest = hashlib.sha1(f"{device.type}|{name}".encode()).digest()
    return int.from_bytes(digest[:6], "big")


class _Clock:
    """Times one kernel on `device` (CUDA events, else the host clock), stretched by the
    slowdevice drill's sleep before the clock stops."""

    def __init__(self, device: torch.device, slow_factor: float):
        self.device = device
        self.slow_factor = slow_factor

    def time(self, kernel) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            kernel()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            kernel()
            elapsed = time.perf_counter() - t0
        return elapsed + self._stretch(elapsed)

    def _stretch(self, elapsed: float) -> float:
        if self.slow_factor <= 1.0:
            return 0.0
        t0 = time.perf_counter()
        until = t0 + (self.slow_factor - 1.0) * elapsed
        # A sleep wakes 0.05-0.2 ms late (timer slack, a busy core), as long as a small kernel
        # itself (a factor of 1.25 read as 1.7): sleep to just short of the mark, then wait the
        # rest out on the clock.
        if until - t0 > SLEEP_SLACK_S:
            time.sleep(until - t0 - SLEEP_SLACK_S)
        while time.perf_counter() < until:
            pass
        return time.perf_counter() - t0


def _best_seconds(clock: _Clock, kernel, plan: ProbePlan, group: comm.Group) -> float:
    """The fastest of `plan.repeats` timed runs after `plan.warmup` untimed ones, every rank
    starting together."""
    for _ in range(plan.warmup):
        kernel()
    if clock.device.type == "cuda":
        torch.cuda.synchronize(clock.device)
    comm.barrier(group)
    return min(clock.time(kernel) for _ in range(plan.repeats))


def _measure(clock: _Clock, plan: ProbePlan, dtype: torch.dtype, group: comm.Group) -> tuple[float, float]:
    """(GEMM FLOP/s, copy bytes/s) of this rank at the current thread count: the best of
    `plan.rounds` rounds of both kernels, so each rank's samples spread over the whole probe
    rather than one stretch a busy neighbour may cover."""
    n, device = plan.gemm_size, clock.device
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    src = torch.ones(plan.copy_bytes // 4, device=device)
    dst = torch.empty_like(src)
    gemm_s = copy_s = math.inf
    with torch.no_grad():
        for _ in range(plan.rounds):
            gemm_s = min(gemm_s, _best_seconds(clock, lambda: torch.mm(a, b, out=out), plan, group))
            copy_s = min(copy_s, _best_seconds(clock, lambda: dst.copy_(src), plan, group))
    # A copy reads and writes every byte once.
    return 2 * n**3 / gemm_s, 2 * plan.copy_bytes / copy_s


def _measure_this_rank(device: torch.device, dtype: torch.dtype, slow_factor: float, plan: ProbePlan, group):
    """(GEMM, copy, GEMM at one thread, copy at one thread, threads) of this rank."""
    clock = _Clock(device, slow_factor)
    gemm, copy = _measure(clock, plan, dtype, group)
    gemm_1t = copy_1t = math.nan
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    # Every rank runs the one-thread phase when any rank has a wider pool: the phases' barriers
    # must match on every rank.
    widest = comm.all_reduce_max(torch.tensor([float(threads)], device=device), group)
    if widest.item() > 1:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            gemm_1t, copy_1t = _measure(clock, plan, dtype, group)
        finally:
            torch.set_num_threads(before)
    return gemm, copy, gemm_1t, copy_1t, threads


def _own_record(device: torch.device, dtype: torch.dtype, figures: tuple, threads: int, rank: int) -> list[float]:
    peak = cuda_peak_flops(torch.cuda.get_device_name(device), dtype) if device.type == "cuda" else None
    device_type = DEVICE_TYPES.index(device.type) if device.type in DEVICE_TYPES else len(DEVICE_TYPES) - 1
    own = [*figures, float(_kind_id(device)), float(device_type), float(node_index(rank))]
    return [*own, math.nan if peak is None else float(peak), float(threads)]


# --- rank 0: the comparison ---------------------------------------------------------------------


@dataclass
class _Kind:
    """The ranks on one kind of device and the median of each figure (NaN: not measured)."""

    label: str
    ranks: list[int]
    medians: list[float]
    peak: float


def _median(values: list[float]) -> float:
    measured = [v for v in values if not math.isnan(v)]
    return statistics.median(measured) if measured else math.nan


def _kinds(rows: list[dict]) -> dict[int, _Kind]:
    """The ranks grouped by device kind, labelled by device type (numbered when one type has
    several kinds)."""
    members: dict[int, list[int]] = {}
    for rank, row in enumerate(rows):
        members.setdefault(int(row["kind"]), []).append(rank)
    type_name = {kid: DEVICE_TYPES[int(rows[ranks[0]]["device_type"])] for kid, ranks in members.items()}
    kinds = {}
    for kid, ranks in members.items():
        label = type_name[kid]
        same_type = [k for k in members if type_name[k] == label]
        if len(same_type) > 1:
            label = f"{label} kind {same_type.index(kid) + 1}"
        medians = [_median([rows[r][f] for r in ranks]) for f in FIGURES]
        kinds[kid] = _Kind(label, ranks, medians, rows[ranks[0]]["peak_flops"])
    return kinds


def _rate(value: float, what: str, with_unit: bool, like: float) -> str:
    """A FLOP/s in G or T (T when `like`, the median it is set against, reaches 1e12), bytes/s in GB/s."""
    if what == "GEMM":
        scale, unit = (1e12, "TFLOP/s") if like >= 1e12 else (1e9, "GFLOP/s")
    else:
        scale, unit = 1e9, "GB/s"
    return f"{value / scale:.1f} {unit}" if with_unit else f"{value / scale:.1f}"


def _slow_figures(row: dict, kind: _Kind, margin: float) -> list[str]:
    """The figures of `row` more than `margin` below its kind's median."""
    return [f for f, median in zip(FIGURES, kind.medians) if not math.isnan(row[f]) and row[f] < (1 - margin) * median]


def _rank_line(rank: int, row: dict, kind: _Kind, nodes: dict[int, int]) -> str:
    gemm, copy, gemm_1t, copy_1t = (row[f] for f in FIGURES)
    m_gemm, m_copy, m_gemm_1t, m_copy_1t = kind.medians
    line = (
        f"threefold: node: {where([rank], nodes)} GEMM {_rate(gemm, 'GEMM', True, m_gemm)} vs median "
        f"{_rate(m_gemm, 'GEMM', False, m_gemm)} of {len(kind.ranks)} ranks ({kind.label}); "
        f"memory {_rate(copy, 'copy', True, m_copy)} vs median {_rate(m_copy, 'copy', False, m_copy)}"
    )
    if not math.isnan(gemm_1t):
        line += (
            f"; at one thread GEMM {_rate(gemm_1t, 'GEMM', True, m_gemm_1t)} vs median "
            f"{_rate(m_gemm_1t, 'GEMM', False, m_gemm_1t)}, memory {_rate(copy_1t, 'copy', True, m_copy_1t)} "
            f"vs median {_rate(m_copy_1t, 'copy', False, m_copy_1t)}"
        )
    return line


def _peak_line(kind: _Kind, nodes: dict[int, int]) -> str:
    share = kind.medians[0] / kind.peak
    return (
        f"threefold: node: {where(kind.ranks, nodes)} GEMM median {_rate(kind.medians[0], 'GEMM', True, kind.peak)} "
        f"of {len(kind.ranks)} ranks ({kind.label}) is {share:.0%} of the datasheet peak "
        f"{_rate(kind.peak, 'GEMM', True, kind.peak)} (under {PEAK_FLOOR:.0%})"
    )


def compare(rows: list[dict], margin: float, suspects: set[int] | None = None) -> tuple[list[int], list[str], dict]:
    """(named ranks, lines, per-kind summary) from every rank's record (rank 0; pure). With
    `suspects` (the ranks a first pass named), only those can be named again."""
    nodes = {rank: int(row["node"]) for rank, row in enumerate(rows)}
    kinds = _kinds(rows)
    below, lines, summary = [], [], {}
    for rank, row in enumerate(rows):
        kind = kinds[int(row["kind"])]
        if (suspects is None or rank in suspects) and _slow_figures(row, kind, margin):
            below.append(rank)
            if len(below) <= MAX_LINES:
                lines.append(_rank_line(rank, row, kind, nodes))
    if len(below) > MAX_LINES:
        rest = below[MAX_LINES:]
        lines.append(f"threefold: node: and {where(rest, nodes)} below their kind's median by more than {margin:.0%}")
    named = set(below)
    for kind in kinds.values():
        under_peak = not math.isnan(kind.peak) and kind.medians[0] < PEAK_FLOOR * kind.peak
        under_peak = under_peak and (suspects is None or bool(suspects.intersection(kind.ranks)))
        if under_peak:
            named.update(kind.ranks)
            lines.append(_peak_line(kind, nodes))
        summary[kind.label] = {
            "ranks": where(kind.ranks, nodes),
            **{f"{f}_median": _json(m) for f, m in zip(FIGURES, kind.medians)},
            "peak_flops": _json(kind.peak),
            "peak_fraction": None if math.isnan(kind.peak) else kind.medians[0] / kind.peak,
            **_peak_note(kind),
        }
    return sorted(named), lines, summary


def _peak_note(kind: _Kind) -> dict:
    if kind.label.startswith("cpu"):
        return {"peak_note": CPU_PEAK_NOTE}
    if math.isnan(kind.peak):
        return {"peak_note": "no datasheet peak for this part and dtype in observe/peak.py"}
    return {}


def _json(value: float) -> float | None:
    return None if math.isnan(value) else value


def _rank_record(rank: int, row: dict) -> dict:
    figures = {f: _json(row[f]) for f in FIGURES}
    return {"rank": rank, "node": int(row["node"]), "threads": int(row["threads"]), **figures}


def _row(values: list[float]) -> dict:
    return dict(zip(RECORD, values))


def _one_pass(device: torch.device, dtype: torch.dtype, slow_factor: float, plan: ProbePlan, group):
    """Measure every rank; returns this rank's figures and, on rank 0, every rank's record."""
    *figures, threads = _measure_this_rank(device, dtype, slow_factor, plan, group)
    own = _own_record(device, dtype, tuple(figures), threads, comm.global_rank())
    gathered = comm.gather_dim0(torch.tensor([own], dtype=torch.float64, device=device), group)
    rows = None if gathered is None else [_row(values) for values in gathered.cpu().tolist()]
    return figures, rows


def _decided(flag: bool, device: torch.device, group: comm.Group) -> bool:
    """Rank 0's `flag` on every rank."""
    return bool(comm.broadcast(torch.tensor([float(flag)], dtype=torch.float64, device=device), group).item())


def probe_node(
    grid, device: torch.device, dtype: torch.dtype, slow_factor: float = 1.0, margin: float = MARGIN
) -> NodeReport:
    """Time the probe kernels on every rank at once; rank 0 names the ranks more than `margin`
    below the median of their kind (and, on CUDA, kinds far under their datasheet peak), and every
    rank returns whether any was named. Collective over grid.world.

    A rank the first pass names is measured again, every rank with it, and named only when the
    second pass names it too: a neighbour that happened to be busy through one pass (a shared
    host, a page-cache flush) does not name a healthy rank, and a slow device is slow twice. A
    clean run costs one pass."""
    started = time.perf_counter()
    device = torch.device(device)
    group = grid.world
    plan = plan_for(device)
    with comm.unrecorded(group):
        figures, rows = _one_pass(device, dtype, slow_factor, plan, group)
        named, lines, kinds = compare(rows, margin) if rows is not None else ([], [], {})
        suspects, passes = list(named), 1
        if _decided(bool(suspects), device, group):
            figures, rows = _one_pass(device, dtype, slow_factor, plan, group)
            named, lines, kinds = compare(rows, margin, set(suspects)) if rows is not None else ([], [], {})
            passes = 2
            verdict = _decided(bool(named), device, group)
        else:
            verdict = False
    record: dict = {"rank": comm.global_rank(), **{f: _json(v) for f, v in zip(FIGURES, figures)}}
    if rows is not None:
        record = {
            "margin": margin,
            "plan": {"dtype": str(dtype).removeprefix("torch."), **asdict(plan)},
            "passes": passes,
            "first_pass_named": suspects,
            "kinds": kinds,
            "named": named,
            "ranks": [_rank_record(rank, row) for rank, row in enumerate(rows)],
        }
    record["wall_s"] = time.perf_counter() - started
    return NodeReport(verdict, lines, record)
