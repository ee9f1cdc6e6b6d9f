"""A slow layer, named in-run: traced steps time each layer's forward and backward per rank
(observe/layers.py); the report names a layer whose time exceeds its siblings' median, with the
MoE layer's hot expert or the stage's share of the partition where the record shows them."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from threefold.config import build_config
from threefold.distributed import drills
from threefold.errors import ConfigError
from threefold.observe.layers import LayerClock, SlowLayers, detector

# --- the detector on tables ------------------------------------------------------------------


def table(times: dict[int, float], kinds: dict[int, str] | None = None, stages=None) -> dict:
    kinds = kinds or {}
    stages = stages or [sorted(times)]
    stage_of = {i: s for s, ids in enumerate(stages) for i in ids}
    layers = {
        i: {
            "forward_s": t / 3,
            "backward_s": 2 * t / 3,
            "time_s": t,
            "typical_forward_s": t / 3,
            "typical_backward_s": 2 * t / 3,
            "typical_s": t,
            "calls": 2,
            "kind": kinds.get(i, "dense"),
            "stage": stage_of[i],
            "ranks": [stage_of[i]],
        }
        for i, t in times.items()
    }
    return {"step": 20, "layers": layers, "stage_layers": stages, "stage_time_s": []}


def view(layers: dict | None, record: dict | None = None):
    return SimpleNamespace(step=20, layers=layers, record=record or {})


def test_the_slow_layer_is_named_with_its_figures_and_a_clean_table_names_none():
    det = SlowLayers()
    assert det.on_report(view(table({0: 0.014, 1: 0.015, 2: 0.013, 3: 0.0145}))) == []
    (found,) = det.on_report(view(table({0: 0.014, 1: 0.015, 2: 0.013, 3: 0.041})))
    assert (found.kind, found.key, found.layer, found.category) == ("slow_layer", "layer 3", 3, "backward")
    assert found.text == (
        "slow layer: layer 3 takes 41 ms (forward 14 + backward 27) vs 14 ms median of 3 layers, on step 20"
    )
    # A report step without a traced step measures no layer: the finding stands until one does.
    assert [f.key for f in det.on_report(view(None))] == ["layer 3"]
    assert det.on_report(view(table({0: 0.014, 1: 0.015, 2: 0.013, 3: 0.014}))) == []


def test_the_attempts_first_step_names_no_layer():
    # Its layers pay their first calls in the order they run: layer 0 at twice the others is
    # warm-up (CI: `threefold memory`'s one step named it). The same table later names it.
    det, first = SlowLayers(), view(table({0: 0.080, 1: 0.040, 2: 0.040, 3: 0.040}))
    first.step = 1
    det.on_step(1, {})
    assert det.on_report(first) == []
    det.on_step(2, {})
    later = view(table({0: 0.080, 1: 0.040, 2: 0.040, 3: 0.040}))
    assert [f.key for f in det.on_report(later)] == ["layer 0"]


def test_noise_below_the_floor_and_a_layer_of_another_kind_are_not_named():
    det = SlowLayers()
    assert det.on_report(view(table({0: 0.0004, 1: 0.0004, 2: 0.0019}))) == []  # 3x, but 1.5 ms
    # MoE blocks cost more than dense ones by design: each kind is compared with its own.
    kinds = {0: "dense", 1: "moe", 2: "dense", 3: "moe", 4: "dense", 5: "moe"}
    times = {0: 0.01, 1: 0.03, 2: 0.011, 3: 0.031, 4: 0.0105, 5: 0.029}
    assert det.on_report(view(table(times, kinds))) == []


def test_the_finding_says_why_a_hot_expert_and_a_heavy_stage():
    record = {"moe_hot_experts": ["L3/E2"], "moe_expert_tokens": {"3": [10, 10, 100, 8], "1": [30, 30, 30, 38]}}
    times = {0: 0.010, 1: 0.011, 2: 0.012, 3: 0.030, 4: 0.010, 5: 0.011, 6: 0.012, 7: 0.011}
    (found,) = SlowLayers().on_report(view(table(times, stages=[[0, 1, 2, 3, 4], [5, 6, 7]]), record))
    assert found.extra["hot_experts"] == [2] and found.extra["expert_load"] == pytest.approx(100 / 32)
    assert found.text.endswith("; MoE: expert 2 takes 3.1x the layer's mean load; stage 0 holds 5 of 8 layers")
    assert found.stage == 0 and found.extra["stage_layers"] == [5, 3]


def test_the_drill_spec_and_the_detector_switch():
    (fault,) = drills.parse("slowlayer:layer=3:factor=2.5:step=4")
    assert (fault.kind, fault.layer, fault.factor, fault.step) == ("slowlayer", 3, 2.5, 4)
    for bad, why in (("slowlayer:layer=3", "needs factor"), ("slowlayer:layer=x:factor=2", "not a number")):
        with pytest.raises(ConfigError, match=why):
            drills.parse(bad, "train.faults")
    assert detector(build_config(None, [("log.trace_steps", "5")]), None) is not None
    assert detector(build_config(None, [("log.trace_steps", "")]), None) is None
    assert detector(build_config(None, [("log.trace_steps", "5"), ("log.layer_times", "false")]), None) is None


def hooks(block) -> list:
    return [*block._forward_pre_hooks, *block._forward_hooks, *block._backward_pre_hooks, *block._backward_hooks]


def test_the_clock_hooks_blocks_on_traced_steps_only():
    from threefold.distributed.grid import Grid
    from threefold.model.transformer import Transformer

    cfg = build_config(None, [("model.preset", "tiny"), ("model.layers", "2"), ("log.trace_steps", "2")])
    torch.manual_seed(0)
    model = Transformer(cfg.model).to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    clock = LayerClock([model], cfg, Grid.alone(), "cpu", is_logger=True)
    tokens = torch.randint(0, cfg.model.vocab, (1, 16))

    def step(n: int):
        clock.begin_step(n)
        hooked = [len(hooks(b)) for b in model.layers.values()]
        model(tokens, tokens).backward()
        return hooked, clock.end_step(n)

    hooked, (fields, layers) = step(0)  # metrics step 1: not traced
    assert hooked == [0, 0] and (fields, layers) == ({}, None)
    hooked, (fields, layers) = step(1)
    assert hooked == [4, 4] and sorted(fields["layer_time_s"]) == ["0", "1"]
    assert all(
        row["forward_s"] > 0 and row["backward_s"] > 0 and row["calls"] == 1 for row in layers["layers"].values()
    )
    assert not [h for b in model.layers.values() for h in hooks(b)]  # removed again


# --- runs ------------------------------------------------------------------------------------

RUN = [
    "--model.preset", "tiny", "--train.global_batch", "4", "--train.micro_batch", "1",
    "--log.interval", "5", "--log.quiet", "true", "--log.spans", "true",
]  # fmt: skip
PIPELINE = ["--parallel.pp", "2", "--parallel.microbatches", "4", "--train.steps", "10", "--log.trace_steps", "5,10"]


def train(tmp_path, cache_dir: str, name: str, *extra: str):
    log = tmp_path / name
    cmd = [
        sys.executable,
        "-m",
        "threefold",
        "train",
        *RUN,
        *extra,
        "--log.dir",
        str(log),
        "--data.cache_dir",
        cache_dir,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    console = out.stdout + out.stderr
    assert out.returncode == 0, console[-3000:]
    metrics = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    return console, metrics


def named(metrics: list[dict], step: int) -> list[dict]:
    (line,) = [m for m in metrics if m["step"] == step]
    return [f for f in line.get("findings", []) if f["kind"] == "slow_layer"]


def test_a_slow_layer_is_named_on_the_next_traced_step(tmp_path, cache_dir):
    # Layer 2 (stage 1 of pp 2) runs 3x slower from step index 6: step 5 is traced clean, step 10
    # names it, with every layer's time in its metrics line.
    console, metrics = train(
        tmp_path, cache_dir, "slow", *PIPELINE, "--train.faults", "slowlayer:layer=2:factor=3:step=6"
    )
    assert named(metrics, 5) == [], console[-3000:]
    (found,) = named(metrics, 10)
    assert (found["key"], found["layer"], found["stage"], found["ranks"]) == ("layer 2", 2, 1, [1]), found
    assert found["value"] > 2 * found["baseline"], found
    assert "threefold: slow layer: layer 2 takes" in console and "median of 3 layers, on step 10" in console
    times = {m["step"]: m.get("layer_time_s") for m in metrics if m.get("layer_time_s")}
    assert sorted(times) == [5, 10] and sorted(times[10]) == ["0", "1", "2", "3"], times


def test_a_clean_run_names_no_layer(tmp_path, cache_dir):
    console, metrics = train(tmp_path, cache_dir, "clean", *PIPELINE)
    assert "slow layer" not in console, console[-3000:]
    assert [m["step"] for m in metrics if m.get("layer_time_s")] == [5, 10]
    assert not [f for m in metrics for f in m.get("findings", []) if f["kind"] == "slow_layer"]


def test_an_moe_layer_with_a_hot_expert_is_named_with_the_expert(tmp_path, cache_dir):
    # dp 4 x ep 4, one expert per rank, top-1: hotexpert makes layer 3's router pick expert 2
    # first for every token, so the rank holding it computes every rank's tokens of that layer
    # (4x its balanced share) and the all-to-all holds its peers to it. Nothing is slowed: the
    # layer is named from its time, the expert from the expert-load table. Micro-batches of
    # 4 x 128 tokens and ffn 1408, so that the experts' matmuls, not the per-layer host work, are
    # most of a layer's time on this CPU. A layer whose router is merely uneven at initialisation
    # may be named too: then with its busiest expert as the reason.
    console, metrics = train(
        tmp_path,
        cache_dir,
        "moe",
        *("--model.num_experts", "4", "--model.top_k", "1", "--model.ffn_hidden", "1408"),
        *("--parallel.dp", "4", "--parallel.ep", "4", "--train.global_batch", "16", "--train.micro_batch", "4"),
        *("--train.steps", "10", "--log.trace_steps", "5,10", "--train.faults", "hotexpert:layer=3:expert=2"),
    )
    # Two traced steps: each is one sample of every layer's time, and with four ranks on two cores
    # another job's burst can hide a 4x expert in one of them (CI: 1 run in about 8; here, with
    # a core kept busy in bursts, 2 of 12). The layer must be named on one of them, with its expert.
    traced = [{f["key"]: f for f in named(metrics, step)} for step in (5, 10)]
    found = next((one for one in traced if "layer 3" in one), {})
    assert "layer 3" in found, console[-3000:]
    hot = found.pop("layer 3")
    assert hot["extra"]["hot_experts"] == [2] and hot["extra"]["expert_load"] > 3, hot
    assert hot["extra"]["kind"] == "moe" and "MoE: expert 2 takes 4.0x" in hot["text"], hot
    # Another layer named is one whose router is uneven of its own: named with its busiest expert,
    # a lighter load than the forced one. Its time is not compared with layer 3's: CI once read an
    # uneven layer (load 1.6x) slower than the hot one (4.0x) on the shared 2-core host.
    for other in found.values():
        assert other["extra"].get("hot_experts") and other["extra"]["expert_load"] < hot["extra"]["expert_load"], other
