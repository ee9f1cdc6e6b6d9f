"""A slow link, named in-run, told apart from a slow rank: 60 steps of tp2 x pp2 x dp2 (8 gloo
processes, a tiny model) with spans on and a report every 5 steps. The slowlink drill delays every
exchange between the two ends of one pipeline pair; the slow drill stretches one rank's compute.
The detector (observe/links.py) sees neither drill, only the ranks' waits and own times."""

from __future__ import annotations

import pytest

from threefold.distributed.grid import RankLayout

from harness import CALM_LR, run_training

INTERVAL = 5
MINE = ("slow_link", "slow_rank", "slow_node")  # what observe/links.py names
LAYOUT = RankLayout(tp=2, pp=2, dp=2)
A, B = LAYOUT.rank_of(tp=1, dp=1, pp=0), LAYOUT.rank_of(tp=1, dp=1, pp=1)  # one replica's stages 0 and 1


def _run(tmp_path, data, cache_dir, faults: str) -> list[dict]:
    overrides = {
        "data.path": data,
        "data.vocab": 256,
        # The tiny preset as it is (4 layers of 128, 128 tokens), as bench/clean_runs.py and
        # bench/detection.py run it: a stage's compute of ~11 ms at width 64 and 32 tokens doubled
        # under the 2-core host's scheduling alone now and then (a rank named at 2.0x its peers).
        "model.preset": "tiny",
        "parallel.tp": 2,
        "parallel.pp": 2,
        "parallel.dp": 2,
        "parallel.microbatches": 2,
        "train.global_batch": 8,
        "train.steps": 60,
        "train.lr": CALM_LR,
        "train.faults": faults,
        "log.spans": "true",
        "log.interval": INTERVAL,
        "log.trace_steps": "",
        "checkpoint.dir": "",
    }
    return run_training(overrides, tmp_path / "log", cache_dir, timeout=240)


def _named(metrics: list[dict]) -> dict[int, list[dict]]:
    """Report step -> the active findings of the kinds observe/links.py names."""
    return {r["step"]: [f for f in r["findings"] if f["kind"] in MINE] for r in metrics if "findings" in r}


@pytest.mark.timeout(540)
def test_a_slow_pipeline_link_is_named_and_nothing_else(tmp_path, data, cache_dir):
    # The drill acts from step 0: named by the report at 2 x log.interval (a candidate is named on
    # its second report window in a row), and still at the last. A run that names it only later
    # gets a second: CI's shared host once held the first window back (named by step 60, not at
    # 10); a detector that is late is late twice.
    first = 2 * INTERVAL
    for attempt in range(2):
        reports = _named(_run(tmp_path / f"try{attempt}", data, cache_dir, f"slowlink:ranks={A}-{B}:ms=40"))
        assert sorted(reports) == list(range(INTERVAL, 61, INTERVAL)), sorted(reports)
        keys = [(f["kind"], f["key"]) for f in reports[60]]
        assert ("slow_link", f"pp {A}->{B}") in keys, (60, reports[60])
        if ("slow_link", f"pp {A}->{B}") in [(f["kind"], f["key"]) for f in reports[first]]:
            break
    else:
        raise AssertionError(f"named at step {first} in neither of 2 runs: {reports[first]}")
    (link,) = [f for f in reports[first] if f["key"] == f"pp {A}->{B}"]
    assert link["ranks"] == [A, B] and link["group"] == "pp" and link["since"] <= first, link
    # Per step each end posts to the other at least twice (2 micro-batches), 40 ms each time.
    assert link["value"] - link["baseline"] > 0.05, link
    others = {(f["kind"], f["key"]) for found in reports.values() for f in found} - {("slow_link", f"pp {A}->{B}")}
    assert not others, others  # no slow rank, no other pair, no group


@pytest.mark.timeout(300)
def test_a_slow_rank_is_named_as_a_rank_not_a_link(tmp_path, data, cache_dir):
    slow = LAYOUT.rank_of(tp=1, dp=0, pp=1)
    reports = _named(_run(tmp_path, data, cache_dir, f"slow:rank={slow}:factor=3"))
    for step in (2 * INTERVAL, 60):
        assert ("slow_rank", f"rank {slow}") in [(f["kind"], f["key"]) for f in reports[step]], reports[step]
    # Its peers' waits name no link (and no node: it is one rank of eight on one host).
    links = {(f["kind"], f["key"]) for found in reports.values() for f in found if f["kind"] != "slow_rank"}
    assert not links, links


# --- the detector alone, on synthetic report rows (no processes) --------------------------------


