"""`threefold memory`: measured per-rank bytes next to ZeRO's and the activation formulas."""

import json
import subprocess
import sys

import pytest

from threefold.distributed.pipeline.schedules import build_schedule
from threefold.training.memory_probe import peak_inflight, peak_inflight_layers

from harness import within


@pytest.mark.parametrize(
    "schedule, p, m, v, rank, layers, heads",
    [
        ("gpipe", 4, 8, 1, 0, 8, 8),  # every forward before any backward
        ("1f1b", 4, 8, 1, 0, 4, 4),  # min(p - rank, m) micro-batches
        ("1f1b", 4, 8, 1, 3, 1, 1),
        ("1f1b", 4, 2, 1, 0, 2, 2),
        ("interleaved", 2, 4, 2, 0, 5, 2),  # min(v m, (v-1) p + 2 (p-1) + 1) chunks; chunk 1 holds 2
    ],
)
def test_in_flight_microbatches_follow_the_schedule(schedule, p, m, v, rank, layers, heads):
    actions = build_schedule(schedule, p, m, v)[rank]
    assert peak_inflight_layers(actions, [1] * v) == layers
    assert peak_inflight(actions, {v - 1}) == heads
    assert peak_inflight(actions, set()) == 0


def _memory(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "threefold", "memory", *args], capture_output=True, text=True, timeout=timeout
    )


def test_memory_command_measures_every_rank_against_the_formulas(cache_dir):
    out = _memory(
        "--parallel.pp", "2", "--parallel.dp", "2", "--parallel.zero", "1", "--data.cache_dir", cache_dir, "--json"
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    assert {(r["pp"], r["dp"]) for r in rows} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for r in rows:
        meas, pred = r["measured"], r["predicted"]
        for c in ("params", "grads", "optimizer"):  # ZeRO's formulas, byte for byte
            within(f"rank {r['rank']} {c} measured / predicted - 1", abs(meas[c] / pred[c] - 1), 0)
        # The activation formula: 0.1% off on the first stage, 2.5% on the last (deterministic counts).
        within(
            f"rank {r['rank']} activations measured / predicted - 1",
            abs(meas["activations"] / pred["activations"] - 1),
            0.03,
        )
        # fp32: 8P / N=2 = 4P = params
        within(f"rank {r['rank']} optimizer / params - 1", abs(meas["optimizer"] / meas["params"] - 1), 0)
    first, last = rows[0]["measured"]["activations"], rows[2]["measured"]["activations"]
    assert first > last  # 1F1B: the first stage holds p micro-batches, the last one


def test_sent_outputs_are_freed_before_their_backward(cache_dir):
    """GPipe holds every micro-batch's activations on stage 0 at once: without
    parallel.free_sent_outputs it also keeps all m outputs, with it only the one being made."""
    m, seq, micro, hidden = 4, 64, 2, 128  # the tiny preset's width
    peak = {}
    for free in ("true", "false"):
        out = _memory(
            "--parallel.pp",
            "2",
            "--parallel.schedule",
            "gpipe",
            "--train.global_batch",
            str(m * micro),
            "--train.micro_batch",
            str(micro),
            "--model.seq_len",
            str(seq),
            "--parallel.free_sent_outputs",
            free,
            "--data.cache_dir",
            cache_dir,
            "--json",
        )
        assert out.returncode == 0, out.stderr
        rows = [r for r in json.loads(out.stdout) if r["pp"] == 0]
        peak[free] = rows[0]["measured"]["activations"]
        within(
            f"stage 0 activations, free_sent_outputs {free}: measured / predicted - 1",
            abs(peak[free] / rows[0]["predicted"]["activations"] - 1),
            0.03,
        )
    assert peak["false"] - peak["true"] == (m - 1) * seq * micro * hidden * 4  # fp32 [seq, micro, hidden] each


def test_memory_command_bad_key_is_one_line():
    out = _memory("--parallel.zeroo", "1")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "parallel.zeroo" in lines[0]
