"""Context parallelism at long sequences: step time and memory at cp 1/2/4, ring and a2a.

    python bench/context_parallel.py                          # both levels, seq 1k 4k 16k
    python bench/context_parallel.py --level attention --seqs 1024 4096 --rounds 5
    python bench/context_parallel.py --level train --seqs 1024 4096 --rounds 3

(a) attention: forward + backward of context_parallel_attention on random q/k/v of the tiny
    model's shape (4 heads, 2 kv heads, head dim 32, batch 2), in ONE 4-process gloo job with
    groups of 1, 2 and 4 ranks, the configurations taking turns in every round (so load drift
    hits them alike; the idle ranks wait in a barrier). Per configuration: the slowest member's
    seconds, their ratio to cp 1 in the same round (bench/stats.py paired_ratio, median with a
    95% bootstrap interval), the peak tensor bytes allocated during one forward+backward on
    rank 0 (training/memory_probe.AllocationPeak: torch's CPU allocator reports to the profiler;
    transients included) and the bytes autograd saved for backward (q, k, v, output, lse), the
    bytes rank 0 handed to the cp group against analytic_bytes, and the ring's hidden fraction
    (measure_overlap).
(b) train: `threefold train --model.preset tiny --model.seq_len N --parallel.cp C --parallel.cp_impl X`
    (global batch 2, micro-batch 1), rounds of every configuration in turn; the median step
    time of steps 2.. of each run, as a ratio to cp 1's in the same round; the ring's hidden
    fraction on the run's last step, which is traced (`cp_hidden` in metrics.jsonl: the step's
    exposed cp wait against its exchanges replayed alone after it; `cp_hidden_own`: the same
    with the waits for a slower cp peer set aside); and `threefold memory`'s
    measured activation bytes on rank 0 (autograd's saved tensors at their peak).

The analytic minimum is cp 1's time / cp and cp 1's memory / cp. These machines have 2 cores
for everyone: cp 4 runs 4 processes on 2 cores and measures oversubscription, not scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]
os.environ.setdefault("OMP_NUM_THREADS", "1")

from stats import exact, paired_ratio, show  # noqa: E402

from harness import run_ranks  # noqa: E402

BATCH, HEADS, KV_HEADS, HD = 2, 4, 2, 32  # the tiny preset's attention: hidden 128 over 4 heads
MiB = 2**20


def configs(cps: list[int], impls: list[str], heads: int, kv_heads: int) -> tuple[list, list]:
    """(runnable (cp, impl) pairs with cp 1 once, refused pairs with the reason)."""
    run, refused = [(1, "none")], []
    for cp in cps:
        for impl in impls:
            if cp == 1:
                continue
            if impl == "a2a" and (heads % cp or kv_heads % cp):
                refused.append((cp, impl, f"a2a needs heads {heads} and kv_heads {kv_heads} divisible by cp {cp}"))
            else:
                run.append((cp, impl))
    return run, refused


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while fn() runs its forward."""
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _once(qkvw, group, impl: str, measure: bool):
    """One forward+backward of this rank's shard: (seconds, peak bytes or 0, saved bytes, bytes
    handed to the group, the local q/k/v)."""
    import torch

    from threefold.distributed.context_parallel import context_parallel_attention, shard_sequence
    from threefold.training.memory_probe import AllocationPeak

    cp = group.size
    q, k, v, w = (shard_sequence(x, 2, cp, group.rank) for x in qkvw)
    mine = [x.requires_grad_() for x in (q, k, v)]
    group.stats.reset()
    peak = AllocationPeak(torch.device("cpu")).start() if measure else None
    start = time.perf_counter()
    y, saved = _saved_bytes(lambda: context_parallel_attention(*mine, group, "ring" if cp == 1 else impl))
    y.backward(w)
    took = time.perf_counter() - start
    return took, (peak.stop() if measure else 0), saved, group.stats.total_bytes, mine


