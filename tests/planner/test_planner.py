"""The planner against the published formulas, its search, and fault advice (its CLI:
test_planner_cli.py; calibration: test_calibration.py)."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
from planner_helpers import model

from threefold.errors import ConfigError
from threefold.model.flops import megatron_flops_per_iteration
from threefold.planner import (
    Layout,
    advise,
    bubble_ratio,
    build_cluster,
    daly_interval,
    device_memory,
    goodput,
    inflight,
    layer_activation_bytes,
    model_shape,
    model_state_bytes,
    predict,
    search,
    split_layers,
    step_terms,
    young_interval,
)
from threefold.planner.faults import Faults

ONE_T = [
    ("model.preset", "gpt-175b"),
    ("model.hidden", "25600"),
    ("model.layers", "128"),
    ("model.heads", "160"),
    ("model.kv_heads", "160"),
    ("model.ffn_hidden", "102400"),
]  # Narayanan et al. 2021's 1T GPT


# ----------------------------------------------------------------------------- memory


@pytest.mark.parametrize("n", [1, 4, 64])
def test_zero_memory_per_stage_matches_the_zero_paper(n):
    p = 1_000_000
    # Gradients accumulate and reduce in fp32 (train.grad_reduce_dtype auto): 4 bytes, not 2.
    expect = {0: 2 * p + 4 * p + 12 * p, 1: 2 * p + 4 * p + 12 * p / n, 2: 2 * p + 16 * p / n, 3: 18 * p / n}
    for zero, total in expect.items():
        got = model_state_bytes(p, n, zero, "bf16")
        assert sum(got.values()) == pytest.approx(total), zero
    assert sum(model_state_bytes(p, n, 0, "fp32").values()) == pytest.approx(16 * p)  # 4P + 4P + 8P
    assert model_state_bytes(p, n, 2, "bf16")["params"] == pytest.approx(2 * p)
    assert model_state_bytes(p, n, 0, "bf16")["grads"] == pytest.approx(4 * p)


def test_korthikanti_activation_table_for_gpt3_175b():
    # Korthikanti et al. 2022, Table 2, at s=2048, b=1, h=12288, a=96, t=8: 5as/h = 80.
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    table = {
        (1, False, "none"): 114 * sbh,  # sbh(34 + 5as/h)
        (t, False, "none"): 23 * sbh,  # sbh(10 + 24/t + 5as/(ht))
        (t, True, "none"): 114 / 8 * sbh,  # sbh/t (34 + 5as/h)
        (t, False, "selective"): 13 * sbh,  # sbh(10 + 24/t)
        (t, True, "selective"): 34 / 8 * sbh,  # 34 sbh/t
        (t, True, "full"): 2 * sbh,  # 2sbh
    }
    for (tp, sp, rc), want in table.items():
        assert layer_activation_bytes(s, b, h, a, tp, sp, rc) == pytest.approx(want), (tp, sp, rc)
    assert layer_activation_bytes(s, b, h, a, t, True, "none", "fp32") == pytest.approx(2 * 114 / 8 * sbh)


def test_inflight_microbatches_per_schedule():
    p, m, v = 8, 32, 4
    assert inflight("1f1b", p, m) == (p, 1)
    assert inflight("zb", p, m) == (p, 1)
    assert inflight("gpipe", p, m) == (m, m)
    first, _ = inflight("interleaved", p, m, v)
    assert first == pytest.approx(p * (1 + (p - 1) / (p * v)))  # Korthikanti sec. 4.2.3
    assert inflight("1f1b", 1, m) == (1, 1)


def test_device_memory_is_state_plus_layers_times_inflight():
    cfg = model([("model.preset", "gpt-175b")])
    shape = model_shape(cfg)
    lay = Layout(tp=8, pp=8, dp=4, mbs=1, schedule="1f1b", zero=1, sp=True, recompute="selective")
    mem = device_memory(shape, lay, global_batch=256)
    per_layer = layer_activation_bytes(2048, 1, 12288, 96, 8, True, "selective")
    assert mem.rank == "first" and mem.inflight == 8
    assert mem.activations == pytest.approx(12 * per_layer * 8)  # 96/8 layers, p micro-batches
    numel = (12 * shape.layer_params + shape.embed_params) / 8
    assert mem.params + mem.grads + mem.optimizer == pytest.approx(6 * numel + 12 * numel / 4)  # fp32 grads


def test_a_fused_attention_kernel_keeps_no_scores():
    """Korthikanti's 5as/h term is the s x s probabilities, mask and dropout an unfused kernel keeps
    for backward; a fused one (threefold's SDPA) keeps none of them: without recompute its layer
    keeps what the paper's selective recompute keeps. Only the unfused square kernel counts them."""
    shape = model_shape(model([("model.preset", "gpt-175b")]))
    lay = Layout(tp=8, pp=8, dp=4, mbs=1, schedule="1f1b", zero=1, sp=True)
    fused = device_memory(shape, lay, 256, scores=False)
    unfused = device_memory(shape, lay, 256, scores=True)
    selective = device_memory(shape, Layout(**{**lay.as_dict(), "recompute": "selective"}), 256, scores=True)
    assert fused.activations == pytest.approx(selective.activations)
    s, a, t, layers, held = 2048, 96, 8, 12, 8
    assert unfused.activations - fused.activations == pytest.approx(layers * held * 5 * a * s * s / t)
    square = build_cluster({"device": "a100-80gb", "attention_efficiency": 0, "attention_scores": "square"})
    assert square.keeps_attention_scores and not build_cluster({"device": "h100"}).keeps_attention_scores
    assert not build_cluster({"device": "cpu"}).keeps_attention_scores
    for cluster, want in ((build_cluster({"device": "h100", "nodes": 32}), fused), (square, unfused)):
        assert predict(shape, cluster, lay, 256).memory.activations == pytest.approx(want.activations)


# ----------------------------------------------------------------------------- time


def test_megatron_flops_per_iteration_through_the_planner():
    cfg = model([("model.preset", "gpt-175b")])  # gpt2, ffn = 4h, kv = heads
    shape = model_shape(cfg, causal=False)
    b = 1536
    want = megatron_flops_per_iteration(b, 2048, 96, 12288, 51200)
    assert shape.hardware_flops_per_step(b, "full") == pytest.approx(want, rel=1e-12)
    # The per-device FLOPs the time model charges add up to the same step (pp=1: every device alike).
    cl = build_cluster({"device": "a100-80gb", "nodes": 192})
    lay = Layout(tp=8, pp=1, dp=192, mbs=1, zero=1, recompute="full")
    st = step_terms(shape, cl, lay, b)
    assert st.hardware_flops_per_device * lay.world == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("p,m,v", [(4, 8, 1), (8, 64, 1), (4, 8, 2), (16, 128, 3)])
def test_bubble_in_the_ideal_time_form(p, m, v):
    if v == 1:
        assert bubble_ratio("1f1b", p, m) == pytest.approx((p - 1) / m)
        assert bubble_ratio("gpipe", p, m) == pytest.approx((p - 1) / m)
        assert bubble_ratio("zb", p, m) == pytest.approx((p - 1) / (3 * m))
    else:
        assert bubble_ratio("interleaved", p, m, v) == pytest.approx((1 / v) * (p - 1) / m)
    assert bubble_ratio("1f1b", 1, m) == 0


def test_predicted_bubble_is_the_ratio_times_the_pipelined_work():
    # A vocabulary small enough that the last rank's head is negligible: every rank's work is
    # the slowest's, the fill and drain's included.
    shape = model_shape(model([("model.preset", "gpt-175b"), ("model.vocab", "128")]))
    cl = build_cluster({"device": "h100", "nodes": 16, "layer_overhead_us": 0, "step_overhead_s": 0})
    lay = Layout(tp=8, pp=8, dp=2, vpp=3, mbs=1, schedule="interleaved", zero=1, sp=True, recompute="selective")
    pred = predict(shape, cl, lay, 64)
    m = pred.microbatches
    work = pred.times["compute"] + pred.times["recompute"] + pred.times["tp_comm"]
    assert pred.times["bubble"] == pytest.approx(work * (8 - 1) / (3 * m), rel=2e-3)  # (p-1)/(v m), p=8, v=3
    assert pred.bubble_fraction == pytest.approx(pred.times["bubble"] / pred.step_time_s)
    assert pred.step_time_s == pytest.approx(sum(pred.times.values()))


def test_bubble_is_the_fill_and_drain_ranks_work_not_the_heads():
    # 1F1B: the slowest rank (the last, with the vocabulary head) runs m passes back to back;
    # the first micro-batch's forward reaches it and the last one's backward leaves it through
    # the other p - 1 ranks, so the step is m t_last + (p - 1) t_other: a heavier head adds m of
    # its passes to the step and nothing to the bubble.
    cl = build_cluster({"device": "a100-80gb", "nodes": 4, "grad_accumulation": "fused"})
    lay = Layout(tp=8, pp=4, dp=1, mbs=1, recompute="selective", sp=True)
    times = {}
    for vocab in (8192, 65536):
        shape = model_shape(model([("model.preset", "gpt-175b"), ("model.layers", "16"), ("model.vocab", str(vocab))]))
        pred = predict(shape, cl, lay, 16)
        assert pred.slowest_rank == "last" and pred.microbatches == 16
        times[vocab] = pred.times
    small, large = times[8192], times[65536]
    assert large["compute"] > 1.05 * small["compute"]  # the head's passes lengthen the last rank's work
    assert large["bubble"] == pytest.approx(small["bubble"], rel=1e-3)


def test_stage_split_matches_the_pipeline_partition():
    from threefold.distributed.pipeline.partition import balanced_partition

    for layers, stages, c, head in [(32, 4, 1.0, 0.0), (24, 4, 1.0, 3.0), (12, 6, 1.0, 1.5), (10, 3, 2.0, 5.0)]:
        counts = balanced_partition(layers, stages, c, 0.0, head)
        best = max(n * c + (head if i == stages - 1 else 0) for i, n in enumerate(counts))
        split = split_layers(layers, stages, 1, c, head)
        assert max(split.other_stage_layers * c, split.last_layers * c + head) == pytest.approx(best)


def test_tp_across_nodes_is_slower_than_inside():
    shape = model_shape(model([("model.preset", "llama-7b")]))
    inside = build_cluster({"device": "h100", "devices_per_node": 8, "nodes": 2})
    across = build_cluster({"device": "h100", "devices_per_node": 4, "nodes": 4, "allow_tp_across_nodes": True})
    lay = Layout(tp=8, pp=1, dp=2, mbs=1, zero=1)
    a, b = predict(shape, inside, lay, 64), predict(shape, across, lay, 64)
    assert a.links["tp"] == "intra" and b.links["tp"] == "inter"
    assert b.times["tp_comm"] > 5 * a.times["tp_comm"]


# ----------------------------------------------------------------------------- search


def test_one_trillion_parameters_on_16384_gpus_plans_in_under_10_seconds():
    shape = model_shape(model(ONE_T))
    assert shape.total_params == pytest.approx(1.008e12, rel=1e-3)
    cl = build_cluster({"device": "h100", "devices_per_node": 8, "nodes": 2048})
    t0 = time.perf_counter()
    plan = search(shape, cl, global_batch=4096)
    elapsed = time.perf_counter() - t0
    assert elapsed < 10, elapsed
    best = plan.best
    assert best.fits and best.layout.world == 16384
    assert best.layout.tp == 8  # TP fills the NVLink domain for a model this wide
    # What docs/planner.md quotes (the cost model is deterministic).
    # Micro-batches of 2 and ZeRO-2: each micro-batch's gradients are added into the fp32 buffers
    # (per parameter), and ZeRO-2 zeroes only its own slice of them. No recompute: the fused
    # attention keeps no s x s probabilities, which are all that selective recompute would drop.
    assert best.layout.spec() == (
        "tp=8,pp=16,dp=128,vpp=8,mbs=2,schedule=interleaved,zero=2,sp=true,recompute=none,ep=1"
    )
    assert best.mfu == pytest.approx(
        0.478, abs=0.005
    )  # fp32 gradients; GEMM shapes, fused attention, modelled overlap and its slowdown; threefold's kernels
    assert plan.considered > 2000


def test_search_ranks_by_step_time_and_everything_fits():
    shape = model_shape(model([("model.preset", "llama-7b")]))
    cl = build_cluster({"device": "h100", "nodes": 4})
    plan = search(shape, cl, 512, keep=20)
    times = [p.step_time_s for p in plan.ranked]
    assert times == sorted(times)
    assert all(p.fits and p.layout.world == 32 for p in plan.ranked)


def test_pins_restrict_the_search():
    shape = model_shape(model([("model.preset", "llama-7b")]))
    cl = build_cluster({"device": "h100", "nodes": 4})
    plan = search(shape, cl, 512, pins={"tp": 4, "zero": 1, "recompute": "full"})
    assert {(p.layout.tp, p.layout.zero, p.layout.recompute) for p in plan.ranked} == {(4, 1, "full")}


def test_rejection_reasons_are_sentences():
    # llama-70b on 2 x 4 A100-40GB: too small, heads 64 not divisible by 3.., TP beyond the node.
    shape = model_shape(model([("model.preset", "llama-70b")]))
    cl = build_cluster({"device": "a100-40gb", "devices_per_node": 4, "nodes": 16})
    plan = search(shape, cl, 64)
    kinds = set(plan.rejected)
    assert {"memory", "tp-across-nodes"} <= kinds
    for rej in plan.rejected.values():
        for _spec, sentence in rej.best():
            assert "\n" not in sentence and sentence.endswith(".") and sentence[0].isalnum()
            assert "None" not in sentence and "{" not in sentence
    spec, oom = plan.rejected["memory"].best()[0]
    assert oom.startswith("out of memory: needs") and "GiB per device" in oom and "usable" in oom
    _, across = plan.rejected["tp-across-nodes"].best()[0]
    assert "across nodes of 4 devices" in across


def test_shape_and_batch_reasons():
    shape = model_shape(
        model([("model.preset", "llama-7b"), ("model.heads", "24"), ("model.hidden", "3072"), ("model.kv_heads", "24")])
    )
    cl = build_cluster({"device": "h100", "devices_per_node": 8, "nodes": 2})
    plan = search(shape, cl, 24)
    sentences = [s for r in plan.rejected.values() for _, s in r.best()]
    assert any("tp=16 cannot split the model's 24 attention heads evenly." == s for s in sentences)
    assert any("does not split evenly over dp=16" in s for s in sentences)


# ----------------------------------------------------------------------------- faults


def test_young_daly_and_goodput():
    c, mtbf = 60.0, 3 * 3600.0
    assert young_interval(c, mtbf) == pytest.approx(math.sqrt(2 * c * mtbf))
    assert daly_interval(c, mtbf) == pytest.approx(young_interval(c, mtbf), rel=0.05)
    g = goodput(young_interval(c, mtbf), c, 600, mtbf)
    assert 0.8 < g < 1
    # Expanding Daly's exponentials: wall / work ~ (1 + C/tau)(1 + (tau + C)/(2M))(1 + R/M).
    tau = young_interval(c, mtbf)
    assert g == pytest.approx(1 / ((1 + c / tau) * (1 + (tau + c) / (2 * mtbf)) * (1 + 600 / mtbf)), abs=0.005)
    assert goodput(tau, c, 600, mtbf / 10) < g


def test_fault_advice_scales_with_devices():
    small = advise(Faults(), devices=64, nodes=8, total_params=7e9, step_time_s=5.0)
    large = advise(Faults(), devices=16384, nodes=2048, total_params=1e12, step_time_s=5.0)
    assert large.system_mtbf_s == pytest.approx(50000 * 3600 / 16384)
    assert large.interval_s < small.interval_s and large.goodput < small.goodput
    assert large.interval_steps == round(large.interval_s / 5.0)
    assert large.checkpoint_bytes == pytest.approx(14e12)


def test_small_gemms_and_elementwise_work_make_throughput_depend_on_shape():
    """Small micro-batches and narrow TP shards run below the large-GEMM rate; element-wise
    bytes grow with width h while GEMM FLOPs grow with h^2, so a narrow model pays more of them."""
    from threefold.planner.kernels import elementwise_bytes, gemm_factor

    small = model([("model.preset", "small")])

    def kernels(half_dim, sms=0):
        return SimpleNamespace(
            gemm_half_dim=half_dim, sm_count=sms, attention_efficiency=0.0, attention_scores="causal"
        )

    assert gemm_factor(small, 256, 1, kernels(0.0)) == 1.0
    assert gemm_factor(small, 64, 1, kernels(64.0)) > gemm_factor(small, 512, 1, kernels(64.0)) > 1.0  # fewer tokens
    assert gemm_factor(small, 512, 4, kernels(64.0)) > gemm_factor(small, 512, 1, kernels(64.0))  # narrower shards
    # Wave quantization: 132 SMs and 4 x 4 tiles of 128 leave most of the one wave idle.
    assert gemm_factor(small, 512, 1, kernels(0.0, 132)) > 2 * gemm_factor(small, 512, 1, kernels(0.0))
    wide = model([("model.preset", "small"), ("model.hidden", "2048"), ("model.ffn_hidden", "5632")])
    shape_s, shape_w = model_shape(small), model_shape(wide)
    per_flop = [elementwise_bytes(m.cfg, 1, 2) / m.layer_hw_flops["none"] for m in (shape_s, shape_w)]
    assert per_flop[0] > 1.5 * per_flop[1]

    def per_token_compute(cluster, mbs):
        pred = predict(shape_s, cluster, Layout(dp=8, mbs=mbs), 64)
        return pred.times["compute"] / (pred.microbatches * mbs)

    shaped = build_cluster({"device": "h100"})
    flat = build_cluster(
        {"device": "h100", "gemm_half_dim": 0, "sm_count": 0, "elementwise_bw_gbps": 1e12, "reduction_bw_gbps": 1e12}
    )
    assert per_token_compute(shaped, 1) > 1.05 * per_token_compute(shaped, 8)
    assert per_token_compute(flat, 1) == pytest.approx(per_token_compute(flat, 8))


def test_unfused_square_attention_computes_and_moves_every_score():
    """attention_scores = square (Megatron-LM before flash attention): QK^T and PV over all s keys,
    the softmax over the whole square: twice the causal half's attention FLOPs and probabilities."""
    from threefold.planner.kernels import attention_factor, elementwise_bytes

    small = model([("model.preset", "small")])
    causal = build_cluster({"device": "a100-80gb", "attention_efficiency": 0})
    square = build_cluster({"device": "a100-80gb", "attention_efficiency": 0, "attention_scores": "square"})
    assert attention_factor(small, square) == pytest.approx(2 * attention_factor(small, causal))
    probabilities = elementwise_bytes(small, 1, 2) - elementwise_bytes(small, 1, 2, fused_attention=True)
    both = elementwise_bytes(small, 1, 2, square=True) - elementwise_bytes(small, 1, 2, fused_attention=True)
    assert both == pytest.approx(2 * probabilities) and probabilities > 0
    # At 2048 tokens the scores are a large part of a narrow model's layer.
    long = model([("model.preset", "small"), ("model.seq_len", "2048")])
    layout = Layout(dp=8, mbs=2)
    slower = predict(model_shape(long), square, layout, 64).times["compute"]
    assert slower > 1.2 * predict(model_shape(long), causal, layout, 64).times["compute"]
    with pytest.raises(ConfigError, match="cluster.attention_scores"):
        build_cluster({"device": "a100-80gb", "attention_scores": "square"})  # the profile's kernel is fused


def test_unfused_attention_dropout_and_selective_rerun_move_the_probabilities_again():
    """attention_dropout (Megatron-LM's --attention-dropout): dropout reads the probabilities and
    writes the dropped ones and a 1-byte mask forward, the mirror backward; selective recompute
    reruns the unfused softmax and dropout with the core's GEMMs. A fused kernel moves neither."""
    from threefold.planner.kernels import attention_dropout_bytes, rerun_attention_bytes, softmax_bytes

    long = model([("model.preset", "small"), ("model.seq_len", "2048")])
    shape, heads, s = model_shape(long), long.heads, long.seq_len
    assert attention_dropout_bytes(long, 2, 2, square=True) == pytest.approx(heads / 2 * s * 5)
    assert rerun_attention_bytes(long, 1, 2, True, dropout=True) == pytest.approx(
        softmax_bytes(long, 1, 2, True) + attention_dropout_bytes(long, 1, 2, True)
    )
    unfused = {"device": "a100-80gb", "attention_efficiency": 0, "attention_scores": "square"}
    layout, batch = Layout(dp=8, mbs=2, recompute="selective"), 64
    plain, dropped = (
        step_terms(shape, build_cluster({**unfused, "attention_dropout": d}), layout, batch) for d in (False, True)
    )
    tokens, m = 2 * s, batch // 16
    extra = dropped.categories["compute"]["elementwise_bw_gbps"] - plain.categories["compute"]["elementwise_bw_gbps"]
    assert extra == pytest.approx(2 * m * long.layers * tokens * attention_dropout_bytes(long, 1, 2, True))
    rerun = dropped.categories["recompute"]["elementwise_bw_gbps"]
    assert rerun == pytest.approx(m * long.layers * tokens * rerun_attention_bytes(long, 1, 2, True, dropout=True))
    fused = step_terms(shape, build_cluster({"device": "a100-80gb", "attention_dropout": True}), layout, batch)
    assert "elementwise_bw_gbps" not in fused.categories["recompute"]
