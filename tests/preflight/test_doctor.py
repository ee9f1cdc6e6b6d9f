"""The preflight as `threefold train` and `threefold doctor` run it (threefold/preflight/run.py):
a hard stack difference stops before step 1 with exit 2 and one line, allow_stack_mismatch and
soft differences warn, a node whose agent runs another NCCL_* variable is named, a resume on
another stack says what changed, and the doctor's --json verdict of a clean run parses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from harness import run_agents

TRAIN = ["--train.steps", "2", "--train.global_batch", "4", "--train.micro_batch", "1", "--log.quiet", "true"]


def _threefold(args, fault="", env=None, timeout=60):
    environ = {**os.environ, "THREEFOLD_FAULT": fault, "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", "threefold", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=environ)


def _train(tmp: Path, data: str, cache_dir: str, *args, fault=""):
    extra = ["--data.path", data, "--data.vocab", "256", "--data.cache_dir", cache_dir, "--log.dir", str(tmp)]
    return _threefold(["train", *TRAIN, *extra, *args], fault)


def _threefold_lines(stderr: str, part: str) -> list[str]:
    return [line for line in stderr.splitlines() if f"{part}:" in line and line.startswith("threefold:")]


def test_a_hard_stack_difference_on_one_rank_stops_before_step_1_with_exit_2(tmp_path, data, cache_dir):
    out = _train(tmp_path, data, cache_dir, "--parallel.dp", "4", fault="stack:rank=2:torch=0.0.0")
    assert out.returncode == 2, out.stderr[-3000:]
    said = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(said) == 1, out.stderr[-3000:]
    assert "rank 2" in said[0] and "torch" in said[0] and "0.0.0" in said[0], said
    assert not (tmp_path / "metrics.jsonl").exists()  # no step ran
    assert json.loads((tmp_path / "preflight.json").read_text())["hard"] is True


def test_allow_stack_mismatch_warns_and_trains_and_an_environment_difference_warns(tmp_path, data, cache_dir):
    """One 4-process run, two drills: a hard difference let through, and an environment one."""
    fault = "stack:rank=2:torch=0.0.0,stack:rank=1:NCCL_ALGO=Tree"
    out = _train(tmp_path, data, cache_dir, "--parallel.dp", "4", "--train.allow_stack_mismatch", "true", fault=fault)
    assert out.returncode == 0, out.stderr[-3000:]
    stack = _threefold_lines(out.stderr, "stack")
    assert any("rank 2" in line and "0.0.0" in line for line in stack), out.stderr[-3000:]
    assert any("rank 1" in line and "NCCL_ALGO" in line for line in stack), out.stderr[-3000:]
    assert len(stack) == len(set(stack))  # once, from rank 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert json.loads((tmp_path / "run.json").read_text())["fingerprint"]


def test_resume_on_a_changed_fingerprint_says_what_changed(tmp_path, data, cache_dir):
    ckpt = ["--checkpoint.dir", str(tmp_path / "ckpt"), "--checkpoint.interval", "2", "--checkpoint.resume", "auto"]
    first = _train(tmp_path / "a", data, cache_dir, *ckpt)
    assert first.returncode == 0, first.stderr[-3000:]
    (manifest,) = (tmp_path / "ckpt").glob("*/manifest.json")
    assert json.loads(manifest.read_text())["extra"]["fingerprint"]
    again = ["--train.steps", "4", "--train.allow_stack_mismatch", "true"]
    second = _train(tmp_path / "b", data, cache_dir, *ckpt, *again, fault="stack:rank=0:torch=0.0.0")
    assert second.returncode == 0, second.stderr[-3000:]
    said = (second.stdout + second.stderr).splitlines()
    changed = [line for line in said if line.startswith("threefold: resuming step_00000002: ")]
    assert len(changed) == 1, said[-40:]  # one line, beside the preflight's warning
    assert "torch" in changed[0] and "-> 0.0.0" in changed[0], changed
    assert "pid" not in changed[0] and "host" not in changed[0]  # per-host keys are no change


def test_a_node_whose_workers_run_another_nccl_variable_is_named(tmp_path, data, cache_dir):
    """Two one-process "nodes" under torchrun --nnodes 2 on localhost (c10d rendezvous hosted
    here); node 1's agent, and so its worker, has NCCL_ALGO=Tree in its environment. The world
    spans two nodes, so train.preflight auto runs the probes too."""
    base = {**os.environ, "THREEFOLD_FAULT": "", "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    base.pop("NCCL_ALGO", None)
    train = ["-m", "threefold", "train", "--parallel.dp", "0", *TRAIN]  # train.preflight auto: 2 nodes probe
    train += ["--data.path", data, "--data.vocab", "256", "--data.cache_dir", cache_dir, "--log.dir", str(tmp_path)]
    codes, outs = run_agents([base, {**base, "NCCL_ALGO": "Tree"}], train, "2", timeout=90)
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    said = _threefold_lines(outs[0] + outs[1], "stack")
    assert len(said) == 1, said
    assert "node 1" in said[0] and "NCCL_ALGO" in said[0], said
    record = json.loads((tmp_path / "preflight.json").read_text())
    assert record["hard"] is False and record["node"] is not None and record["link"] is not None


def test_doctor_json_on_a_clean_single_rank_parses_and_exits_0(tmp_path):
    out = _threefold(["doctor", "--json", "--log.dir", str(tmp_path)])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    doc = json.loads(out.stdout)
    assert doc["named"] is False and doc["lines"] == [] and doc["exit_code"] == 0
    assert doc["fingerprint"] and doc["node"] is not None and doc["link"] is not None
    table = _threefold(["doctor", "--log.dir", str(tmp_path)])
    assert table.returncode == 0 and "nothing named" in table.stdout, table.stdout + table.stderr
