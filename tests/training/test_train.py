import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from threefold.training.optim import clip_gradients, global_grad_norm, lr_at

from harness import CALM_LR, assert_parity, run_training, run_training_many

STEPS = 20
BASE = {"train.steps": STEPS, "train.seed": 0, "train.lr": CALM_LR}


def test_lr_warmup_then_cosine_to_floor():
    t = SimpleNamespace(lr=1.0, min_lr_ratio=0.1, warmup_steps=4, steps=14)
    lrs = [lr_at(s, t) for s in range(14)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert math.isclose(lr_at(14, t), 0.1)


def test_global_grad_norm_and_clip_match_torch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 3))
    model(torch.randn(4, 5)).pow(2).sum().backward()
    ref_model = [p.grad.clone() for p in model.parameters()]
    norm = global_grad_norm(model, [])
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_model]))
    torch.testing.assert_close(norm, expected)
    clip_gradients(model, 0.5, norm)
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert abs(clipped.item() - 0.5) < 1e-4


def test_tied_weight_counts_once_in_the_norm():
    emb = torch.nn.Embedding(4, 3)
    head = torch.nn.Linear(3, 4, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    emb.weight.grad = torch.full((4, 3), 2.0)
    assert global_grad_norm(model, []).item() == pytest.approx((12 * 4.0) ** 0.5)


@pytest.fixture(scope="module")
def dp1_run(tmp_path_factory, cache_dir):
    return run_training(BASE, tmp_path_factory.mktemp("dp1"), cache_dir)


def test_single_process_loss_falls_and_metrics_are_complete(dp1_run):
    assert len(dp1_run) == STEPS
    assert dp1_run[-1]["loss"] < dp1_run[0]["loss"] - 1.0
    keys = {
        "step",
        "loss",
        "grad_norm",
        "lr",
        "tokens",
        "step_time_s",
        "tokens_per_s",
        "model_tflops_per_device",
        "mfu",
        "peak_mem_bytes",
        "data_wait_s",
    }
    assert keys <= set(dp1_run[0])
    assert dp1_run[-1]["tokens"] == STEPS * 16 * 128
    assert dp1_run[0]["peak_mem_bytes"] > 0 and dp1_run[0]["mfu"] > 0


@pytest.mark.parametrize("dp", [2, 4])
def test_data_parallel_matches_single_process(dp, dp1_run, tmp_path, cache_dir):
    run = run_training({**BASE, "parallel.dp": dp}, tmp_path, cache_dir)
    assert_parity(f"dp{dp} vs dp1 loss", dp1_run, run)


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory, cache_dir):
    runs = {f"zero{z}": {**BASE, "parallel.dp": 2, "parallel.zero": z} for z in (1, 2, 3)}
    runs["zero1-bucketed"] = {**runs["zero1"], "parallel.bucket_mb": 0.25}
    return run_training_many(runs, tmp_path_factory.mktemp("zero"), cache_dir, world=2)


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "zero1-bucketed"])
def test_zero_stages_in_the_loop_match_single_process(name, zero_runs, dp1_run):
    assert_parity(f"dp2 {name} vs dp1 loss", dp1_run, zero_runs[name])
    assert zero_runs[name][-1]["dp_exposed_s"] >= 0 and not zero_runs[name][-1]["step_skipped"]


def test_cli_trains_through_the_elastic_agent(tmp_path, cache_dir):
    log = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "threefold",
        "train",
        "--parallel.dp",
        "2",
        "--train.steps",
        "3",
        "--log.dir",
        str(log),
        "--data.cache_dir",
        cache_dir,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = (log / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    run = json.loads((log / "run.json").read_text())
    assert run["layout"]["dp"] == 2 and run["config"]["parallel"]["dp"] == 2
    assert "step 3/3" in out.stdout


def test_cli_bad_data_path_is_one_line(tmp_path, cache_dir):
    cmd = [
        sys.executable,
        "-m",
        "threefold",
        "train",
        "--data.path",
        str(tmp_path / "nope.txt"),
        "--data.cache_dir",
        cache_dir,
        "--log.dir",
        str(tmp_path / "run"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "nope.txt" in lines[0], out.stderr
