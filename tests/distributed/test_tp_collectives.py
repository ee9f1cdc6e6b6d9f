"""distributed/tp_collectives.py against what tensor parallelism does: the calls and bytes one
tp2 step records for dense and MoE blocks (with and without a shared expert), SP on and off,
and full recompute's rerun of dense blocks; and the table imports without torch (the planner
reads it in `threefold plan`, which never imports torch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from threefold.config import build_config
from threefold.distributed.tp_collectives import (
    DENSE_BLOCK,
    TP_COLLECTIVES,
    Collectives,
    block_collectives,
    moe_block,
)

from harness import CALM_LR, run_ranks, train_jobs

SEQ, MB, TP = 32, 2, 2
BASE = {
    "train.steps": 1,
    "train.seed": 0,
    "train.lr": CALM_LR,
    "model.seq_len": SEQ,
    "train.global_batch": 2 * MB,  # two micro-batches: the per-micro-batch counts twice
    "train.micro_batch": MB,
    "parallel.tp": TP,
    "log.spans": "true",
    "log.interval": 1,
    "checkpoint.dir": "",
}
MOE = {"model.num_experts": 4, "model.top_k": 2}
RUNS = {
    "dense": {},
    "dense_sp": {"parallel.sp": "true"},
    "dense_full": {"train.recompute": "full"},
    "dense_sp_full": {"parallel.sp": "true", "train.recompute": "full"},
    "moe": MOE,
    "moe_sp": {**MOE, "parallel.sp": "true"},
    "moe_shared": {**MOE, "model.shared_expert": "true"},
    "moe_shared_sp": {**MOE, "model.shared_expert": "true", "parallel.sp": "true"},
}


def _config(name: str):
    return build_config(None, [(k, str(v)) for k, v in {**BASE, **RUNS[name]}.items()])


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, cache_dir) -> dict[str, tuple[int, int]]:
    """Each run's tp (calls, bytes) of its one step, as spans.jsonl reports them (rank 0)."""
    from harness import resolved_config

    root = tmp_path_factory.mktemp("tp_collectives")
    jobs = [resolved_config({**BASE, **over}, root / name, cache_dir, TP) for name, over in RUNS.items()]
    run_ranks(train_jobs, TP, jobs, timeout=600)
    out = {}
    for name in RUNS:
        (step,) = [json.loads(line) for line in (Path(root) / name / "spans.jsonl").read_text().splitlines()]
        rank = next(r for r in step["ranks"] if r["rank"] == 0)
        out[name] = (rank["comm_calls"]["tp"], rank["comm_bytes"]["tp"])
    return out


def _per_micro_batch(name: str) -> Collectives:
    """The table's collectives of one micro-batch of run `name` (pp 1: every block, both ends, the loss)."""
    m = _config(name).model
    sp, full = "parallel.sp" in RUNS[name], "train.recompute" in RUNS[name]
    pieces = moe_block(m.shared_expert) if m.num_experts else DENSE_BLOCK
    total = TP_COLLECTIVES[sp]["embedding"].both + TP_COLLECTIVES[sp]["head"].both + TP_COLLECTIVES[sp]["loss"].both
    for _ in range(m.layers):
        total = total + block_collectives(sp, pieces, full)
    return total


@pytest.mark.parametrize("name", list(RUNS))
def test_a_step_makes_the_collectives_the_table_counts(recorded, name):
    m = _config(name).model
    micro = BASE["train.global_batch"] // MB
    counted = _per_micro_batch(name)
    # Once per step besides: the TP shards' squared norms, and the partial gradient sums (norm
    # weights under SP, the router under TP) in one flat all-reduce when there are any.
    partial_sums = int("parallel.sp" in RUNS[name] or m.num_experts > 0)
    calls, nbytes = recorded[name]
    assert calls == micro * counted.calls + 1 + partial_sums, (name, recorded[name])
    # Every all-reduce, all-gather and reduce-scatter but the loss's handles one activation X;
    # what the loss, the routing counts and the per-step sums add is well under one X.
    x = SEQ * MB * m.hidden * 4
    activations = counted.all_reduce - TP_COLLECTIVES[False]["loss"].forward.all_reduce
    activations += counted.all_gather + counted.reduce_scatter
    assert 0 < nbytes - micro * activations * x < x, (name, recorded[name])


def test_full_recompute_reruns_a_dense_block_but_its_output_collective():
    assert block_collectives(False, DENSE_BLOCK, True) - block_collectives(False, DENSE_BLOCK) == Collectives(
        all_reduce=1
    )
    assert block_collectives(True, DENSE_BLOCK, True) - block_collectives(True, DENSE_BLOCK) == Collectives(
        all_gather=2, reduce_scatter=1
    )


def test_the_table_imports_without_torch():
    code = "import sys, threefold.distributed.tp_collectives; print('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
