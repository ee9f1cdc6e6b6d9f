"""The planner's context parallelism: compute split 1/cp, cp_comm volume equal to the attention's
analytic bytes (forward, backward, the recomputed forward), the ring's exposure rule, one-line
refusals, the search finding a long-sequence layout only cp makes fit, and --layout cp= /
emitted configs."""

from __future__ import annotations

import json

import pytest

from threefold.cli import main
from threefold.config import build_config
from threefold.distributed.context_parallel import analytic_bytes
from threefold.planner.cluster import build_cluster
from threefold.planner.comm_cost import latency_steps as _latency_steps
from threefold.planner.cost import step_terms
from threefold.planner.cp_cost import cp_traffic
from threefold.planner.layout import Layout, parse_layout, structural_reason
from threefold.planner.model import model_shape
from threefold.planner.search import search


def _shape(preset="llama-7b", seq=16384, **model):
    pairs = [("model.preset", preset), ("model.seq_len", seq)] + [(f"model.{k}", v) for k, v in model.items()]
    return model_shape(build_config(None, pairs).model)


def _cluster(**keys):
    # FLOPs at the GEMM rate alone: no shape factors (waves, fused attention) that differ with tokens per rank,
    # and no gradient accumulation pass (its bytes go with the parameters, not the tokens).
    fixed = [("device", "h100"), ("gemm_half_dim", 0.0), ("sm_count", 0), ("attention_efficiency", 0.0)]
    return build_cluster([*fixed, ("grad_accumulation", "fused"), *keys.items()])


def test_compute_per_rank_is_one_cp_th():
    """Each cp rank computes seq/cp tokens and 1/cp of the causal attention (the zigzag
    balance): the compute terms at cp 4 are a quarter of cp 1's, attention included."""
    shape, cluster = _shape(), _cluster()
    one = step_terms(shape, cluster, Layout(tp=2), 4).categories
    four = step_terms(shape, cluster, Layout(tp=2, cp=4), 4).categories
    for name, coef in one["compute"].items():
        assert four["compute"][name] == pytest.approx(coef / 4, rel=1e-12), name
    assert one.get("cp_comm", {}) == {} and four["cp_comm"]


