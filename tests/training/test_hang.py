"""A hang, attributed (distributed/hang.py): from every rank's operation counts per group, the
collective and group a hang is stuck in and the rank or ranks that never posted it, in
failures.jsonl and in the restart's one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from threefold.distributed import failures, hang
from threefold.distributed.comm import Group

from harness import CALM_LR, run_ranks


def _g(name, ranks, posted, completed, kind="all_reduce", peers=(), done_kind=None):
    return {
        "name": name,
        "ranks": hang.compact_ranks(list(ranks)),
        "posted": posted,
        "posted_kind": kind,
        "posted_peers": list(peers),
        "completed": completed,
        "completed_kind": done_kind or kind,
    }


def test_two_hung_ranks_in_different_groups_are_each_named_with_their_collective():
    """8 ranks, dp groups [0..3] and [4..7], pp pairs (r, r+4). Rank 2 hangs outside any
    communication; rank 6 died and left nothing. Their dp peers wait in the all-reduce each
    never posted (#5 in one group, #9 in the other): two roots, each with its own collective."""
    states = {}
    for r in (0, 1, 3):
        states[r] = {"groups": [_g("dp", range(4), 5, 4), _g("pp", (r, r + 4), 7, 7, "p2p", (r + 4,))]}
    states[2] = {"groups": [_g("dp", range(4), 4, 4), _g("pp", (2, 6), 7, 7, "p2p", (6,))]}
    for r in (4, 5, 7):
        states[r] = {"groups": [_g("dp", range(4, 8), 9, 8), _g("pp", (r - 4, r), 7, 7, "p2p", (r - 4,))]}
    found = hang.attribute(states)
    assert found.roots == [2, 6]
    stuck = {(w.group, tuple(w.ranks), w.seq): (w.waiting, w.holders) for w in found.waits}
    assert stuck == {("dp", (0, 1, 2, 3), 5): ([0, 1, 3], [2]), ("dp", (4, 5, 6, 7), 9): ([4, 5, 7], [6])}
    assert found.doing[6].startswith("it left no state")
    assert found.doing[2] == "it waited on no peer; newest per group: dp all-reduce #4, pp p2p #7 with rank 6"
    assert found.line() == (
        "hang: dp all-reduce #5 on group [0, 1, 2, 3]: rank 2 never posted it (it waited on no peer; newest per "
        "group: dp all-reduce #4, pp p2p #7 with rank 6); dp all-reduce #9 on group [4, 5, 6, 7]: rank 6 never "
        "posted it (it left no state: dead, or hung where no thread of it ran)"
    )
    json.dumps(found.to_json())  # a failures.jsonl record


def test_a_chain_of_waits_names_its_root_and_what_the_link_was_in():
    """The issue's example: dp all-reduce #5512 on [0, 8, 16, 24] waits for rank 16, which waits
    in a pipeline receive from rank 15, which is in no communication: rank 15 is the root, rank
    16 a link (named with its receive). A rank whose peers posted everything it waits in (a slow
    completion, or an asynchronous handle waited on outside comm.wait) holds nothing up."""
    dp = (0, 8, 16, 24)
    states = {r: {"groups": [_g("dp", dp, 5512, 5511)]} for r in (0, 8, 24)}
    states[16] = {"groups": [_g("dp", dp, 5511, 5511), _g("pp", (15, 16), 90, 89, "recv", (15,))]}
    states[15] = {"groups": [_g("pp", (15, 16), 89, 89, "send", (16,)), _g("dp", (7, 15, 23, 31), 3, 0)]}
    for r in (7, 23, 31):
        states[r] = {"groups": [_g("dp", (7, 15, 23, 31), 3, 0)]}  # unmarked async completions
    found = hang.attribute(states)
    assert found.roots == [15]
    assert {w.group: w.holders for w in found.waits} == {"dp": [16], "pp": [15]}
    assert found.doing[16] == "it was in pp recv #90 from rank 15"
    line = found.line()
    assert line.startswith("hang: pp recv of rank 16 (its #90) with rank 15 on group [15, 16]: rank 15 never"), line
    assert line.endswith("; so rank 16 never posted dp all-reduce #5512 on group [0, 8, 16, 24]"), line
    assert hang.members({"ranks": hang.compact_ranks(list(range(0, 16384, 8)))}) == list(range(0, 16384, 8))
    assert hang.compact_ranks(list(range(0, 16384, 8))) == {"first": 0, "step": 8, "count": 2048}


def test_the_summary_attributes_from_records_and_state_files_and_records_it_once(tmp_path):
    """Ranks 0 and 2 time out with their counts in their records, rank 3 left only its stall
    file (waiting in a receive from rank 1), rank 1 its stall file: rank 1 hung, rank 3 waited."""
    why = "a collective timed out after train.timeout_s = 5 s (a peer is hung or dead)"
    for r, peer in ((0, 1), (2, 3)):
        ops = {"groups": [_g("dp", (r, peer), 4, 3), _g("pp", (0, 2), 9, 9, "p2p", (2 - r,))]}
        failures.record(tmp_path, 0, r, why, run="r", extra={"ops": ops})
    files = {
        1: {"groups": [_g("dp", (0, 1), 3, 0), _g("pp", (1, 3), 9, 9, "p2p", (3,))]},
        3: {"groups": [_g("dp", (2, 3), 3, 0), _g("pp", (1, 3), 10, 9, "p2p", (1,))]},
    }
    for r, state in files.items():
        path = failures.state_file(tmp_path, "r", 0, r)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(state))
    line = failures.summary(tmp_path, 0, 4, run="r")
    assert line.startswith(f"rank 1 hung or died (ranks 0, 2: {why}; rank 3: left its state waiting on a peer); hang: ")
    assert "dp all-reduce #4 on group [0, 1]: rank 1 never posted it" in line
    assert failures.summary(tmp_path, 0, 4, run="r") == line
    records = map(json.loads, (tmp_path / failures.FAILURES).read_text().splitlines())
    (record,) = [r for r in records if r["kind"] == failures.HANG]
    assert record["hang"]["roots"] == [1] and line.endswith(record["why"])
    assert {(w["group"], w["op"], tuple(w["never_posted"])) for w in record["hang"]["stuck"]} == {
        ("dp", "all_reduce", (1,)),
        ("dp", "all_reduce", (3,)),
        ("pp", "p2p", (1,)),
    }


