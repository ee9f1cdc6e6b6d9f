"""Run pipeline schedules without processes: timing, bubble, activation memory, deadlock.

`simulate` executes every rank's action list in order with given durations, the way the
executor will (see `schedules` for the batching convention): a compute action takes its cost;
a batch of consecutive comm actions is posted when the rank reaches it and the rank moves on
once the batch is done. Sends and receives pair up first-in first-out per (source,
destination, direction). Two models of when a batch is done:

- ``"eager"`` (default, the executor's rule): when its receives are, each at the time its send
  was posted + latency (or when posted, if later). Sends never hold a rank up (their requests are waited on at the end).
- ``"rendezvous"`` (the strict rule): when every send and receive in it has its partner
  posted, at max(both post times) + latency. Anything deadlock-free here is deadlock-free
  under any looser rule, so `check_schedule` proves deadlock freedom with this model.

Bubble: rank r's idle fraction of the step, 1 - busy_r / makespan (makespan = the slowest
rank's finish); `bubble` is the mean over ranks. Activation memory is counted in micro-batch
chunks (one micro-batch's activations of one chunk, 1/v of the rank's layers):
`peak_inflight[r]` is the most (micro-batch, chunk) pairs whose F is done and B is not, the
activations the B pass needs; `peak_held[r]` counts until the last backward pass (W where the
schedule splits backward), since W keeps part of them.

`check_schedule` asserts a schedule is complete, ordered, matched and deadlock-free.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from threefold.distributed.pipeline.schedules import Action, stage_owner, virtual_stage

_DIRECTION = {"SEND_F": "F", "RECV_F": "F", "SEND_B": "B", "RECV_B": "B"}


class DeadlockError(RuntimeError):
    """No rank can progress; the message names where each blocked rank waits."""


@dataclass(frozen=True)
class Span:
    """What a rank did over [start, end): a compute action, or a wait on a batch of comms."""

    start: float
    end: float
    step: Action | tuple[Action, ...]


@dataclass
class SimResult:
    """What one simulated step looked like."""

    timelines: list[list[Span]]
    """Per rank, its computes and batch waits in order."""
    makespan: float
    """Time at which the last rank finishes."""
    busy: list[float]
    """Per rank, time spent computing."""
    bubble_per_rank: list[float]
    """Per rank, 1 - busy / makespan."""
    bubble: float
    """Mean of bubble_per_rank."""
    peak_inflight: list[int]
    """Per rank, most micro-batch chunks with F done and B not done."""
    peak_held: list[int]
    """Per rank, most micro-batch chunks with F done and their last backward pass not done."""


def _pair(actions: list[list[Action]]) -> dict[tuple[int, int], tuple[int, int] | None]:
    """(rank, index) of each send or receive -> (rank, index) of its partner, FIFO per
    (source, destination, direction); None when the other side has too few."""
    sends: dict[tuple, list] = defaultdict(list)
    recvs: dict[tuple, list] = defaultdict(list)
    for rank, acts in enumerate(actions):
        for i, a in enumerate(acts):
            if a.kind.startswith("SEND"):
                sends[(rank, a.peer, _DIRECTION[a.kind])].append((rank, i))
            elif a.kind.startswith("RECV"):
                recvs[(a.peer, rank, _DIRECTION[a.kind])].append((rank, i))
    partner: dict[tuple[int, int], tuple[int, int] | None] = {}
    for channel in set(sends) | set(recvs):
        s, r = sends.get(channel, []), recvs.get(channel, [])
        for k in range(max(len(s), len(r))):
            a = s[k] if k < len(s) else None
            b = r[k] if k < len(r) else None
            if a is not None:
                partner[a] = b
            if b is not None:
                partner[b] = a
    return partner


def _steps(acts: list[Action]) -> list[list[int]]:
    """Indices of one rank's actions grouped into steps: [compute] or a run of comms (a batch)."""
    steps: list[list[int]] = []
    for i, a in enumerate(acts):
        if a.is_comm and steps and acts[steps[-1][0]].is_comm:
            steps[-1].append(i)
        else:
            steps.append([i])
    return steps


def _memory(acts: list[Action]) -> tuple[int, int]:
    split = {(a.microbatch, a.chunk) for a in acts if a.kind == "W"}
    inflight = held = peak_inflight = peak_held = 0
    for a in acts:
        if a.kind == "F":
            inflight, held = inflight + 1, held + 1
        elif a.kind == "B":
            inflight -= 1
            held -= (a.microbatch, a.chunk) not in split
        elif a.kind == "W":
            held -= 1
        peak_inflight, peak_held = max(peak_inflight, inflight), max(peak_held, held)
    return peak_inflight, peak_held


