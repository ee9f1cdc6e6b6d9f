"""bench/zero_vs_deepspeed.py's pure parts, without DeepSpeed: the config it gives DeepSpeed mirrors
threefold's run (buckets, batch, clipping, AdamW), the missing-extra line, and the suite skipping
the section when DeepSpeed is absent. No timing is asserted."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench")]

import run as bench_run  # noqa: E402
import suite  # noqa: E402
import zero_vs_deepspeed as zvd  # noqa: E402
from dp_common import make_cfg  # noqa: E402

from threefold.distributed.data_parallel.engine import DataParallel  # noqa: E402
from threefold.training.optim import param_groups  # noqa: E402


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("bucket_mb", [1.0, 0.25])
def test_deepspeed_config_mirrors_threefolds_run(stage, bucket_mb):
    cfg = make_cfg(**{"parallel.dp": 2})
    ds = zvd.deepspeed_config(cfg, stage, bucket_mb, dp=2)
    ours = zvd.threefold_config(cfg, stage, bucket_mb).parallel
    # threefold's bucket is MiB of fp32 gradient; DeepSpeed counts elements.
    elements = bucket_mb * 2**20 / torch.empty((), dtype=torch.float32).element_size()
    zero = ds["zero_optimization"]
    assert zero["stage"] == ours.zero == stage
    assert ours.bucket_mb == bucket_mb
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == elements
    assert zero.get("stage3_prefetch_bucket_size") == (elements if stage == 3 else None)
    assert zero["overlap_comm"] is zero["contiguous_gradients"] is True
    assert ours.overlap_param_gather is True and ours.zero3_prefetch == 1 and ours.grad_reduce == "overlap"
    assert ds["gradient_clipping"] == cfg.train.grad_clip == 1.0
    t = cfg.train
    assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 2 == t.global_batch
    assert ds["train_micro_batch_size_per_gpu"] == t.micro_batch
    assert not ds["fp16"]["enabled"] and not ds["bf16"]["enabled"]  # fp32, as threefold on CPU


def test_deepspeed_optimizer_has_threefolds_adamw():
    cfg = make_cfg()
    t = cfg.train
    eps = inspect.signature(DataParallel.__init__).parameters["eps"].default
    assert zvd.adamw_arguments(cfg) == {"lr": t.lr, "betas": (t.beta1, t.beta2), "eps": eps}
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = zvd.deepspeed_optimizer("torch_foreach", param_groups(model, t.weight_decay), cfg)
    decays = sorted((g["weight_decay"], len(g["params"])) for g in opt.param_groups)
    assert decays == [(0.0, 3), (t.weight_decay, 1)]  # the matrix only: biases and the norm weight none
    assert all(g["lr"] == t.lr and g["betas"] == (t.beta1, t.beta2) and g["eps"] == eps for g in opt.param_groups)
    assert isinstance(zvd.deepspeed_optimizer("torch_fused", param_groups(model, 0.1), cfg), torch.optim.AdamW)


@pytest.fixture
def no_deepspeed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))


def test_missing_deepspeed_is_one_line_and_nonzero_exit(no_deepspeed, capsys):
    with pytest.raises(SystemExit) as exit_:
        zvd.main(["--quick"])
    assert exit_.value.code != 0
    err = capsys.readouterr()
    assert err.out == ""
    assert err.err.strip().splitlines() == [
        "bench/zero_vs_deepspeed.py: DeepSpeed is not installed; install the bench extra: pip install -e '.[bench]'"
    ]


def test_suite_skips_the_section_without_deepspeed(no_deepspeed):
    section = next(s for s in bench_run.SECTIONS if s.name == "zero_vs_deepspeed")
    logged = []
    (r,) = suite.run_sections([section], quick=True, log=lambda *a, **k: logged.append(" ".join(a)))
    assert r.skipped == "deepspeed is not installed (pip install -e '.[bench]')" and not r.error
    assert logged == [f"bench: zero_vs_deepspeed skipped: {r.skipped}"]
    assert "| zero_vs_deepspeed | - | skipped: deepspeed is not installed" in "\n".join(suite.summary_table([r]))
    doc = suite.write_markdown([r], suite.machine(), "python bench/run.py", 1.0, quick=True)
    assert f"Skipped in this run: {r.skipped}" in doc