def attention_worker(seqs: list[int], runs: list, rounds: dict) -> list[dict]:
    """Every rank joins every barrier; the members of a configuration's group run it."""
    import torch

    from threefold.distributed import comm
    from threefold.distributed.comm import Group
    from threefold.distributed.context_parallel import (
        analytic_bytes,
        measure_overlap,
    )
    from threefold.distributed.runtime import init_distributed, shutdown_distributed

    cpu = torch.device("cpu")
    init_distributed(cpu, timeout_s=1800)
    world_group = comm.job_group()
    rank = comm.global_rank()
    groups = {}
    for cp in sorted({cp for cp, _ in runs}):
        handle = comm.new_group(list(range(cp))) if cp > 1 else None
        if rank < cp:
            groups[cp] = Group(f"cp{cp}", list(range(cp)), handle, device=cpu, span_category="cp_comm")
    out = []
    for seq in seqs:
        g = torch.Generator().manual_seed(seq)
        q = torch.randn(BATCH, HEADS, seq, HD, generator=g)
        k, v = (torch.randn(BATCH, KV_HEADS, seq, HD, generator=g) for _ in range(2))
        w = torch.randn(BATCH, HEADS, seq, HD, generator=g)
        rows = {run: {"seconds": [], "seq": seq, "cp": run[0], "impl": run[1]} for run in runs}

        for rep in range(rounds[seq] + 1):  # round 0 warms up and measures memory
            for run in runs:
                cp, impl = run
                comm.barrier(world_group)
                took = 0.0
                if rank < cp:
                    took, peak, saved, sent, mine = _once((q, k, v, w), groups[cp], impl, rep == 0)
                    if rep == 0 and rank == 0:
                        expect = analytic_bytes(impl, BATCH, HEADS, KV_HEADS, seq, HD, cp, 4).total if cp > 1 else 0
                        rows[run].update(peak=peak, saved=saved, sent=sent, analytic=expect)
                    if rep == 0 and impl == "ring":
                        repeats = 1 if seq >= 16384 else 2  # each repeat is a ring fwd+bwd and the transfers
                        ov = measure_overlap(*(x.detach() for x in mine), groups[cp], repeats=repeats)
                        rows[run]["hidden"] = ov.hidden
                slowest = comm.all_gather_objects(took, world_group)
                if rep:
                    rows[run]["seconds"].append(max(slowest[:cp]))
        out += list(rows.values())
    comm.barrier(world_group)
    shutdown_distributed()
    return out


def _train_args(seq: int, cp: int, impl: str, log_dir: str) -> list[str]:
    args = ["--model.preset", "tiny", "--model.seq_len", str(seq), "--parallel.cp", str(cp)]
    args += ["--train.global_batch", "2", "--train.micro_batch", "1", "--log.dir", log_dir, "--checkpoint.dir", ""]
    return args + (["--parallel.cp_impl", impl] if cp > 1 else [])


