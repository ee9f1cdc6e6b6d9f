"""The whole benchmark suite in one command: every side-by-side comparison, then docs/benchmarks.md
rewritten from scratch with the tables, the machine and the command.

    python bench/run.py                 # full suite (18 min on 2 cores); rewrites docs/benchmarks.md
    python bench/run.py --quick         # every section with few steps (4 min); prints, writes nothing
    python bench/run.py --only threed_vs_torch dp_vs_ddp [--out FILE]
    python bench/run.py --list
    threefold bench ...                 # the same

Each section runs in this process tree (its ranks are spawned from here), contestants
interleaved inside it; every number in the written file comes from this run. The full run
writes docs/benchmarks.md unless --out says otherwise; --quick and --only write only where
--out points (their numbers are partial). --json FILE also saves the ratios and the machine.

Adding a section is one `Script(...)` line in SECTIONS below: the bench/ module whose
`main(argv)` prints markdown tables and returns its rows (with per-round data for timed
comparisons), a title, the arguments of a full and of a quick run, a function from the rows to
named ratios (bench/stats.py Intervals; a bare float counts as exact), and goals by
ratio-name prefix. A goal is met only when the ratio's whole 95% interval clears it. A section
whose peer is an optional extra names its module (`requires`): without it, the section is
skipped with one line.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
os.environ.setdefault("OMP_NUM_THREADS", "1")

from stats import Interval, exact  # noqa: E402
from suite import Script, run_sections, write_json, write_markdown  # noqa: E402
from timing import ratio  # noqa: E402

# Every timed comparison: the median per-round ratio with its 95% bootstrap interval
# (bench/stats.py); deterministic quantities (memory, bytes, loss differences) are exact.
# A section's module is imported inside its ratio function: it has run by then, and
# `--list` stays free of torch.


def _dp_ratios(r: dict) -> dict[str, Interval]:
    from dp_vs_ddp import hidden

    out = {
        f"{label} time": ratio(r[key], "threefold", "torch")
        for key, label in (
            ("dp", "zero 0 / DDP"),
            ("zero1", "zero 1 / ZeroRedundancyOptimizer"),
            ("zero3", "zero 3 / FSDP2"),
            ("zero1_ddp", "zero 1 / DDP"),
        )
    }
    out["DDP / ZeroRedundancyOptimizer time"] = ratio(r["ddp_zero1"], "threefold", "torch")
    out["zero 3 / FSDP2 memory"] = exact(r["zero3_memory"]["threefold"] / r["zero3_memory"]["torch"])
    for key, label in (("overlap0", "zero 0"), ("overlap2", "zero 2")):
        out[f"{label} DP communication hidden"] = hidden(r[key])
    return out


def _deepspeed_ratios(r: dict) -> dict[str, Interval]:
    return {
        f"zero {stage} / DeepSpeed time": ratio(s["blocks"], "threefold", "deepspeed")
        for stage, s in r["stages"].items()
    }


def _planner_worst(rows: list[dict]) -> Interval:
    from planner_calibration import worst_error

    return worst_error(rows)


def _threed_ratios(r: dict) -> dict[str, Interval]:
    from threed_vs_torch import comm_ratios

    return {
        "tokens/s threefold / torch": ratio(r["blocks"], "torch", "threefold"),
        "max loss difference": exact(r["loss_diff"]),
        **{k: exact(v) for k, v in comm_ratios(r).items()},
    }


def _bubble_ratios(rows: list) -> dict[str, Interval]:
    from pp_bubble import over_theory

    return {f"{r['schedule']} bubble measured / theory": over_theory(r) for r in rows}


def _checkpoint_ratios(r: dict) -> dict[str, Interval]:
    from checkpoint_bench import async_over_sync

    return {f"{preset} async / sync blocking": async_over_sync(v) for preset, v in r.items()}


def _moe_ratios(rows: list) -> dict[str, Interval]:
    from moe_dispatch import share, vs_ep1

    return {
        **{f"ep{r['ep']} / ep1 tokens/s": vs_ep1(rows[0], r) for r in rows[1:]},
        **{f"ep{r['ep']} all-to-all share": share(r) for r in rows[1:]},
    }


def _ring_ratio(r: dict) -> dict[str, Interval]:
    from ring_latency import group_ratio

    return {"group of 4 / group of 2 all-reduce time": group_ratio(r["samples"], 4, 2)}


def _overlap_free_ratios(r: dict) -> dict[str, Interval]:
    out = {f"{name} on / off time": ratio(blocks, "on", "off") for name, blocks in r["timed"].items()}
    for name, m in r["memory"].items():
        out[f"pp2 {name} stage 0 activations on / off"] = exact(m["on"]["measured"] / m["off"]["measured"])
    return out


SECTIONS = [
    Script(
        "overhead",
        "Framework overhead: threefold vs a plain PyTorch loop (single process)",
        "--rounds 6 --steps 20",
        "--quick",
        lambda r: {"threefold / plain loop time": ratio(r["blocks"], "threefold", "plain")},
        {"threefold / plain": "<= 1.05"},
    ),
    Script(
        "dp_vs_ddp",
        "Data parallelism and ZeRO vs DDP, ZeroRedundancyOptimizer, FSDP2 (2 ranks)",
        "--rounds 12 --steps 2",
        "--quick",
        _dp_ratios,
        {
            "zero 0 / DDP": "<= 1.0",
            "zero 1 / ZeroRedundancyOptimizer": "<= 0.9",
            "zero 3 / FSDP2 time": "<= 0.8",
            "zero 3 / FSDP2 memory": "<= 1.0",
        },
    ),
    Script(
        "zero_vs_deepspeed",
        "ZeRO 1, 2, 3 vs DeepSpeed's (2 ranks; optional: the bench extra)",
        "--rounds 20 --steps 3",
        "--quick",
        _deepspeed_ratios,
        {"zero": "<= 0.8"},
        requires="deepspeed",
        install="pip install -e '.[bench]'",
    ),
    Script(
        "tp_vs_dtensor",
        "Tensor parallelism vs PyTorch DTensor",
        "--rounds 6 --steps 2 --warmup 2",
        "--tp 2 --sp off --rounds 3 --steps 1 --warmup 2",
        lambda rows: {f"tp{r['tp']} sp {r['sp']} time": ratio(r["blocks"], "threefold", "dtensor") for r in rows},
        {"tp": "<= 0.8"},
    ),
    Script(
        "tp_memory",
        "Activation memory per rank vs the formulas (Korthikanti et al. 2022, adjusted)",
        "",
        "--tp 2 --attention flash --seq 128",
        lambda rows: {"worst distance of measured / predicted from 1": exact(max(abs(r["ratio"] - 1) for r in rows))},
        {"worst": "<= 0.01"},
    ),
    Script(
        "pp_bubble",
        "Pipeline bubble vs theory (equal-cost sleeping stages)",
        "--p 4 --m 8 --forward-ms 60 --steps 5",
        "--p 2 --m 4 --forward-ms 20 --steps 3",
        _bubble_ratios,
        note="Bubble = 1 - compute / step wall time (mean over ranks per step; the ratio is the median over "
        "steps with its bootstrap interval); theory: gpipe and 1f1b (p-1)/(m+p-1), interleaved "
        "(p-1)/(v m+p-1), zb (p-1)/(3m+p-1). Every stage boundary costs a gloo transfer the formulas "
        "count as zero.",
    ),
    Script(
        "pp_vs_torch",
        "Pipeline schedules vs torch.distributed.pipelining",
        "--rounds 8 --steps 1",
        "--quick --pairs 1f1b interleaved",
        lambda rows: {f"{r['name']} p{r['p']} time": ratio(r["blocks"], "threefold", "torch") for r in rows},
        {"gpipe": "<= 0.9", "1f1b": "<= 0.9", "interleaved": "<= 0.9"},
    ),
    Script(
        "moe_dispatch",
        "Expert parallelism: all-to-all dispatch and MoE tokens/s (ep 1, 2, 4; 4 ranks)",
        "--rounds 8 --steps 3",
        "--quick",
        _moe_ratios,
        note="On one CPU box ep trades each rank's share of expert matmuls for all-to-all traffic; the "
        "ratios show what that exchange costs over gloo, not a speed-up to expect from CPUs.",
    ),
    Script(
        "spans_overhead",
        "Span recording overhead: log.spans on vs off (tp2 x pp2, 4 ranks)",
        "--rounds 4 --steps 20 --warmup 4",
        "--quick",
        lambda r: {"spans on / off step time": ratio(r["blocks"], "on", "off")},
        {"spans on": "<= 1.02"},
    ),
    Script(
        "overlap_free",
        "Backward mechanics on vs off: TP dW overlap, freeing sent pipeline outputs",
        "--rounds 4 --steps 12 --warmup 3",
        "--quick",
        _overlap_free_ratios,
        {"tp2 on": "<= 1.0", "pp2 gpipe stage 0": "< 1.0", "pp2 1f1b stage 0": "< 1.0"},
        note="On 2 shared cores gloo's communication thread competes with the matmuls it should hide behind, "
        "so the CPU shows what the overlap costs or saves here, not what NVLink would.",
    ),
    Script(
        "checkpoint_bench",
        "Checkpoints: save/load throughput, async vs sync blocking, MTTR (CPU)",
        "--presets tiny,small --steps 8 --interval 2",
        "--quick",
        _checkpoint_ratios,
        {"tiny async": "<= 0.1", "small async": "<= 0.1"},
    ),
    Script(
        "ring_latency",
        "Collective call cost and ring-step latency with ranks sharing cores (gloo, 4 ranks)",
        "",
        "--quick",
        _ring_ratio,
        note="The cpu planner profile's intra_latency_us and collective_overhead_us priors come from this "
        "measurement (docs/planner.md).",
    ),
    Script(
        "planner_calibration",
        "Planner: calibrated on two runs, predicted vs measured step time (1-8 processes)",
        "--out runs/planner_calibration --steps 8",
        "--quick --out runs/planner_calibration_quick",
        lambda rows: {"worst held-out |predicted / measured - 1|": _planner_worst(rows)},
        {"worst held-out": "<= 0.25"},
    ),
    Script(
        "threed_vs_torch",
        "Full 3D vs PyTorch's composable stack (FSDP2 + DTensor TP + pipelining)",
        "--rounds 9 --steps 1",
        "--quick",
        _threed_ratios,
        {"tokens/s": ">= 1.0", "max loss": "<= 1e-05", "memory": "<= 1.05"},
    ),
]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="bench/run.py", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="few steps per section (about 4 minutes on 2 cores); indicative"
    )
    ap.add_argument("--only", nargs="+", metavar="SECTION", help="run only these sections (see --list)")
    ap.add_argument("--out", help="markdown file to write (default: docs/benchmarks.md for a full run)")
    ap.add_argument("--json", help="also write the ratios and the machine description here")
    ap.add_argument("--list", action="store_true", help="list the sections and exit")
    args = ap.parse_args(argv)
    names = [s.name for s in SECTIONS]
    if args.list:
        for s in SECTIONS:
            print(f"{s.name:18} {s.title}")
        return 0
    unknown = sorted(set(args.only or []) - set(names))
    if unknown:
        print(f"bench/run.py: error: unknown section {unknown[0]!r} (valid: {', '.join(names)})", file=sys.stderr)
        return 2
    sections = [s for s in SECTIONS if not args.only or s.name in args.only]
    out = args.out or (None if args.quick or args.only else str(ROOT / "docs" / "benchmarks.md"))
    return run_suite(
        sections, args.quick, out, args.json, "python bench/run.py" + "".join(f" {shlex.quote(a)}" for a in argv)
    )


def run_suite(sections: list, quick: bool, out: str | None, json_path: str | None, command: str) -> int:
    from suite import machine

    info = machine()
    t0 = time.perf_counter()
    results = run_sections(sections, quick, log=lambda *a, **k: print(*a, file=sys.stderr, **k))
    text = write_markdown(results, info, command, time.perf_counter() - t0, quick)
    if out:
        from threefold.atomic import atomic_write

        atomic_write(out, text + "\n")  # never leave a half-written document
        print(f"bench: wrote {out}", file=sys.stderr)
    else:
        print(text)
    if json_path:
        write_json(json_path, results, info, command)
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