def simulate(
    actions: list[list[Action]],
    f: float = 1.0,
    b: float = 2.0,
    w: float = 1.0,
    latency: float = 0.0,
    sends: str = "eager",
) -> SimResult:
    """Execute per-rank action lists with durations f, b, w per chunk; raises DeadlockError."""
    if sends not in ("rendezvous", "eager"):
        raise ValueError(f"sends={sends!r} (valid: 'rendezvous', 'eager')")
    cost = {"F": f, "B": b, "W": w}
    p = len(actions)
    partner = _pair(actions)
    steps = [_steps(acts) for acts in actions]
    pc, clock = [0] * p, [0.0] * p
    posted: dict[tuple[int, int], float] = {}
    timelines: list[list[Span]] = [[] for _ in range(p)]
    moved = True
    while moved:  # a fixpoint: each time is fixed by its inputs, so the visiting order is free
        moved = False
        for r in range(p):
            while pc[r] < len(steps[r]):
                step = steps[r][pc[r]]
                first = actions[r][step[0]]
                if first.is_comm:
                    for i in step:
                        posted.setdefault((r, i), clock[r])
                    end = _batch_done(actions, r, step, partner, posted, clock[r], latency, sends)
                    if end is None:
                        break
                    timelines[r].append(Span(clock[r], end, tuple(actions[r][i] for i in step)))
                else:
                    end = clock[r] + cost[first.kind]
                    timelines[r].append(Span(clock[r], end, first))
                clock[r], pc[r], moved = end, pc[r] + 1, True
    blocked = [r for r in range(p) if pc[r] < len(steps[r])]
    if blocked:
        raise DeadlockError("deadlock: " + "; ".join(_why(actions, steps, pc, partner, posted, r) for r in blocked))
    makespan = max(clock, default=0.0)
    busy = [sum(s.end - s.start for s in t if isinstance(s.step, Action)) for t in timelines]
    per_rank = [1.0 - x / makespan if makespan else 0.0 for x in busy]
    memory = [_memory(acts) for acts in actions]
    return SimResult(
        timelines,
        makespan,
        busy,
        per_rank,
        sum(per_rank) / p if p else 0.0,
        [m[0] for m in memory],
        [m[1] for m in memory],
    )


def _batch_done(actions, r, step, partner, posted, now, latency, sends) -> float | None:
    """When rank r's batch completes, or None while a partner has not been posted."""
    end = now
    for i in step:
        if sends == "eager" and actions[r][i].kind.startswith("SEND"):
            continue
        other = partner[(r, i)]
        if other is None or other not in posted:
            return None
        # eager: the data left when the send was posted; rendezvous: once both sides were.
        start = posted[other] if sends == "eager" else max(posted[other], now)
        end = max(end, start + latency)
    return end


def _why(actions, steps, pc, partner, posted, r) -> str:
    step = steps[r][pc[r]]
    batch = " ".join(str(actions[r][i]) for i in step)
    for i in step:
        other = partner[(r, i)]
        a = actions[r][i]
        if other is None:
            return f"rank {r} waits at [{batch}]: {a} has no partner on rank {a.peer}"
        if other not in posted:
            o_rank, o_index = other
            return (
                f"rank {r} waits at [{batch}] for rank {o_rank} to reach {actions[o_rank][o_index]} (action {o_index})"
            )
    return f"rank {r} waits at [{batch}]"


def format_timeline(result: SimResult, unit: float = 1.0) -> str:
    """One row per rank, one character per `unit` of time: F, B, W (uppercase on chunk 0,
    lowercase on later chunks), '.' idle or waiting."""
    width = round(result.makespan / unit)
    rows = []
    for r, spans in enumerate(result.timelines):
        row = ["."] * width
        for s in spans:
            if isinstance(s.step, Action):
                ch = s.step.kind if s.step.chunk == 0 else s.step.kind.lower()
                for t in range(round(s.start / unit), round(s.end / unit)):
                    row[t] = ch
        rows.append(f"rank {r} | " + "".join(row))
    return "\n".join(rows)


def bubble_theory(name: str, p: int, m: int, v: int = 1) -> float:
    """Bubble fraction of the step with equal stages and B = 2F (zb: B = W = F), as
    `simulate` measures it: gpipe and 1f1b (p-1)/(m+p-1); interleaved (p-1)/(v*m+p-1), i.e.
    Megatron's (1/v)(p-1)/m of the ideal time, for m a multiple of p; zb (p-1)/(3m+p-1) for
    m >= p, a third of 1f1b's idle time."""
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zb":
        return (p - 1) / (3 * m + p - 1)
    raise ValueError(f"unknown schedule {name!r}")


# ----------------------------------------------------------------------------- checking


