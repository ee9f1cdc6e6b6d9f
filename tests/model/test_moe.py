"""Mixture of experts and expert parallelism: routing rules, balance, FLOPs, parity over ep."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from threefold.config import build_config
from threefold.errors import ConfigError
from threefold.model.flops import active_params, total_params, train_flops_per_token
from threefold.model.moe import MoE, route
from threefold.model.transformer import Transformer
from threefold.observe.trace import check_trace
from threefold.validate import validate

from harness import CALM_LR, assert_parity, run_training, run_training_many


def moe_cfg(**over):
    pairs = [("model.num_experts", "4"), ("model.top_k", "2")] + [
        (k.replace("__", "."), str(v)) for k, v in over.items()
    ]
    return validate(build_config(None, pairs))


# --- routing rules, without processes --------------------------------------------------------


def brute_force_keep(expert: torch.Tensor, capacity: int) -> torch.Tensor:
    """GShard's queue: all first choices (in token order), then all second choices, ..."""
    tokens, k = expert.shape
    taken: dict[int, int] = {}
    keep = torch.zeros(tokens, k, dtype=torch.bool)
    for j in range(k):
        for t in range(tokens):
            e = int(expert[t, j])
            if taken.get(e, 0) < capacity:
                keep[t, j] = True
                taken[e] = taken.get(e, 0) + 1
    return keep


@pytest.mark.parametrize("factor, top_k", [(1.0, 1), (1.0, 2), (0.5, 2), (1.5, 3)])
def test_capacity_drops_exactly_what_the_rule_says(factor, top_k):
    gen = torch.Generator().manual_seed(top_k)
    logits = torch.randn(64, 8, generator=gen)
    logits[:, 0] += 2.0  # a hot expert, so the rule has something to drop
    r = route(logits, top_k, factor, total_tokens=64)
    capacity = math.ceil(factor * 64 * top_k / 8)
    expected = brute_force_keep(r.expert, capacity)
    assert torch.equal(r.keep, expected)
    assert (~r.keep).sum() > 0  # the test exercised dropping
    assert torch.bincount(r.expert[r.keep], minlength=8).max() <= capacity


def test_dropless_keeps_every_assignment_and_counts_routes():
    logits = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    r = route(logits, 2, 0.0, total_tokens=32)
    assert bool(r.keep.all())
    assert torch.equal(r.counts, torch.bincount(r.expert.flatten(), minlength=4))
    assert r.counts.sum() == 64


def test_balance_losses_match_their_formulas():
    logits = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    r = route(logits, 1, 0.0, total_tokens=16)
    probs = logits.softmax(-1)
    f = torch.bincount(probs.argmax(-1), minlength=4).float() / 16
    assert torch.allclose(r.aux, 4 * (f * probs.mean(0)).sum())
    assert torch.allclose(r.z, torch.logsumexp(logits, -1).pow(2).mean())
    uniform = route(torch.zeros(16, 4), 1, 0.0, total_tokens=16)
    assert uniform.aux.item() == pytest.approx(1.0)  # E * sum(f * 1/E) with sum(f) = 1


def test_experts_as_one_batched_matmul_equal_per_token_mlps():
    cfg = moe_cfg(model__hidden=32, model__heads=4, model__kv_heads=4, model__ffn_hidden=48).model
    layer = MoE(cfg)
    gen = torch.Generator().manual_seed(2)
    for p in layer.parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.2
    x = torch.randn(5, 3, 32, generator=gen)
    out = layer(x)
    flat = x.reshape(-1, 32)
    probs = (flat @ layer.router.weight.t()).softmax(-1)
    top_p, top_e = probs.topk(2, dim=-1)
    top_p = top_p / top_p.sum(-1, keepdim=True)
    ffn = cfg.ffn_hidden
    expected = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(2):
            e = int(top_e[t, j])
            w1 = layer.experts.w1.weight[e * ffn : (e + 1) * ffn]
            w3 = layer.experts.w3.weight[e * ffn : (e + 1) * ffn]
            w2 = layer.experts.w2.weight[e * 32 : (e + 1) * 32]
            h = F.silu(flat[t] @ w1.t()) * (flat[t] @ w3.t())
            expected[t] += top_p[t, j] * (h @ w2.t())
    assert torch.allclose(out.reshape(-1, 32), expected, atol=1e-5)


def load_ratio(layer: MoE, x: torch.Tensor) -> float:
    with torch.no_grad():
        layer(x)
    counts = layer.pop_stats()[: layer.num_experts]
    return float(counts.max() / counts.mean())