@pytest.mark.parametrize("impl", ["ring", "a2a"])
@pytest.mark.parametrize("recompute,forwards", [("none", 1), ("selective", 2), ("full", 2)])
def test_cp_comm_volume_is_the_analytic_bytes(impl, recompute, forwards):
    """Per step: layers x micro-batches x (forwards x forward + backward) of analytic_bytes for
    the TP-local heads (a2a: the (cp-1)/cp of each all-to-all that leaves the rank), the
    exposed fraction applied to it; recompute reruns the attention core's forward once."""
    shape, cluster = _shape(), _cluster()
    lay = Layout(tp=2, cp=4, cp_impl=impl, mbs=2, recompute=recompute)
    cfg, gb = shape.cfg, 8
    sent = analytic_bytes(impl, 2, cfg.heads // 2, cfg.kv_heads // 2, shape.seq_len, cfg.head_dim, 4, 2)
    volume = (forwards * sent.forward + sent.backward) * ((4 - 1) / 4 if impl == "a2a" else 1)
    x = cp_traffic(shape, cluster, lay, 2, _latency_steps)
    assert x["bytes"] == pytest.approx(volume, rel=1e-12) and x["link"] == "intra"
    assert 0 < x["exposed"] <= 1 and (impl == "ring" or x["exposed"] == 1)
    terms = step_terms(shape, cluster, lay, gb).categories["cp_comm"]
    m = lay.microbatches(gb)
    assert terms["intra_bw_gbps"] == pytest.approx(shape.layers * m * x["exposed"] * volume, rel=1e-9)


def test_ring_exposes_what_outlasts_the_attention():
    """A fast link hides every ring exchange behind its block except the last gradient's trip
    home; a slow one exposes nearly all; a2a is always exposed."""
    shape = _shape()
    lay = Layout(cp=4)
    fast = _cluster(intra_bw_gbps=1e6, intra_latency_us=1e-9, collective_overhead_us=0.0)  # 0 = profile
    x = cp_traffic(shape, fast, lay, 2, _latency_steps)
    sent = analytic_bytes("ring", 1, shape.cfg.heads, shape.cfg.kv_heads, shape.seq_len, shape.cfg.head_dim, 4, 2)
    last_trip = (sent.backward - sent.forward) / 4
    assert x["exposed"] == pytest.approx(last_trip / sent.total, rel=1e-6)
    slow = cp_traffic(shape, _cluster(intra_bw_gbps=0.01), lay, 2, _latency_steps)
    assert slow["exposed"] > 0.99
    assert cp_traffic(shape, fast, Layout(cp=4, cp_impl="a2a"), 2, _latency_steps)["exposed"] == 1.0


def test_cp_group_crosses_nodes_when_tp_times_cp_does():
    shape = _shape()
    cluster = _cluster(nodes=4)
    assert step_terms(shape, cluster, Layout(tp=4, cp=2), 8).links["cp"] == "intra"
    terms = step_terms(shape, cluster, Layout(tp=4, cp=4), 8)
    assert terms.links["cp"] == "inter" and "inter_bw_gbps" in terms.categories["cp_comm"]


def test_dp_reduction_runs_over_dp_times_cp():
    """cp ranks hold the same weights: cp 2 x dp 2 reduces gradients like dp 4."""
    shape, cluster = _shape(seq=4096), _cluster()
    a = step_terms(shape, cluster, Layout(dp=2, cp=2, zero=1), 8).categories["dp_comm"]
    b = step_terms(shape, cluster, Layout(dp=4, zero=1), 8).categories["dp_comm"]
    assert a == pytest.approx(b)


@pytest.mark.parametrize(
    "spec,seq,pattern",
    [
        (
            "cp=16",
            1008,
            r"^cp=16 cuts each sequence into 2\*cp = 32 equal chunks .* seq_len 1008 is not a multiple of 32\.$",
        ),
        ("cp=4,cp_impl=a2a", 4096, r"^cp=4 with a2a splits each tp rank's 2 kv heads over cp ranks, .*divisible by cp"),
    ],
)
def test_invalid_cp_is_refused_in_one_sentence(spec, seq, pattern):
    import re

    cfg = build_config(None, [("model.preset", "tiny"), ("model.seq_len", seq)]).model
    why = structural_reason(cfg, parse_layout(spec, 16), 16, 8, False, 16)
    assert why[0] == "cp" and re.match(pattern, why[1]) and "\n" not in why[1], why


def test_layout_text_round_trips_cp():
    lay = parse_layout("tp=2,cp=4,cp_impl=a2a", 16)
    assert (lay.tp, lay.cp, lay.dp, lay.cp_impl, lay.world) == (2, 4, 2, "a2a", 16)
    assert parse_layout(lay.spec(), 16) == lay
    assert "cp" not in Layout(tp=2).spec()
    with pytest.raises(Exception, match=r"^--layout: cp_impl 'zigzag' is unknown.*valid: ring, a2a"):
        parse_layout("cp=2,cp_impl=zigzag", 8)


def test_search_finds_cp_where_cp1_does_not_fit():
    """llama-7b at 256k tokens on one node of 8 H100s: no cp = 1 layout fits (at 128k ZeRO-3 with
    full recompute does, in 74 GiB: the fused attention keeps no s x s scores); the default search
    (cp for seq >= cp_min_seq) finds one, with cp > 1; cp_min_seq 0 keeps cp at 1 and finds nothing."""
    shape = _shape(seq=262144)
    off = search(shape, build_cluster([("device", "h100"), ("cp_min_seq", 0)]), 8)
    assert not off.ranked and off.rejected["memory"].count > 0
    plan = search(shape, build_cluster([("device", "h100")]), 8)
    assert plan.best is not None and plan.best.layout.cp > 1 and plan.best.fits
    assert all(p.layout.cp > 1 for p in plan.ranked)
    assert plan.best.layout.world == 8 and plan.best.times["cp_comm"] > 0


def test_short_sequences_keep_cp_at_one_unless_pinned():
    shape = _shape(seq=4096)
    plan = search(shape, _cluster(), 64, keep=200)
    assert {p.layout.cp for p in plan.ranked} == {1}
    pinned = search(shape, _cluster(), 64, pins={"cp": 2, "cp_impl": "a2a"}, keep=20)
    assert pinned.ranked and all((p.layout.cp, p.layout.cp_impl) == (2, "a2a") for p in pinned.ranked)


def test_plan_layout_cp_and_emitted_config(capsys, tmp_path):
    out = tmp_path / "cp.toml"
    args = ["plan", "--model.preset", "llama-7b", "--model.seq_len", "32768", "--cluster.device", "h100"]
    args += ["--train.global_batch", "8", "--json", "--layout", "tp=2,cp=4,zero=1,recompute=full"]
    code = main(args + ["--emit-config", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    (lay,) = json.loads(captured.out)["layouts"]
    assert (lay["cp"], lay["cp_impl"], lay["dp"]) == (4, "ring", 1) and lay["time_split_s"]["cp_comm"] > 0
    cfg = build_config(str(out), [])
    assert (cfg.parallel.cp, cfg.parallel.cp_impl, cfg.parallel.tp) == (4, "ring", 2)
    tiny = ["plan", "--model.preset", "tiny", "--model.seq_len", "100", "--train.global_batch", "8"]
    code = main(tiny + ["--layout", "cp=4"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and err.count("\n") == 0 and "cp=4 cuts each sequence into 2*cp = 8" in err, err


def test_calibration_fits_cp_comm_from_its_span(tmp_path):
    """Synthetic cp 2 runs (ring and a2a) whose measured cp_comm span is twice the prediction:
    the per-category fit gives cp_comm its own link parameters and matches the spans."""
    from planner_helpers import cpu_cluster

    from threefold.planner import fit, load_run
    from threefold.planner.calibrate import Run, cluster_for_run
    from threefold.planner.predict import predict

    truth = cpu_cluster(compute_efficiency=0.3, intra_bw_gbps=1.5)
    runs = []
    for name, lay in (
        ("ring", Layout(cp=2, mbs=1)),
        ("a2a", Layout(cp=2, cp_impl="a2a", mbs=1)),
        ("ring4", Layout(cp=4)),
    ):
        pairs = [("model.preset", "tiny"), ("train.global_batch", "4"), ("parallel.cp", str(lay.cp))]
        cfg = build_config(None, pairs + [("parallel.cp_impl", lay.cp_impl), ("train.micro_batch", str(lay.mbs))])
        run = tmp_path / name
        run.mkdir()
        info = {
            "config": cfg.to_dict(),
            "layout": {"tp": 1, "pp": 1, "dp": 1, "cp": lay.cp, "world_size": lay.world},
            "hardware": {"device_type": "cpu", "logical_cores": truth.host_cores},
            "extra": {"peak_flops_per_device": truth.peak_tflops * 1e12, "dtype": "torch.float32"},
        }
        (run / "run.json").write_text(json.dumps(info))
        fake = Run(str(run), cfg, lay, "fp32", 0, {}, 0, truth.peak_tflops * 1e12, truth.host_cores, "cpu")
        t = predict(model_shape(cfg.model), cluster_for_run(truth, fake), lay, 4, "fp32").times
        step = sum(t.values()) + t["cp_comm"]
        (run / "metrics.jsonl").write_text(
            "\n".join(json.dumps({"step": i + 1, "step_time_s": step}) for i in range(6))
        )
        spans = {"forward": t["compute"] + t["overhead"], "cp_comm": 2 * t["cp_comm"], "optimizer": t["optimizer"]}
        spans["dp_exposed"] = t["dp_comm"]
        recs = [{"step": i + 1, "ranks": [{"rank": 0, "time_s": spans}]} for i in range(6)]
        (run / "spans.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
        runs.append(load_run(str(run)))
    assert all("span_cp_comm_s" in r.categories and r.layout.cp > 1 for r in runs)
    cal = fit(runs, cpu_cluster(), ["compute_efficiency"])
    assert "cp_comm" in cal.cluster.categories
    rows = [r for r in cal.rows if r.category == "span_cp_comm_s"]
    assert len(rows) == 3 and all(abs(r.fitted / r.measured - 1) < 0.05 for r in rows), [
        (r.fitted, r.measured) for r in rows
    ]
