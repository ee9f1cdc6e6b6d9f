"""One NVIDIA GPU: CUDA correctness of threefold's code paths against CPU fp32 references, then
MFU of a ~1B model in bf16 and its step time next to a plain PyTorch loop.

    python bench/gpu.py [--json runs/gpu_bench.json] [--steps 12] [--budget-s 420]   # one CUDA GPU
    python bench/gpu.py --device cpu --tiny --json out.json      # the same plumbing on CPU (tests)

Phases, in order, with their expected wall time on one H200: what each took there in its first
run (2026-12-04, torch 2.11.0+cu130; the breakdown and the longer sweep estimated from that run's
step times), rounded up; --budget-s skips a phase whose estimate exceeds the time left.
  sweep        ~15 s  24 bf16 GEMMs, 8 fused causal attention problems, a 1 GiB copy, fused AdamW
                      over 2^27 elements and a tiny kernel's launch cost, fitted to the planner's
                      kernel knobs and written as a [cluster] profile (--profile-out;
                      bench/kernel_sweep.py, threefold/planner/kernel_fit.py)            (9.0 s)
  attention     ~5 s  CUDA start-up; 8 SDPA forward + backward problems (2 x 8 heads x 256 x 64 or
                      128) and their CPU fp32 references                                  (0.8 s)
  optimizer     ~4 s  5 AdamW steps on 1,000 parameters, the foreach path and the fused kernel
                      (torch.optim's first step imports torch._dynamo: most of it)        (3.1 s)
  training     ~10 s  5 tiny-model runs of 3 steps (CPU fp32 reference, fp32, bf16, recompute
                      selective and full), most of it preparing the token cache once      (5.0 s)
  compile      ~25 s  the tiny run with train.compile: inductor compiles a block's forward and
                      backward from a cold cache                                         (14.0 s)
  threefold    ~30 s  gpt-1.3b, 12 steps of 16,384 tokens (~0.3 s each) after compiling its
                      block                                                              (15.6 s)
  memory       ~20 s  one eager gpt-1.3b step under `threefold memory`'s probe           (11.3 s)
  plain        ~90 s  the plain recipe compiled whole (24 blocks traced into one graph), then
                      its 12 steps                                                       (68.6 s)
  breakdown   ~120 s  6 single-GPU configurations of 10 steps each, their kernels by class under
                      torch.profiler next to the planner's classes (bench/gpu_breakdown.py)
  ~320 s in all; the default --budget-s 420 on CUDA (none on CPU) keeps one call under 8 minutes
  with the interpreter's start and a phase that overruns its estimate. --only NAME[,NAME] runs
  those phases and lists the others as skipped.

Checks (value <= tolerance passes; the tolerances and their reasoning: bench/gpu_checks.py):
  sweep fit <knob>             a fitted knob's value (no tolerance; the fit and its points are the
                               JSON's "kernel_fit")
  attention <backend> <dtype>  threefold's AttentionCore (SDPA, causal, GQA) per SDPA backend:
                               max |out - ref| and max |dq - ref dq|, relative to max |ref|
                               ("not served": SDPA refuses that backend for the dtype/shape;
                               any other exception FAILs the check)
  attention <backend> bf16 hd128  the same without GQA at head dim 128, flash and efficient
  fused attention served       required on CUDA: flash or efficient serves bf16 at head dim
                               128 within tolerance (only the math kernel serving fails)
  adamw foreach / fused        threefold's adamw_update (the engine's foreach path) and
                               torch._fused_adamw_ as the engine calls it on CUDA (grouped by decay,
                               a device step count and gradient scale, one skipped step), each
                               against torch.optim.AdamW on the CPU in fp32: max |p - ref| / max |p|
  train fp32                   threefold train (dp = tp = pp = 1, tiny model, 3 steps) against CPU
                               fp32: the largest relative loss difference
  train bf16 + fp32 master     the same in bf16 parameters with fp32 master weights
  recompute selective / full   vs no recompute on the same device (fp32)
  train.compile vs eager       the same tiny run with each block torch.compiled (fp32)
Performance: threefold train in bf16 (fp32 master weights, fp32 gradients: the defaults) on
the model the device's memory allows (gpt-1.3b preset at >= 60 GiB, its paper's learning-rate
schedule), with train.compile (each block compiled), median step time over the steps after
warm-up, MFU against the device's dense bf16 peak (threefold.observe peak table); the plain
loop trains the same model and batches, torch.compile'd whole, with fp32 parameters under
torch.autocast(bf16), F.cross_entropy, AdamW (fused on CUDA, foreach on CPU) and
clip_grad_norm_(foreach=True), the usual PyTorch recipe; both run the same steps and drop the
same warm-up steps (which include the compilation), each after torch._dynamo.reset(). --eager
runs both without compiling. Memory: the threefold run's peak allocated bytes next to `threefold
memory`'s measured and predicted totals for the same configuration (one eager step). Planner:
the planner's prediction of the threefold run on the sweep's fitted profile (or the device's
built-in one when the sweep did not run), next to the run's spans per measured category
(threefold/planner/calibrate.py compare_run; the JSON's performance.planner). No run saves a
checkpoint. TF32 stays off.

Every check and phase is isolated: any exception (or a worker's exit) becomes that row's FAIL with
its first line, and the next check runs. The JSON is rewritten atomically (a temp file, then a
rename) when each phase starts and after every row, so a run killed at any point leaves what it
measured: {"finished": false until the end, "phases": [{name, expected_s, status (running, ok,
fail, skip, interrupted), wall_s}], "checks": [{check, key, value, tolerance, ok, note, phase,
skipped}], "performance", "all_ok", ...}. THREEFOLD_GPU_BENCH_FAIL=<key>[,...] (test-only) makes
the named checks or phases raise (keys: bench/gpu_checks.py).
Prints the table last; exits 0 when no row failed (skipped phases are listed, not failed), 1 when
one did, 2 on bad input or without a CUDA device, 130/143 when a worker was stopped by SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpu_breakdown import breakdown, breakdown_lines  # noqa: E402
from gpu_checks import (  # noqa: E402
    TinyRuns,
    adamw_checks,
    attention_checks,
    compile_check,
    first_line,
    forced,
    training_checks,
)
from gpu_perf import GIB, Performance, pick_model  # noqa: E402
from kernel_sweep import sweep  # noqa: E402

from threefold.atomic import atomic_write  # noqa: E402

# runs/ is git-ignored: a results file at the repository root reads as committed evidence.
DEFAULT_JSON = "runs/gpu_bench.json"
CUDA_BUDGET_S = 420.0
PHASE_NAMES = ("sweep", "attention", "optimizer", "training", "compile", "threefold", "memory", "plain", "breakdown")


@dataclass
class Phase:
    name: str
    expected_s: float
    """Wall time on one H200, estimated from the phase's work (module docstring)."""
    run: Callable
    """run(emit): measures, calling emit(row) for each row."""
    skip: str = ""
    """Why the phase does not run at all (a flag), or ''."""