@pytest.mark.parametrize("coeff", [1.0, 0.0])
def test_aux_loss_drives_a_skewed_router_toward_balance(coeff):
    cfg = moe_cfg(
        model__hidden=32,
        model__heads=4,
        model__kv_heads=4,
        model__ffn_hidden=32,
        model__top_k=1,
        model__aux_loss_coeff=coeff,
        model__z_loss_coeff=0,
    ).model
    layer = MoE(cfg)
    gen = torch.Generator().manual_seed(3)
    for p in layer.parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.1
    direction = torch.ones(32) / 32**0.5
    x = torch.randn(32, 4, 32, generator=gen) + 2 * direction
    with torch.no_grad():  # skew: every token shares a direction that expert 0's router row favours
        layer.router.weight[0] = 2 * direction
    before = load_ratio(layer, x)
    opt = torch.optim.Adam(layer.router.parameters(), lr=0.02)
    for _ in range(60):
        opt.zero_grad()
        (layer(x) * 0).sum().backward()  # the only gradient is the injected balance loss
        opt.step()
    after = load_ratio(layer, x)
    assert before > 3.0  # of at most 4: nearly every token picks expert 0
    if coeff:
        assert after < 1.2, (before, after)
    else:
        assert after == pytest.approx(before)  # the control: without the loss nothing moves


# --- counting ---------------------------------------------------------------------------------


@pytest.mark.parametrize("arch, shared", [("llama", False), ("llama", True), ("gpt2", True)])
def test_parameter_counts_match_the_model_and_flops_count_active_ones(arch, shared):
    over = dict(model__arch=arch, model__shared_expert=shared, model__moe_every=2, model__num_experts=8)
    if arch == "gpt2":
        over.update(model__kv_heads=4)
    cfg = moe_cfg(**over).model
    model = Transformer(cfg)
    assert total_params(cfg) == sum(p.numel() for p in model.parameters())
    per_expert = 3 * cfg.hidden * cfg.ffn_hidden if arch == "llama" else 2 * cfg.hidden * cfg.ffn_hidden
    moe_blocks = cfg.layers // 2
    assert active_params(cfg) == total_params(cfg) - moe_blocks * (8 - cfg.top_k) * per_expert
    dense = build_config(None, [("model.arch", arch)] + ([("model.kv_heads", "4")] if arch == "gpt2" else [])).model
    router = moe_blocks * cfg.hidden * 8
    extra = moe_blocks * ((cfg.top_k - 1 + shared) * per_expert) + router
    s = cfg.seq_len
    assert train_flops_per_token(cfg, s) == pytest.approx(train_flops_per_token(dense, s) + 6 * extra)


# --- settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pairs, key, fragment",
    [
        ([("model.top_k", "5")], "model.top_k", "more than model.num_experts"),
        ([("parallel.dp", "4"), ("parallel.ep", "3")], "parallel.ep", "does not divide dp"),
        (
            [("model.num_experts", "6"), ("parallel.dp", "4"), ("parallel.ep", "4")],
            "parallel.ep",
            "not divisible by ep",
        ),
    ],
)
def test_invalid_moe_settings_name_the_key(pairs, key, fragment):
    with pytest.raises(ConfigError) as info:
        validate(build_config(None, [("model.num_experts", "4")] + pairs))
    assert info.value.key == key and fragment in str(info.value) and "\n" not in str(info.value)


