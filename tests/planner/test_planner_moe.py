"""The planner on mixture-of-experts models: expert memory over ep, the all-to-all's volume,
expert parallelism chosen when memory requires it, and its rejections."""

from __future__ import annotations

import json

import pytest
from planner_helpers import GiB, cpu_cluster, model
from planner_helpers import plan_cli as _cli

from threefold.config import build_config
from threefold.errors import ConfigError
from threefold.planner import Layout, build_cluster, device_memory, model_shape, search, step_terms, structural_reason

OLMOE = [("model.preset", "olmoe-1b-7b")]  # h 2048, 16 layers, 16 heads, ffn 1024, V 50304, 64 experts top-8


def _olmoe_counts():
    """OLMoE's parameters by hand: (dense per layer, experts per layer, embedding, head + final norm)."""
    h, f, E, V = 2048, 1024, 64, 50304
    dense = 4 * h * h + 2 * h + h * E  # q k v o, two RMSNorms, router
    return dense, E * 3 * h * f, V * h, V * h + h


def test_moe_memory_per_device_is_the_hand_formula():
    shape = model_shape(model(OLMOE))
    assert shape.is_moe and shape.moe_fraction == 1 and shape.top_k == 8
    dense, experts, embed, head = _olmoe_counts()
    assert shape.expert_layer_params == experts and shape.dense_layer_params == dense
    t, dp, ep, L = 2, 4, 2, 16
    lay = Layout(tp=t, dp=dp, ep=ep, mbs=1, zero=1)
    mem = device_memory(shape, lay, global_batch=64)
    dense_numel = (L * dense + embed + head) / t  # the dense part over tp, ZeRO-1 over dp
    expert_numel = L * experts / ep  # whole on each TP rank, ZeRO-1 over expert_dp = t * dp / ep = 4
    # bf16 parameters (2) and fp32 gradients (4, train.grad_reduce_dtype auto) stay whole under ZeRO-1.
    expect_dense = 6 * dense_numel + 12 * dense_numel / dp
    expect_experts = 6 * expert_numel + 12 * expert_numel / (t * dp // ep)
    assert mem.expert_state == pytest.approx(expect_experts)
    assert mem.params + mem.grads + mem.optimizer == pytest.approx(expect_dense + expect_experts)
    # Activations: Korthikanti's TP layer with the MLP share (3sbh + 16sbh/t) swapped for the routed
    # path of the sb/t tokens each TP rank routes: router input 4h, per assignment 2h + 4 x 2f + 2h.
    s, b, h, a, f, k, V = 4096, 1, 2048, 16, 1024, 8, 50304
    sbh = s * b * h
    layer = sbh * (10 + 24 / t + 5 * a * s / (h * t)) - (3 + 16 / t) * sbh + s * b / t * (4 * h + k * (4 * h + 8 * f))
    assert mem.activations == pytest.approx(L * layer + 4 * sbh + 2 * s * b * V / t)  # bf16 logits


def test_expert_parallelism_divides_expert_memory_by_ep():
    shape = model_shape(model(OLMOE))
    by_ep = {ep: device_memory(shape, Layout(tp=1, dp=8, ep=ep, mbs=1, zero=0), global_batch=64) for ep in (1, 2, 8)}
    for ep, mem in by_ep.items():
        assert mem.expert_state == pytest.approx(by_ep[1].expert_state / ep)
        dense_state = mem.params + mem.grads + mem.optimizer - mem.expert_state
        assert dense_state == pytest.approx(
            by_ep[1].params + by_ep[1].grads + by_ep[1].optimizer - by_ep[1].expert_state
        )
        assert mem.activations == by_ep[1].activations
    # Under ZeRO-1 the experts' optimizer state is already spread over tp * dp ranks in total:
    # ep only shrinks their parameters and gradients.
    z1 = {ep: device_memory(shape, Layout(tp=1, dp=8, ep=ep, mbs=1, zero=1), global_batch=64) for ep in (1, 8)}
    experts = 16 * _olmoe_counts()[1]
    assert z1[1].expert_state == pytest.approx(experts * (6 + 12 / 8))
    assert z1[8].expert_state == pytest.approx(experts / 8 * (6 + 12))


def test_moe_step_terms_carry_the_all_to_all_volume():
    shape = model_shape(model(OLMOE))
    s, h, k, L, B = 4096, 2048, 8, 16, 64
    node = build_cluster({"device": "h100", "nodes": 1, "overlap": "none"})  # volumes, every transfer exposed
    lay = Layout(tp=2, dp=4, ep=2, mbs=1, zero=0)
    m = B // 4
    terms = step_terms(shape, node, lay, B)
    volume = s / 2 * k * h * 2  # tokens per TP rank x top_k x hidden x 2 bytes
    a2a = terms.categories["ep_comm"]
    assert terms.links["ep"] == "intra"
    assert a2a["intra_bw_gbps"] == pytest.approx(L * m * 4 * volume * (2 - 1) / 2)  # 4 all-to-alls, half sent
    assert a2a["intra_latency_us"] == pytest.approx(L * m * 5 * 1)  # + the counts, 1 peer each
    # Full recompute repeats the forward's dispatch and combine.
    full = step_terms(shape, node, Layout(tp=2, dp=4, ep=2, mbs=1, recompute="full"), B)
    assert full.categories["ep_comm"]["intra_bw_gbps"] == pytest.approx(a2a["intra_bw_gbps"] * 6 / 4)
    # TP without SP: attention's 2 all-reduces and the routed path's 2 all-gathers per block, + 2.
    x, ring = s * h * 2, 1 / 2
    assert terms.categories["tp_comm"]["intra_bw_gbps"] == pytest.approx(
        m * (L * (2 * 2 * ring * x + 2 * ring * x) + 2 * 2 * ring * x)
    )
    # Gradients (fp32, the default reduction): dense over dp=4, the experts (E/ep per rank) over
    # expert_dp = 2 * 4 / 2 = 4.
    dense, experts, embed, head = _olmoe_counts()
    dense_numel, expert_numel = (L * dense + embed + head) / 2, L * experts / 2
    assert terms.categories["dp_comm"]["intra_bw_gbps"] == pytest.approx(
        2 * 3 / 4 * dense_numel * 4 + 2 * 3 / 4 * expert_numel * 4
    )
    # ep = 1: no all-to-all. Across nodes (tp 4 x ep 4 > 8 per node): the share bound for the
    # other node, (ep - 2 local) / ep, over the inter-node link.
    assert not step_terms(shape, node, Layout(tp=2, dp=4, ep=1, mbs=1), B).categories["ep_comm"]
    two = build_cluster({"device": "h100", "nodes": 2})
    wide = step_terms(shape, two, Layout(tp=4, dp=4, ep=4, mbs=1), B)
    assert wide.links["ep"] == "inter"
    assert wide.categories["ep_comm"]["inter_bw_gbps"] == pytest.approx(L * m * 4 * (s / 4 * k * h * 2) * 2 / 4)
    assert "intra_bw_gbps" not in wide.categories["ep_comm"]


def test_collective_calls_are_counted_once_per_call():
    # Small collectives pay a fixed launch/rendezvous cost per call, whatever the ring length.
    shape = model_shape(build_config(None, [("model.preset", "small")]).model)
    L, B = shape.layers, 16
    node = cpu_cluster()
    for tp in (2, 4):
        lay = Layout(tp=tp, dp=1, mbs=2)
        terms = step_terms(shape, node, lay, B, "fp32").categories
        m = lay.microbatches(B)
        assert terms["tp_comm"]["collective_overhead_us"] == pytest.approx(m * (4 * L + 2))
        assert terms["tp_comm"]["intra_latency_us"] == pytest.approx(m * (4 * L + 2) * 2 * (tp - 1))
    dp = step_terms(shape, node, Layout(dp=4, mbs=2), B, "fp32").categories
    assert dp["dp_comm"]["collective_overhead_us"] == 1  # one all-reduce (its buckets overlap)
    z3 = step_terms(shape, node, Layout(dp=4, mbs=2, zero=3), B, "fp32").categories
    assert z3["dp_comm"]["collective_overhead_us"] == 1 + 2 * 2  # + a gather per micro-batch, forward and backward
    pp = step_terms(shape, node, Layout(pp=2, dp=1, mbs=2), B, "fp32").categories
    assert "collective_overhead_us" not in pp["pp_comm"]  # posted sends and receives: no rendezvous


def test_processes_sharing_cores_get_a_share_to_the_exponent():
    c = cpu_cluster(devices_per_node=8, host_cores=2, core_share_exponent=1.3)
    assert c.core_share == pytest.approx(0.25**1.3) and c.peak_flops == pytest.approx(0.05e12 * 0.25**1.3)
    assert cpu_cluster(devices_per_node=2, host_cores=2).core_share == 1.0
    assert build_cluster({"device": "cpu", "peak_tflops": 0.05}).core_share_exponent == 1.3  # the profile's
    with pytest.raises(ConfigError, match="core_share_exponent"):
        cpu_cluster(core_share_exponent=-1)


def test_olmoe_on_two_h100_nodes_keeps_experts_unsharded():
    """docs/planner.md: with room for the experts, ep only adds all-to-alls, so the best is ep = 1."""
    plan = search(model_shape(model(OLMOE)), build_cluster({"device": "h100", "nodes": 2}), 512)
    best = plan.best.layout.spec()
    assert best == "tp=1,pp=2,dp=8,vpp=1,mbs=4,schedule=zb,zero=2,sp=false,recompute=none,ep=1"
    assert plan.best.mfu == pytest.approx(0.396, abs=0.005)  # small expert GEMMs below peak


def test_search_uses_expert_parallelism_when_memory_requires_it():
    shape = model_shape(model(OLMOE))
    cl = build_cluster({"device": "a100-40gb", "nodes": 1})
    plan = search(shape, cl, 64, pins={"tp": 1, "pp": 1, "zero": 1})
    assert plan.ranked and all(p.layout.ep > 1 and p.fits for p in plan.ranked)
    assert {p.layout.ep for p in plan.ranked} <= {2, 4, 8}
    assert any(p.times["ep_comm"] > 0 for p in plan.ranked)
    assert plan.rejected["memory"].count > 0
    # The experts of ep=1 alone (6.6B x 5.5 bytes under ZeRO-1 over 8) leave no room on 37 GiB.
    one = device_memory(shape, Layout(dp=8, mbs=1, zero=1, recompute="full"), 64)
    assert one.total > cl.usable_bytes and one.expert_state > 30 * GiB


def test_expert_parallel_reasons():
    dense = model([("model.preset", "llama-7b")])
    moe = model(OLMOE)
    world = 8
    assert structural_reason(dense, Layout(dp=8, ep=2), 64, 8, False, world) == (
        "ep",
        "ep=2: the model has no experts to place, so expert parallelism must be 1.",
    )
    kind, why = structural_reason(moe, Layout(dp=6, ep=3), 48, 8, False, world)
    assert kind == "ep" and why == (
        "ep=3 cannot split the model's 64 experts evenly: each expert-parallel rank holds an equal share."
    )
    kind, why = structural_reason(moe, Layout(dp=2, ep=4), 64, 8, False, world)
    assert why == "ep=4 does not divide dp=2: expert-parallel ranks are carved out of the data-parallel ones."
    assert structural_reason(moe, Layout(dp=8, ep=8), 64, 8, False, world) is None
    # A dense model still refuses a pinned ep and plans ep=1.
    cl = build_cluster({"device": "h100", "nodes": 1})
    plan = search(model_shape(dense), cl, 64, pins={"ep": 2, "tp": 4, "zero": 1, "recompute": "selective"})
    assert plan.ranked and all(p.layout.ep == 1 for p in plan.ranked)
    assert plan.rejected["ep"].best() == [
        ("ep=2", "ep=2: the model has no experts to place, so expert parallelism must be 1.")
    ]


def test_moe_emit_config_writes_ep(capsys, tmp_path):
    path = tmp_path / "moe.toml"
    code, out, err = _cli(
        capsys,
        "--model.preset",
        "olmoe-1b-7b",
        "--cluster.device",
        "a100-40gb",
        "--train.global_batch",
        "64",
        "--parallel.tp",
        "1",
        "--parallel.pp",
        "1",
        "--parallel.zero",
        "1",
        "--json",
        "--emit-config",
        str(path),
    )
    assert code == 0, err
    doc = json.loads(out)
    best = doc["layouts"][0]
    assert best["ep"] > 1 and best["time_split_s"]["ep_comm"] > 0 and doc["model"]["num_experts"] == 64
    assert "ep_comm" in best["time_split_s"] and best["memory"]["expert_state"] > 0
    cfg = build_config(str(path), [])
    assert cfg.parallel.ep == best["ep"] and (cfg.model.num_experts, cfg.model.top_k) == (64, 8)
    assert "ep = " in path.read_text() and "num_experts = 64" in path.read_text()
    # A layout breaking an ep rule is one line.
    code, _, err = _cli(capsys, "--model.preset", "olmoe-1b-7b", "--train.global_batch", "64", "--layout", "dp=8,ep=3")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "64 experts" in err
