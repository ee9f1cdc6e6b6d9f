"""Every collective and point-to-point transfer threefold issues, and the process group's start
and end: the one module that talks to torch.distributed (tests/distributed/test_comm.py fails on a direct
call anywhere else).

Each data-plane function takes the `Group` it talks to (distributed/grid.py) and

- checks that the tensor lives where the group communicates (`group.device`): NCCL takes
  device tensors only, and gloo silently accepts the CPU tensor NCCL would refuse, so the
  check runs on every backend and at every group size, a group of one included;
- records the call and its bytes in `group.stats` (bytes = the whole logical tensor: the
  all-reduced tensor, the all-gather's output, the reduce-scatter's input, a send's payload;
  receives are the peers' sends and are not counted again);
- is timed as `group.span_category` when the group carries a span recorder (threefold.observe);
- skips the communication on a group of one rank (the call is not counted either).

Asynchronous calls (`async_op=True`) return torch's work handle; `wait()` on it (NCCL: the
current stream waits; gloo: the host waits).

Every operation on a group of two or more also gets the group's next sequence number
(`group.ops`, an OpLog: the newest posted and the newest completed, with their kinds): when a
collective times out, each surviving rank can say which operation of which group it was waiting
in, and a rank that never posted it shows as one whose count stopped short (distributed/hang.py).
A batch of point-to-point operations is one number. While `group.link` holds a LinkTimes (the
observer sets one when spans are on), the time in each collective (the call, and the wait of an
asynchronous one) and the time spent posting and waiting per peer of point-to-point batches are
summed there: what a slow link or a slow peer costs this rank, per group and per peer.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from threefold.distributed.timer import DeviceTimer

ReduceOp = dist.ReduceOp
SUM, MAX = dist.ReduceOp.SUM, dist.ReduceOp.MAX
_UNTIMED = contextlib.nullcontext()
# torch 2.13 renamed the flat collectives (the old names warn); older versions have only those.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Collectives this rank issued on one group: calls and bytes per kind ("all_reduce", ...).

    Bytes are the size of the whole logical tensor a collective handles (the all-reduced
    tensor, the all-gather's output, the reduce-scatter's input): the message size nccl-tests
    reports. On a ring each rank sends 2(n-1)/n of it for an all-reduce, (n-1)/n otherwise.
    """

    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def record(self, kind: str, nbytes: int) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + int(nbytes)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """{kind: (calls, bytes)}; subtract two snapshots to see what a region of code sent."""
        return {k: (self.calls[k], self.bytes[k]) for k in self.calls}

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()


@dataclass
class OpLog:
    """This rank's numbered operations on one group: the newest posted and the newest completed.
    A sequence number counts every collective and every batch of point-to-point operations this
    rank issued on the group, from 1; the same operation has the same number on every member."""

    posted: int = 0
    posted_kind: str = ""
    posted_peers: tuple[int, ...] = ()
    """Global ranks of the newest posted point-to-point batch's peers (() for a collective)."""
    completed: int = 0
    completed_kind: str = ""
    _open: dict = field(default_factory=dict, repr=False)
    """id(work handle) -> (seq, kind) of asynchronous operations not waited on yet."""

    def post(self, kind: str, peers: tuple[int, ...] = ()) -> int:
        self.posted += 1
        self.posted_kind, self.posted_peers = kind, peers
        return self.posted

    def complete(self, seq: int, kind: str) -> None:
        if seq > self.completed:
            self.completed, self.completed_kind = seq, kind

    def state(self) -> dict:
        """What this rank last did on the group: JSON-ready, for a failure record."""
        return {
            "posted": self.posted,
            "posted_kind": self.posted_kind,
            "posted_peers": list(self.posted_peers),
            "completed": self.completed,
            "completed_kind": self.completed_kind,
        }


class LinkTimes:
    """Seconds this rank spent in one group's communication since the last take(): in its
    collectives (the call, and the wait of an asynchronous one) and, per peer (a global rank), in
    posting and waiting for point-to-point batches that involve that peer. DeviceTimers: host
    perf_counter on CPU, event pairs on the stream on CUDA (read where the host waits anyway)."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = device
        self.collective = DeviceTimer(device)
        self.peers: dict[int, DeviceTimer] = {}

    def peer(self, rank: int) -> DeviceTimer:
        timer = self.peers.get(rank)
        if timer is None:
            timer = self.peers[rank] = DeviceTimer(self.device)
        return timer

    def take(self) -> tuple[DeviceTimer, dict[int, DeviceTimer]]:
        """The intervals so far, unread; the timers start again from zero."""
        return self.collective.take(), {r: t.take() for r, t in self.peers.items()}


@contextlib.contextmanager
def peer_timing(group: Group, peers):
    """Time a block as point-to-point time with each of `peers` (global ranks) on `group`'s
    LinkTimes; nothing without one. The pipeline executor's receive waits use it."""
    link = group.link
    if link is None or not peers:
        yield
        return
    timers = [link.peer(p) for p in peers]
    tokens = [t.start() for t in timers]
    try:
        yield
    finally:
        for t, token in zip(timers, tokens):
            t.stop(token)


