"""Pipeline schedules as data: a pure function returns every rank's ordered list of actions.

Layout. With p pipeline ranks and v chunks per rank the model is cut into S = p * v virtual
stages; virtual stage s = chunk * p + rank (Megatron's interleaved placement, the same as
`partition.py`). Stage 0 reads the tokens, stage S - 1 computes the loss.

Actions. F runs the forward of one micro-batch on one chunk. B runs its backward: input and
weight gradients together, except in `zb`, where B is the input gradient only and W the
weight gradient (Qi et al. 2023). SEND_F / RECV_F move an activation from stage s to stage
s + 1, SEND_B / RECV_B move its gradient from stage s + 1 back to stage s. A send names the
chunk that produced the tensor, a receive the chunk that consumes it; `peer` is the other
pipeline rank. Sends and receives are explicit: no two virtual stages exchange anything the
lists do not say, and a stage never sends to itself (interleaving needs p >= 2).

Batching convention (what the executor must do). A maximal run of consecutive comm actions
on a rank is one batch: post all of it with one `batch_isend_irecv`, ops in list order. Wait
for the batch's receives before the next compute action; keep its send requests and wait for
them before the step ends (torch.distributed.pipelining does the same). The strict rule,
waiting for sends too before moving on, is also deadlock-free for every schedule here
(`simulate.check_schedule` runs both per (p, m, v)) and costs gpipe, 1f1b and zb nothing at
equal stage costs, but stalls interleaved a little: there a rank can be busy at the very
moment its partner would hand a tensor over. Per ordered pair of ranks, sends and receives
come in the same order, so the pairing also holds on a transport that matches by order
without tags (NCCL).

Where the comms go. The compute order is the schedule; the comms are placed by one rule,
`_with_comms`: run the compute order at nominal costs (F = 1, B = 2; zb: F = B = W = 1) and
give each message a meeting time between the end of its producer and the start of its
consumer, when both ranks stand between two computes if there is such a time. The send goes
into the producer's batch at that time, the receive into the consumer's. Every rank's batches
are then ordered by meeting time, which rules out deadlock for any real costs; in 1F1B this
reproduces Megatron's send_forward_recv_backward / send_backward_recv_forward pairs.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from dataclasses import dataclass

from threefold.errors import ConfigError

COMPUTE_KINDS = ("F", "B", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")

# Nominal per-chunk costs the comms are placed with (integers: meeting times compare exactly).
_FUSED_COSTS = {"F": 1, "B": 2}
_SPLIT_COSTS = {"F": 1, "B": 1, "W": 1}


class ScheduleError(ConfigError, ValueError):
    """An invalid (schedule, p, m, v): one line naming the setting, the problem and what is valid."""


@dataclass(frozen=True)
class Action:
    """One step of one pipeline rank."""

    kind: str
    """F, B or W (compute) or SEND_F, RECV_F, SEND_B, RECV_B (point-to-point)."""
    microbatch: int
    """Micro-batch index, 0..m-1."""
    chunk: int = 0
    """Model chunk local to the rank, 0..v-1; virtual stage = chunk * p + rank."""
    peer: int | None = None
    """Pipeline rank at the other end of a send or receive; None for compute."""

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE_KINDS + COMM_KINDS:
            raise ValueError(f"unknown action kind {self.kind!r} (valid: {', '.join(COMPUTE_KINDS + COMM_KINDS)})")
        if (self.peer is None) != (self.kind in COMPUTE_KINDS):
            raise ValueError(f"{self.kind} {'takes no' if self.kind in COMPUTE_KINDS else 'needs a'} peer")

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    def __str__(self) -> str:
        text = f"{self.kind}{self.microbatch}c{self.chunk}"
        if self.kind.startswith("SEND"):
            return f"{text}->{self.peer}"
        if self.kind.startswith("RECV"):
            return f"{text}<-{self.peer}"
        return text


def virtual_stage(rank: int, chunk: int, p: int) -> int:
    """Virtual stage of `chunk` on pipeline `rank` (Megatron interleaved layout)."""
    return chunk * p + rank


def stage_owner(stage: int, p: int) -> tuple[int, int]:
    """(rank, chunk) holding virtual stage `stage`."""
    return stage % p, stage // p


def group_batches(actions: list[Action]) -> list[Action | tuple[Action, ...]]:
    """One rank's actions as the executor runs them: a compute action, or a tuple of comm
    actions posted together as one batch (see the module docstring)."""
    steps: list[Action | tuple[Action, ...]] = []
    run: list[Action] = []
    for action in actions:
        if action.is_comm:
            run.append(action)
            continue
        if run:
            steps.append(tuple(run))
            run = []
        steps.append(action)
    if run:
        steps.append(tuple(run))
    return steps


# ----------------------------------------------------------------------------- validation


def check_args(name: str, p: int, m: int, v: int = 1) -> None:
    """Refuse an invalid (schedule, p, m, v) with one clear line (ScheduleError, a ValueError)."""
    if name not in SCHEDULES:
        raise ScheduleError(
            "parallel.schedule", f"{name!r} is not a pipeline schedule", f"valid: {', '.join(SCHEDULES)}"
        )
    for key, value in (("parallel.pp", p), ("parallel.microbatches", m), ("parallel.vpp", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(key, f"{value!r} must be a positive integer")
    if name != "interleaved" and v != 1:
        raise ScheduleError(
            "parallel.vpp",
            f"vpp={v} needs schedule=interleaved, {name} runs one chunk per rank",
            "set vpp=1 or schedule=interleaved",
        )
    if name == "interleaved":
        if v < 2:
            raise ScheduleError(
                "parallel.vpp", f"schedule=interleaved needs vpp >= 2, got vpp={v}", "or use schedule=1f1b"
            )
        if p < 2:
            raise ScheduleError(
                "parallel.pp", f"schedule=interleaved needs pp >= 2, got pp={p}", "one stage has no bubble to shrink"
            )
        if m % p:
            raise ScheduleError(
                "parallel.microbatches",
                f"schedule=interleaved needs microbatches to be a multiple of pp={p}, got {m}",
                "or use schedule=1f1b",
            )


# ----------------------------------------------------------------------------- schedules


def gpipe(p: int, m: int) -> list[list[Action]]:
    """GPipe: every forward, then every backward (activations of all m micro-batches live)."""
    check_args("gpipe", p, m)
    orders = [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(p)]
    return _with_comms(orders, p, 1)


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """1F1B (PipeDream-flush): p - rank - 1 warm-up forwards, then one forward one backward,
    then the remaining backwards. Stage r holds at most p - r micro-batches."""
    check_args("1f1b", p, m)
    orders = []
    for rank in range(p):
        warmup = min(p - rank - 1, m)
        order = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action("F", warmup + i), Action("B", i)]
        order += [Action("B", i) for i in range(m - warmup, m)]
        orders.append(order)
    return _with_comms(orders, p, 1)


def interleaved_1f1b(p: int, m: int, v: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021, sec. 2.2): v chunks per rank, the
    bubble divided by v. Needs m to be a multiple of p.

    Forwards run in groups of p micro-batches, chunk by chunk: micro-batches 0..p-1 on chunk 0,
    the same on chunk 1, ..., then the next p. Backwards follow the same table with the
    chunks reversed. A group of p is what lets stage 0 start chunk c + 1 of a micro-batch just
    as the last rank hands it over; the table is Megatron's, where m % p == 0 is required too.
    """
    check_args("interleaved", p, m, v)
    table = [(group + i, chunk) for group in range(0, m, p) for chunk in range(v) for i in range(p)]
    total = m * v
    orders = []
    for rank in range(p):
        # Stage 0's first backward (micro-batch 0, last chunk) follows p forwards on each of
        # chunks 0..v-2 and a round trip to the last rank: Megatron's warm-up count.
        warmup = min((v - 1) * p + 2 * (p - rank - 1), total)
        order = [Action("F", mb, chunk) for mb, chunk in table[:warmup]]
        for k in range(total - warmup):
            mb, chunk = table[warmup + k]
            order.append(Action("F", mb, chunk))
            mb, chunk = table[k]
            order.append(Action("B", mb, v - 1 - chunk))
        order += [Action("B", mb, v - 1 - chunk) for mb, chunk in table[total - warmup :]]
        orders.append(order)
    return _with_comms(orders, p, v)


