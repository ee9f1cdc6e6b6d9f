"""Spare nodes and growing back under torchrun --nnodes MIN:MAX, with one-agent "nodes" on
localhost sharing a c10d rendezvous whose store the test hosts (harness.Agents): a spare takes a
lost node's position with the layout unchanged, and a node that returns grows dp back."""

import json
import os
import time

import pytest

from threefold.config import build_config
from threefold.errors import ConfigError
from threefold.training.seating import Node, Round, decide, host_order, labels, nodes_needed, restart_line

from harness import CALM_LR, PARITY, Agents, run_training, within

# Quick rendezvous rounds: a dead agent is noticed after 2 x 3 s without its heartbeat, and a
# round closes 3 s after its minimum of nodes joined.
RDZV = "is_host=false,last_call_timeout=3,keep_alive_interval=2,keep_alive_max_attempt=3"


def _env(node: str, fault: str = "") -> dict:
    return {
        **os.environ,
        "THREEFOLD_NODE": node,
        "THREEFOLD_FAULT": fault,
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
    }


def _train(log, ckpt, cache_dir, steps: int, *more) -> list[str]:
    args = ["-m", "threefold", "train", "--train.steps", str(steps), "--train.lr", str(CALM_LR)]
    args += [
        "--train.timeout_s",
        "30",
        "--train.startup_timeout_s",
        "60",
        "--checkpoint.dir",
        str(ckpt),
        "--checkpoint.interval",
        "2",
    ]
    args += ["--checkpoint.keep", "0", "--log.dir", str(log), "--data.cache_dir", cache_dir, "--log.quiet", "true"]
    return args + list(more)


def _metrics(log):
    return [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]


def _rounds(log):
    return json.loads((log / "nodes.json").read_text())["rounds"]


def test_a_round_keeps_positions_and_fills_a_lost_one_with_a_spare():
    """The seating, by hand: the first round seats in rendezvous order; a lost node's position
    goes to the spare, the others keep theirs; a node that returns joins where the layout grows;
    a round without a failure says so."""
    first = decide(None, [Node("a"), Node("b"), Node("c")], needed=2, dp=2)
    assert (first.seats, first.spares, first.attempt, first.failed) == (("a", "b"), ("c",), 0, False)
    # b is gone; a restarted on the failure, the spare c restarted to join (its agent's count 0).
    second = decide(first, [Node("c"), Node("a", 1)], needed=2, dp=2)
    assert (second.seats, second.spares) == (("a", "c"), ())
    assert (second.attempt, second.restarts, second.failed) == (1, 1, True)
    assert second.change == "spare c replaced b"
    # No spare left: a is alone and dp halves (parallel.dp 0).
    third = decide(second, [Node("a", 2)], needed=1, dp=1)
    assert (third.seats, third.change, third.attempt) == (("a",), "c lost, dp 2 -> 1", 2)
    # b returns: a keeps position 0, b takes the new one; no agent restarted on a failure.
    fourth = decide(third, [Node("b"), Node("a", 2)], needed=2, dp=2)
    assert (fourth.seats, fourth.change, fourth.failed, fourth.attempt) == (("a", "b"), "b joined, dp 1 -> 2", False, 3)
    line = restart_line(3, 2, None, 12, " from step_00000012", {"THREEFOLD_ROUND": json.dumps(fourth.to_json())})
    assert line == "threefold: the job re-formed: b joined, dp 1 -> 2; resumed at step 12 from step_00000012"
    assert Round.from_json(json.loads(json.dumps(fourth.to_json()))) == fourth
    # Agents sharing a host are told apart by their tags, and keep their labels when alone.
    both = labels(["vm", "vm"], ["11", "12"], None)
    assert both == ["vm:11", "vm:12"]
    kept = decide(None, [Node(n) for n in both], needed=2, dp=2)
    assert labels(["vm"], ["11"], kept) == ["vm:11"] and labels(["vm"], ["13"], kept) == ["vm"]


def test_the_layout_takes_whole_nodes_and_dp_0_what_the_batch_allows():
    cfg = build_config(None, [("parallel.dp", "2"), ("parallel.tp", "2")])
    assert nodes_needed(cfg, nodes=3, per_node=2) == 2  # one spare
    auto = build_config(None, [("parallel.dp", "0"), ("train.global_batch", "8"), ("train.micro_batch", "2")])
    assert nodes_needed(auto, nodes=3, per_node=1) == 2  # dp 3 does not divide 4 micro-batches
    with pytest.raises(ConfigError, match="parallel.dp: .* leave part of a node of 2 processes idle"):
        nodes_needed(build_config(None, [("parallel.dp", "3")]), nodes=2, per_node=2)
    # A lost node with no spare left and an explicit dp: one line saying how to wait or shrink.
    with pytest.raises(
        ConfigError, match="need 2 nodes of 2 processes, but the rendezvous brought 1 .* --nnodes 2:MAX"
    ):
        nodes_needed(cfg, nodes=1, per_node=2)