@dataclass
class Deadlines:
    """How long this rank's collectives on a group wait for its peers: `regular` (train.timeout_s),
    or `patient` (train.startup_timeout_s) while `open_phases` > 0: phases in which some rank does
    long host work that its peers wait through with collectives already issued (start-up and the
    first step's compilation, a save, a resume; distributed/runtime.py opens and closes them)."""

    regular: timedelta
    patient: timedelta
    open_phases: int = 0


@dataclass
class Group:
    """One process group as seen from this rank: its members, our index, the torch handle, where
    it communicates, and the communication it carried (recorded by the functions below)."""

    name: str
    ranks: list[int]
    pg: object | None
    """torch's process group handle (None for a group of this rank alone, built without one)."""
    stats: CommStats = field(default_factory=CommStats, compare=False, repr=False)
    spans: object = field(default=None, compare=False, repr=False)
    """A span recorder (threefold.observe.spans) that times this group's collectives, or None."""
    device: torch.device | None = field(default=None, compare=False)
    """Where tensors must live to enter this group's collectives (None: unchecked)."""
    span_category: str = field(default="sync", compare=False)
    """The span category this group's collectives count as (tp_comm, ep_a2a, ...)."""
    p2p_log: list | None = field(default=None, compare=False, repr=False)
    """While a list (the observer sets one on traced steps): a P2PBatch for every batch that
    batch_send_recv posts, so the same traffic can be timed alone (context_parallel.overlap)."""
    deadlines: Deadlines | None = field(default=None, compare=False, repr=False)
    """A training run's two timeouts for this group (None: it keeps the one it was made with)."""
    link_delays: dict[int, float] = field(default_factory=dict, compare=False, repr=False)
    """The slowlink drill (Grid.build's link_delays): seconds this rank waits before exchanging
    with each peer (a global rank) of this group: before a send to or receive from that peer,
    and before every collective of the group (the longest). Empty (no cost) unless drilled."""
    ops: OpLog = field(default_factory=OpLog, compare=False, repr=False)
    """This rank's numbered operations on the group (hang attribution)."""
    link: LinkTimes | None = field(default=None, compare=False, repr=False)
    """While set (the observer, with spans on): where the time in this group's communication is
    summed, per collective and per point-to-point peer. None costs nothing."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        return self.ranks.index(dist.get_rank()) if self.pg is not None else 0


@contextlib.contextmanager
def unrecorded(group: Group):
    """Communication on `group` that measures rather than trains (a replay, a probe, the
    observer's own report): left out of group.stats, its spans, its p2p log and its LinkTimes,
    which are as they were afterwards."""
    saved = group.stats, group.spans, group.p2p_log, group.link
    group.stats, group.spans, group.p2p_log, group.link = CommStats(), None, None, None
    try:
        yield
    finally:
        group.stats, group.spans, group.p2p_log, group.link = saved


def nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _check(x: torch.Tensor, group: Group, what: str) -> None:
    if group.device is not None and x.device.type != group.device.type:
        raise RuntimeError(
            f"{what} over the {group.name} group: the tensor is on {x.device}, the group "
            f"communicates on {group.device.type} (NCCL takes device tensors only)"
        )


def _timed(group: Group):
    return _UNTIMED if group.spans is None else group.spans.span(group.span_category)


def _link_wait(group: Group, peers=None) -> None:
    """The slowlink drill: wait as a slow link would, before an exchange with `peers` (global
    ranks; None: a collective, which crosses every link of the group)."""
    delays = group.link_delays
    waits = delays.values() if peers is None else [delays.get(p, 0.0) for p in peers]
    seconds = max(waits, default=0.0)
    if seconds > 0:
        time.sleep(seconds)


def _run(group: Group, kind: str, size: int, fn, async_op: bool):
    """Record, number, time and issue one collective; a group of one only returns."""
    if group.size == 1:
        return None
    link = group.link
    token = link.collective.start() if link is not None else None
    group.stats.record(kind, size)
    seq = group.ops.post(kind)
    with _timed(group):
        if group.link_delays and not async_op:  # an asynchronous one waits where it is waited on
            _link_wait(group)
        work = fn(async_op)
    if link is not None:
        link.collective.stop(token)
    if async_op and work is not None:
        group.ops._open[id(work)] = (seq, kind)
    else:
        group.ops.complete(seq, kind)
    return work


# --- collectives -------------------------------------------------------------------------------


def all_reduce(x: torch.Tensor, group: Group, op=SUM, async_op: bool = False):
    """All-reduce `x` in place (contiguous). Returns `x`, or the work handle with async_op."""
    _check(x, group, "all_reduce")
    work = _run(
        group, "all_reduce", nbytes(x), lambda a: dist.all_reduce(x, op=op, group=group.pg, async_op=a), async_op
    )
    return work if async_op else x


def all_reduce_sum(values: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum a small tensor of scalars (loss, token counts) over `group`, in place."""
    return all_reduce(values, group)


def all_reduce_max(values: torch.Tensor, group: Group) -> torch.Tensor:
    """The element-wise maximum over `group`, in place."""
    return all_reduce(values, group, op=MAX)


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group: Group, async_op: bool = False):
    """out (group.size x x's elements, contiguous) <- every rank's `x` in rank order."""
    _check(x, group, "all_gather")
    if group.size == 1:
        out.copy_(x.reshape(out.shape))
        return None
    return _run(
        group, "all_gather", nbytes(out), lambda a: _all_gather_flat(out, x, group=group.pg, async_op=a), async_op
    )


