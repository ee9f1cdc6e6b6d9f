"""bench/gpu.py on CPU: its rows, table and model choice, and that a run returns what it measured
whatever fails (a forced failure, a kill between phases, a budget that skips phases)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = str(ROOT / "bench" / "gpu.py")
sys.path[:0] = [str(ROOT / "bench")]

import gpu  # noqa: E402
import gpu_checks  # noqa: E402
import gpu_perf  # noqa: E402

CPU_KEYS = {
    *(f"attention_{b}_{d}" for b in ("flash", "efficient", "math") for d in ("bf16", "fp32")),
    "attention_flash_bf16_hd128",
    "attention_efficient_bf16_hd128",
    "fused_attention",
    "adamw",
    "adamw_fused",
    "train_fp32",
    "train_bf16",
    "recompute_selective",
    "recompute_full",
    "train_compile",
    "perf_threefold",
    "perf_memory",
    "perf_plain",
    *(f"sweep.{k}" for k in ("gemm_half_dim", "peak_tflops", "compute_efficiency", "elementwise_bw_gbps")),
    "sweep.mem_bw_gbps",
    "sweep.reduction_bw_gbps",
    "breakdown",
}
PHASES = ["sweep", "attention", "optimizer", "training", "compile", "threefold", "memory", "plain", "breakdown"]
NOT_BREAKDOWN = ",".join(PHASES[:-1])  # the breakdown's own runs are a test of their own


def bench_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", gpu_checks.FAIL_ENV: ""}


def run_bench(out: Path, capsys, monkeypatch, *args: str, fail: str = "") -> tuple[int, str]:
    """`python bench/gpu.py --device cpu --tiny --json out *args` in this process (torch and dynamo
    are imported once for every test): its exit status and what it printed."""
    monkeypatch.setenv(gpu_checks.FAIL_ENV, fail)
    rc = gpu.main(["--device", "cpu", "--tiny", "--json", str(out), *args])
    return rc, capsys.readouterr().out


def test_forced_failure_is_one_row_and_every_other_row_is_written(tmp_path, capsys, monkeypatch):
    # The compiled and performance checks are forced too: each is the slow part of its phase on CPU.
    out = tmp_path / "out.json"
    rc, printed = run_bench(
        out, capsys, monkeypatch, "--only", NOT_BREAKDOWN, fail="adamw,train_compile,perf_threefold,perf_plain"
    )
    assert rc == 1
    doc = json.loads(out.read_text())
    rows = {r["key"]: r for r in doc["checks"]}
    assert set(rows) == CPU_KEYS and len(doc["checks"]) == len(CPU_KEYS)
    note = "AssertionError: forced failure of adamw (THREEFOLD_GPU_BENCH_FAIL, test-only)"
    assert rows["adamw"]["ok"] is False and rows["adamw"]["note"] == note  # the first line only
    forced = {"adamw", "train_compile", "perf_threefold", "perf_plain"}
    assert {k for k, r in rows.items() if not r["ok"]} == forced
    for key in CPU_KEYS - forced - {"breakdown"}:  # the rest measured, in the same phase and the phases after
        assert rows[key]["value"] is not None or rows[key]["note"] == "not served", rows[key]
    assert rows["breakdown"]["note"] == "skipped: not in --only"
    assert rows["adamw_fused"]["phase"] == "optimizer" and rows["adamw_fused"]["value"] < 1e-6
    assert doc["performance"]["memory"]["train_peak_bytes"] is None  # threefold's run failed; memory ran
    assert [p["name"] for p in doc["phases"]] == PHASES
    assert [p["status"] for p in doc["phases"]] == ["ok", "ok", "fail", "ok", "fail", "fail", "ok", "fail", "skip"]
    ran = [p for p in doc["phases"] if p["status"] != "skip"]
    assert all(p["wall_s"] >= 0 for p in ran) and doc["finished"] and not doc["all_ok"]
    assert f"| adamw foreach (engine arithmetic) | {note} | 2.4e-06 | FAIL |" in printed
    # The sweep's fit is a profile the planner takes, with the fitted knobs.
    from threefold.planner import build_cluster

    fit = doc["kernel_fit"]
    assert fit["profile"] == str(tmp_path / "out_profile.toml") and len(fit["points"]["gemm"]) == 9
    planned = build_cluster({"profile": fit["profile"]})
    for key, value in fit["knobs"].items():
        assert getattr(planned, key) == pytest.approx(value) and rows[f"sweep.{key}"]["value"] == value, key


def test_json_survives_a_kill_between_phases(tmp_path):
    out = tmp_path / "out.json"
    cmd = [sys.executable, GPU, "--device", "cpu", "--tiny", "--json", str(out)]
    proc = subprocess.Popen(cmd, env=bench_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, done = time.monotonic() + 90, []
        while not done and time.monotonic() < deadline:
            if out.exists():  # written by rename: never half a file
                phases = json.loads(out.read_text())["phases"]
                done = [p for p in phases if p["name"] == "attention" and p.get("status") in ("ok", "fail")]
            time.sleep(0.05)
        assert done, "the attention phase did not finish within 90 s"
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    doc = json.loads(out.read_text())
    assert not doc["finished"]
    first, second = doc["phases"][:2]
    assert (first["name"], first["status"], second["name"], second["status"]) == ("sweep", "ok", "attention", "ok")
    assert second["wall_s"] > 0
    attention = [r for r in doc["checks"] if r["phase"] == "attention"]
    assert len(attention) == 9 and all(r["ok"] for r in attention)
    assert {p["status"] for p in doc["phases"][2:]} <= {"ok", "fail", "running"}


def test_budget_skips_what_would_not_finish_and_says_so(tmp_path, capsys, monkeypatch):
    # Every phase's H200 estimate but the optimizer's (4 s) exceeds a 4.5 s budget.
    out = tmp_path / "out.json"
    rc, printed = run_bench(out, capsys, monkeypatch, "--budget-s", "4.5")
    assert rc == 0
    doc = json.loads(out.read_text())
    status = {p["name"]: p["status"] for p in doc["phases"]}
    assert status == {**{name: "skip" for name in PHASES}, "optimizer": "ok"}
    skips = [r for r in doc["checks"] if r.get("skipped")]
    assert [r["key"] for r in skips] == [name for name in PHASES if name != "optimizer"]
    assert re.fullmatch(r"skipped: expected ~15 s on an H200, [34] s of --budget-s 4.5 left", skips[0]["note"])
    assert re.fullmatch(r"skipped: expected ~5 s on an H200, [34] s of --budget-s 4.5 left", skips[1]["note"])
    assert skips[2]["note"].startswith("skipped: expected ~10 s on an H200, ")
    assert [r["key"] for r in doc["checks"] if not r.get("skipped")] == ["adamw", "adamw_fused"]
    assert doc["budget_s"] == 4.5 and doc["finished"] and doc["all_ok"]
    assert "| attention phase | skipped: expected ~5 s on an H200" in printed
    assert "skipped phases: sweep, attention, training, compile, threefold, memory, plain, breakdown" in printed


def test_phases_are_isolated_and_the_budget_counts_time_spent(tmp_path):
    now = [0.0]

    def failing(emit):
        now[0] += 30
        raise AssertionError("the first line\nnot this one")

    def passing(emit):
        now[0] += 1
        emit(gpu_checks.check("x", 0.0, 1.0, "x"))

    bench = gpu.Bench(tmp_path / "b.json", {"device": "test"}, 50.0, clock=lambda: now[0])
    bench.run([gpu.Phase("a", 40, failing), gpu.Phase("b", 25, passing), gpu.Phase("c", 10, passing)])
    doc = json.loads((tmp_path / "b.json").read_text())
    assert [(p["name"], p["status"]) for p in doc["phases"]] == [("a", "fail"), ("b", "skip"), ("c", "ok")]
    assert doc["phases"][0]["wall_s"] == 30
    assert [(r["phase"], r["ok"], r.get("note")) for r in doc["checks"]] == [
        ("a", False, "AssertionError: the first line"),
        ("b", True, "skipped: expected ~25 s on an H200, 20 s of --budget-s 50 left"),
        ("c", True, None),
    ]
    assert bench.skipped == ["b"] and doc["finished"] and not doc["all_ok"]


def test_guarded_rows_take_any_failure_but_a_signal_stop():
    def raises(err):
        def measure():
            raise err

        return measure

    assert gpu_checks.guarded("k", "k", 1.0, raises(AssertionError()))["note"] == "AssertionError: "
    exited = gpu_checks.guarded("k", "k", 1.0, raises(SystemExit(2)))
    assert not exited["ok"] and exited["note"] == "SystemExit: the worker exited with code 2"
    with pytest.raises(SystemExit):
        gpu_checks.guarded("k", "k", 1.0, raises(SystemExit(143)))
    assert gpu_checks.guarded("k", "k", None, lambda: 3.0) == {
        "check": "k",
        "key": "k",
        "value": 3.0,
        "tolerance": None,
        "ok": True,
    }


def test_the_planner_predicts_the_bench_run_category_by_category(tmp_path):
    # A tiny run's spans against the planner, on the built-in profile and on a profile that
    # halves the GEMM rate: the work it predicts follows the profile, the measurement does not.
    import dataclasses

    from threefold.planner import build_cluster
    from threefold.planner.cluster import profile_toml

    logs = tmp_path / "logs"
    logs.mkdir()
    # Spans lines average log.interval steps: two of them after the 2 warm-up steps.
    cache = str(tmp_path / "cache")
    gpu_checks.train_metrics(gpu_checks.TINY, "cpu", "fp32", 6, cache, str(logs), **{"log.interval": 2})
    perf = gpu_perf.Performance("cpu", "tiny", gpu_checks.TINY, 6, cache, False)
    built_in = perf._planner_comparison(str(logs))
    assert built_in["profile"] == "built-in cpu"
    rows = built_in["categories"]
    assert {"step", "span_work_s", "span_optimizer_s"} <= set(rows)
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in rows.values())
    base = build_cluster({"device": "cpu"})
    slow = tmp_path / "slow.toml"
    slow.write_text(profile_toml(dataclasses.replace(base, compute_efficiency=base.compute_efficiency / 2)))
    perf.profile = str(slow)
    halved = perf._planner_comparison(str(logs))["categories"]
    assert halved["span_work_s"]["measured_s"] == rows["span_work_s"]["measured_s"]
    assert halved["span_work_s"]["predicted_s"] > 1.3 * rows["span_work_s"]["predicted_s"]


def test_the_sweeps_attention_timing_runs_and_fits_on_cpu():
    # The attention problems run on CUDA only; their timing and fit are the same code on CPU.
    import kernel_sweep
    import torch

    from threefold.planner import build_cluster
    from threefold.planner.kernel_fit import AttentionPoint, fit_kernels

    timer, cpu = kernel_sweep._timer(torch.device("cpu")), torch.device("cpu")
    points = [
        AttentionPoint(1, 4, seq, 16, kernel_sweep._attention_seconds(timer, cpu, torch.float32, 1, 4, seq, 16))
        for seq in (64, 128, 256)
    ]
    fit = fit_kernels(build_cluster({"device": "h200"}), [], points, [])
    assert set(fit.knobs) == {"attention_efficiency", "attention_half_seq"} and fit.knobs["attention_efficiency"] > 0


def test_failed_cpu_run_restores_threads_and_leaves_its_group(tmp_path, monkeypatch):
    import torch
    import torch.distributed as dist

    threads, calls = torch.get_num_threads(), []
    set_threads = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), set_threads(n)))
    (tmp_path / "empty").mkdir()
    set_threads(2)
    try:
        with pytest.raises((Exception, SystemExit)):  # noqa: B017 - the worker's failure, whichever it is
            gpu_checks.train_metrics({**gpu_checks.TINY, "data.path": str(tmp_path / "empty")}, "cpu", "fp32", 1, "")
        assert calls[0] == 1  # the worker joined its group with train.threads = 1, then failed on the data
        assert torch.get_num_threads() == 2
        assert not dist.is_initialized()
    finally:
        set_threads(threads)


def test_bench_configs_never_save():
    cfg = gpu_checks.make_cfg(gpu_checks.TINY, "cpu", "fp32", 3, "/tmp/logs", "")
    assert cfg.log.dir == "/tmp/logs" and cfg.checkpoint.dir == ""


def test_tolerances_follow_the_arithmetic():
    assert gpu_checks.ADAMW_TOL == pytest.approx(20 * 2**-23)  # 4 ulps x 5 steps
    assert gpu_checks.reordered_bound([64, 256]) == pytest.approx(2 * 2**-24 * 24)
    tiny = gpu_checks.TinyRuns("cpu", "").fp32_bound()
    assert 1e-4 < tiny < 3e-4  # 3 steps through 4 blocks of width 128, 1,024 tokens


def test_gpu_model_choice_by_memory():
    gib = 2**30
    assert gpu_perf.pick_model(141 * gib)[0] == "gpt-1.3b"
    assert gpu_perf.pick_model(80 * gib)[1]["train.micro_batch"] == 4
    assert gpu_perf.pick_model(40 * gib)[1]["train.micro_batch"] == 1
    assert gpu_perf.pick_model(24 * gib)[0] == "gpt-350m"
    assert gpu_perf.pick_model(0, tiny=True)[1]["model.preset"] == "tiny"
    for mem in (8, 16, 40, 80):  # every choice is a valid configuration
        gpu_checks.make_cfg(gpu_perf.pick_model(mem * gib)[1], "cpu", "bf16", 2, "", "")


def test_gpu_table_marks_failures_skips_and_unserved_backends():
    checks = [
        gpu_checks.check("a", 1e-7, 1e-5),
        gpu_checks.check("b", 1.0, 1e-5),
        {"check": "attention efficient bfloat16", "value": None, "tolerance": 2e-2, "ok": True, "note": "not served"},
        {
            "check": "attention flash bfloat16",
            "value": None,
            "tolerance": 2e-2,
            "ok": False,
            "note": "RuntimeError: CUDA error: an illegal memory access",
        },
        {"check": "plain phase", "value": None, "tolerance": None, "ok": True, "skipped": True, "note": "skipped: x"},
    ]
    perf = {
        "model": "tiny",
        "tokens_per_step": 1000,
        "steps": 4,
        "warmup": 2,
        "threefold_step_s": 0.5,
        "plain_step_s": 0.4,
        "threefold_mfu": 0.4,
        "plain_mfu": None,
        "ratio": 1.25,
    }
    text = gpu.table(checks, perf)
    assert "| a | 1.00e-07 | 1.0e-05 | ok |" in text and "| b | 1.00e+00 | 1.0e-05 | FAIL |" in text
    assert "| attention efficient bfloat16 | not served | 2.0e-02 | - |" in text
    assert "| attention flash bfloat16 | RuntimeError: CUDA error: an illegal memory access | 2.0e-02 | FAIL |" in text
    assert "| plain phase | skipped: x | - | SKIP |" in text
    assert "| threefold | 500.0 | 2,000 | 40.0% |" in text and "| - |" in text
    assert "Contestants:" in text
    assert text.rstrip().endswith("1.250")
    alone = gpu.table(checks[:1], {k: v for k, v in perf.items() if not k.startswith(("plain", "ratio"))})
    assert "| threefold | 500.0 |" in alone and "plain PyTorch (autocast" not in alone and "1.250" not in alone
    assert gpu.table(checks[:1], {"model": "gpt-1.3b"}).splitlines()[-1] == "| a | 1.00e-07 | 1.0e-05 | ok |"


def test_gpu_only_sdpa_refusals_count_as_not_served():
    def refuse(message):
        def measure():
            raise RuntimeError(message)

        return measure

    cpu = gpu_checks.backend_check("x", 2e-2, refuse("No viable backend for scaled_dot_product_attention was found."))
    cuda = gpu_checks.backend_check("x", 2e-2, refuse("No available kernel.  Aborting execution."))
    assert cpu["ok"] and cuda["ok"] and cpu["value"] is None and cpu["note"] == "not served"
    other = gpu_checks.backend_check("x", 2e-2, refuse("CUDA error: misaligned address\nmore detail"))
    assert not other["ok"] and other["value"] is None
    assert other["note"] == "RuntimeError: CUDA error: misaligned address"
    broken = gpu_checks.backend_check("x", 2e-2, lambda: 1 / 0)
    assert not broken["ok"] and broken["note"].startswith("ZeroDivisionError")
    ok, wrong = (gpu_checks.backend_check("x", 2e-2, lambda v=v: v) for v in (1e-3, 0.5))
    assert ok["ok"] and not wrong["ok"]


def test_gpu_fused_attention_requirement():
    served = gpu_checks.check("attention flash bf16 hd128", 5e-3, 2e-2)
    refused = {
        "check": "attention efficient bf16 hd128",
        "value": None,
        "tolerance": 2e-2,
        "ok": True,
        "note": "not served",
    }
    wrong = gpu_checks.check("attention efficient bf16 hd128", 0.3, 2e-2)
    requirement = gpu_checks.fused_requirement
    assert requirement([served, refused], "cuda")["ok"]
    assert requirement([served, refused], "cuda")["note"] == "flash"
    none = requirement([dict(refused, check="attention flash bf16 hd128"), refused], "cuda")
    assert not none["ok"] and none["value"] is None and none["note"] == "no fused backend served"
    assert not requirement([wrong, refused], "cuda")["ok"]  # served, but wrong: fails too
    on_cpu = requirement([dict(refused, check="attention flash bf16 hd128"), refused], "cpu")
    assert on_cpu["ok"] and "required on cuda only" in on_cpu["note"]


def test_gpu_json_defaults_under_ignored_runs():
    assert gpu.DEFAULT_JSON == "runs/gpu_bench.json" and "runs/" in (ROOT / ".gitignore").read_text().split()


def test_gpu_adamw_paths_match_torch_on_cpu():
    case = gpu_checks.adamw_case("cpu")
    assert gpu_checks.adamw_foreach_error("cpu", case) == 0.0  # torch's foreach op sequence: bit-identical
    assert gpu_checks.adamw_fused_error("cpu", case) <= gpu_checks.ADAMW_TOL  # another op order, within bounds


def test_gpu_script_without_cuda_exits_with_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert gpu.main([]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "no CUDA device" in err
    assert gpu.main(["--device", "cpu"]) == 2 and "needs --tiny" in capsys.readouterr().err


class _Kernel:
    """A profiler event as kineto gives it: name() and duration_ns()."""

    def __init__(self, name: str, ns: int):
        self._name, self._ns = name, ns

    def name(self) -> str:
        return self._name

    def duration_ns(self) -> int:
        return self._ns


def test_kernels_are_classed_by_name_as_shares_of_the_window():
    import gpu_breakdown

    events = [
        _Kernel("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT", 40_000_000),
        _Kernel("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", 10_000_000),
        _Kernel("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>", 5_000_000),
        _Kernel("triton_poi_fused_gelu_gelu_backward_view_0", 20_000_000),
        _Kernel("Memcpy HtoD (Pageable -> Device)", 1_000_000),
        _Kernel("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT", 4_000_000),
    ]
    classes, top = gpu_breakdown.classify(events, window_s=0.1)
    assert classes == pytest.approx(
        {"kernels": 60.0, "gemm": 0.44, "attention": 0.1, "optimizer": 0.05, "elementwise": 0.2, "memcpy": 0.01}
    )
    assert top[0][:2] == ("gemm", "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT")
    assert top[0][2:] == pytest.approx((0.44, 20.0))  # its share, and 2 launches in 0.1 s


def test_the_breakdown_runs_a_configuration_and_prices_it(tmp_path):
    # On CPU there are no device kernels to class: the step, the optimizer span and the
    # planner's classes are what the row holds, and the table says so.
    import gpu_breakdown

    row = gpu_breakdown.one_config("tiny", gpu_checks.TINY, "cpu", str(tmp_path / "cache"), "")
    assert row["step_s"] > 0 and row["optimizer_span_s"] > 0 and row["kernels"] == {}
    pred = row["predicted"]
    assert set(pred) == {"gemm", "attention", "elementwise", "optimizer", "overhead", "step"}
    assert all(v >= 0 for v in pred.values()) and pred["step"] >= sum(v for k, v in pred.items() if k != "step")
    lines = gpu_breakdown.breakdown_lines([row])
    assert any(line.startswith("| tiny | step | ") for line in lines)
    assert "| tiny | gemm | - |" in "\n".join(lines)  # nothing measured on cpu, nothing compared


def test_only_names_phases_that_exist(capsys):
    assert gpu.main(["--device", "cpu", "--tiny", "--only", "sweep,nonsense"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "bench/gpu.py: error: --only: no phase nonsense (phases: " + ", ".join(PHASES) + ")"
