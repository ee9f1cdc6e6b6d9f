"""What to change next: the biggest recoverable cost on the slowest rank's critical path, the
knobs that relieve it, and what each is predicted to gain.

Every rank's step lasts as long as the slowest rank's, so the costs worth paying attention to
are those of the *critical* rank: the one with the most work of its own (compute, data, host
work: `OWN`), where the others wait for it (`pp_bubble`, `dp_exposed`, the optimizer's and the
loss's reductions). A rank whose own work is well above that of the ranks doing the same work
(its pipeline stage's peers) is a straggler: no knob fixes it, so the report names it.

Each of the critical rank's costs (`COSTS`) becomes a `Finding` with the knobs that relieve it.
A knob's gain is the planner's where the planner models the knob (micro-batches, schedule,
recompute, ZeRO, degrees): its predicted tokens/s for the changed config over that of the run's
config (`Predictor`, planner/predict.py's RunPredictor). Where it does not (bucket size,
prefetch, asynchronous checkpoints) the gain is estimated from the spans: the seconds the knob
removes from the step. A cost no knob recovers (a saturated link, a data source slower than the
step) says so and why. Findings are ordered recoverable first, then a straggler, then the rest,
each group by its seconds per step on the critical rank: the first is the prescription.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Protocol

from threefold.observe.spans import OWN

STRAGGLER_MARGIN = 0.10  # own work this much above its stage's median, and ...
STRAGGLER_SHARE = 0.05  # ... at least this share of the step, names a straggler
MIN_SHARE = 0.03  # costs below this share of the step are not listed
MIN_GAIN = 0.01  # a knob predicted to gain less recovers nothing
NEAR_BEST = 1 / 2  # more micro-batches: the fewest predicted to reach this share of the best gain
LATENCY_BOUND = 0.5  # dp exposure this fraction (or more) per-call fixed cost is latency-bound
SATURATED = 0.7  # exposed dp time at least this fraction of the bytes at the link's bandwidth
MiB = float(1 << 20)


class Predictor(Protocol):
    """The planner's view of the run (planner.predict.RunPredictor)."""

    def gain(self, changes: dict) -> float | None: ...
    def memory(self, changes: dict) -> tuple[float, float] | None: ...
    def link(self, group: str) -> tuple[float, float]: ...


@dataclass
class Knob:
    """A change of the run's config and what it is predicted to gain."""

    changes: dict
    """Config key -> new value."""
    gain: float | None
    """Predicted tokens/s over the run's, minus 1 (None: unknown)."""
    source: str
    """Who predicts the gain: "planner" or "spans" (the seconds it removes from the measured step)."""
    cause: bool = False
    """It removes the cost's cause (too few micro-batches): listed first whatever the gains."""

    def cli(self) -> str:
        return " ".join(f"--{k} {_text(v)}" for k, v in self.changes.items())

    def text(self) -> str:
        gain = "gain unknown" if self.gain is None else f"{self.gain:+.0%} tokens/s"
        return f"`{self.cli()}` ({'predicted' if self.source == 'planner' else 'estimated from spans'} {gain})"


@dataclass
class Finding:
    """One cost on the critical path."""

    cost: str
    """What it is, in words ("pipeline bubble")."""
    category: str
    """The span category it was read from ("straggler" for a slow rank)."""
    seconds: float
    """Per step, on the critical rank (a straggler: its own work above its stage's median)."""
    share: float
    """Of the step."""
    knobs: list[Knob] = field(default_factory=list)
    why: str = ""
    """What the cost is, or, without knobs, why no knob recovers it."""
    rank: int | None = None

    @property
    def recoverable(self) -> bool:
        """Some knob is predicted to gain more than MIN_GAIN (or its gain is unknown)."""
        return any(k.gain is None or k.gain > MIN_GAIN for k in self.knobs)

    def text(self) -> str:
        head = f"{self.cost} {self.share:.0%} of the step"
        knobs = " or ".join(k.text() for k in sorted(self.knobs, key=_by_gain))
        if self.recoverable:
            return f"{head}: {knobs}" + (f"; {self.why}" if self.why else "")
        if self.knobs:
            return f"{head}: not recoverable by a knob here, none is predicted to gain: {knobs}" + (
                f"; {self.why}" if self.why else ""
            )
        return f"{head}: not recoverable by a knob: {self.why}"