class _SummedSlices:
    """gloo's reduce-scatter composed as an all-to-all of the slices and a local sum: gloo has
    no reduce-scatter of its own (torch runs it as a reduction of the whole tensor), and the
    all-to-all moves each rank's (size - 1)/size of it once. Measured at 2 ranks on the 2-core
    host: 1 MiB 0.62 ms against 1.03 for gloo's reduce-scatter and 2.44 for its all-reduce
    (median of 30). The sum is chained to the all-to-all's future, so it runs on gloo's thread
    as soon as the slices are in (behind backward, like the rest of an overlapped reduction);
    wait() waits for both."""

    def __init__(self, work, chunks: torch.Tensor, out: torch.Tensor):
        self.future = work.get_future().then(lambda _: _sum_slices(chunks, out))

    def wait(self) -> bool:
        self.future.wait()
        return True


def _sum_slices(chunks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out <- the sum of the slices every rank sent this one (chunks: size x out's elements)."""
    return torch.sum(chunks, dim=0, out=out.view(-1))


def _is_gloo(group: Group) -> bool:
    return dist.get_backend(group.pg) == "gloo"


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group: Group, async_op: bool = False):
    """out (1/size of x) <- this rank's slice of the sum of every rank's `x`. `out` may be this
    rank's own slice of `x` (in place, as NCCL allows)."""
    _check(x, group, "reduce_scatter")
    if group.size == 1:
        out.copy_(x.reshape(out.shape))
        return None
    if _is_gloo(group):
        chunks = torch.empty((group.size, out.numel()), dtype=x.dtype, device=x.device)

        def composed(a: bool):
            work = dist.all_to_all_single(chunks, x.reshape(-1), group=group.pg, async_op=a)
            if a:
                return _SummedSlices(work, chunks, out)
            _sum_slices(chunks, out)
            return None

        return _run(group, "reduce_scatter", nbytes(x), composed, async_op)
    return _run(
        group,
        "reduce_scatter",
        nbytes(x),
        lambda a: _reduce_scatter_flat(out, x, op=SUM, group=group.pg, async_op=a),
        async_op,
    )


def all_gather_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's `x` concatenated along dimension 0."""
    x = x.contiguous()
    if group.size == 1:
        _check(x, group, "all_gather")
        return x
    out = torch.empty((x.shape[0] * group.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into(out, x, group)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The sum of `x` over the group, this rank's 1/size slice of dimension 0."""
    x = x.contiguous()
    if group.size == 1:
        _check(x, group, "reduce_scatter")
        return x
    if x.shape[0] % group.size:
        raise ValueError(f"reduce-scatter: dimension 0 ({x.shape[0]}) is not divisible by {group.size}")
    out = torch.empty((x.shape[0] // group.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_into(out, x, group)
    return out


def all_to_all(
    out: torch.Tensor,
    x: torch.Tensor,
    group: Group,
    out_splits: list[int] | None = None,
    in_splits: list[int] | None = None,
) -> torch.Tensor:
    """Rows of `x` to every rank (in_splits[j] rows to rank j, even splits when None); rank i's
    rows for us land in `out` (out_splits[i] rows)."""
    _check(x, group, "all_to_all")
    if group.size == 1:
        return out.copy_(x)
    _run(
        group,
        "all_to_all",
        nbytes(x),
        lambda a: dist.all_to_all_single(
            out, x, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group.pg, async_op=a
        ),
        False,
    )
    return out


def gather_dim0(x: torch.Tensor, group: Group) -> torch.Tensor | None:
    """Every rank's `x` concatenated along dimension 0 on the group's first rank (None on the
    others): per-rank detail for rank 0 only, O(size) bytes there and O(1) everywhere else."""
    x = x.contiguous()
    _check(x, group, "gather")
    if group.size == 1:
        return x
    first = group.rank == 0
    parts = [torch.empty_like(x) for _ in range(group.size)] if first else None
    # Bytes as each rank handles them: the first rank the whole output, the others their part.
    _run(
        group,
        "gather",
        nbytes(x) * (group.size if first else 1),
        lambda a: dist.gather(x, parts, dst=group.ranks[0], group=group.pg),
        False,
    )
    return torch.cat(parts) if first else None


def broadcast(x: torch.Tensor, group: Group, src: int = 0) -> torch.Tensor:
    """`x` from the group's rank `src` (an index in the group) to every rank, in place."""
    _check(x, group, "broadcast")
    _run(group, "broadcast", nbytes(x), lambda a: dist.broadcast(x, src=group.ranks[src], group=group.pg), False)
    return x


def wait(work, group: Group, _collective: bool = True, spans: bool = True) -> None:
    """Wait for an asynchronous call on `group` (None: a group of one issued nothing); timed as
    the group's span category, like the call (and as collective time on its LinkTimes), and
    marked complete in its OpLog. `spans=False`: a caller that times the wait under a span of its
    own (a bucket's reduction, a ZeRO gather) keeps it there."""
    if work is not None:
        link = group.link if _collective else None
        token = link.collective.start() if link is not None else None
        with _timed(group) if spans else _UNTIMED:
            if group.link_delays and _collective and id(work) in group.ops._open:
                _link_wait(group)  # the slowlink drill: a slow link finishes a collective late
            work.wait()
        if link is not None:
            link.collective.stop(token)
        done = group.ops._open.pop(id(work), None)
        if done is not None:
            group.ops.complete(*done)


def barrier(group: Group) -> None:
    if group.size > 1:
        dist.barrier(group=group.pg)


def set_timeout(group: Group, timeout: timedelta) -> None:
    """The deadline of the collectives this rank issues on `group` from now on. torch gives a
    collective its group's timeout when it is issued (NCCL's watchdog ignores barrier(timeout=))."""
    if group.pg is not None:
        dist.distributed_c10d._set_pg_timeout(timeout, group.pg)


# --- point to point ----------------------------------------------------------------------------


@dataclass
class P2PBatch:
    """One logged batch of point-to-point operations (Group.p2p_log) and when, on this host's
    clock, it was posted and waited on (wait_all: from its start to its end)."""

    ops: tuple[tuple[str, tuple[int, ...], torch.dtype, int], ...]
    """(kind, shape, dtype, peer index in the group) of each operation."""
    posted: float
    waited: float | None = None
    done: float | None = None


class Posted(list):
    """The work handles of one batch_send_recv, with its P2PBatch when the group logs, its
    sequence number on the group and its peers (global ranks)."""

    entry: P2PBatch | None = None
    seq: int = 0
    peers: tuple[int, ...] = ()
    recv_peers: tuple[int, ...] = ()
    """The peers this batch receives from: a wait on the batch is time spent on them."""


def batch_done(posted: Posted, group: Group) -> None:
    """Mark a batch of batch_send_recv complete in the group's OpLog (wait_all does; a caller
    that waits on the handles itself, as the pipeline executor does, calls this after)."""
    if posted.seq:
        group.ops.complete(posted.seq, "p2p")


def batch_send_recv(ops: list[tuple[str, torch.Tensor, int]], group: Group) -> Posted:
    """Post ("send" | "recv", tensor, peer index in the group) operations together; returns the
    work handles (gloo: one per operation; NCCL: one for the whole batch)."""
    entry = None
    if group.p2p_log is not None:
        shapes = tuple((kind, tuple(t.shape), t.dtype, peer) for kind, t, peer in ops)
        entry = P2PBatch(shapes, time.perf_counter())
        group.p2p_log.append(entry)
    p2p = []
    for kind, tensor, peer in ops:
        _check(tensor, group, kind)
        if kind == "send":
            group.stats.record("send", nbytes(tensor))
        p2p.append(dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, group.ranks[peer], group=group.pg))
    peers = tuple(sorted({group.ranks[peer] for _, _, peer in ops}))
    with peer_timing(group, peers):
        if group.link_delays:
            _link_wait(group, peers)
        posted = Posted(dist.batch_isend_irecv(p2p) if p2p else [])
    posted.entry = entry
    posted.peers = peers
    posted.recv_peers = tuple(sorted({group.ranks[peer] for kind, _, peer in ops if kind == "recv"}))
    if p2p:
        posted.seq = group.ops.post("p2p", peers)
    return posted


def wait_all(works: list, group: Group) -> None:
    """Wait for every handle of one batch_send_recv (timed like wait); a logged batch records
    when its wait started and ended."""
    entry = getattr(works, "entry", None)
    if entry is not None:
        entry.waited = time.perf_counter()
    with peer_timing(group, getattr(works, "recv_peers", ())):
        for work in works:
            wait(work, group, _collective=False)
    if entry is not None:
        entry.done = time.perf_counter()
    if isinstance(works, Posted):
        batch_done(works, group)


def send(x: torch.Tensor, group: Group, peer: int) -> None:
    """Blocking send to the group's rank `peer` (an index in the group)."""
    _check(x, group, "send")
    group.stats.record("send", nbytes(x))
    peers = (group.ranks[peer],)
    seq = group.ops.post("send", peers)
    with peer_timing(group, peers):
        if group.link_delays:
            _link_wait(group, peers)
        dist.send(x, dst=group.ranks[peer], group=group.pg)
    group.ops.complete(seq, "send")


def recv(x: torch.Tensor, group: Group, peer: int) -> torch.Tensor:
    """Blocking receive into `x` from the group's rank `peer`."""
    _check(x, group, "recv")
    peers = (group.ranks[peer],)
    seq = group.ops.post("recv", peers)
    with peer_timing(group, peers):
        if group.link_delays:
            _link_wait(group, peers)
        dist.recv(x, src=group.ranks[peer], group=group.pg)
    group.ops.complete(seq, "recv")
    return x


# --- Python objects (rare: reports, checkpoint manifests) --------------------------------------


def all_gather_objects(obj, group: Group) -> list:
    """Every rank's picklable `obj`, in the group's rank order."""
    if group.size == 1:
        return [obj]
    out = [None] * group.size
    group.stats.record("all_gather_object", 0)
    dist.all_gather_object(out, obj, group=group.pg)
    return out


def gather_objects(obj, group: Group) -> list | None:
    """Every rank's `obj` on the group's first rank (a list there, None elsewhere)."""
    if group.size == 1:
        return [obj]
    first = group.rank == 0
    out = [None] * group.size if first else None
    group.stats.record("gather_object", 0)
    dist.gather_object(obj, out, dst=group.ranks[0], group=group.pg)
    return out


def broadcast_object(obj, group: Group, src: int = 0):
    """The group's rank `src`'s picklable `obj` on every rank (a decision taken once, by one rank)."""
    if group.size == 1:
        return obj
    box = [obj if group.rank == src else None]
    group.stats.record("broadcast_object", 0)
    dist.broadcast_object_list(box, src=group.ranks[src], group=group.pg)
    return box[0]


# --- the job's process group: start, groups, end -----------------------------------------------


def is_initialized() -> bool:
    return dist.is_initialized()


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def world_handle():
    """torch's handle of the whole job's group."""
    return dist.group.WORLD


def new_group(ranks: list[int], timeout: timedelta | None = None, backend: str | None = None, local: bool = False):
    """A process group over `ranks` (collective over the whole job: every rank calls it; with
    `local`, only the members call it, O(1) per member whatever the world size)."""
    if local:
        return dist.new_group(ranks, timeout=timeout, backend=backend, use_local_synchronization=True)
    return dist.new_group(ranks, timeout=timeout, backend=backend)


def can_split() -> bool:
    """Whether the job's group can be split into many groups in one collective call: torch's
    `split_group` (2.6+) on a backend that supports it (NCCL, with the device bound at init)."""
    if not dist.is_initialized() or not hasattr(dist, "split_group"):
        return False
    world = dist.group.WORLD
    device = getattr(world, "bound_device_id", None)
    if device is None:
        return False
    try:
        return bool(getattr(world._get_backend(device), "supports_splitting", False))
    except RuntimeError:  # no backend for that device
        return False


def split_group(lists: list[list[int]], timeout: timedelta | None = None):
    """Disjoint groups `lists` of global ranks out of the job's group, in one collective call over
    the whole job; returns this rank's group (None when it is in none of them)."""
    return dist.split_group(split_ranks=lists, timeout=timeout)


def job_group(name: str = "world", backend: str | None = None) -> Group:
    """The whole job as a Group: its default process group, or (with `backend`) a new one of
    that backend over every rank (e.g. "gloo" for host-side traffic beside NCCL; collective)."""
    ranks = list(range(world_size()))
    if not is_initialized():
        return Group(name, ranks, None)
    pg = new_group(ranks, backend=backend) if backend else world_handle()
    return Group(name, ranks, pg, device=torch.device("cpu") if backend == "gloo" else None)


def destroy_group(handle) -> None:
    dist.destroy_process_group(handle)


StoreTimeout = dist.DistStoreError
"""What a store's wait raises when its keys did not come in time (any other DistError: the store
is gone)."""


def launcher_store(timeout: timedelta):
    """The launcher's store for this round (torchrun's MASTER_ADDR:MASTER_PORT, hosted by its
    rank 0) as torchrun numbered the workers: (store, rank, world). Its get, set, add, wait and
    check are the c10d Store's."""
    return next(dist.rendezvous("env://", timeout=timeout))


def prefixed(store, prefix: str):
    """`store` with every key under `prefix`."""
    return dist.PrefixStore(prefix, store)


def join(
    backend: str,
    device: torch.device,
    timeout: timedelta,
    restart_count: int,
    launched: bool,
    seat: tuple | None = None,
) -> None:
    """Join the job's process group. Under the elastic agent the group lives on a store
    prefixed by the restart count: restarted workers would otherwise read the dead attempt's
    stale gloo keys and fail to connect. `seat`: (launcher store, rank, world) when the worker's
    rank is its seat in the round (training/seats.py) rather than torchrun's numbering. Alone
    (not launched), a one-rank group on a local store."""
    if seat is not None or launched:
        store, rank, world = seat if seat is not None else launcher_store(timeout)
        # The agents' shared store outlives a failed attempt: a restarted group must not read its
        # keys. Without it (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) the new rank 0 hosts a fresh store
        # each round, and agents of several nodes may count restarts differently (one restarts its
        # workers for a failure, another for the membership change): no prefix that differs.
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "True") == "True":
            store = dist.PrefixStore(f"threefold/attempt_{restart_count}", store)
    else:
        store, rank, world = dist.HashStore(), 0, 1
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)


def leave() -> None:
    """Barrier, then destroy: ranks leave together, so no peer sees a closed connection mid-collective."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def join_local(rank: int = 0, world: int = 1) -> None:
    """A gloo group on an in-memory store, for one process (tests, tools)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=rank, world_size=world)


# --- bytes point to point (rare: one rank's detail that only some ranks send) ------------------


def send_bytes(data: bytes, group: Group, peer: int) -> None:
    """Blocking send of `data` to the group's rank `peer`: its length, then its bytes, as tensors
    where the group communicates. The peer calls recv_bytes, which needs no size agreed ahead."""
    device = group.device or torch.device("cpu")
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else None
    group.stats.record("send_bytes", nbytes(size) + len(data))
    if group.link_delays:
        _link_wait(group, [group.ranks[peer]])
    dist.send(size, dst=group.ranks[peer], group=group.pg)
    if payload is not None:
        dist.send(payload, dst=group.ranks[peer], group=group.pg)


def recv_bytes(group: Group, peer: int) -> bytes:
    """What the group's rank `peer` sends with send_bytes."""
    device = group.device or torch.device("cpu")
    size = torch.zeros(1, dtype=torch.int64, device=device)
    if group.link_delays:
        _link_wait(group, [group.ranks[peer]])
    dist.recv(size, src=group.ranks[peer], group=group.pg)
    length = int(size.item())
    if length == 0:
        return b""
    payload = torch.empty(length, dtype=torch.uint8, device=device)
    dist.recv(payload, src=group.ranks[peer], group=group.pg)
    return payload.cpu().numpy().tobytes()