def test_cli_refuses_ep_without_experts_in_one_line():
    out = subprocess.run(
        [sys.executable, "-m", "threefold", "train", "--parallel.dp", "2", "--parallel.ep", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "parallel.ep" in lines[0] and "num_experts" in lines[0]


# --- training, in the loop --------------------------------------------------------------------

STEPS = 12  # the parity standard of the issues (>= 12 calm steps)
INTERVAL = 6  # log.interval and checkpoint.interval
MODEL = {
    "model.num_experts": 4,
    "model.top_k": 2,
    "model.seq_len": 32,
    "model.hidden": 64,
    "model.ffn_hidden": 96,
    "train.global_batch": 8,
    "train.micro_batch": 1,
    "train.steps": STEPS,
    "train.seed": 0,
    "train.lr": CALM_LR,
    "log.interval": INTERVAL,
}


@pytest.fixture(scope="module")
def ep1_run(tmp_path_factory, cache_dir):
    return run_training(MODEL, tmp_path_factory.mktemp("ep1"), cache_dir)


@pytest.fixture(scope="module")
def capacity_run(tmp_path_factory, cache_dir):
    return run_training({**MODEL, "model.capacity_factor": 1.0}, tmp_path_factory.mktemp("cap"), cache_dir)


def test_single_process_moe_reports_expert_load(ep1_run, capacity_run):
    last = ep1_run[-1]
    assert last["loss"] < ep1_run[0]["loss"]
    tokens = MODEL["train.global_batch"] * MODEL["model.seq_len"] * MODEL["model.top_k"]
    assert set(last["moe_expert_tokens"]) == {"0", "1", "2", "3"}
    # Counts of the steps since the last report step (log.interval 6: steps 7-12).
    assert last["moe_steps"] == INTERVAL
    assert all(sum(c) == tokens * INTERVAL for c in last["moe_expert_tokens"].values())
    assert all("moe_expert_tokens" not in r for r in ep1_run[: INTERVAL - 1])  # no per-step gather
    assert last["moe_dropped_tokens"] == 0 and 0.5 < last["moe_aux_loss"] < 2
    assert any(r.get("moe_dropped_tokens", 0) > 0 for r in capacity_run)


def test_a_traced_step_of_an_expert_parallel_run_replays_its_gradient_collectives(tmp_path, cache_dir):
    """log.trace_steps on an MoE run (dp 2 x ep 2): the step's gradient collectives (the dense
    engine's over dp, the experts' over expert_dp) are replayed alone (dp_comm_serial_s), and
    both ranks' spans reach trace.json."""
    over = {**MODEL, "parallel.dp": 2, "parallel.ep": 2, "train.steps": 3, "log.trace_steps": "2"}
    run = run_training(over, tmp_path, cache_dir)
    assert [r["step"] for r in run] == [1, 2, 3]
    assert run[1]["dp_comm_serial_s"] > 0
    assert all("dp_comm_serial_s" not in run[i] for i in (0, 2))  # measured on traced steps only
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert check_trace(trace) == []
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("ep")
    runs = {
        "dp4_ep4": {"parallel.dp": 4, "parallel.ep": 4},
        "tp2_dp2_ep2": {
            "parallel.tp": 2,
            "parallel.dp": 2,
            "parallel.ep": 2,
            "checkpoint.dir": root / "ckpt",
            "checkpoint.interval": INTERVAL,
        },
        "pp2_dp2_ep2_recompute": {"parallel.pp": 2, "parallel.dp": 2, "parallel.ep": 2, "train.recompute": "full"},
        "dp4_ep2_zero2": {"parallel.dp": 4, "parallel.ep": 2, "parallel.zero": 2},
        "dp4_ep4_zero3": {"parallel.dp": 4, "parallel.ep": 4, "parallel.zero": 3},
        "cap_tp2_sp_dp2_ep2": {
            "parallel.tp": 2,
            "parallel.sp": True,
            "parallel.dp": 2,
            "parallel.ep": 2,
            "model.capacity_factor": 1.0,
        },
    }
    out = run_training_many({k: {**MODEL, **v} for k, v in runs.items()}, root, cache_dir, world=4, timeout=900)
    return out, root / "ckpt"


@pytest.mark.parametrize("name", ["dp4_ep4", "tp2_dp2_ep2", "pp2_dp2_ep2_recompute", "dp4_ep2_zero2", "dp4_ep4_zero3"])
def test_expert_parallel_matches_single_process(name, ep_runs, ep1_run):
    run = ep_runs[0][name]
    assert_parity(f"moe {name} vs one process loss", run, ep1_run)
    assert run[-1]["moe_expert_tokens"] == ep1_run[-1]["moe_expert_tokens"]


def test_capacity_dropping_is_layout_invariant(ep_runs, capacity_run):
    run = ep_runs[0]["cap_tp2_sp_dp2_ep2"]
    assert_parity("moe capacity tp2 sp dp2 ep2 vs one process loss", run, capacity_run)
    assert [r.get("moe_dropped_tokens") for r in run] == [r.get("moe_dropped_tokens") for r in capacity_run]


def test_expert_checkpoint_loads_into_other_expert_layouts(ep_runs, ep1_run, tmp_path, cache_dir):
    """Saved at step 6 by tp2 x dp2 x ep2; resumed by dp4 x ep4 with ZeRO 1, and by one process."""
    saved = ep_runs[1] / f"step_{INTERVAL:08d}"
    resumed = run_training_many(
        {"ep4": {**MODEL, "parallel.dp": 4, "parallel.ep": 4, "parallel.zero": 1, "checkpoint.resume": saved}},
        tmp_path,
        cache_dir,
        world=4,
    )["ep4"]
    single = run_training({**MODEL, "checkpoint.resume": saved}, tmp_path / "single", cache_dir)
    for run in (resumed, single):
        assert [r["step"] for r in run] == list(range(INTERVAL + 1, STEPS + 1))
        assert_parity("moe checkpoint into another expert layout, loss", run, ep1_run[INTERVAL:])