def _by_gain(k: Knob) -> tuple[bool, float]:
    return not k.cause, -(k.gain if k.gain is not None else -math.inf)


def best_knob(f: Finding) -> Knob | None:
    """The knob the finding prescribes first (None when no knob recovers the cost)."""
    return min(f.knobs, key=_by_gain) if f.recoverable else None


def _text(v) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)


def _gain(wall: float, saved: float) -> float:
    """tokens/s ratio - 1 of a step `saved` seconds shorter."""
    saved = min(max(saved, 0.0), 0.95 * wall)
    return wall / (wall - saved) - 1 if wall > 0 else 0.0


def _own(entry: dict) -> float:
    return sum(entry["time_s"].get(c, 0.0) for c in OWN)


def critical_rank(ranks: dict[int, dict]) -> int:
    """The rank with the most work of its own: the one the others wait for."""
    return max(ranks, key=lambda r: _own(ranks[r]))


def straggler(ranks: dict[int, dict], wall: float) -> Finding | None:
    """The rank whose own work most exceeds its pipeline stage's median, when it does by more
    than STRAGGLER_MARGIN and STRAGGLER_SHARE of the step. Stages differ in work by design (the
    last holds the head), so a rank is compared with its stage's peers only."""
    worst = None
    for r, e in ranks.items():
        peers = [q for q in ranks.values() if q["coords"].get("pp", 0) == e["coords"].get("pp", 0)]
        if len(peers) < 2:
            continue
        med = statistics.median(_own(q) for q in peers if q is not e)  # the others: two peers tell apart
        excess = _own(e) - med
        if med > 0 and excess > STRAGGLER_MARGIN * med and excess > STRAGGLER_SHARE * wall:
            if worst is None or excess > worst[1]:
                others = [q for q in peers if q is not e]
                cat = max(OWN, key=lambda c: e["time_s"][c] - statistics.median(q["time_s"][c] for q in others))
                worst = (r, excess, med, cat)
    if worst is None:
        return None
    r, excess, med, cat = worst
    where = " ".join(f"{k}{v}" for k, v in ranks[r]["coords"].items() if k != "ep" or v)
    why = (
        f"rank {r} ({where}) does {1 + excess / med:.1f}x the own work of the other ranks of its stage "
        f"(+{1e3 * excess:.0f} ms per step, mostly {cat}) and every other rank waits for it: check its "
        f"host or device (another job, throttling, a slow disk); {_gain(wall, excess):+.0%} tokens/s "
        "if it ran as fast as its peers"
    )
    return Finding(f"straggler rank {r}", "straggler", excess, excess / wall, [], why, r)


def diagnose(summary: dict, config: dict, predictor: Predictor | None = None) -> list[Finding]:
    """The costs on the critical rank's path with the knobs that relieve them, biggest first.
    `summary` is analysis.summary.summarize's; without per-rank spans the mean over ranks stands in."""
    ranks = summary.get("per_rank") or {}
    if ranks:
        r = critical_rank(ranks)
        entry = ranks[r]
        seconds, wall = entry["time_s"], entry["wall_s"] or sum(entry["time_s"].values())
        calls, nbytes = entry.get("comm_calls", {}), entry.get("comm_bytes", {})
    elif summary.get("breakdown"):
        r, seconds = None, summary["breakdown"]
        wall = summary.get("wall_s") or sum(seconds.values())
        calls, nbytes = summary.get("comm_calls", {}), summary.get("comm_bytes", {})
    else:
        return []
    if wall <= 0:
        return []
    ctx = _Context(
        config,
        predictor,
        seconds,
        wall,
        calls or {},
        nbytes or {},
        r,
        summary.get("dp_comm_serial_s"),
        summary.get("gather_wait_s"),
        summary.get("dp_gather_serial_s"),
    )
    found = [f for f in (cost(ctx) for cost in COSTS) if f is not None and f.share >= MIN_SHARE]
    slow = straggler(ranks, wall) if ranks else None
    if slow is not None:
        found.append(slow)
    # What a knob recovers first, then a straggler (a person's job), then what nothing recovers.
    return sorted(found, key=lambda f: (not f.recoverable and f.category != "straggler", -f.seconds))


