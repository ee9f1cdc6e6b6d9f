"""train.on_slow (training/actions.py): a node or pipeline stage the in-run diagnosis keeps naming
is warned about once, excluded as a lost node, or given an uneven pipeline partition at a restart;
and the slow-stage detector (observe/stages.py) that names a heavy stage."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from threefold.config import build_config
from threefold.distributed.pipeline.partition import (
    balanced_partition,
    partition_for_speeds,
    stage_costs,
    stage_times,
)
from threefold.distributed.runtime import WorkerEnv
from threefold.errors import ConfigError
from threefold.observe.diagnose import ReportView
from threefold.observe.findings import Finding
from threefold.observe.spans import CATEGORIES
from threefold.observe.stages import StageDetector
from threefold.training.actions import REBALANCE, Decider, Target, planned_config, rebalanced, write_rebalance

from harness import CALM_LR, PARITY, run_agents, run_training, within

ABLE = {"exclude": "", "rebalance": ""}


def _node(node: int, step: int, ranks=(2, 3)) -> Finding:
    return Finding("slow_node", f"node {node}", f"slow node: node {node}", step, 2, tuple(ranks), node=node, value=3.0)


def _rank(rank: int, step: int, per_node: int = 2) -> Finding:
    return Finding(
        "slow_rank", f"rank {rank}", f"slow rank: rank {rank}", step, 2, (rank,), node=rank // per_node, value=0.3,
        baseline=0.1,
    )  # fmt: skip


def _decider(mode: str, needed: int = 3, pp: int = 1, not_able=None) -> Decider:
    # 4 ranks, 2 per node; with pp 2 ranks 0, 1 are stage 0 and 2, 3 stage 1.
    return Decider(mode, needed, pp, 2, lambda r: r // 2, not_able or ABLE)


def test_a_node_acts_after_the_streak_and_a_quiet_report_restarts_it():
    d = _decider("exclude", needed=3)
    assert d.on_report(2, [_node(1, 2)]) == ([], None)
    assert d.on_report(4, [_node(1, 4)]) == ([], None)
    # Report 6: the finding is still active (the hub keeps it a while) but was not named on it.
    assert d.on_report(6, [_node(1, 4)]) == ([], None)
    for step in (8, 10):
        assert d.on_report(step, [_node(1, step)]) == ([], None)
    lines, target = d.on_report(12, [_node(1, 12)])
    assert lines == [] and target == Target("exclude", "node 1", _node(1, 12))


def test_slow_ranks_make_a_node_only_when_they_cover_it():
    d = _decider("exclude", needed=1)
    assert d.on_report(2, [_rank(2, 2)]) == ([], None)  # rank 3 of node 1 is fine
    lines, target = d.on_report(4, [_rank(2, 4), _rank(3, 4)])
    assert target is not None and target.key == "node 1"


def test_warn_says_once_what_would_act():
    d = _decider("warn", needed=2)
    said = []
    for step in (2, 4, 6, 8):
        lines, target = d.on_report(step, [_node(1, step)])
        assert target is None
        said += lines
    assert len(said) == 1, said
    assert said[0].startswith("threefold: on_slow warn: node 1 named for 2 reports in a row (slow node: node 1)")
    assert said[0].endswith("(train.on_slow exclude would act)")


def test_which_action_a_finding_leads_to():
    stage = Finding("slow_stage", "stage 0", "slow stage: stage 0", 2, 2, (0, 1), stage=0)
    # rebalance: a slow stage, and a slow node's stage in a pipelined layout.
    assert _decider("rebalance", 1, pp=2).on_report(2, [stage])[1].key == "stage 0"
    assert _decider("rebalance", 1, pp=2).on_report(2, [_node(1, 2)])[1] == Target("rebalance", "stage 1", _node(1, 2))
    # exclude takes the node, and only says what rebalance would do with a stage.
    assert _decider("exclude", 1, pp=2).on_report(2, [_node(1, 2)])[1].key == "node 1"
    lines, target = _decider("exclude", 1, pp=2).on_report(2, [stage])
    assert target is None and lines[0].endswith("(train.on_slow rebalance would act)")
    # Without pipeline stages a slow node gives rebalance nothing to do.
    lines, target = _decider("rebalance", 1, pp=1).on_report(2, [_node(1, 2)])
    assert target is None and "(train.on_slow exclude would act)" in lines[0]
    # An action that cannot act in this attempt says why, once.
    d = _decider("exclude", 1, not_able={"exclude": "no restart left", "rebalance": ""})
    lines, target = d.on_report(2, [_node(1, 2)])
    assert target is None and lines[0].endswith("; not acting: no restart left")
    assert d.on_report(4, [_node(1, 4)]) == ([], None)
    # Nor do layers or links make a target.
    layer = Finding("slow_layer", "layer 3", "slow layer", 2, 2, (1,), layer=3, stage=1)
    link = Finding("slow_link", "pp 0->1", "slow link", 2, 2, (0, 1))
    assert _decider("rebalance", 1, pp=2).on_report(2, [layer, link]) == ([], None)


def test_partitions_from_speeds():
    assert balanced_partition(8, 2, 1.0, 0.0, 0.0) == [4, 4]
    assert balanced_partition(8, 2, 1.0, 0.0, 0.0, speeds=[1.0, 1 / 3]) == [6, 2]
    assert balanced_partition(8, 2, 1.0, 0.0, 0.0, layer_weights=[1] * 7 + [5]) == [6, 2]
    model = build_config(None, [("model.layers", "8"), ("parallel.pp", "2")]).model
    cost = stage_costs(model)
    # A stage heavy only because it holds more layers runs at the others' speed: the balanced cut.
    heavy = [t * 1e-9 for t in stage_times([6, 2], *cost)]
    new, speeds, predicted = partition_for_speeds(model, 2, [6, 2], heavy)
    assert new == balanced_partition(8, 2, *cost) and speeds == pytest.approx([1.0, 1.0])
    assert max(predicted) < max(heavy)
    # A stage whose ranks run at half speed gets about half the layers of the other.
    even = [t * 1e-9 for t in stage_times([4, 4], *cost)]
    new, speeds, _ = partition_for_speeds(model, 2, [4, 4], [even[0] * 2, even[1]])
    assert new == [3, 5] and speeds[0] == pytest.approx(0.5)


def _view(step: int, compute: list[float]) -> ReportView:
    ranks = []
    for pp, seconds in enumerate(compute):
        time_s = dict.fromkeys(CATEGORIES, 0.0)
        time_s["forward"], time_s["backward"] = seconds / 3, 2 * seconds / 3
        ranks.append({"rank": pp, "pp": pp, "tp": 0, "dp": 0, "time_s": time_s})
    return ReportView(step, 2, ranks, None, {})


def test_the_stage_detector_names_a_heavy_stage_and_what_would_even_it():
    cfg = build_config(None, [("parallel.pp", "2"), ("parallel.stage_layers", "3,1")])
    detector = StageDetector(cfg, 2)
    (found,) = detector.on_report(_view(4, [0.041, 0.016]))
    assert found.kind == "slow_stage" and found.key == "stage 0" and found.stage == 0 and found.ranks == (0,)
    assert found.text.startswith(
        "slow stage: stage 0 computes 41 ms per step vs 16 ms for the others (holds 3 of 4 layers); "
        "layers per stage 2,2 instead of 3,1"
    ), found.text
    assert found.extra["partition"] == "2,2" and found.extra["speeds"][0] == 1.0
    assert detector.on_report(_view(6, [0.041, 0.016]))[0].since == 4
    # Balanced, or heavy where no cut helps (the head on the last stage): nothing.
    balanced = StageDetector(build_config(None, [("parallel.pp", "2")]), 2)
    assert balanced.on_report(_view(4, [0.030, 0.032])) == []
    assert balanced.on_report(_view(4, [0.030, 0.036])) == []


def test_a_slow_node_s_stage_is_rebalanced_by_its_figure():
    cfg = build_config(None, [("model.layers", "8"), ("parallel.pp", "2")])
    new = rebalanced(cfg, Target("rebalance", "stage 1", _node(1, 2)), [])
    assert new[1] < new[0]  # the slow stage holds fewer layers
    layer = Finding("slow_layer", "layer 0", "slow layer", 2, 2, (0,), layer=0, value=0.9, baseline=0.1)
    stage = Finding("slow_stage", "stage 0", "", 2, 2, (0,), stage=0, extra={"compute_s": [0.2, 0.1]})
    assert rebalanced(cfg, Target("rebalance", "stage 0", stage), [layer])[0] < 4


def test_a_restart_of_the_same_run_trains_with_the_decided_partition(tmp_path, monkeypatch, capsys):
    cfg = build_config(None, [("parallel.pp", "2"), ("log.dir", str(tmp_path))])
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-a")
    write_rebalance(tmp_path, "3,1", 8)
    write_rebalance(tmp_path, "1,3", 4, run="run-b")
    first, restart = WorkerEnv(0, 2, 0, 2, 0), WorkerEnv(0, 2, 0, 2, 1)
    assert planned_config(cfg, first).parallel.stage_layers == ""
    assert planned_config(cfg, restart).parallel.stage_layers == "3,1"
    assert "layers per stage 3,1 (was 2,2), from step 8" in capsys.readouterr().err
    assert json.loads((tmp_path / REBALANCE).read_text())["run-b"]["stage_layers"] == "1,3"
    # A partition cut for another layout is left, with one line.
    cfg = build_config(None, [("parallel.pp", "2"), ("model.layers", "6"), ("log.dir", str(tmp_path))])
    assert planned_config(cfg, restart).parallel.stage_layers == ""
    assert "not applying rebalance.json" in capsys.readouterr().err


def test_on_slow_reports_must_be_positive():
    from threefold.validate import validate

    with pytest.raises(ConfigError, match="train.on_slow_reports"):
        validate(build_config(None, [("train.on_slow_reports", "0")]))
    with pytest.raises(ConfigError, match="train.on_slow"):
        build_config(None, [("train.on_slow", "drop")])


def _metrics(log) -> list[dict]:
    return [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]


DEVICE = "slowlayer:layer=0:factor=3:rank=0,slowlayer:layer=1:factor=3:rank=0"


def test_rebalance_restarts_a_slow_stage_with_an_uneven_partition_and_a_shorter_step(tmp_path, data, cache_dir):
    """pp 2, 2 of 4 layers per stage, stage 0's rank a 3x slower device (slowlayer on the two
    blocks it holds, :rank=0: every forward and backward pass through them there; a block moved to
    rank 1 computes at full speed).
    The slow-stage detector names stage 0 on two reports in a row, the action writes an uneven
    partition, every rank exits after the checkpoint of step 4, and the agent's restart trains on
    with fewer layers on the slow stage and a shorter step. (The drill's extra time is the slow
    device's, not the host's CPU: this 2-core host shares its cores with the other stage's rank,
    where a heavy stage of real compute gains nothing from the cut; bench/rebalance.py.)"""
    log, ckpt = tmp_path / "log", tmp_path / "ckpt"
    args = [sys.executable, "-m", "threefold", "train", "--parallel.pp", "2", "--parallel.microbatches", "4"]
    args += ["--train.global_batch", "8", "--train.micro_batch", "2", "--train.steps", "16"]
    args += ["--train.max_restarts", "1", "--train.on_slow", "rebalance", "--train.on_slow_reports", "2"]
    args += ["--log.interval", "2", "--checkpoint.dir", str(ckpt), "--checkpoint.interval", "2"]
    args += ["--log.dir", str(log), "--log.quiet", "true", "--data.path", data, "--data.vocab", "256"]
    args += ["--data.cache_dir", cache_dir]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "THREEFOLD_FAULT": DEVICE}
    done = subprocess.run(args, capture_output=True, text=True, timeout=150, env=env)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    acted = [line for line in said.splitlines() if line.startswith("threefold: on_slow rebalance: stage 0 named")]
    assert len(acted) == 1 and "instead of 2,2 (train.on_slow rebalance)" in acted[0], said[-3000:]
    (entry,) = json.loads((log / REBALANCE).read_text()).values()
    assert entry["stage_layers"] == "1,3" and "layers per stage 1,3 (was 2,2)" in said
    assert json.loads((log / "run.json").read_text())["config"]["parallel"]["stage_layers"] == "1,3"
    rows = _metrics(log)
    segments = list(dict.fromkeys(r["segment"] for r in rows))
    assert len(segments) == 2 and rows[-1]["step"] == 16, [r["step"] for r in rows]
    records = [json.loads(line) for line in (log / "failures.jsonl").read_text().splitlines()]
    assert sorted(r["rank"] for r in records if r["kind"] == "action") == [0, 1]
    assert "restart 1 of 1 after ranks 0, 1: train.on_slow rebalance: a new pipeline partition" in said, said[-3000:]
    goodput = json.loads((log / "goodput.json").read_text())
    assert goodput["actions"] == 1 and goodput["failures"][0]["cause"] == "on_slow_rebalance"
    # Step time of each attempt past its first step (start-up).
    before, after = ([r["step_time_s"] for r in rows if r["segment"] == s][1:] for s in segments)
    assert statistics.median(after) < 0.9 * statistics.median(before), (before, after)


def test_exclude_leaves_a_slow_node_out_and_trains_on_at_a_smaller_dp(tmp_path, data, cache_dir):
    """Two one-process "nodes" under torchrun --nnodes 1:2 (tests/preflight/test_exclude.py's
    launch); node 1's rank computes 3x slower. The link detector names node 1 on two reports in a
    row, the action waits for the checkpoint, node 1 ends whole and node 0's agent re-forms the job
    alone at dp 1, whose losses are those of a straight dp-1 run from the same checkpoint."""
    env = {
        **os.environ,
        "THREEFOLD_FAULT": "slow:rank=1:factor=3",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
    }
    log, ckpt = tmp_path / "run", tmp_path / "ckpt"
    common = ["--train.global_batch", "8", "--train.micro_batch", "2", "--model.seq_len", "64"]
    common += ["--train.lr", str(CALM_LR), "--train.steps", "10", "--data.path", data, "--data.vocab", "256"]
    train = ["-m", "threefold", "train", "--parallel.dp", "0", *common, "--train.on_slow", "exclude"]
    train += ["--train.on_slow_reports", "2", "--log.interval", "2", "--checkpoint.dir", str(ckpt)]
    train += ["--checkpoint.interval", "2", "--checkpoint.keep", "0", "--train.timeout_s", "30"]
    train += ["--data.cache_dir", cache_dir, "--log.dir", str(log), "--log.quiet", "true"]
    codes, outs = run_agents([env, env], train, "1:2", "is_host=false,last_call_timeout=8", ["--max-restarts", "1"])
    said = outs[0] + outs[1]
    assert sorted(codes) == [-9, 0], said[-4000:]
    acted = [line for line in said.splitlines() if line.startswith("threefold: on_slow exclude: node 1 named")]
    assert len(acted) == 1 and "leaving node 1 out after the checkpoint of step" in acted[0], said[-4000:]
    assert json.loads((log / "run.json").read_text())["layout"]["dp"] == 1
    rows = _metrics(log)
    segments = [r["segment"] for r in rows]
    resumed = next(i for i in range(1, len(rows)) if segments[i] != segments[i - 1])
    at = rows[resumed]["step"] - 1
    assert rows[resumed - 1]["step"] == at and rows[-1]["step"] == 10  # no step lost
    straight = run_training(
        {
            "parallel.dp": 1,
            "train.global_batch": 8,
            "train.micro_batch": 2,
            "model.seq_len": 64,
            "train.lr": CALM_LR,
            "train.steps": 10,
            "data.path": data,
            "data.vocab": 256,
            "checkpoint.resume": ckpt / f"step_{at:08d}",
        },
        tmp_path / "straight",
        cache_dir,
    )
    after = rows[resumed:]
    assert [r["step"] for r in straight] == [r["step"] for r in after]
    within("on_slow exclude: dp1 after the exclusion vs straight dp1 from its checkpoint", max(
        abs(a["loss"] - b["loss"]) for a, b in zip(after, straight)), PARITY)  # fmt: skip
    records = [json.loads(line) for line in (log / "failures.jsonl").read_text().splitlines()]
    assert [r["rank"] for r in records if r["kind"] == "action"] == [0]
    assert "restart 1 of 1 after rank 0: train.on_slow exclude left node 1 out" in said, said[-4000:]
    assert json.loads((log / "goodput.json").read_text())["actions"] == 1