def test_a_new_job_seats_its_nodes_in_the_placements_order(tmp_path):
    """parallel.hostfile: the first round follows the placement's host order (hosts, then spares),
    whatever order the rendezvous numbered the nodes in; a host it does not name comes last."""
    doc = tmp_path / "hosts.json"
    doc.write_text(json.dumps({"hosts": ["h2", "h0"], "spares": ["h1"]}))
    order = host_order(str(doc))
    rnd = decide(None, [Node("h0"), Node("h9"), Node("h1"), Node("h2")], needed=2, dp=2, order=order)
    assert (rnd.seats, rnd.spares) == (("h2", "h0"), ("h1", "h9"))
    (tmp_path / "hostfile").write_text("h1\n# a comment\nh0\n")
    assert host_order(str(tmp_path / "hostfile")) == ["h1", "h0"]
    with pytest.raises(ConfigError, match="parallel.hostfile: cannot read"):
        host_order(str(tmp_path / "missing"))


def _seat_and_leave(log_dir: str) -> dict:
    """One rank of a 3-"node" job (one process each) with parallel.dp 2: take the seat, then train
    (a short sleep) and release it, or wait as a spare until the job ends."""
    from threefold.training import seats

    rank = int(os.environ["RANK"])
    os.environ.update(
        LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank), GROUP_WORLD_SIZE="3", THREEFOLD_NODE=f"n{rank}"
    )
    os.environ["TORCHELASTIC_RUN_ID"] = "seats"
    cfg = build_config(None, [("parallel.dp", "2"), ("log.dir", log_dir)])
    seat = seats.take_seat(cfg)
    if seat.spare:
        prefixed = seats.comm.prefixed

        class SlowAck:  # the spare sees the end a second late: the host must wait for it
            def __init__(self, store, prefix):
                self.keys = prefixed(store, prefix)

            def __getattr__(self, name):
                return getattr(self.keys, name)

            def add(self, key, n):
                time.sleep(1.0 if n else 0.0)
                return self.keys.add(key, n)

        seats.comm.prefixed = SlowAck
        seats.wait_as_spare(seat, cfg)
        seats.comm.prefixed = prefixed
    else:
        time.sleep(1.0)  # the spare is waiting by now
        seats.release(seat, ok=True)
    acks = int(seats.comm.prefixed(seat.store, seats.PREFIX).add(seats.ACKS, 0)) if seat.hosts_store else None
    keys = ("RANK", "WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT")
    return {"position": seat.position, "acks": acks, **{k: os.environ.get(k) for k in keys}}


def test_a_spare_takes_no_rank_and_leaves_when_the_job_ends(tmp_path):
    """The seats over a real store (three one-process "nodes", no torchrun): two nodes are seated
    with the ranks of their positions, the third waits without a rank and returns once the job
    ended well; the store's host leaves only after the spare has seen the end, also when the host
    is the spare itself (the job's last round seated it so)."""
    from harness import run_ranks

    first = run_ranks(_seat_and_leave, 3, str(tmp_path / "a"), timeout=60)
    assert [r["position"] for r in first] == [0, 1, None]
    assert [(r["RANK"], r["WORLD_SIZE"], r["GROUP_RANK"]) for r in first[:2]] == [("0", "2", "0"), ("1", "2", "1")]
    assert first[2]["RANK"] == "2"  # a spare keeps torchrun's numbering: it joins no group
    assert first[0]["acks"] == 1
    # The job's last round seated n1 and n2: n0, torchrun's rank 0 and the store's host, waits.
    earlier = decide(None, [Node("n1"), Node("n2"), Node("n0")], needed=2, dp=2)
    (tmp_path / "b").mkdir()
    record = {"run": "seats", "rounds": [earlier.to_json()]}
    (tmp_path / "b" / "nodes.json").write_text(json.dumps(record))
    second = run_ranks(_seat_and_leave, 3, str(tmp_path / "b"), timeout=60)
    assert [r["position"] for r in second] == [None, 0, 1]
    assert second[0]["acks"] == 1 and [r["TORCHELASTIC_RESTART_COUNT"] for r in second[1:]] == ["1", "1"]