@dataclass
class _Context:
    config: dict
    predictor: Predictor | None
    seconds: dict
    wall: float
    calls: dict
    nbytes: dict
    rank: int | None
    dp_serial: float | None = None
    """The step's dp collectives replayed alone, back to back (traced steps; None without)."""
    gather_wait: float | None = None
    """Per step, the waits for ZeRO's parameter gathers (zero3_gather_wait_s; None without)."""
    gather_serial: float | None = None
    """The step's parameter gathers replayed alone (traced steps' dp_gather_serial_s; None without)."""

    def get(self, dotted: str, default=None):
        section, key = dotted.split(".", 1)
        return self.config.get(section, {}).get(key, default)

    def finding(self, cost: str, category: str, knobs=(), why: str = "") -> Finding:
        s = self.seconds.get(category, 0.0)
        return Finding(cost, category, s, s / self.wall, [k for k in knobs if k is not None], why, self.rank)

    def planned(self, changes: dict, fallback_saved: float | None = None) -> Knob | None:
        """A planner-predicted knob; without a planner, estimated from `fallback_saved` seconds
        (None: leave the knob out)."""
        if self.predictor is not None:
            gain = self.predictor.gain(changes)
            return None if gain is None else Knob(changes, gain, "planner")
        return None if fallback_saved is None else self.spans_knob(changes, fallback_saved)

    def spans_knob(self, changes: dict, saved: float) -> Knob:
        return Knob(changes, _gain(self.wall, saved), "spans")


def _bubble(ctx: _Context) -> Finding | None:
    p, m = ctx.get("parallel.pp", 1), ctx.get("parallel.microbatches", 1)
    v, schedule = ctx.get("parallel.vpp", 1), ctx.get("parallel.schedule", "1f1b")
    if p <= 1 or not m:
        return None
    from threefold.distributed.pipeline.simulate import bubble_theory

    bubble = ctx.seconds.get("pp_bubble", 0.0)

    def saved(schedule2: str, m2: int, v2: int) -> float:
        # The bubble scales with the theory's idle/ideal ratio B / (1 - B).
        now, new = (bubble_theory(s, p, mm, vv) for s, mm, vv in ((schedule, m, v), (schedule2, m2, v2)))
        return bubble * (1 - (new / (1 - new)) / (now / (1 - now))) if 0 < now < 1 else 0.0

    per_rank = ctx.get("train.global_batch", m) // max(1, ctx.get("parallel.dp", 1))
    more = [d for d in range(m + 1, min(per_rank, 8 * m) + 1) if per_rank % d == 0]
    knobs = []
    if more:
        options = [ctx.planned({"parallel.microbatches": d}, saved(schedule, d, v)) for d in more[:4]]
        options = [k for k in options if k is not None]
        if options:
            # The smallest step that gets half the best predicted gain: the planner undercounts
            # what smaller micro-batches lose (on the 2-core CPU host at pp 2, m 2 -> 8 was
            # predicted +24% and measured -13%; m 2 -> 4 predicted +17%, measured +7% to +19%).
            top = max(k.gain for k in options)
            best = next(k for k in options if k.gain >= (NEAR_BEST * top if top > 0 else top))
            # Fewer micro-batches than twice the stages is the bubble's cause (1F1B wants m >> p);
            # a schedule change then only shrinks what the cause leaves.
            best.cause = m < 2 * p
            knobs.append(best)
    layers = ctx.get("model.layers", 0)
    v2 = 2 * v if schedule == "interleaved" else 2
    if layers and layers % (p * v2) == 0 and m % p == 0:
        knobs.append(ctx.planned({"parallel.schedule": "interleaved", "parallel.vpp": v2}, saved("interleaved", m, v2)))
    if schedule in ("1f1b", "gpipe") and m >= p:
        knobs.append(ctx.planned({"parallel.schedule": "zb"}, saved("zb", m, 1)))
    why = [] if more else [f"micro-batches are at the most train.global_batch {ctx.get('train.global_batch')} allows"]
    if getattr(ctx.predictor, "shares_cores", False):
        why.append(
            "the ranks share too few cores: one waiting in the bubble leaves its core to the others, "
            "so only the bubble's idle cores are lost (the gains count only those)"
        )
    return ctx.finding("pipeline bubble", "pp_bubble", knobs, "; ".join(why))


