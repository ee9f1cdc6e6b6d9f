"""The hop inside a ring group (observe/hops.py): the probe's phases keep every rank in at most
one hop at a time, and rank 0 names the slow hop, inside the slow group it belongs to or alone,
never a slow rank's. Synthetic report rows in this process (tests/observe/test_slow_link.py runs
the probe itself)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from threefold.config import Config
from threefold.distributed.grid import RankLayout
from threefold.distributed.round_trips import ring_rounds
from threefold.observe.links import LinkDetector
from threefold.observe.observer import GROUPS

CLEAN_HOP = 0.0003


@pytest.mark.parametrize("n", range(3, 10))
def test_no_rank_is_in_two_hops_of_one_phase(n):
    rounds = ring_rounds(n)
    for phase in range(3):
        ranks = [r for i in rounds[phase] for r in (i, (i + 1) % n)]
        assert len(ranks) == len(set(ranks)), (n, phase, ranks)
    assert {p for p, hops in enumerate(rounds) if hops} == ({0, 1, 2} if n % 2 else {0, 1})
    assert sorted(i for hops in rounds for i in hops) == list(range(n))  # every hop timed once


def _view(layout, step: int, dp_s: dict, hops: dict, own: dict | None = None):
    rows = []
    for r in range(layout.world_size):
        time_s = {"forward": (own or {}).get(r, 0.02), "backward": 0.03}
        links = {"collective_s": dict.fromkeys(GROUPS, 0.0) | {"dp": dp_s.get(r, 0.004)}, "pp_prev_s": 0.0,
                 "pp_next_s": 0.0, "pp_prev": None, "pp_next": None,
                 "hop_s": {"dp": hops.get(r, CLEAN_HOP), "edp": hops.get(r, CLEAN_HOP)}}  # fmt: skip
        rows.append({"rank": r, "pp": 0, "time_s": time_s, "wall_s": 0.06, "links": links})
    return SimpleNamespace(step=step, steps=5, ranks=rows, extra={"local_world_size": 4})


def _found(layout, dp_s: dict, hops: dict, own: dict | None = None) -> list:
    grid = SimpleNamespace(layout=layout, world=SimpleNamespace(device=torch.device("cpu")))
    detector = LinkDetector(Config(), grid)
    detector.on_report(_view(layout, 5, dp_s, hops, own))  # named on the second window in a row
    return detector.on_report(_view(layout, 10, dp_s, hops, own))


def test_a_slow_group_names_its_slow_hop():
    layout = RankLayout(tp=2, dp=4)  # dp rings [0, 2, 4, 6] and [1, 3, 5, 7]; nodes of 4 ranks
    found = _found(layout, dp_s={r: 0.05 for r in (0, 2, 4, 6)}, hops={2: 0.04})
    assert [f.key for f in found] == ["dp 0"], [f.text for f in found]
    assert found[0].extra["hop"] == [2, 4], found[0].extra
    assert ": the hop is rank 2 -> 4 (40 ms per round trip vs 0.3 ms)" in found[0].text, found[0].text


def test_a_slow_hop_is_named_alone_where_its_group_does_not_stand_out():
    found = _found(RankLayout(tp=2, dp=4), dp_s={}, hops={5: 0.02})
    assert [(f.key, f.ranks, f.extra["nodes"]) for f in found] == [("dp 5->7", (5, 7), [1, 1])]
    assert found[0].text.startswith("slow link: dp hop 5 -> 7 (node 1 -> node 1) takes 20 ms per round trip vs 0.3 ms")


def test_a_slow_nodes_two_hops_are_both_named():
    # Rank 4's NIC: its hop in and its hop out, both named (not only the worse one).
    found = _found(RankLayout(tp=2, dp=4), dp_s={}, hops={2: 0.03, 4: 0.03})
    assert sorted(f.key for f in found) == ["dp 2->4", "dp 4->6"], [f.text for f in found]


def test_a_slow_ranks_hops_are_not_links():
    found = _found(RankLayout(tp=2, dp=4), dp_s={}, hops={4: 0.03}, own={4: 0.2})
    assert [f.key for f in found] == ["rank 4"], [f.text for f in found]