class Bench:
    """The run's JSON document, rewritten atomically whenever it changes, and the phases' runner:
    budget, isolation, status and wall time per phase."""

    def __init__(self, path: Path, header: dict, budget_s: float, clock=time.perf_counter):
        self.path, self.budget_s, self.clock, self.t0 = path, budget_s, clock, clock()
        self.phase = None
        budget = None if math.isinf(budget_s) else budget_s
        self.doc = {**header, "budget_s": budget, "seconds": 0.0, "finished": False, "all_ok": True}
        self.doc |= {"phases": [], "checks": [], "performance": None}
        self.write()

    def write(self) -> None:
        self.doc["seconds"] = self.clock() - self.t0
        self.doc["all_ok"] = all(r["ok"] for r in self.doc["checks"])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, json.dumps(self.doc, indent=2))

    def emit(self, row: dict) -> None:
        self.doc["checks"].append({**row, "phase": self.phase})
        self.write()

    def _skip(self, phase: Phase, record: dict, why: str) -> None:
        record["status"] = "skip"
        row = {"check": f"{phase.name} phase", "key": phase.name, "value": None, "tolerance": None}
        self.emit({**row, "ok": True, "skipped": True, "note": f"skipped: {why}"})
        print(f"bench/gpu.py: {phase.name}: skipped: {why}", flush=True)

    def run(self, phases: list[Phase]) -> None:
        for phase in phases:
            self.phase = phase.name
            record = {"name": phase.name, "expected_s": phase.expected_s}
            self.doc["phases"].append(record)
            left = self.budget_s - (self.clock() - self.t0)
            if phase.skip:
                self._skip(phase, record, phase.skip)
                continue
            if phase.expected_s > left:
                why = f"expected ~{phase.expected_s:g} s on an H200, "
                why += f"{max(left, 0):.0f} s of --budget-s {self.budget_s:g} left"
                self._skip(phase, record, why)
                continue
            record["status"] = "running"
            self.write()
            start, first = self.clock(), len(self.doc["checks"])
            try:
                forced(phase.name)
                phase.run(self.emit)
            except Exception as err:  # noqa: BLE001 - a phase's failure is its row, the next phase runs
                row = {"check": f"{phase.name} phase", "key": phase.name, "value": None, "tolerance": None}
                self.emit({**row, "ok": False, "note": first_line(err)})
            except BaseException:  # stopped by a signal: what ran is on disk, marked
                record |= {"status": "interrupted", "wall_s": self.clock() - start}
                self.write()
                raise
            ok = all(r["ok"] for r in self.doc["checks"][first:])
            record |= {"status": "ok" if ok else "fail", "wall_s": self.clock() - start}
            self.write()
            print(
                f"bench/gpu.py: {phase.name}: {record['status']} in {record['wall_s']:.1f} s "
                f"(~{phase.expected_s:g} s expected on an H200)",
                flush=True,
            )
        self.phase = None
        self.doc["finished"] = True
        self.write()

    @property
    def skipped(self) -> list[str]:
        return [p["name"] for p in self.doc["phases"] if p.get("status") == "skip"]


