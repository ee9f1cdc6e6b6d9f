"""Where every parameter lives in the flat buffers, and which part of them each dp rank owns.

Pure arithmetic, no tensors and no communication, so it is testable without processes.

Parameters are laid out in the order backward produces their gradients (reverse of
definition order) and grouped into buckets. Each bucket is padded to a multiple of
`shards * ALIGN` elements and cut into `shards` equal slices: dp rank r owns slice r of every
bucket (Megatron's distributed-optimizer layout). A bucket's reduce-scatter therefore hands
each rank exactly its slice, and the bucket's all-gather rebuilds it, with no re-packing.
A rank's owned slices are stored back to back in its "shard space" (master weights, Adam
moments, sharded gradients), offset `Bucket.shard_offset`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

ALIGN = 16  # elements per shard boundary: 64-byte aligned fp32 slices for vectorized kernels


@dataclass(frozen=True)
class Slot:
    """One parameter: [start, start+numel) of the flat buffer, inside bucket `bucket`."""

    index: int  # position in the parameter list given to `build_layout`
    bucket: int
    start: int
    numel: int
    shape: tuple[int, ...]
    decay: bool  # AdamW weight decay applies (ndim >= 2)


@dataclass(frozen=True)
class Bucket:
    index: int
    start: int  # offset of the bucket in the flat buffer
    numel: int  # padded: a multiple of shards * ALIGN
    slots: tuple[int, ...]  # parameter indices, in buffer order
    shards: int
    shard_offset: int  # where this bucket's owned slice sits in a rank's shard space

    @property
    def shard_numel(self) -> int:
        return self.numel // self.shards

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Flat-buffer offsets [lo, hi) of the slice owned by `rank`."""
        lo = self.start + rank * self.shard_numel
        return lo, lo + self.shard_numel


@dataclass(frozen=True)
class Segment:
    """A run of owned elements of one bucket sharing a key (e.g. the weight-decay rule):
    offsets [lo, hi) are relative to the start of that bucket's owned slice."""

    bucket: int
    lo: int
    hi: int
    key: object


@dataclass(frozen=True)
class BucketLayout:
    slots: tuple[Slot, ...]  # indexed by parameter index
    buckets: tuple[Bucket, ...]  # in launch order (first ready first)
    shards: int

    @property
    def numel(self) -> int:
        """Flat-buffer length, padding included."""
        return sum(b.numel for b in self.buckets)

    @property
    def shard_numel(self) -> int:
        return self.numel // self.shards

    @property
    def param_numel(self) -> int:
        return sum(s.numel for s in self.slots)

    def segments(self, rank: int, key=lambda slot: slot.decay) -> list[Segment]:
        """Owned elements of `rank`, cut where `key(slot)` changes; never across buckets
        (owned slices of neighbouring buckets are not adjacent in the flat buffer). Padding
        belongs to no segment: it is zero and stays zero."""
        out: list[Segment] = []
        for b in self.buckets:
            lo, hi = b.shard_range(rank)
            for i in b.slots:
                s = self.slots[i]
                a, z = max(lo, s.start), min(hi, s.start + s.numel)
                if a >= z:
                    continue
                seg = Segment(b.index, a - lo, z - lo, key(s))
                last = out[-1] if out else None
                if last and last.bucket == seg.bucket and last.hi == seg.lo and last.key == seg.key:
                    out[-1] = Segment(last.bucket, last.lo, seg.hi, seg.key)
                else:
                    out.append(seg)
        return out


def share_of(segments: list[Segment], parts: int, part: int) -> list[Segment]:
    """The segments `part` of `parts` takes when whole segments are dealt out by size (largest
    first, each to the least loaded part; ties to the lower part), in their original order:
    every part computes the same deal, so the shares partition the segments. A heap of the
    parts' loads keeps the deal O(segments log parts) at any dp size."""
    loads = [(0, p) for p in range(parts)]  # already a heap
    mine = set()
    for i in sorted(range(len(segments)), key=lambda i: (-(segments[i].hi - segments[i].lo), i)):
        load, taker = heapq.heappop(loads)
        heapq.heappush(loads, (load + segments[i].hi - segments[i].lo, taker))
        if taker == part:
            mine.add(i)
    return [seg for i, seg in enumerate(segments) if i in mine]


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_layout(
    shapes: list[tuple[int, ...]],
    bucket_bytes: float,
    elem_bytes: int,
    shards: int,
    groups: list[list[int]] | None = None,
    solo: set[int] = frozenset(),
) -> BucketLayout:
    """Lay out parameters `shapes` (already in gradient-ready order) into buckets.

    Without `groups`, a bucket closes once it holds >= bucket_bytes of gradient (a larger
    parameter gets a bucket to itself; parameters are never split); a parameter in `solo`
    always gets a bucket to itself, so its slices line up with those of the same tensor on
    another rank (a tied embedding on the first and last pipeline stage). With `groups`
    (ZeRO-3 units), each group is exactly one bucket.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {bucket_bytes}")
    if groups is None:
        groups, current, size = [], [], 0
        for i, shape in enumerate(shapes):
            if i in solo:
                groups += [g for g in (current, [i]) if g]
                current, size = [], 0
                continue
            current.append(i)
            size += _numel(shape) * elem_bytes
            if size >= bucket_bytes:
                groups.append(current)
                current, size = [], 0
        if current:
            groups.append(current)
    slots: dict[int, Slot] = {}
    buckets: list[Bucket] = []
    start = shard_offset = 0
    for members in groups:
        if not members:
            continue
        offset = start
        for i in members:
            shape = tuple(shapes[i])
            slots[i] = Slot(i, len(buckets), offset, _numel(shape), shape, len(shape) >= 2)
            offset += _numel(shape)
        numel = _pad(offset - start, shards * ALIGN)
        buckets.append(Bucket(len(buckets), start, numel, tuple(members), shards, shard_offset))
        start += numel
        shard_offset += numel // shards
    if sorted(slots) != list(range(len(shapes))):
        raise ValueError("every parameter must be in exactly one group")
    return BucketLayout(tuple(slots[i] for i in range(len(shapes))), tuple(buckets), shards)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