def check_schedule(actions: list[list[Action]], p: int, m: int, v: int = 1) -> SimResult:
    """Assert that a schedule is complete (one F and one B, and one W if any, per micro-batch
    and virtual stage; the sends and receives its stage boundaries need and no others), ordered
    (F before B before W; receive before use, send after production), matched (every send
    pairs with the receive of the same micro-batch on the next or previous stage) and free of
    deadlock under the strict rendezvous rule. AssertionError names the first problem.
    Returns the eager simulation at f=1, b=2, w=1."""
    assert len(actions) == p, f"expected {p} rank lists, got {len(actions)}"
    last = p * v - 1
    split = any(a.kind == "W" for acts in actions for a in acts)
    for rank, acts in enumerate(actions):
        where: dict[tuple[str, int, int], list[int]] = defaultdict(list)
        for i, a in enumerate(acts):
            assert isinstance(a, Action), f"rank {rank} action {i}: {a!r} is not an Action"
            assert 0 <= a.microbatch < m, f"rank {rank} action {i}: {a} has micro-batch outside 0..{m - 1}"
            assert 0 <= a.chunk < v, f"rank {rank} action {i}: {a} has chunk outside 0..{v - 1}"
            where[(a.kind, a.microbatch, a.chunk)].append(i)
        for chunk in range(v):
            s = virtual_stage(rank, chunk, p)
            expected = {
                "F": True,
                "B": True,
                "W": split,
                "RECV_F": s > 0,
                "SEND_F": s < last,
                "RECV_B": s < last,
                "SEND_B": s > 0,
            }
            for mb in range(m):
                pos = {}
                for kind, needed in expected.items():
                    found = where.pop((kind, mb, chunk), [])
                    assert len(found) == needed, (
                        f"rank {rank}: {kind}{mb}c{chunk} (stage {s}) appears "
                        f"{len(found)} times, expected {int(needed)}"
                    )
                    if found:
                        pos[kind] = found[0]
                for before, after in (
                    ("F", "B"),
                    ("B", "W"),
                    ("RECV_F", "F"),
                    ("F", "SEND_F"),
                    ("RECV_B", "B"),
                    ("B", "SEND_B"),
                ):
                    if before in pos and after in pos:
                        assert pos[before] < pos[after], (
                            f"rank {rank}: {after}{mb}c{chunk} (action {pos[after]}) "
                            f"comes before {before}{mb}c{chunk} (action {pos[before]})"
                        )
        assert not where, f"rank {rank}: unexpected actions " + ", ".join(f"{k}{mb}c{c}" for k, mb, c in where)
        for i, a in enumerate(acts):
            if a.is_comm:
                s = virtual_stage(rank, a.chunk, p)
                to = s + 1 if a.kind in ("SEND_F", "RECV_B") else s - 1
                owner = stage_owner(to, p)[0]
                assert a.peer == owner, (
                    f"rank {rank} action {i}: {a} names peer {a.peer}, but stage {to} is on rank {owner}"
                )
    _check_pairs(actions, p)
    try:
        strict = simulate(actions, sends="rendezvous")
    except DeadlockError as err:
        raise AssertionError(str(err)) from None
    result = simulate(actions)
    _check_dependencies(strict, p, v)
    _check_dependencies(result, p, v)
    return result


def _check_pairs(actions: list[list[Action]], p: int) -> None:
    partner = _pair(actions)
    for (rank, i), other in partner.items():
        a = actions[rank][i]
        assert other is not None, f"rank {rank} action {i}: {a} has no partner on rank {a.peer}"
        if a.kind.startswith("SEND"):
            b = actions[other[0]][other[1]]
            s, t = virtual_stage(rank, a.chunk, p), virtual_stage(other[0], b.chunk, p)
            step = 1 if a.kind == "SEND_F" else -1
            assert b.microbatch == a.microbatch and t == s + step, (
                f"rank {rank} action {i}: {a} (stage {s}) pairs with {b} on rank {other[0]} "
                f"(stage {t}): sends and receives on this channel come in different orders"
            )
    # NCCL matches by order per pair of ranks, without tags: directions must line up too.
    order: dict[tuple[int, int, str], list[str]] = defaultdict(list)
    for rank, acts in enumerate(actions):
        for a in acts:
            if a.is_comm:
                src, dst = (rank, a.peer) if a.kind.startswith("SEND") else (a.peer, rank)
                order[(src, dst, a.kind[:4])].append(f"{_DIRECTION[a.kind]}{a.microbatch}")
    for (src, dst, side), seq in order.items():
        if side == "SEND":
            recv = order.get((src, dst, "RECV"), [])
            assert seq == recv, (
                f"rank {src} -> rank {dst}: sends go {' '.join(seq)} but receives expect "
                f"{' '.join(recv)}: an untagged transport would pair them wrongly"
            )


def _check_dependencies(result: SimResult, p: int, v: int) -> None:
    span: dict[tuple[str, int, int], Span] = {}
    for rank, spans in enumerate(result.timelines):
        for s in spans:
            if isinstance(s.step, Action):
                span[(s.step.kind, s.step.microbatch, virtual_stage(rank, s.step.chunk, p))] = s
    last = p * v - 1
    for (kind, mb, s), x in span.items():
        need = (
            ("F", mb, s - 1)
            if kind == "F" and s > 0
            else ("B", mb, s + 1)
            if kind == "B" and s < last
            else ("F", mb, s)
            if kind == "B"
            else ("B", mb, s)
            if kind == "W"
            else None
        )
        if need is not None:
            assert span[need].end <= x.start, (
                f"{kind}{mb} on stage {s} starts at {x.start} before "
                f"{need[0]}{mb} on stage {need[2]} ends at {span[need].end}"
            )