def _view(layout, own: dict, waits: dict, per_node: int, step: int):
    """A ReportView of `layout` where every rank's own time is 40 ms (or `own[rank]`) and every
    pipeline wait 20 ms (or `waits[rank] = (prev_s, next_s)`)."""
    from threefold.observe.diagnose import ReportView
    from threefold.observe.links import links_of, pipeline_neighbours
    from threefold.observe.observer import GROUPS

    ranks = []
    for r in range(layout.world_size):
        prev, nxt = pipeline_neighbours(layout.group_of(r, ("pp",)), r)
        p, n = waits.get(r, (0.02 * (prev is not None), 0.02 * (nxt is not None)))
        row = [0.01] * len(GROUPS) + [p, n]
        ranks.append(
            {
                "rank": r,
                **layout.coords(r),
                "time_s": {"forward": own.get(r, 0.04)},
                "links": links_of(row, GROUPS, prev, nxt),
            }
        )
    return ReportView(step, 5, ranks, layout, {}, extra={"local_world_size": per_node})


def _detect(layout, views) -> list:
    from types import SimpleNamespace

    from threefold.config import Config
    from threefold.observe.links import detector

    d = detector(Config(), SimpleNamespace(layout=layout, world=SimpleNamespace(device=None)))
    return [[(f.kind, f.key) for f in d.on_report(v)] for v in views]


def test_a_node_whose_every_rank_is_slow_is_named_as_the_node():
    layout = RankLayout(dp=8, pp=2)  # stage 0: ranks 0-7 (nodes 0, 1), stage 1: ranks 8-15 (nodes 2, 3)
    slow = {r: 0.12 for r in range(4, 8)}
    views = [_view(layout, slow, {}, per_node=4, step=s) for s in (5, 10)]
    assert _detect(layout, views) == [[], [("slow_node", "node 1")]]  # named on its second report
    one = _view(layout, {6: 0.12}, {}, per_node=4, step=10)
    assert _detect(layout, [one, one]) == [[], [("slow_rank", "rank 6")]]


def test_a_one_ended_wait_is_no_link_and_a_two_ended_one_is():
    layout = RankLayout(dp=4, pp=2)  # pairs 0->4, 1->5, 2->6, 3->7
    waited_on = _view(layout, {}, {4: (0.09, 0.0)}, per_node=8, step=10)  # rank 4 waits on rank 0 alone
    both = _view(layout, {}, {0: (0.0, 0.09), 4: (0.09, 0.0)}, per_node=8, step=10)
    assert _detect(layout, [waited_on, waited_on]) == [[], []]
    assert _detect(layout, [both, both]) == [[], [("slow_link", "pp 0->4")]]


def test_the_link_clock_reads_device_timers_one_step_late_and_all_on_a_report():
    """On CUDA a step's timers are read at the next step's close (the host has waited for that
    step by then), and every one of them on a report step; the columns are per group and per
    pipeline neighbour, and the pipeline's peer time goes to its neighbour's column only."""
    from threefold.distributed.comm import Group
    from threefold.observe.links import LinkClock

    pp, tp = Group("pp", [3, 7], None), Group("tp", [2, 3], None)
    clock = LinkClock([tp, pp], ("tp", "pp"), pp, 3, "cpu")
    clock.cuda = True  # the late path, with host timers standing in for event pairs
    tp.link.collective.add(0.25)
    pp.link.peer(7).add(0.5)
    clock.end_step(flush=False)
    assert clock.take() == [0.0, 0.0, 0.0, 0.0]  # the step just closed is not read yet
    clock.end_step(flush=True)
    assert clock.take() == [0.25, 0.0, 0.0, 0.5]  # tp, pp's flush, previous stage, next stage (7)
    LinkClock.detach(type("G", (), {"groups": {"tp": tp, "pp": pp}})())
    assert tp.link is None and pp.link is None


@pytest.mark.timeout(300)
def test_a_slow_hop_inside_a_ring_group_is_named_by_the_probe(tmp_path, data, cache_dir):
    """dp 4 (one ring of four, 4 processes): the group's collective time cannot name the hop, nor
    be compared with another dp group; the report step's round trips (observe/hops.py) name the
    one slow hop, and nothing else is named."""
    metrics = run_training(
        {
            "data.path": data, "data.vocab": 256, "model.preset": "tiny", "model.layers": 2,
            "model.hidden": 64, "model.ffn_hidden": 128, "model.heads": 4, "model.kv_heads": 2,
            "model.seq_len": 32, "parallel.dp": 4, "train.global_batch": 8, "train.micro_batch": 2, "train.steps": 20,
            "train.lr": CALM_LR, "train.faults": "slowlink:ranks=1-2:ms=20", "log.spans": "true",
            "log.interval": INTERVAL, "log.trace_steps": "", "checkpoint.dir": "",
        },
        tmp_path / "log", cache_dir, timeout=240,
    )  # fmt: skip
    reports = _named(metrics)
    for step in (2 * INTERVAL, 20):
        assert [f["key"] for f in reports[step]] == ["dp 1->2"], (step, reports[step])
    hop = reports[20][0]
    assert hop["ranks"] == [1, 2] and hop["extra"]["hop"] == [1, 2], hop
    assert hop["value"] > 0.03 and hop["baseline"] < 0.01, hop  # two 20 ms waits per round trip
    assert hop["text"].startswith("slow link: dp hop 1 -> 2 (node 0 -> node 0) takes "), hop["text"]