def _dp(ctx: _Context) -> Finding | None:
    exposed = ctx.seconds.get("dp_exposed", 0.0)
    n, zero = ctx.get("parallel.dp", 1), ctx.get("parallel.zero", 0)
    if n <= 1 or exposed <= 0:
        return None

    def found(why: str, changes: dict | None = None, saved: float = 0.0, cost: str = "exposed dp communication"):
        return ctx.finding(cost, "dp_exposed", [ctx.spans_knob(changes, saved)] if changes else [], why)

    calls, nbytes = ctx.calls.get("dp", 0.0), ctx.nbytes.get("dp", 0.0)
    bucket = ctx.get("parallel.bucket_mb", 25.0)
    total = nbytes / (1 if zero == 0 else 2)  # ZeRO 1/2 move the gradient twice: RS + AG
    if ctx.get("parallel.grad_reduce") == "after":
        saved = exposed * (1 - 1 / max(2.0, calls))
        return found("gradients are reduced only after backward", {"parallel.grad_reduce": "overlap"}, saved)
    if zero == 3:
        return _zero3(ctx, exposed)
    bw, fixed = ctx.predictor.link("dp") if ctx.predictor is not None else (None, None)
    # No core to spare (cpu): overlap hides a reduction's wait, not its work.
    shared_cores = getattr(ctx.predictor, "comm_on_compute_cores", False)
    per_call = nbytes / calls if calls else nbytes
    if calls <= 2 and bucket * MiB >= 0.5 * total > 0:
        why = f"{calls:.0f} bucket(s) of {per_call / MiB:.2f} MiB: the reduction starts when backward ends"
        saved = min(0.75 * exposed, ctx.seconds.get("backward", 0.0))
        if shared_cores:
            why += (
                "; on cores it shares with compute, overlap hides the reduction's wait but not its work, "
                "so the estimate is an upper bound"
            )
        return found(why, {"parallel.bucket_mb": _round_mb(total / 4 / MiB)}, saved)
    latency_bound = (fixed * calls >= LATENCY_BOUND * exposed) if fixed is not None else per_call < 256 * 1024
    if calls > 4 and latency_bound and bucket * MiB < total / 4:
        new = _round_mb(max(4 * bucket, min(25.0, total / 4 / MiB)))
        calls_new = max(1.0, math.ceil(total / (new * MiB)))
        saved = min(exposed, (calls - calls_new) * (fixed if fixed is not None else exposed / calls))
        why = f"{calls:.0f} buckets of {per_call / 1024:.0f} KiB per step: each pays the call's fixed cost"
        if ctx.dp_serial and shared_cores:
            # Overlap hid the calls' wait, but their work ran on compute's cores and lengthened
            # backward: fewer calls save up to their share of the replay (mostly fixed cost; an
            # upper bound, since the replay's blocking calls also wait for the peer each time).
            saved = max(saved, ctx.dp_serial * (calls - calls_new) / calls)
            why += (
                f"; alone, back to back, they take {1e3 * ctx.dp_serial:.0f} ms on the cores backward "
                "uses, so fewer calls save up to their share of that"
            )
        return found(why, {"parallel.bucket_mb": new}, saved)
    wire = 2 * (n - 1) / n * nbytes / bw if bw is not None else math.inf
    if exposed >= SATURATED * wire:
        why = (
            f"{nbytes / MiB:.1f} MiB per step over dp at the link's calibrated {bw / 1e9:.3g} GB/s take "
            f"{1e3 * wire:.0f} ms, more than backward hides: fewer bytes would help "
            "(--train.grad_reduce_dtype bf16 halves them and changes the numerics; a smaller dp)"
        )
        return found(why, cost="exposed dp communication (saturated link)")
    return found("neither latency- nor bandwidth-bound: likely waiting for a slower dp peer")