def phases(device: str, tiny: bool, memory: int, args, cache_dir: str, doc: dict) -> tuple[list[Phase], dict]:
    """The run's phases, and the performance dict they fill; the sweep's fit goes to doc["kernel_fit"]."""
    runs = TinyRuns(device, cache_dir)
    label, overrides = pick_model(memory, tiny)
    perf = Performance(device, label, overrides, args.steps, cache_dir, not args.eager)
    no_perf = "--skip-perf" if args.skip_perf else ""

    def fit_kernels(emit) -> None:
        doc["kernel_fit"] = sweep(device, doc["device"], Path(args.profile_out), emit)
        perf.profile = doc["kernel_fit"]["profile"]

    def split(emit) -> None:
        profile = doc["kernel_fit"]["profile"] if "kernel_fit" in doc else ""
        doc["breakdown"] = breakdown(device, cache_dir, profile, emit)

    plan = [
        Phase("sweep", 15, fit_kernels),
        Phase("attention", 5, lambda emit: attention_checks(device, emit)),
        Phase("optimizer", 4, lambda emit: adamw_checks(device, emit)),
        Phase("training", 10, lambda emit: training_checks(runs, emit)),
        Phase("compile", 25, lambda emit: compile_check(runs, emit)),
        Phase("threefold", 30, perf.threefold, no_perf),
        Phase("memory", 20, perf.memory, no_perf),
        Phase("plain", 90, perf.plain, no_perf),
        Phase("breakdown", 120, split, no_perf),
    ]
    for phase in plan:
        if args.only and phase.name not in args.only:
            phase.skip = phase.skip or "not in --only"
    return plan, perf.perf