def _flight_recorded() -> dict:
    """A rank of a 4-rank gloo job: two groups of its own (made in an order that gives torch's
    recorder ids other than their names), a few collectives on each; its snapshot."""
    import torch

    from threefold.distributed import comm
    from threefold.distributed.runtime import init_distributed

    init_distributed(torch.device("cpu"), 60)
    rank = comm.global_rank()
    mine = {}
    for name, ranks in (("dp", [0, 1]), ("dp", [2, 3]), ("pp", [0, 2]), ("pp", [1, 3])):
        pg = comm.new_group(ranks)
        if rank in ranks:
            mine[name] = Group(name, ranks, pg)
    x = torch.ones(4)
    for _ in range(3):
        comm.all_reduce(x, mine["dp"])
    comm.wait(comm.all_reduce(x, mine["pp"], async_op=True), mine["pp"])
    state = hang.snapshot(mine)
    comm.leave()
    return state


def test_each_group_carries_torchs_flight_recorder_count():
    """torch's flight recorder (on gloo in torch 2.13, TORCH_FR_BUFFER_SIZE set before the group
    is made) beside each group's own count, matched to the right group."""
    for state in run_ranks(_flight_recorded, 4, timeout=90):
        groups = {g["name"]: g for g in state["groups"]}
        assert (groups["dp"]["posted"], groups["dp"]["completed"], groups["pp"]["completed"]) == (3, 3, 1)
        # gloo's recorder marks a collective complete only when it next looks: enqueued is exact.
        assert groups["dp"]["fr"]["enqueued"] == 3 and groups["dp"]["fr"]["completed"] >= 2, groups
        assert groups["pp"]["fr"]["enqueued"] == 1 and groups["pp"]["fr"]["last"] == "gloo:all_reduce #1 scheduled"


def test_the_stall_watch_leaves_the_state_and_takes_it_back_when_counts_move(tmp_path):
    """A deadline of 1 s: counts that stand still for half of it leave the file; a completion
    (the counts move) takes it back."""
    group = Group("dp", [0, 1], pg=object())
    group.ops.post("all_reduce")
    path = tmp_path / "rank_0.ops.json"
    watch = hang.StallWatch({"dp": group}, path, lambda: 1.0).start()
    try:
        deadline = time.monotonic() + 10
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        state = json.loads(path.read_text())
        assert [(g["name"], g["posted"], g["completed"]) for g in state["groups"]] == [("dp", 1, 0)]
        assert state["stalled_s"] >= hang.STALL_FRACTION
        group.ops.complete(1, "all_reduce")
        deadline = time.monotonic() + 10
        while path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not path.exists()
    finally:
        watch.stop()


def test_a_hang_drill_names_the_collective_its_group_and_the_rank(tmp_path, data, cache_dir):
    """pp2 x dp2 (4 gloo processes; ranks 0, 1 are stage 0, ranks 2, 3 stage 1): rank 1 hangs as
    step 1 begins. Rank 0 waits in the dp all-reduce rank 1 never posted, rank 3 in a receive from
    rank 1, rank 2 in the dp all-reduce rank 3 never posted. The restarted rank 0's one line and
    failures.jsonl name the dp all-reduce on [0, 1] and rank 1."""
    log = tmp_path / "log"
    args = {
        "data.path": data,
        "data.vocab": 256,
        "data.cache_dir": cache_dir,
        "model.layers": 2,
        "model.seq_len": 32,
        "parallel.pp": 2,
        "parallel.dp": 2,
        "train.steps": 2,
        "train.global_batch": 4,
        "train.micro_batch": 1,
        "train.lr": CALM_LR,
        "train.timeout_s": 4,
        "train.max_restarts": 1,
        "train.preempt_grace_s": 1,
        "log.dir": str(log),
        "log.quiet": "true",
    }
    cmd = [sys.executable, "-m", "threefold", "train", *[x for k, v in args.items() for x in (f"--{k}", str(v))]]
    env = {**os.environ, "THREEFOLD_FAULT": "hang:rank=1:step=1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=env)
    console = out.stdout + out.stderr
    assert out.returncode == 0, console[-3000:]
    (line,) = [x for x in console.splitlines() if x.startswith("threefold: restart")]
    assert line.startswith("threefold: restart 1 of 1 after rank 1 hung or died ("), line
    assert "; hang: dp all-reduce #" in line and " on group [0, 1]: rank 1 never posted it (" in line, line
    records = [json.loads(x) for x in (log / failures.FAILURES).read_text().splitlines()]
    (found,) = [r for r in records if r["kind"] == failures.HANG]
    assert found["attempt"] == 0 and found["hang"]["roots"] == [1]
    held = [w for w in found["hang"]["stuck"] if 1 in w["never_posted"]]
    assert {(w["group"], tuple(hang.members(w)), w["op"]) for w in held if w["op"] != "p2p"} == {
        ("dp", (0, 1), "all_reduce")
    }
    # Every rank that timed out left its counts per group with its reason.
    peers = [r for r in records if r["kind"] == failures.PEER]
    assert peers and all({g["name"] for g in r["ops"]["groups"]} >= {"dp", "pp"} for r in peers)