def zero_bubble_h1(p: int, m: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023, sec. 2.1): 1F1B with the backward split into B (input gradient,
    on the critical path) and W (weight gradient, free to move).

    Rank r keeps 1F1B's order of F and B and runs each W as soon as more than r of them are
    pending; the r it holds back fill the cool-down, where 1F1B waits. Every rank then keeps
    at most p micro-batches between F and W, stage 0's 1F1B peak; with F = B = W the bubble
    drops from 3(p-1) to p-1 time units.
    """
    check_args("zb", p, m)
    orders = []
    for rank in range(p):
        warmup = min(p - rank - 1, m)
        order: list[Action] = [Action("F", i) for i in range(warmup)]
        pending: deque[int] = deque()
        for i in range(m):
            if i < m - warmup:
                order.append(Action("F", warmup + i))
            order.append(Action("B", i))
            pending.append(i)
            if len(pending) > rank:
                order.append(Action("W", pending.popleft()))
        order += [Action("W", i) for i in pending]
        orders.append(order)
    return _with_comms(orders, p, 1)


def build_schedule(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Dispatch on `parallel.schedule`: gpipe | 1f1b | interleaved | zb."""
    check_args(name, p, m, v)
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved_1f1b(p, m, v)
    return zero_bubble_h1(p, m)


def format_schedule(actions_per_rank: list[list[Action]], comms: bool = True) -> str:
    """A printable table, one row per rank; a bracketed cell is one batch of comms."""
    rows = []
    for actions in actions_per_rank:
        cells = []
        for step in group_batches(actions):
            if isinstance(step, tuple):
                if comms:
                    cells.append("[" + " ".join(str(a) for a in step) + "]")
            else:
                cells.append(str(step))
        rows.append(cells)
    widths = [max(len(row[k]) for row in rows if k < len(row)) for k in range(max(map(len, rows), default=0))]
    label = len(str(len(rows) - 1))
    return "\n".join(
        f"rank {r:>{label}} | " + " ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
        for r, row in enumerate(rows)
    )


