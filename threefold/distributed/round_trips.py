"""Timed round trips between ranks: the preflight link probe's and, on report steps, the
in-run hop probe's (observe/hops.py). The fastest of a few calls after one warm-up; a ring's
hops in rounds of disjoint pairs, so that a slow hop does not hold up the hops timed beside it."""

from __future__ import annotations

import math
import time

import torch

from threefold.distributed import comm


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn, device: torch.device, reps: int) -> float:
    """The fastest of `reps` timed calls after one warm-up: a systematic slowdown is in every
    call, a scheduler's hiccup in only some."""
    fn()
    best = math.inf
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def ping_pong(group, me: int, peer: int, x: torch.Tensor, initiator: bool, reps: int) -> float:
    """Round trips of `x` between group indices `me` and `peer`; the initiator's fastest (0 on the other)."""

    def once():
        if initiator:
            comm.send(x, group, peer)
            comm.recv(x, group, peer)
        else:
            comm.recv(x, group, peer)
            comm.send(x, group, peer)

    seconds = best_time(once, x.device, reps)
    return seconds if initiator else 0.0


def ring_rounds(n: int) -> list[list[int]]:
    """The hops i -> i+1 (mod n) of a ring of n, in rounds of disjoint pairs: even hops, odd
    hops, and for an odd n the hop n-1 -> 0 alone (two ranks: their one link)."""
    hops = [i for i in range(n) if n > 2 or i == 0]
    return [
        [i for i in hops if i % 2 == 0 and (i < n - 1 or n == 2)],
        [i for i in hops if i % 2 == 1],
        [n - 1] if n % 2 and n > 2 else [],
    ]


def ring_hop(group, reps: int, x: torch.Tensor) -> float:
    """Hop i -> i+1 (mod n) of this group's ring, in rounds of disjoint pairs (even hops, odd
    hops, and for an odd n the hop n-1 -> 0 alone); this rank's outgoing hop time."""
    n, me = group.size, group.rank
    mine = 0.0
    for pairs in ring_rounds(n):
        comm.barrier(group)
        for i in pairs:
            if me == i:
                mine = ping_pong(group, me, (i + 1) % n, x, True, reps)
            elif me == (i + 1) % n:
                ping_pong(group, me, i, x, False, reps)
    return mine