def _threefold(command: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "threefold", command, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def train_level(seqs: list[int], runs: list, rounds: int, steps: int) -> list[dict]:
    """Step times (rounds of every configuration in turn) and `threefold memory`'s activations."""
    rows = []
    for seq in seqs:
        per = {run: {"seconds": [], "seq": seq, "cp": run[0], "impl": run[1]} for run in runs}
        for _ in range(rounds):
            for run in runs:
                with tempfile.TemporaryDirectory() as log:
                    # The last step is traced: its ring exchanges are replayed alone after it
                    # (outside step_time_s), which gives the hidden fraction of a training step.
                    extra = ["--train.steps", str(steps), "--log.trace_steps", str(steps)]
                    done = _threefold("train", _train_args(seq, *run, log) + extra, 3600)
                    if done.returncode:
                        per[run]["error"] = (done.stderr.strip().splitlines() or ["?"])[-1]
                        continue
                    lines = [json.loads(x) for x in Path(log, "metrics.jsonl").read_text().splitlines()]
                per[run]["seconds"].append(statistics.median(x["step_time_s"] for x in lines[1:]))
                if "cp_hidden" in lines[-1]:
                    per[run].setdefault("hidden", []).append(lines[-1]["cp_hidden"]["mean"])
                    per[run].setdefault("hidden_own", []).append(lines[-1].get("cp_hidden_own", {}).get("mean"))
        for run in runs:
            with tempfile.TemporaryDirectory() as log:
                done = _threefold("memory", _train_args(seq, *run, log) + ["--json"], 3600)
            if done.returncode == 0:
                per[run]["activations"] = json.loads(done.stdout)[0]["measured"]["activations"]
        rows += list(per.values())
    return rows


def _ratios(rows: list[dict]) -> None:
    """Each row's per-round time ratio to cp 1 at the same sequence length."""
    base = {r["seq"]: r for r in rows if r["cp"] == 1}
    for r in rows:
        b = base[r["seq"]]["seconds"]
        n = min(len(b), len(r["seconds"]))
        r["ratio"] = paired_ratio(r["seconds"][:n], b[:n]) if n >= 2 else None


def _mib(x) -> str:
    return "-" if x is None else f"{x / MiB:.1f}"


def attention_table(rows: list[dict], refused: list) -> list[str]:
    base = {r["seq"]: r for r in rows if r["cp"] == 1}
    out = [
        "| seq | cp | impl | fwd+bwd s (median) | time / cp 1 [95% CI] | analytic min | peak MiB rank 0 "
        "| / cp 1 | saved MiB | bytes sent / analytic | ring hidden |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = base[r["seq"]]
        ratio = "1" if r["cp"] == 1 else (show(r["ratio"]) if r["ratio"] else "-")
        sent = "-" if r["cp"] == 1 else f"{r['sent']:,} / {r['analytic']:,}"
        hidden = f"{r['hidden']:.2f}" if "hidden" in r else "-"
        out.append(
            f"| {r['seq']} | {r['cp']} | {r['impl'] if r['cp'] > 1 else '-'} | {statistics.median(r['seconds']):.3f} "
            f"| {ratio} | {1 / r['cp']:.3f} | {_mib(r['peak'])} | {show(exact(r['peak'] / b['peak']))} "
            f"| {_mib(r['saved'])} | {sent} | {hidden} |"
        )
    return out + _refused_rows(base, refused, 11)


def _refused_rows(base: dict, refused: list, columns: int) -> list[str]:
    """A table's rows for the refused configurations, at every sequence length measured."""
    pad = " |" * (columns - 4)
    return [f"| {seq} | {cp} | {impl} | refused: {why} |{pad}" for seq in sorted(base) for cp, impl, why in refused]


def train_table(rows: list[dict], refused: list) -> list[str]:
    base = {r["seq"]: r for r in rows if r["cp"] == 1}
    out = [
        "| seq | cp | impl | step s (median) | time / cp 1 [95% CI] | analytic min | activations MiB rank 0 "
        "| / cp 1 | analytic min | ring hidden, traced step (per round) | the same, slower peer set aside |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r and not r["seconds"]:
            out.append(f"| {r['seq']} | {r['cp']} | {r['impl']} | failed: {r['error']} | | | | | | | |")
            continue
        b = base[r["seq"]]
        ratio = "1" if r["cp"] == 1 else (show(r["ratio"]) if r["ratio"] else "-")
        act, act1 = r.get("activations"), b.get("activations")
        rel = show(exact(act / act1)) if act and act1 else "-"
        out.append(
            f"| {r['seq']} | {r['cp']} | {r['impl'] if r['cp'] > 1 else '-'} | {statistics.median(r['seconds']):.3f} "
            f"| {ratio} | {1 / r['cp']:.3f} | {_mib(act)} | {rel} | {1 / r['cp']:.3f} "
            f"| {_fractions(r.get('hidden'))} | {_fractions(r.get('hidden_own'))} |"
        )
    return out + _refused_rows(base, refused, 11)


def _fractions(values) -> str:
    return ", ".join("-" if v is None else f"{v:.2f}" for v in values) if values else "-"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--level", choices=("attention", "train", "both"), default="both")
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--impls", nargs="+", default=["ring", "a2a"])
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per sequence length")
    ap.add_argument("--long-rounds", type=int, default=3, help="timed rounds at 16k and above (attention)")
    ap.add_argument("--train-seqs", type=int, nargs="+", default=[1024, 4096], help="lengths for level train")
    ap.add_argument("--steps", type=int, default=4, help="training steps per run (the first is not timed)")
    ap.add_argument("--train-rounds", type=int, default=3, help="rounds of training runs per length")
    ap.add_argument("--json", default="", help="also write the rows here")
    args = ap.parse_args(argv)
    runs, refused = configs(args.cps, args.impls, HEADS, KV_HEADS)
    results: list[dict] = []
    print(f"# context parallelism, tiny model shapes; `python bench/context_parallel.py {' '.join(argv or [])}`")
    print("host: shared 2 cores under load; cp 4 = 4 processes on 2 cores (oversubscribed).\n", flush=True)
    if args.level in ("attention", "both"):
        print(f"## (a) attention forward+backward, batch {BATCH}, {HEADS} heads, {KV_HEADS} kv heads, hd {HD}\n")
        world = max(cp for cp, _ in runs)
        for seq in args.seqs:  # one job per length: each table is out as soon as it is measured
            t0 = time.perf_counter()
            rounds = {seq: args.long_rounds if seq >= 16384 else args.rounds}
            rows = run_ranks(attention_worker, world, [seq], runs, rounds, timeout=3 * 3600)[0]
            _ratios(rows)
            print(f"seq {seq}: {rounds[seq]} timed rounds, {time.perf_counter() - t0:.0f} s\n")
            print("\n".join(attention_table(rows, refused)) + "\n", flush=True)
            results += [dict(r, level="attention") for r in rows]
    if args.level in ("train", "both"):
        t0 = time.perf_counter()
        print("## (b) training steps, `threefold train --model.preset tiny`, global batch 2, micro-batch 1\n")
        for seq in args.train_seqs:
            t0 = time.perf_counter()
            rows = train_level([seq], runs, args.train_rounds, args.steps)
            _ratios(rows)
            print(f"seq {seq}: {args.train_rounds} rounds of {args.steps} steps, {time.perf_counter() - t0:.0f} s\n")
            print("\n".join(train_table(rows, refused)) + "\n", flush=True)
            results += [dict(r, level="train") for r in rows]
    if args.json:
        clean = [{k: (v.value if hasattr(v, "value") else v) for k, v in r.items()} for r in results]
        Path(args.json).write_text(json.dumps(clean, indent=1))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