# ----------------------------------------------------------------------------- comm placement


def _nominal_times(orders: list[list[Action]], p: int, v: int) -> list[list[tuple[int, int]]]:
    """(start, end) of each compute action when every rank runs its order as early as its data
    allows, with nominal costs and free, instant transfers."""
    costs = _SPLIT_COSTS if any(a.kind == "W" for order in orders for a in order) else _FUSED_COSTS
    last = p * v - 1
    done: dict[tuple[str, int, int], int] = {}
    times: list[list[tuple[int, int]]] = [[] for _ in orders]
    clock = [0] * p
    moved = True
    while moved:
        moved = False
        for rank, order in enumerate(orders):
            while len(times[rank]) < len(order):
                a = order[len(times[rank])]
                s = virtual_stage(rank, a.chunk, p)
                need = (
                    ("F", a.microbatch, s - 1)
                    if a.kind == "F" and s > 0
                    else ("B", a.microbatch, s + 1)
                    if a.kind == "B" and s < last
                    else None
                )
                if need is not None and need not in done:
                    break
                start = max(clock[rank], done.get(need, 0))
                clock[rank] = start + costs[a.kind]
                done[(a.kind, a.microbatch, s)] = clock[rank]
                times[rank].append((start, clock[rank]))
                moved = True
    stuck = [r for r, order in enumerate(orders) if len(times[r]) < len(order)]
    if stuck:  # a bug in a schedule function, not a user error
        raise RuntimeError(f"compute orders wait on each other: ranks {stuck} cannot proceed")
    return times


def _meeting_time(times_a: list[tuple[int, int]], t_p: int, times_b: list[tuple[int, int]], t_c: int) -> int:
    """Earliest time in [t_p, t_c] at which both ranks stand between two computes; t_c (the
    consumer is about to start, the producer may wait) when there is none."""

    def idle(times: list[tuple[int, int]], t: int) -> bool:
        k = bisect_right([end for _, end in times], t)  # computes finished by t
        return k == len(times) or times[k][0] >= t

    candidates = sorted({t_p} | {end for times in (times_a, times_b) for _, end in times if t_p < end <= t_c})
    return next((t for t in candidates if idle(times_a, t) and idle(times_b, t)), t_c)


def _with_comms(orders: list[list[Action]], p: int, v: int) -> list[list[Action]]:
    """Insert the sends and receives into compute-only orders (see the module docstring).

    Slot k of a rank is the time span [end of compute k-1, end of compute k): the comms placed
    in it form the batch just before compute k. A message produced at t_p and consumed at t_c
    meets at some t in [t_p, t_c]: its send goes into the producer's slot holding t (after the
    producer, since t >= t_p), its receive into the consumer's slot holding t (before the
    consumer, since t <= t_c < its end). Each rank's batches are thus strictly ordered by
    meeting time, for every choice of t, so the smallest unfinished meeting can always
    complete: no deadlock. Choosing t where both ranks are idle means nobody waits for a
    partner even under the strict rule; gpipe, 1f1b and zb always find such a t, interleaved
    not always (see the module docstring).
    """
    times = _nominal_times(orders, p, v)
    slot_starts = [[0] + [end for _, end in t] for t in times]
    where = {(r, a.kind, a.microbatch, a.chunk): k for r, order in enumerate(orders) for k, a in enumerate(order)}
    slots: list[list[list[tuple]]] = [[[] for _ in range(len(order) + 1)] for order in orders]
    last = p * v - 1
    for rank, order in enumerate(orders):
        for k, a in enumerate(order):
            s = virtual_stage(rank, a.chunk, p)
            if a.kind == "F" and s < last:
                direction, to = "F", s + 1
            elif a.kind == "B" and s > 0:
                direction, to = "B", s - 1
            else:
                continue
            peer, peer_chunk = stage_owner(to, p)
            j = where[(peer, direction, a.microbatch, peer_chunk)]
            t = _meeting_time(times[rank], times[rank][k][1], times[peer], times[peer][j][0])
            key = (t, direction, a.microbatch, s)
            slots[rank][bisect_right(slot_starts[rank], t) - 1].append(
                (key, Action("SEND_" + direction, a.microbatch, a.chunk, peer))
            )
            slots[peer][bisect_right(slot_starts[peer], t) - 1].append(
                (key, Action("RECV_" + direction, a.microbatch, peer_chunk, rank))
            )
    out = []
    for rank, order in enumerate(orders):
        actions: list[Action] = []
        for k in range(len(order) + 1):
            actions += [a for _, a in sorted(slots[rank][k], key=lambda item: (item[0], item[1].kind))]
            if k < len(order):
                actions.append(order[k])
        out.append(actions)
    return out