def check_line(c: dict) -> str:
    """One row: a value and ok/FAIL; a check without a value shows why (not served, the error)."""
    note = c.get("note", "")
    tol = "-" if c["tolerance"] is None else f"{c['tolerance']:.1e}"
    if c.get("skipped"):
        return f"| {c['check']} | {note} | {tol} | SKIP |"
    if c["value"] is None:
        return f"| {c['check']} | {note or 'no value'} | {tol} | {'-' if c['ok'] else 'FAIL'} |"
    verdict = "ok" if c["ok"] else "FAIL"
    return f"| {c['check']} | {c['value']:.2e} | {tol} | {verdict}{f' ({note})' if note else ''} |"


def perf_lines(perf: dict) -> list[str]:
    """The contestants that ran, their MFU, and the ratio when both did."""
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    names = (("threefold", "threefold"), ("plain PyTorch (autocast bf16)", "plain"))
    ran = [(name, key) for name, key in names if f"{key}_step_s" in perf]
    if not ran:
        return []
    compiled = perf.get("compiled", False)
    lines = [
        "",
        f"{perf['model']} in bf16 (fp32 master weights), {perf['tokens_per_step']:,} tokens per step, "
        f"median of {perf['steps'] - perf['warmup']} steps after {perf['warmup']} warm-up",
        "",
        "| contestant | step ms | tokens/s | MFU |",
        "|---|---|---|---|",
    ]
    for name, key in ran:
        s = perf[f"{key}_step_s"]
        lines.append(f"| {name} | {s * 1e3:.1f} | {perf['tokens_per_step'] / s:,.0f} | {pct(perf[f'{key}_mfu'])} |")
    lines += [
        "",
        "Contestants:",
        "",
        "- threefold: `threefold train`'s worker (dp = tp = pp = 1), bf16 parameters with fp32 master "
        "weights and fp32 gradients, the DataParallel engine's AdamW (fused on CUDA, foreach on CPU), "
        f"clipping at grad_clip, the chunked loss{', train.compile (each block)' if compiled else ''}.",
        f"- plain PyTorch: {'the model torch.compile-d whole, ' if compiled else ''}fp32 parameters under "
        f"torch.autocast(bf16), F.cross_entropy, AdamW({perf.get('plain_optimizer', '')}), "
        "clip_grad_norm_(foreach=True), zero_grad(set_to_none=True).",
        f"- Both: the same model, init and batches, {perf['steps']} steps, the first {perf['warmup']} "
        "dropped, the device synchronized at each step's end, each after torch._dynamo.reset().",
    ]
    if "ratio" in perf:
        lines.append(f"\nthreefold / plain step time: {perf['ratio']:.3f}")
    planner = perf.get("planner") or {}
    if planner.get("categories"):
        lines += [
            "",
            f"The planner's prediction of the threefold run ({planner['profile']}), per measured category:",
            "",
            "| category | measured ms | predicted ms | predicted / measured - 1 |",
            "|---|---|---|---|",
        ]
        for key, row in planner["categories"].items():
            lines.append(
                f"| {key} | {row['measured_s'] * 1e3:.1f} | {row['predicted_s'] * 1e3:.1f} | {row['error']:+.1%} |"
            )
    mem = perf.get("memory") or {}
    if mem.get("memory_predicted_bytes") and mem.get("train_peak_bytes"):
        lines.append(
            f"threefold peak allocated {mem['train_peak_bytes'] / GIB:.2f} GiB; `threefold memory`: "
            f"measured {mem['memory_measured_bytes'] / GIB:.2f} GiB, "
            f"predicted {mem['memory_predicted_bytes'] / GIB:.2f} GiB "
            f"(peak / predicted {mem['peak_over_predicted']:.2f})"
        )
    return lines


