"""The headline layouts, every dimension at once, against one process: tp 2 with sequence
parallelism x pp 2 x dp 2 (ZeRO 1 and ZeRO 3; 1F1B and interleaved with two virtual stages per
rank) and a mixture of experts over tp 2 x pp 2 x dp 2 with ep 2 — eight gloo processes each,
twelve steps at a calm learning rate (see harness.PARITY)."""

import pytest

from harness import CALM_LR, assert_parity, run_training, run_training_many

STEPS = 12
# Two micro-batches per dp rank and step (global batch 8, micro-batch 2): the interleaved
# schedule needs at least pp of them, and every stage boundary is crossed twice per step.
BASE = {
    "train.steps": STEPS,
    "train.seed": 0,
    "train.lr": CALM_LR,
    "train.global_batch": 8,
    "train.micro_batch": 2,
    "model.seq_len": 64,
}
MOE = {"model.num_experts": 4, "model.top_k": 2}
THREE_D = {"parallel.tp": 2, "parallel.sp": True, "parallel.pp": 2, "parallel.dp": 2}
INTERLEAVED = {"parallel.schedule": "interleaved", "parallel.vpp": 2}
RUNS = {
    "tp2-sp-pp2-dp2-zero1-1f1b": {**THREE_D, "parallel.zero": 1},
    "tp2-sp-pp2-dp2-zero3-1f1b": {**THREE_D, "parallel.zero": 3},
    "tp2-sp-pp2-dp2-zero1-interleaved": {**THREE_D, "parallel.zero": 1, **INTERLEAVED},
    "tp2-sp-pp2-dp2-zero3-interleaved": {**THREE_D, "parallel.zero": 3, **INTERLEAVED},
    "moe-tp2-pp2-dp2-ep2-zero1": {
        **MOE,
        "parallel.tp": 2,
        "parallel.pp": 2,
        "parallel.dp": 2,
        "parallel.ep": 2,
        "parallel.zero": 1,
    },
}


@pytest.fixture(scope="module")
def references(tmp_path_factory, cache_dir) -> dict:
    root = tmp_path_factory.mktemp("one")
    return {
        "dense": run_training(BASE, root / "dense", cache_dir),
        "moe": run_training({**BASE, **MOE}, root / "moe", cache_dir),
    }


@pytest.fixture(scope="module")
def composed(tmp_path_factory, cache_dir) -> dict:
    return run_training_many(
        {k: {**BASE, **v} for k, v in RUNS.items()}, tmp_path_factory.mktemp("eight"), cache_dir, world=8, timeout=900
    )


@pytest.mark.parametrize("name", list(RUNS))
def test_composed_layout_matches_one_process(name, composed, references):
    run, ref = composed[name], references["moe" if name.startswith("moe") else "dense"]
    assert [r["step"] for r in run] == list(range(1, STEPS + 1))
    assert_parity(f"{name} vs one process loss", ref, run)
    assert not any(r["step_skipped"] for r in run)
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.3  # a run that learns, not a flat line
    if name.startswith("moe"):  # the router sent every token where one process sent it
        assert run[-1]["moe_expert_tokens"] == ref[-1]["moe_expert_tokens"]