def _zero3(ctx: _Context, exposed: float) -> Finding:
    """ZeRO 3's exposed waits: a deeper prefetch (parallel.zero3_prefetch) when the gathers' waits
    outlast what the gathers of the blocks, one pass after another, would leave exposed at that
    depth. Per block, a gather takes g = its replay over the gathers of a step and has N blocks'
    compute c ahead of it (the step's forward + backward over blocks x passes): a pass leaves its
    first block's gather exposed and g - N c of each later one (the link's bound when g > N c).
    The waits above that model at depth N + 1 are what it absorbs (jitter, a gather late behind
    a slow block); without a traced step's replay the gain is unknown."""
    cost, depth = "ZeRO-3 parameter gathers and reductions", ctx.get("parallel.zero3_prefetch", 1)
    wait = min(ctx.gather_wait or 0.0, exposed)
    if wait <= 0:
        return ctx.finding(cost, "dp_exposed", why="the gathers are hidden: what is exposed is the reductions")
    changes = {"parallel.zero3_prefetch": depth + 1}
    if not ctx.gather_serial:
        why = f"{1e3 * wait:.1f} ms per step waiting for gathers; no traced step replayed them, gain unknown"
        return ctx.finding(cost, "dp_exposed", [Knob(changes, None, "spans")], why)
    pp = max(1, ctx.get("parallel.pp", 1))
    blocks = max(1, ctx.get("model.layers", 1) // pp)
    passes = 2 * max(1, ctx.get("parallel.microbatches", 0) or _microbatches(ctx))
    g = ctx.gather_serial / (passes * blocks)
    c = (ctx.seconds.get("forward", 0.0) + ctx.seconds.get("backward", 0.0)) / (passes * blocks)
    model = passes * (g + (blocks - 1) * max(0.0, g - (depth + 1) * c))
    saved = max(0.0, wait - model)
    why = (
        f"{1e3 * wait:.1f} ms per step waiting for gathers ({1e3 * g:.2f} ms each alone, "
        f"{1e3 * c:.2f} ms of a block's compute per pass); prefetching {depth + 1} ahead leaves about "
        f"{1e3 * min(wait, model):.1f} ms (each pass's first block, and what the link cannot carry)"
    )
    return ctx.finding(cost, "dp_exposed", [ctx.spans_knob(changes, saved)], why)


def _microbatches(ctx: _Context) -> int:
    """Micro-batches per step on a dp rank, from the global batch."""
    per_rank = ctx.get("train.global_batch", 1) // max(1, ctx.get("parallel.dp", 1))
    return max(1, per_rank // max(1, ctx.get("train.micro_batch", 1)))


def _round_mb(x: float) -> float:
    """Two significant digits, at least 0.01 MiB."""
    return float(f"{max(x, 0.01):.2g}")


def _data(ctx: _Context) -> Finding | None:
    wait = ctx.seconds.get("data_wait", 0.0)
    depth = ctx.get("data.prefetch", 0)
    if wait <= 0:
        return None
    if depth == 0:
        # The prefetcher makes the next batches while the step runs: it hides the wait up to
        # the rest of the step's length.
        saved = wait - max(0.0, wait - (ctx.wall - wait))
        return ctx.finding("data wait", "data_wait", [ctx.spans_knob({"data.prefetch": 2}, saved)])
    why = (
        f"the prefetcher is {depth} batches ahead and the step still waits: the source makes a batch "
        "slower than the step uses it (a pre-tokenized .bin corpus, data.path, reads fastest)"
    )
    return ctx.finding("data wait", "data_wait", why=why)


def _recompute(ctx: _Context) -> Finding | None:
    mode = ctx.get("train.recompute", "none")
    if mode == "none" or ctx.seconds.get("recompute", 0.0) <= 0:
        return None
    spent = ctx.seconds["recompute"]
    knobs, short = [], []
    for target in ("none", "selective") if mode == "full" else ("none",):
        changes = {"train.recompute": target}
        if ctx.predictor is None:
            knobs.append(ctx.spans_knob(changes, spent if target == "none" else 0.7 * spent))
            continue
        mem = ctx.predictor.memory(changes)
        if mem is not None and mem[0] <= mem[1]:
            knobs.append(ctx.planned(changes))
        elif mem is not None:
            short.append(f"recompute {target} needs {mem[0] / 2**30:.2f} GiB of {mem[1] / 2**30:.2f} usable")
        if knobs:
            break  # the least recompute that fits
    why = "" if ctx.predictor is not None else "memory not checked (no planner)"
    if not knobs:
        why = "the planner's memory model says less recompute does not fit: " + "; ".join(short)
    return ctx.finding(f"recompute ({mode})", "recompute", knobs, why)


def _optimizer(ctx: _Context) -> Finding | None:
    if ctx.get("parallel.dp", 1) > 1 and ctx.get("parallel.zero", 0) == 0:
        knob = ctx.planned({"parallel.zero": 1}, ctx.seconds.get("optimizer", 0.0) / 2)
        return ctx.finding("optimizer", "optimizer", [knob], "each dp rank updates every parameter")
    return ctx.finding("optimizer", "optimizer", why="AdamW reads and writes its state once a step (memory-bound)")


def _checkpoint(ctx: _Context) -> Finding | None:
    spent = ctx.seconds.get("checkpoint", 0.0)
    if spent <= 0:
        return None
    if not ctx.get("checkpoint.async", False):
        return ctx.finding("checkpoint", "checkpoint", [ctx.spans_knob({"checkpoint.async": True}, 0.8 * spent)])
    interval = ctx.get("checkpoint.interval", 0)
    if interval and interval != "auto":
        return ctx.finding(
            "checkpoint", "checkpoint", [ctx.spans_knob({"checkpoint.interval": 2 * interval}, spent / 2)]
        )
    return ctx.finding("checkpoint", "checkpoint", why="the final save only")


def _tp(ctx: _Context) -> Finding | None:
    t, d = ctx.get("parallel.tp", 1), ctx.get("parallel.dp", 1)
    if t <= 1:
        return None
    knobs = []
    if not ctx.get("parallel.tp_comm_overlap", True):
        knobs.append(ctx.spans_knob({"parallel.tp_comm_overlap": True}, ctx.seconds.get("tp_comm", 0.0) / 3))
    knobs.append(ctx.planned({"parallel.tp": t // 2, "parallel.dp": 2 * d}))
    return ctx.finding("exposed tp communication", "tp_comm", knobs, "tensor-parallel collectives on every layer")


def _cp(ctx: _Context) -> Finding | None:
    if ctx.get("parallel.cp", 1) <= 1:
        return None
    # Named without a knob: the ones that relieve it (cp_impl, a smaller cp) are not yet offered with a gain.
    return ctx.finding(
        "exposed cp communication", "cp_comm", why="ring blocks or all-to-alls not hidden behind attention"
    )


def _ep(ctx: _Context) -> Finding | None:
    ep = ctx.get("parallel.ep", 1)
    if ep <= 1:
        return None
    knob = ctx.planned({"parallel.ep": ep // 2})
    return ctx.finding(
        "expert all-to-all", "ep_a2a", [knob], "the routing sets the bytes; fewer ep ranks keep more local"
    )


def _p2p(ctx: _Context) -> Finding | None:
    if ctx.get("parallel.pp", 1) <= 1:
        return None
    return ctx.finding("pipeline sends/receives", "pp_p2p", why="activations cross every stage boundary")


COSTS = (_bubble, _dp, _data, _recompute, _optimizer, _checkpoint, _tp, _cp, _ep, _p2p)  # each: Finding or None


def format_prescriptions(found: list[Finding], rank: int | None) -> str:
    if not found:
        return "  prescription: nothing on the critical path above 3% of the step that a knob could relieve"
    where = f" (critical rank {rank})" if rank is not None else " (mean over ranks: no per-rank spans)"
    lines = [f"  what to change{where}, biggest cost first:"]
    lines += [f"    {i}. {f.text()}" for i, f in enumerate(found, 1)]
    return "\n".join(lines)
