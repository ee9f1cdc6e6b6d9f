"""Modelled overlap's costs (planner/overlap.py, planner/comm_cost.py): the compute beside a hidden
transfer is charged `overlap_slowdown` of it, and an interleaved stage reduces each chunk's
gradients behind the chunks that finish after it."""

from __future__ import annotations

import pytest
from planner_helpers import model

from threefold.errors import ConfigError
from threefold.planner import Layout, build_cluster, model_shape, predict

SHAPE = model_shape(model([("model.preset", "llama-7b")]))


def _comm(cluster: dict, layout: Layout, global_batch: int) -> dict[str, float]:
    pred = predict(SHAPE, build_cluster({"device": "h100", "nodes": 4, **cluster}), layout, global_batch)
    return {k: v for k, v in pred.times.items() if k in ("tp_comm", "pp_comm", "dp_comm", "compute")}


def test_overlapped_compute_is_charged_its_slowdown():
    layout = Layout(tp=2, pp=2, dp=8, mbs=1)
    free, cited, whole = (_comm({"overlap_slowdown": s}, layout, 256) for s in (0.0, 0.19, 1.0))
    for category in ("tp_comm", "pp_comm", "dp_comm"):
        assert free[category] < cited[category] < whole[category], category
    assert free["compute"] == cited["compute"] == whole["compute"]
    # Charged whole, a hidden second costs what an exposed one does: nothing hidden at all.
    exposed = _comm({"tp_overlap": 0.0, "dp_overlap": 0.0}, layout, 256)
    assert whole["tp_comm"] == pytest.approx(exposed["tp_comm"])
    assert whole["dp_comm"] == pytest.approx(exposed["dp_comm"])
    with pytest.raises(ConfigError, match="cluster.overlap_slowdown"):
        build_cluster({"device": "h100", "overlap_slowdown": 1.5})


def test_interleaved_chunks_reduce_their_gradients_behind_the_later_chunks():
    # A slow link, so the gradient reduction outlasts the last micro-batch's backward.
    slow = {"overlap_slowdown": 0.0, "intra_bw_gbps": 10, "inter_bw_gbps": 10}
    plain = _comm(slow, Layout(tp=1, pp=4, dp=8, mbs=1), 64)
    two, four = (_comm(slow, Layout(tp=1, pp=4, dp=8, mbs=1, schedule="interleaved", vpp=v), 64) for v in (2, 4))
    assert plain["compute"] == two["compute"] == four["compute"]
    assert plain["dp_comm"] > 1.4 * two["dp_comm"] and two["dp_comm"] > 1.4 * four["dp_comm"]


def test_16_bit_gradient_reduction_moves_half_the_bytes():
    # Exposed in full (no overlap, no latency or call cost): the reduction's time is its bytes.
    flat = {"overlap": "none", "inter_latency_us": 0, "intra_latency_us": 0, "collective_overhead_us": 0}
    layout = Layout(tp=1, pp=1, dp=32, mbs=1)
    fp32, half = (_comm({**flat, "grad_reduce": g}, layout, 64)["dp_comm"] for g in ("fp32", "16bit"))
    assert half == pytest.approx(fp32 / 2, rel=1e-3) and half > 0  # less a few fixed microseconds
    with pytest.raises(ConfigError, match="cluster.grad_reduce"):
        build_cluster({"device": "h100", "grad_reduce": "fp8"})


def test_zero_gathers_priced_as_the_engine_runs_them():
    """ZeRO 1/2's gather behind the next forward (parallel.overlap_param_gather, param_gather
    forward) costs less than after the step; ZeRO 3's gathers and reduce-scatters are priced on
    two lanes, each hidden behind its own compute (the gathers behind the step's, the reductions
    behind backward); zero3_prefetch adds one layer's gathered weights per block ahead and no time."""
    z1 = Layout(tp=1, pp=1, dp=32, mbs=1, zero=1)
    after, forward = (_comm({"param_gather": g}, z1, 256)["dp_comm"] for g in ("after_step", "forward"))
    assert forward < 0.95 * after  # measured 0.594 s against 0.669 s: one micro-batch's forward hides
    cluster = build_cluster({"device": "h100", "nodes": 4})
    one, two = (predict(SHAPE, cluster, Layout(tp=1, pp=1, dp=32, mbs=1, zero=3, zero3_prefetch=n), 64) for n in (1, 2))
    assert one.times["dp_comm"] == two.times["dp_comm"] > 0
    layer = SHAPE.state_numel(1, 0.0, 1, 1)[0] * 2  # bf16 weights of one block
    assert two.memory.buffers - one.memory.buffers == pytest.approx(layer)
    assert Layout(zero=3, zero3_prefetch=2).spec().endswith("zero3_prefetch=2")
    assert "zero3_prefetch" not in Layout(zero=3).spec()


def test_blocking_pipeline_exchanges_are_exposed_and_scatter_gather_splits_them():
    """pp_overlap 0 (Megatron-LM's blocking batch_isend_irecv before 2023): every exchange exposed,
    each send moving at once with a receive; pp_scatter_gather without SP: 1/tp of each activation
    over the pipeline link, the receivers all-gathering it over the TP link."""
    # Latencies of 0 would take the profile's: a picosecond leaves the bytes alone.
    flat = {"overlap_slowdown": 0.0, "inter_latency_us": 1e-6, "intra_latency_us": 1e-6, "collective_overhead_us": 0}
    layout = Layout(tp=8, pp=4, dp=1, mbs=1)
    hidden, blocking = (_comm({**flat, "pp_overlap": share}, layout, 64)["pp_comm"] for share in (-1.0, 0.0))
    assert blocking > hidden > 0
    # A middle rank: 4 m transfers of s b h, half of them on the link's other direction.
    m, x = 64, SHAPE.seq_len * SHAPE.hidden * 2
    link = build_cluster({"device": "h100", "nodes": 4}).inter_bw_gbps * 1e9
    assert blocking == pytest.approx(2 * m * x / link)
    split = _comm({**flat, "pp_overlap": 0.0, "pp_scatter_gather": True}, layout, 64)["pp_comm"]
    gathers = 2 * m * 7 / 8 * x / (build_cluster({"device": "h100"}).intra_bw_gbps * 1e9)
    assert split == pytest.approx(blocking / 8 + gathers)
    with pytest.raises(ConfigError, match="cluster.pp_overlap"):
        build_cluster({"device": "h100", "pp_overlap": 2.0})
