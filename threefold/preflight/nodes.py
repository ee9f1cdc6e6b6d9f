"""Which node a rank is on, and rank lists written the way a reader scans them ("8-15")."""

from __future__ import annotations

import os
import socket


def node_index(rank: int, environ: dict | None = None) -> int:
    """This rank's node: the elastic agent's GROUP_RANK under torchrun (one agent per node),
    else rank // LOCAL_WORLD_SIZE when the launcher says how many ranks share a node, else 0."""
    env = os.environ if environ is None else environ
    if "GROUP_RANK" in env:
        return int(env["GROUP_RANK"])
    local = int(env.get("LOCAL_WORLD_SIZE", "0") or 0)
    return rank // local if local > 0 else 0


def host_name() -> str:
    return socket.gethostname()


def rank_ranges(ranks) -> str:
    """[8, 9, 10, 11, 3] -> '3, 8-11': sorted, consecutive runs joined."""
    out, run = [], []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [r]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def where(ranks, nodes: dict[int, int]) -> str:
    """'ranks 8-15 (node 1)' / 'rank 3 (node 0)' / 'ranks 3, 9 (nodes 0, 1)'."""
    ranks = sorted(set(ranks))
    on = sorted({nodes.get(r, 0) for r in ranks})
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"
    return f"{who} ({'node' if len(on) == 1 else 'nodes'} {rank_ranges(on)})"