def table(checks: list[dict], perf: dict | None, split: list[dict] = ()) -> str:
    lines = ["| check | value | tolerance | result |", "|---|---|---|---|"]
    lines += [check_line(c) for c in checks]
    return "\n".join(lines + perf_lines(perf or {}) + breakdown_lines(list(split)))


def bad_input(args, torch) -> str:
    """One line saying what is wrong with the command, or ''."""
    if args.device == "cuda" and not torch.cuda.is_available():
        return (
            f"no CUDA device (torch {torch.__version__}, built with CUDA {torch.version.cuda}); "
            "run it on a machine with an NVIDIA GPU, or --device cpu --tiny to test"
        )
    if args.device == "cpu" and not args.tiny:
        return "--device cpu needs --tiny (a ~1B model on CPU would take hours)"
    if args.steps < 1:
        return f"--steps must be >= 1, got {args.steps}"
    if args.budget_s is not None and not args.budget_s >= 0:
        return f"--budget-s must be >= 0 seconds, got {args.budget_s:g}"
    unknown = [name for name in args.only if name not in PHASE_NAMES]
    if unknown:
        return f"--only: no phase {', '.join(unknown)} (phases: {', '.join(PHASE_NAMES)})"
    return ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: only with --tiny, for tests")
    ap.add_argument("--tiny", action="store_true", help="tiny model for the performance part (plumbing checks)")
    ap.add_argument("--steps", type=int, default=12, help="training steps of each performance contestant")
    ap.add_argument("--json", help=f"where to write the results (default: {DEFAULT_JSON} in the checkout)")
    ap.add_argument("--skip-perf", action="store_true", help="correctness checks only")
    ap.add_argument("--eager", action="store_true", help="performance without torch.compile on either side")
    ap.add_argument(
        "--profile-out",
        help="where the sweep writes its fitted [cluster] profile (default: beside the JSON, <json stem>_profile.toml)",
    )
    ap.add_argument(
        "--only",
        type=lambda text: [name for name in text.split(",") if name],
        default=[],
        help=f"run only these phases, comma-separated ({', '.join(PHASE_NAMES)})",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        help=f"skip a phase whose H200 estimate exceeds the seconds left ({CUDA_BUDGET_S:g} on cuda, none on cpu)",
    )
    args = ap.parse_args(argv)
    import torch

    if why := bad_input(args, torch):
        print(f"bench/gpu.py: error: {why}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        name, memory = torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory
    else:
        name, memory = "cpu", 0
    budget = args.budget_s if args.budget_s is not None else CUDA_BUDGET_S if args.device == "cuda" else math.inf
    out = Path(args.json) if args.json else ROOT / DEFAULT_JSON
    args.profile_out = args.profile_out or str(out.with_name(f"{out.stem}_profile.toml"))
    header = {"device": name, "memory_bytes": memory, "torch": torch.__version__, "cuda": torch.version.cuda}
    header["command"] = " ".join(["python", "bench/gpu.py", *(sys.argv[1:] if argv is None else argv)])
    with tempfile.TemporaryDirectory() as cache_dir:
        bench = Bench(out, header, budget)
        plan, perf = phases(args.device, args.tiny, memory, args, cache_dir, bench.doc)
        bench.doc["performance"] = perf
        try:
            bench.run(plan)
        except (SystemExit, KeyboardInterrupt) as err:  # stopped by SIGINT/SIGTERM: the bench stops too
            print(f"bench/gpu.py: stopped in phase {bench.phase}; results so far in {out}", file=sys.stderr)
            return err.code if isinstance(err, SystemExit) and isinstance(err.code, int) else 130
    doc = bench.doc
    print(f"\n{name}, torch {torch.__version__}, {doc['seconds']:.0f} s; results in {out}\n")
    print(table(doc["checks"], doc["performance"], doc.get("breakdown", [])))
    if bench.skipped:
        print(f"\nskipped phases: {', '.join(bench.skipped)} (their SKIP rows say why)")
    return 0 if doc["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