def test_a_spare_node_takes_the_lost_nodes_place(tmp_path, cache_dir):
    """Three agents of 2 workers under --nnodes 2:3, layout tp 2 x dp 2: two nodes train, the
    third waits as a spare. The node of rank 2 dies whole (agent and workers) at step 6; the
    spare takes its position, the run resumes from the checkpoint of step 4 with the same dp and
    global batch, and its losses are those of a straight run."""
    log, ckpt = tmp_path / "run", tmp_path / "ckpt"
    agents = Agents(
        _train(log, ckpt, cache_dir, 8, "--parallel.tp", "2", "--parallel.dp", "2"),
        "2:3",
        RDZV,
        ["--max-restarts", "1"],
        nproc=2,
    )
    for k in range(3):
        agents.start(_env(f"n{k}", "killnode:rank=2:step=5"))
    codes, outs = agents.wait(timeout=240)
    said = "\n".join(outs)
    assert sorted(codes) == [-9, 0, 0], said[-4000:]
    first, second = _rounds(log)
    (spare,) = first["spares"]
    lost = first["seats"][1]
    assert second["seats"] == [first["seats"][0], spare] and second["dp"] == first["dp"] == 2
    assert f"threefold: nodes {', '.join(first['seats'])} train (dp 2); {spare} waits as a spare" in said, said[-4000:]
    restarted = [line for line in said.splitlines() if line.startswith("threefold: restart 1 of 1")]
    assert len(restarted) == 1 and f"; spare {spare} replaced {lost}; resumed at step 4" in restarted[0], said[-4000:]
    rows = _metrics(log)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 5, 6, 7, 8]
    run = json.loads((log / "run.json").read_text())
    # The spare's workers never joined the group: a world of 4 of the 6 workers torchrun started.
    assert (run["layout"]["world_size"], run["layout"]["dp"]) == (4, 2)
    assert run["config"]["train"]["global_batch"] == build_config(None, []).train.global_batch
    straight = run_training({"train.steps": 8, "train.lr": CALM_LR}, tmp_path / "straight", cache_dir)
    final = {r["step"]: r["loss"] for r in rows}
    delta = within(
        "spare takeover (tp2 dp2) vs a straight dp1 run",
        max(abs(final[s] - straight[s - 1]["loss"]) for s in final),
        PARITY,
    )
    print(f"spare takeover: mttr {rows[5]['mttr_s']:.1f} s (the node's death to the end of the first resumed step)")
    print(f"spare takeover: max |loss - straight| {delta:.2e} over steps {sorted(final)}")


def test_a_node_that_returns_grows_dp_back(tmp_path, cache_dir):
    """Two one-process agents under --nnodes 1:2, parallel.dp 0 with ZeRO 1. Node n1 dies whole at
    step 4 and n0 continues alone at dp 1; once it has trained a step there, n1's agent comes back.
    n0's agent re-forms the job: the worker saves at the step it is in and the job resumes at dp 2
    from that checkpoint (ZeRO's shards re-cut), with the same global batch; its losses are those
    of a straight dp 2 run from the same checkpoint."""
    log, ckpt = tmp_path / "run", tmp_path / "ckpt"
    gate = tmp_path / "return"
    fault = "killnode:rank=1:step=3"
    agents = Agents(
        _train(log, ckpt, cache_dir, 24, "--parallel.dp", "0", "--parallel.zero", "1"),
        "1:2",
        RDZV,
        ["--max-restarts", "2"],
    )
    agents.start(_env("n0", fault))
    agents.start(_env("n1", fault))
    agents.start(_env("n1", fault), gate=str(gate))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # n0 trains a step at dp 1, then n1 returns
        rows = _metrics(log) if (log / "metrics.jsonl").exists() else []
        if len({r["segment"] for r in rows}) >= 2:
            break
        time.sleep(0.2)
    gate.touch()
    codes, outs = agents.wait(timeout=240)
    said = "\n".join(outs)
    assert codes == [0, -9, 0], said[-4000:]
    rounds = _rounds(log)
    assert [r["dp"] for r in rounds] == [2, 1, 2], rounds
    rows = _metrics(log)
    segments = list(dict.fromkeys(r["segment"] for r in rows))
    assert len(segments) == 3, [r["step"] for r in rows]
    grown = [r for r in rows if r["segment"] == segments[2]]
    at = grown[0]["step"] - 1
    regrow = f"threefold: the job re-formed: n1 joined, dp 1 -> 2; resumed at step {at} from step_{at:08d}"
    assert regrow in said, said[-4000:]
    assert json.loads((log / "run.json").read_text())["layout"]["dp"] == 2
    straight = run_training(
        {
            "parallel.dp": 2,
            "parallel.zero": 1,
            "train.steps": 24,
            "train.lr": CALM_LR,
            "checkpoint.resume": ckpt / f"step_{at:08d}",
        },
        tmp_path / "straight",
        cache_dir,
    )
    assert [r["step"] for r in straight] == [r["step"] for r in grown]
    delta = within("grown back to dp2 vs a straight dp2 run from its checkpoint", max(
        abs(a["loss"] - b["loss"]) for a, b in zip(grown, straight)), PARITY)  # fmt: skip
    print(f"grow back at step {at}: {len(grown)} steps at dp 2 after it, max |loss - straight| {delta:.2e}")
