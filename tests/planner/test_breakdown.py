"""The planner's single-device classes (planner/breakdown.py) and the memory-bound and host terms
a profile of threefold on one H200 added to the cost model (planner/kernels.py, cost.py)."""

from __future__ import annotations

import dataclasses

import pytest
from planner_helpers import model

from threefold.planner import Layout, build_cluster, predict
from threefold.planner.breakdown import attention_share, predicted_classes
from threefold.planner.cost import step_terms
from threefold.planner.kernels import bias_grad_elements, reduction_bytes
from threefold.planner.model import model_shape
from threefold.planner.units import seconds

GPT13 = [("model.preset", "gpt-1.3b"), ("model.seq_len", "2048")]


def _h200(**keys):
    cluster = build_cluster({"device": "h200", **keys})
    cluster.devices_per_node, cluster.nodes = 1, 1
    return cluster


def test_the_classes_split_the_planners_own_step():
    shape, cluster = model_shape(model(GPT13)), _h200()
    lay = Layout(mbs=4)
    classes = predicted_classes(shape, cluster, lay, 8, "bf16")
    times = step_terms(shape, cluster, lay, 8, "bf16").times(cluster)
    work = times["compute"] + times["recompute"]
    assert classes["gemm"] + classes["attention"] + classes["elementwise"] == pytest.approx(work)
    parts = sum(classes[c] for c in ("gemm", "attention", "elementwise", "optimizer", "overhead"))
    assert parts == pytest.approx(classes["step"]) and classes["step"] == pytest.approx(sum(times.values()))
    # The attention core's share grows with the sequence (its FLOPs go with s, the GEMMs' do not).
    long = model_shape(model([("model.preset", "gpt-1.3b"), ("model.seq_len", "8192")]))
    assert attention_share(long.cfg, 8192, 1, cluster) > 2 * attention_share(shape.cfg, 2048, 1, cluster)
    with pytest.raises(ValueError, match="one-device"):
        predicted_classes(shape, cluster, Layout(dp=2, mbs=4), 8, "bf16")


def test_gradient_accumulation_is_paid_per_micro_batch_unless_fused():
    shape = model_shape(model(GPT13))
    separate, fused = _h200(), _h200(grad_accumulation="fused")

    def reduction_s(cluster, mbs):
        terms = step_terms(shape, cluster, Layout(mbs=mbs), 8, "bf16").categories["compute"]
        return terms["reduction_bw_gbps"] / (cluster.reduction_bw_gbps * 1e9)

    # Four micro-batches of 2 pay the pass over the parameters twice as often as two of 4.
    extra = reduction_s(separate, 2) - reduction_s(separate, 4)
    params = shape.total_params
    assert extra == pytest.approx(2 * params * 10 / (separate.reduction_bw_gbps * 1e9), rel=1e-3)  # bf16 + fp32 r/w
    assert reduction_s(fused, 2) == pytest.approx(reduction_s(fused, 4))


def test_bias_gradients_are_reduced_only_where_there_are_biases():
    gpt, llama = model(GPT13), model([("model.preset", "llama-7b")])
    h, f = gpt.hidden, gpt.ffn_hidden
    assert bias_grad_elements(gpt, 1) == pytest.approx(3 * h + h + f + h)
    assert bias_grad_elements(gpt, 4) == pytest.approx(3 * h / 4 + h + f / 4 + h)  # row-parallel biases whole
    assert bias_grad_elements(llama, 1) == 0.0
    qkv = model([("model.preset", "llama-7b"), ("model.qkv_bias", "true")])
    assert bias_grad_elements(qkv, 1) == pytest.approx(3 * qkv.hidden)
    # A fused attention kernel's backward adds its own passes; sequence parallelism splits the norms.
    assert reduction_bytes(llama, 1, 2, fused_attention=True) > reduction_bytes(llama, 1, 2)
    assert reduction_bytes(llama, 4, 2, sp=True) == pytest.approx(reduction_bytes(llama, 1, 2) / 4)


def test_on_a_gpu_only_host_time_beyond_the_layers_device_time_is_exposed():
    small = model_shape(model([("model.preset", "small")]))
    big = model_shape(model(GPT13))
    gpu, cpu = _h200(), build_cluster({"device": "cpu", "devices_per_node": 1, "peak_tflops": 0.1})

    def overhead(shape, cluster, mbs):
        terms = step_terms(shape, cluster, Layout(mbs=mbs), 8 * mbs, "bf16").categories["overhead"]
        return seconds(terms, cluster) - cluster.step_overhead_s

    # gpt-1.3b at 8192 tokens a micro-batch: a layer's device time (~6 ms) outlasts 2.55 ms of host time.
    assert overhead(big, gpu, 4) == 0.0
    # The small model's layers take well under the host's time: most of it is exposed, not all.
    passes = small.layers * 8
    exposed = overhead(small, gpu, 1)
    assert 0.5 * passes * gpu.layer_overhead_us * 1e-6 < exposed < passes * gpu.layer_overhead_us * 1e-6
    # On cpu the host is the device: every layer pass pays its overhead.
    assert overhead(small, cpu, 1) == pytest.approx(passes * cpu.layer_overhead_us * 1e-6)


def test_the_optimizer_streams_norm_update_copy_down_and_zero_grad():
    shape = model_shape(model(GPT13))
    cluster = _h200()
    n = shape.total_params
    one = step_terms(shape, cluster, Layout(mbs=4), 8, "bf16").categories["optimizer"]["mem_bw_gbps"]
    assert one == pytest.approx(n * (4 + 28 + 6 + 4))  # norm, fused AdamW, fp32 -> bf16, zero_grad
    fp32 = step_terms(shape, cluster, Layout(mbs=4), 8, "fp32").categories["optimizer"]["mem_bw_gbps"]
    assert fp32 == pytest.approx(n * (4 + 28 + 4))  # the master is the parameter: no copy down
    eight = dataclasses.replace(cluster, devices_per_node=8)
    zero2 = step_terms(shape, eight, Layout(dp=8, mbs=4, zero=2), 64, "bf16").categories["optimizer"]
    assert zero2["mem_bw_gbps"] == pytest.approx(one / 8)  # ZeRO-2: the owned slice of all of it
    assert predict(shape, cluster, Layout(mbs=4), 8).times["optimizer"] == pytest.approx(
        one / (cluster.mem_bw_gbps * 1e9)
    )
