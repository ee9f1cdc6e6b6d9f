"""Planner calibration: fitting the cluster's efficiency parameters to measured runs, the
per-category error bands a calibrated profile carries, and cluster profile files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from planner_helpers import cpu_cluster
from planner_helpers import plan_cli as _cli

from threefold.config import build_config
from threefold.errors import ConfigError
from threefold.planner import Layout, bubble_ratio, build_cluster, fit, load_run, model_shape, predict, step_terms
from threefold.planner.calibrate import cluster_for_run, leave_one_out
from threefold.planner.validation import MEASURED_AS


def _synthetic_run(root: Path, name: str, cfg_pairs, layout: Layout, truth, steps: int = 6, spans: bool = False) -> str:
    """A run directory whose step times (and pipeline idle) the planner with `truth` predicts
    exactly; with `spans`, also a spans.jsonl whose slowest rank has the predicted split."""
    from threefold.planner.calibrate import cluster_for_run

    cfg = build_config(
        None,
        cfg_pairs
        + [
            ("parallel.dp", str(layout.dp)),
            ("parallel.tp", str(layout.tp)),
            ("parallel.pp", str(layout.pp)),
            ("parallel.ep", str(layout.ep)),
            ("train.micro_batch", str(layout.mbs)),
        ],
    )
    run = root / name
    run.mkdir()
    info = {
        "config": cfg.to_dict(),
        "layout": {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "world_size": layout.world},
        "hardware": {"device_type": "cpu", "logical_cores": truth.host_cores},
        "extra": {"peak_flops_per_device": truth.peak_tflops * 1e12, "dtype": "torch.float32"},
    }
    (run / "run.json").write_text(json.dumps(info))
    shape = model_shape(cfg.model)
    from threefold.planner.calibrate import Run

    fake = Run(str(run), cfg, layout, "fp32", 0, {}, 0, truth.peak_tflops * 1e12, truth.host_cores, "cpu")
    pred = predict(shape, cluster_for_run(truth, fake), layout, cfg.train.global_batch, "fp32")
    from threefold.planner.cost import seconds

    terms = step_terms(shape, cluster_for_run(truth, fake), layout, cfg.train.global_batch, "fp32")
    step, idle = pred.step_time_s, seconds(terms.extra.get("pp_idle", {}), cluster_for_run(truth, fake))
    lines = [
        json.dumps({"step": i + 1, "step_time_s": step * (3 if i == 0 else 1), "pp_idle_s": idle}) for i in range(steps)
    ]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if spans:
        t = pred.times
        slowest = {
            "forward": t["compute"] + t["overhead"],
            "recompute": t["recompute"],
            "tp_comm": t["tp_comm"],
            "ep_a2a": t["ep_comm"],
            "pp_p2p": t["pp_comm"],
            "pp_bubble": t["bubble"],
            "dp_exposed": t["dp_comm"],
            "optimizer": t["optimizer"],
        }
        # A lighter rank first: the loader must pick the rank with the most compute.
        light = {**slowest, "forward": slowest["forward"] / 2, "tp_comm": 3 * slowest["tp_comm"]}
        recs = [
            {"step": i + 1, "ranks": [{"rank": 0, "time_s": light}, {"rank": 1, "time_s": slowest}]}
            for i in range(steps)
        ]
        (run / "spans.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return str(run)


def test_calibration_recovers_known_parameters(tmp_path):
    truth = cpu_cluster(compute_efficiency=0.37, intra_bw_gbps=2.5, layer_overhead_us=800.0, step_overhead_s=0.02)
    prior = cpu_cluster()
    pairs = [("model.preset", "small"), ("train.global_batch", "16")]
    layouts = [
        Layout(dp=1, mbs=4),
        Layout(dp=2, mbs=2),
        Layout(dp=4, mbs=4),
        Layout(dp=4, mbs=1),
        Layout(dp=8, mbs=1),
        Layout(tp=2, dp=2, mbs=2),
    ]
    runs = [load_run(_synthetic_run(tmp_path, f"r{i}", pairs, lay, truth)) for i, lay in enumerate(layouts)]
    assert runs[0].steps_used == 5  # the slow first step is dropped as warm-up
    free = ["compute_efficiency", "intra_bw_gbps", "layer_overhead_us", "step_overhead_s"]
    cal = fit(runs, prior, free)
    for name in free:
        assert getattr(cal.cluster, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    assert all(abs(r.fitted / r.measured - 1) < 1e-6 for r in cal.rows)
    # With two runs, two parameters are freed automatically and both runs are matched exactly.
    two = fit(runs[:2], prior)
    # (gemm_half_dim is searched on its grid besides: the runs' micro-batches differ)
    linear = [n for n in two.free if n != "gemm_half_dim"]
    assert len(linear) == 2 and all(abs(r.fitted / r.measured - 1) < 1e-6 for r in two.rows)


def test_core_share_exponent_is_fitted_on_a_grid(tmp_path):
    truth = cpu_cluster(compute_efficiency=0.4, devices_per_node=2, host_cores=2, core_share_exponent=1.36)
    pairs = [("model.preset", "small"), ("train.global_batch", "16")]
    runs = [
        load_run(_synthetic_run(tmp_path, f"r{i}", pairs, lay, truth))
        for i, lay in enumerate([Layout(dp=1, mbs=2), Layout(dp=4, mbs=2), Layout(dp=8, mbs=2)])
    ]
    cal = fit(runs, cpu_cluster(host_cores=2), ["compute_efficiency", "core_share_exponent"])
    assert cal.cluster.core_share_exponent == pytest.approx(1.36)
    assert cal.cluster.compute_efficiency == pytest.approx(0.4, rel=1e-6)
    assert "core_share_exponent" in cal.changes()
    # Runs that all share cores alike cannot tell the exponent from the efficiency.
    with pytest.raises(ConfigError, match="different degrees"):
        fit(runs[1:2], cpu_cluster(host_cores=2), ["core_share_exponent"])


def test_pipeline_idle_is_a_measured_category(tmp_path):
    truth = cpu_cluster(compute_efficiency=0.4, intra_bw_gbps=2.0)
    pairs = [("model.preset", "small"), ("train.global_batch", "16")]
    runs = [
        load_run(_synthetic_run(tmp_path, f"r{i}", pairs, lay, truth))
        for i, lay in enumerate([Layout(dp=1, mbs=2), Layout(pp=2, dp=2, mbs=2)])
    ]
    assert "pp_idle_s" not in runs[0].categories and runs[1].categories["pp_idle_s"] > 0
    cal = fit(runs, cpu_cluster(), ["compute_efficiency", "intra_bw_gbps"])
    rows = {(r.run.name, r.category): r for r in cal.rows}
    assert set(rows) == {("r0", "step"), ("r1", "step"), ("r1", "pp_idle_s")}
    assert all(abs(r.fitted / r.measured - 1) < 1e-6 for r in cal.rows)
    assert cal.cluster.compute_efficiency == pytest.approx(0.4)


def test_one_run_with_spans_separates_compute_from_communication(tmp_path):
    # Step time alone is one equation; the slowest rank's spans give one per category.
    truth = cpu_cluster(compute_efficiency=0.42, intra_bw_gbps=1.7)
    pairs = [("model.preset", "small"), ("train.global_batch", "16")]
    run = load_run(_synthetic_run(tmp_path, "tp2dp2", pairs, Layout(tp=2, dp=2, mbs=2), truth, spans=True))
    assert {"span_work_s", "span_tp_comm_s", "span_dp_comm_s", "span_optimizer_s"} <= set(run.categories)
    assert "span_bubble_s" not in run.categories  # no pipeline: nothing measured, no equation
    cal = fit([run], cpu_cluster(), ["compute_efficiency", "intra_bw_gbps"])
    assert cal.cluster.compute_efficiency == pytest.approx(0.42) and cal.cluster.intra_bw_gbps == pytest.approx(1.7)
    assert all(abs(r.fitted / r.measured - 1) < 1e-6 for r in cal.rows)


def test_pipeline_on_shared_cores_is_bounded_by_critical_path_and_total_work():
    from threefold.planner.cost import seconds

    shape = model_shape(build_config(None, [("model.preset", "small")]).model)
    B = 16

    def work(lay, cores, exponent=1.0):
        cluster = cpu_cluster(
            devices_per_node=4,
            host_cores=cores,
            layer_overhead_us=0.0,
            step_overhead_s=0.0,
            core_share_exponent=exponent,
            gemm_half_dim=0.0,  # FLOPs at the efficiency alone: no small-GEMM or element-wise time
            elementwise_bw_gbps=1e12,
            reduction_bw_gbps=1e12,
        )
        t = step_terms(shape, cluster, lay, B, "fp32").categories
        return {c: seconds(t[c], cluster) for c in ("compute", "recompute", "overhead", "bubble")}

    # All the model's work for one micro-batch at a full core (prior efficiency 0.5, 0.05 TFLOP/s).
    whole = (shape.layers * shape.layer_hw_flops["none"] + shape.head_flops) * shape.seq_len / 0.5 / 0.05e12
    layer = shape.layer_hw_flops["none"] * shape.seq_len / 0.5 / 0.05e12
    head = shape.head_flops * shape.seq_len / 0.5 / 0.05e12
    # One micro-batch of the ranks the fill and drain pass through (the p - 1 besides the slowest):
    # pp 4 cuts the 6 layers 2, 2, 2, 1 + head (rank 0 slowest); pp 2 cuts 3, 3 + head (the last).
    fills = {4: (2 * 2 * layer + layer + head) / 3, 2: 3 * layer}
    for lay in (Layout(pp=4, dp=1, mbs=2), Layout(pp=2, dp=2, mbs=4)):
        m, p = lay.microbatches(B), lay.pp
        ratio = bubble_ratio("1f1b", p, m, 1)
        alone = work(lay, 4)
        # A core per process: m of the slowest rank's passes, and the bubble at full speed.
        fill = fills[p] * lay.mbs
        assert alone["bubble"] == pytest.approx(m * ratio * fill)
        for cores, exponent in ((2, 1.0), (2, 1.3), (3, 1.0)):
            share = (cores / 4) ** exponent
            shared = work(lay, cores, exponent)
            # Ranks idle in the bubble leave their cores to the others: the step is the larger of
            # the critical path at a full core and every rank's work spread over the shared cores.
            expected = max(alone["compute"] + m * ratio * fill, m * lay.mbs * whole / p / share)
            assert sum(shared.values()) == pytest.approx(expected)
            assert shared["compute"] <= alone["compute"] / share + 1e-12 and shared["bubble"] >= 0
            # The naive model, the bubble at the share too, is slower than both bounds.
            assert sum(shared.values()) < (1 + ratio) * alone["compute"] / share


def test_calibration_on_expert_parallel_runs(tmp_path):
    truth = cpu_cluster(compute_efficiency=0.35, intra_bw_gbps=2.0)
    pairs = [("model.preset", "tiny"), ("model.num_experts", "4"), ("train.global_batch", "16")]
    runs = [
        load_run(_synthetic_run(tmp_path, f"r{i}", pairs, lay, truth))
        for i, lay in enumerate([Layout(dp=1, mbs=4), Layout(dp=4, ep=4, mbs=2), Layout(dp=4, ep=2, mbs=4)])
    ]
    assert [r.layout.ep for r in runs] == [1, 4, 2]
    cal = fit(runs, cpu_cluster(), ["compute_efficiency", "intra_bw_gbps"])
    assert cal.cluster.compute_efficiency == pytest.approx(0.35) and cal.cluster.intra_bw_gbps == pytest.approx(2.0)
    assert all(r.split["ep_comm"] > 0 for r in cal.rows if r.run.layout.ep > 1)


def test_calibrate_cli_table_and_profile(capsys, tmp_path):
    truth = cpu_cluster(compute_efficiency=0.3, intra_bw_gbps=1.5)
    pairs = [("model.preset", "tiny"), ("train.global_batch", "8")]
    a = _synthetic_run(tmp_path, "dp1", pairs, Layout(dp=1, mbs=4), truth)
    b = _synthetic_run(tmp_path, "dp4", pairs, Layout(dp=4, mbs=2), truth)
    c = _synthetic_run(tmp_path, "dp2", pairs, Layout(dp=2, mbs=4), truth)
    profile = tmp_path / "fitted.toml"
    code, out, err = _cli(
        capsys,
        "--calibrate",
        a,
        b,
        "--validate",
        c,
        "--cluster.device",
        "cpu",
        "--cluster.peak_tflops",
        "0.05",
        "--cluster.host_cores",
        "8",
        "--fit",
        "compute_efficiency,intra_bw_gbps",
        "--save-profile",
        str(profile),
    )
    assert code == 0, err
    assert "compute_efficiency 0.5 -> 0.3" in out and "(held out)" in out and "0.0%" in out
    fitted = build_cluster({"profile": str(profile)})
    assert fitted.compute_efficiency == pytest.approx(0.3) and fitted.intra_bw_gbps == pytest.approx(1.5)


def test_category_error_bands_travel_from_calibration_to_the_plan(capsys, tmp_path):
    """Measured DP communication no parameters can fit (three times the model's on dp 2, a third
    on dp 4, though dp 4 moves more): even fitted on its own the category keeps an error band,
    the saved profile keeps it, and a plan made with the profile prints DP comm with it."""
    truth = cpu_cluster(compute_efficiency=0.3, intra_bw_gbps=1.5)
    pairs = [("model.preset", "tiny"), ("train.global_batch", "8")]
    runs = [
        _synthetic_run(tmp_path, name, pairs, lay, truth, spans=True)
        for name, lay in (("dp2", Layout(dp=2, mbs=2)), ("dp4", Layout(dp=4, mbs=2)))
    ]
    for run, factor in zip(runs, (3.0, 1 / 3)):
        spans = Path(run) / "spans.jsonl"
        recs = [json.loads(line) for line in spans.read_text().splitlines()]
        for rec in recs:
            for rank in rec["ranks"]:
                rank["time_s"]["dp_exposed"] *= factor
        spans.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    profile = tmp_path / "fitted.toml"
    code, out, err = _cli(
        capsys,
        "--calibrate",
        *runs,
        "--cluster.device",
        "cpu",
        "--cluster.peak_tflops",
        "0.05",
        "--cluster.host_cores",
        "8",
        "--fit",
        "compute_efficiency",
        "--save-profile",
        str(profile),
    )
    assert code == 0, err
    bands = build_cluster({"profile": str(profile)}).validation
    dp = bands["dp_comm"]
    assert dp.runs == 2 and dp.hi - dp.lo > 0.5 and not dp.within  # no fit serves both runs
    assert bands["work"].within and bands["work"].runs == 2 and "pp_comm" not in bands
    assert f"dp_comm {dp.runs}" in " ".join(out.split()) and "outside: plans print this band with it" in out
    assert "Kendall's tau, predicted vs measured step time over 2 runs: " in out and "interval covers" in out
    saved = build_cluster({"profile": str(profile)}).categories
    assert "dp_comm" in saved and saved["step"]["log_sigma"] > 0  # the category fits travel with the profile
    code, out, err = _cli(
        capsys,
        "--model.preset",
        "tiny",
        "--train.global_batch",
        "8",
        "--cluster.profile",
        str(profile),
        "--cluster.devices_per_node",
        "4",
        "--layout",
        "tp=2,pp=1,dp=2,mbs=2",  # (on pp > 1 the last stage's reduction hides in the drain)
    )
    assert code == 0, err
    time_line = next(line for line in out.splitlines() if line.strip().startswith("time:"))
    assert "DP comm" in time_line and f"(calibration error {dp.text()})" in time_line
    assert "uncalibrated" not in out  # the step's interval is the calibration's
    assert "TP comm" in time_line and "(not validated)" in time_line
    assert (
        "outside, with the error band calibration measured" in out
        and "not measured by any calibration run: tp_comm" in out
    )
    # Without a calibrated profile the split is called an estimate.
    code, out, _ = _cli(
        capsys,
        "--model.preset",
        "tiny",
        "--train.global_batch",
        "8",
        "--cluster.device",
        "cpu",
        "--cluster.peak_tflops",
        "0.05",
        "--top",
        "2",
    )
    assert code == 0 and "shares are the cost model's estimate" in out


def test_a_bad_validation_table_is_one_line(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('[cluster]\ndevice = "cpu"\npeak_tflops = 0.05\n[validation]\ndp_comm = [0.5, -0.5, 2]\n')
    with pytest.raises(ConfigError, match="validation.dp_comm") as info:
        build_cluster({"profile": str(path)})
    assert "\n" not in str(info.value)
    path.write_text('[cluster]\ndevice = "cpu"\npeak_tflops = 0.05\n[validation]\nbandwidth = [0, 0, 1]\n')
    with pytest.raises(ConfigError, match="unknown category"):
        build_cluster({"profile": str(path)})


def test_calibrate_refuses_a_directory_that_is_not_a_run(capsys, tmp_path):
    code, _, err = _cli(
        capsys, "--calibrate", str(tmp_path), "--cluster.device", "cpu", "--cluster.peak_tflops", "0.05"
    )
    assert code == 2 and "not a run directory" in err


def test_cluster_profile_file_and_overrides(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('[cluster]\ndevice = "a100-80gb"\ninter_bw_gbps = 12.5\nnodes = 3\n')
    c = build_cluster({"profile": str(path), "nodes": 5})
    assert (c.device, c.inter_bw_gbps, c.nodes, c.peak_tflops) == ("a100-80gb", 12.5, 5, 312.0)
    path.write_text("[cluster]\nnodez = 3\n")
    with pytest.raises(ConfigError, match="did you mean 'cluster.nodes'"):
        build_cluster({"profile": str(path)})


def test_kendall_tau_and_log_sigma_intervals():
    from threefold.planner.categories import SIGMA_PRIOR, interval, kendall_tau, sigmas

    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    assert kendall_tau([1.0], [2.0]) is None
    lo, hi = interval(2.0, 0.1)
    assert lo == pytest.approx(2.0 * math.exp(-0.2)) and hi == pytest.approx(2.0 * math.exp(0.2))

    class R:
        def __init__(self, cat, measured, fitted):
            self.category, self.measured, self.fitted = cat, measured, fitted

    rows = [R("span_dp_comm_s", 1.0, 1.1), R("span_dp_comm_s", 1.0, 1 / 1.1), R("span_tp_comm_s", 1.0, 2.0)]
    s = sigmas(rows, {"tp_comm": 1}, MEASURED_AS)
    assert s["dp_comm"] == pytest.approx(math.log(1.1))  # rms of +-log 1.1
    assert s["tp_comm"] == SIGMA_PRIOR  # one row, one parameter: no spread left to measure


def test_each_category_gets_its_own_parameters_and_intervals(tmp_path):
    """DP exposure measured at twice what the shared link predicts: the per-category fit gives
    dp_comm its own parameters (tp_comm keeps the shared ones) and matches it, the rows carry
    intervals, and a plan made with the fitted cluster predicts intervals too."""
    truth = cpu_cluster(compute_efficiency=0.3, intra_bw_gbps=1.5)
    pairs = [("model.preset", "tiny"), ("train.global_batch", "8")]
    lays = (("dp2", Layout(dp=2, mbs=2)), ("dp4", Layout(dp=4, mbs=2)), ("tp2dp2", Layout(tp=2, dp=2, mbs=2)))
    runs = [_synthetic_run(tmp_path, name, pairs, lay, truth, spans=True) for name, lay in lays]
    for run in runs:
        spans = Path(run) / "spans.jsonl"
        recs = [json.loads(line) for line in spans.read_text().splitlines()]
        for rec in recs:
            for rank in rec["ranks"]:
                rank["time_s"]["dp_exposed"] *= 2
        spans.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    loaded = [load_run(r) for r in runs]
    cal = fit(loaded, cpu_cluster(), ["compute_efficiency", "intra_bw_gbps"])
    assert "dp_comm" in cal.cluster.categories and "intra_bw_gbps" not in cal.cluster.categories.get("tp_comm", {})
    dp_rows = [r for r in cal.rows if r.category == "span_dp_comm_s"]
    assert len(dp_rows) == 3 and all(abs(r.fitted / r.measured - 1) < 0.02 for r in dp_rows)
    assert all(r.lo <= r.fitted <= r.hi and r.covered for r in cal.rows)
    assert "log_sigma" in cal.cluster.categories["step"] and cal.tau() is not None
    shape = model_shape(loaded[0].cfg.model)
    pred = predict(shape, cluster_for_run(cal.cluster, loaded[0]), loaded[0].layout, 8, "fp32")
    lo, hi = pred.intervals["step"]
    assert pred.calibrated and lo < pred.step_time_s < hi
    assert pred.tokens_per_s_interval[0] < pred.tokens_per_s < pred.tokens_per_s_interval[1]
    loo = leave_one_out(loaded, cpu_cluster(), ["compute_efficiency", "intra_bw_gbps"])
    assert all(r.held_out for r in loo.rows) and {r.run.name for r in loo.rows} == {"dp2", "dp4", "tp2dp2"}


def test_interval_never_narrower_than_the_measurements_own_step_to_step_spread():
    from types import SimpleNamespace

    from threefold.planner.calibrate import noise_floor
    from threefold.planner.runs import _log_spread

    assert _log_spread([1.0, 1.0, 1.0]) == 0.0 and _log_spread([2.0]) == 0.0
    assert _log_spread([1.0, math.e]) == pytest.approx(1.4826 * 0.5)
    assert _log_spread([1.0, math.e, math.e, math.e, 1e-9]) == pytest.approx(0.0)  # robust to one outlier
    a = SimpleNamespace(noise={"span_dp_comm_s": 0.3, "step": 0.01})
    b = SimpleNamespace(noise={"span_dp_comm_s": 0.4, "step": 0.5})
    rows = [SimpleNamespace(run=a, category="span_dp_comm_s"), SimpleNamespace(run=b, category="span_dp_comm_s")]
    rows.append(SimpleNamespace(run=a, category="step"))  # b has no step row: its step noise is not counted
    assert noise_floor(rows, "dp_comm") == pytest.approx(math.sqrt((0.09 + 0.16) / 2))
    assert noise_floor(rows, "step") == pytest.approx(0.01) and noise_floor(rows, "tp_comm") == 0.0


def test_run_predictor_gives_a_gain_with_its_interval(tmp_path):
    """The report's prescriptions read a change's predicted gain and its range (RunPredictor)."""
    from threefold.planner.predict import RunPredictor

    pairs = [("model.preset", "tiny"), ("train.global_batch", "8")]
    run = _synthetic_run(tmp_path, "pp2", pairs, Layout(pp=2, dp=1, mbs=1), cpu_cluster(), spans=True)
    info = json.loads((Path(run) / "run.json").read_text())
    rp = RunPredictor(info, [("device", "cpu"), ("peak_tflops", 0.05)])
    gain = rp.gain({"parallel.micro_batch": 4})
    lo, hi = rp.gain_interval({"parallel.micro_batch": 4})
    assert lo < gain < hi and hi - lo > 0.5  # uncalibrated: a wide range around the gain
    assert rp.gain_interval({"parallel.tp": 3}) is None  # not runnable: no gain, no interval
