"""Chaos: a long CPU run under a seeded random fault schedule, with memory replicas on and off.

    python bench/chaos.py --faults 30 --seed 0 [--steps 300] [--lock /tmp/cpu.lock] [--json FILE]

Four workers on two "nodes" (two torchrun agents of two processes on localhost, the rendezvous
store hosted here, as a dedicated host would), tp1 x dp2 x pp2 of the tiny model. A node that
dies whole (killnode: its agent and workers, and its RAM: the drill wipes its memory replicas)
is replaced by a new agent started here, as a scheduler would; every other failure is restarted
by the agents. The schedule draws `--faults` faults at distinct steps (at least GAP apart) from
kill, killnode, hang (train.timeout_s 5 s), nan streaks (2 or 3 steps: the third rolls back),
slow rank (3x for 10 steps), corrupted newest checkpoint and a full disk (the next save's write
fails with ENOSPC on one rank). Each drill fires once per run (training/faults.py).

Three jobs, each alone (under --lock when given): a reference run with only the schedule's nan
and slow faults (the classes exact resume cannot undo: skipped steps change the weights; slow
steps change nothing but time), and the full schedule with replicas on (checkpoint.memory_interval
auto) and off, both with checkpoint.interval auto and checkpoint.mtbf_h MTBF_PRIOR_H. It reports:

- per fault class, replicas on and off: how many fired, the failures they caused, detection
  latency and the rest of the recovery by part (goodput.json), MTTR (failure to the end of the
  first new step), and the steps lost;
- the killed-rank MTTR with replicas over without, paired by fault, with its 95% interval, and the
  same for the time to regain the lost work (MTTR + the lost steps' time);
- goodput measured (from the first step on) against Daly's prediction for the measured save
  stalls C, restart cost R, MTBF M and intervals of each tier (observe/failure_model.py);
- "nothing lost": the final weights of both chaos runs bitwise equal to the reference's.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from stats import paired_ratio, show  # noqa: E402

from threefold.checkpoint import open_checkpoint  # noqa: E402
from threefold.checkpoint.consolidate import consolidated  # noqa: E402
from threefold.observe.failure_model import goodput  # noqa: E402

CLASSES = ("kill", "killnode", "hang", "nan", "slow", "corrupt", "enospc")
EXACT = ("kill", "killnode", "hang", "corrupt", "enospc")
"""Classes whose run must end with the reference's weights, bit for bit."""
GAP = 8
MTBF_PRIOR_H = 0.005
"""The prior MTBF the chaos runs are told (18 s: about what the schedule makes it)."""
TIMEOUT_S = 5
WORLD = 4
ENDLESS = 1e12  # an MTBF for a tier that saw no failure


def draw(n: int, seed: int, steps: int) -> list[dict]:
    """`n` faults at distinct steps GAP or more apart in [15, steps - 15), classes and ranks drawn."""
    rng = random.Random(seed)
    room = steps - 30 - (n - 1) * (GAP - 1)
    if room < n:
        raise SystemExit(f"chaos: {n} faults {GAP} steps apart do not fit in {steps} steps (use more --steps)")
    slots = sorted(rng.sample(range(room), n))
    faults = []
    for i, slot in enumerate(slots):
        kind = rng.choice(CLASSES)
        faults.append({"class": kind, "step": 15 + slot + i * (GAP - 1), "rank": rng.randrange(WORLD)})
        if kind == "nan":
            faults[-1]["count"] = rng.choice((2, 3))
    return faults


def spec(f: dict) -> str:
    s, r = f["step"], f["rank"]
    return {
        "kill": f"kill:rank={r}:step={s}",
        "killnode": f"killnode:rank={r}:step={s}",
        "hang": f"hang:rank={r}:step={s}",
        "nan": f"nan:step={s}:count={f.get('count', 2)}",
        "slow": f"slow:rank={r}:factor=3:step={s}:steps=10",
        "corrupt": f"corrupt:step={s}:count={GAP}",
        "enospc": f"enospc:rank={r}:step={s}:count={GAP}",
    }[f["class"]]


@contextlib.contextmanager
def locked(path: str):
    """The shared CPU lock around one job (none without --lock)."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def train_args(run: Path, steps: int, replicas: bool) -> list[str]:
    keys = {
        "parallel.dp": 2,
        "parallel.pp": 2,
        "train.steps": steps,
        "train.lr": 5e-4,
        "train.timeout_s": TIMEOUT_S,
        "train.preflight": "off",
        "checkpoint.dir": run / "ckpt",
        "checkpoint.interval": "auto",
        "checkpoint.memory_interval": "auto" if replicas else 0,
        "checkpoint.mtbf_h": MTBF_PRIOR_H,
        "log.dir": run / "log",
        "log.quiet": "true",
    }
    return [f"--{k}={v}" for k, v in keys.items()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(run: Path, steps: int, faults: list[dict], replicas: bool, timeout: float) -> dict:
    """Two agents of two workers; an agent killed whole (killnode) is replaced by a new one.
    Returns the job's wall time and how many agents were started."""
    from torch.distributed import TCPStore

    run.mkdir(parents=True, exist_ok=True)
    port = free_port()
    store = TCPStore(
        "127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False, timeout=timedelta(seconds=120)
    )
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
    launcher += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"chaos-{run.name}"]
    launcher += ["--rdzv-conf", "is_host=false,join_timeout=300", "--max-restarts", "200", "--monitor-interval", "0.2"]
    env = {
        **os.environ,
        "THREEFOLD_FAULT": ",".join(spec(f) for f in faults),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
    }
    cmd = launcher + ["-m", "threefold", "train", *train_args(run, steps, replicas)]
    started, active, logs = time.time(), [], []

    def start() -> None:
        logs.append(open(run / f"agent{len(logs)}.log", "w"))
        active.append(subprocess.Popen(cmd, env=env, stdout=logs[-1], stderr=subprocess.STDOUT))

    start()
    start()
    try:
        while any(a.poll() is None for a in active):
            time.sleep(0.2)
            for agent in [a for a in active if a.poll() == -9]:  # a node died whole: a new one joins
                active.remove(agent)
                start()
            if time.time() - started > timeout:
                raise SystemExit(f"chaos: {run.name} did not end within {timeout:.0f} s (see {run}/agent*.log)")
    finally:
        for agent in active:
            if agent.poll() is None:
                agent.kill()
        for f in logs:
            f.close()
        del store
    if any(a.returncode != 0 for a in active):
        raise SystemExit(f"chaos: {run.name} failed (see {run}/agent*.log)")
    return {"wall_s": time.time() - started, "agents": len(logs)}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def weights(run: Path, steps: int) -> dict[str, torch.Tensor]:
    directory, manifest = open_checkpoint(run / "ckpt" / f"step_{steps:08d}")
    return consolidated(directory, manifest, prefix="")


def bitwise(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def classify(failure: dict, faults: list[dict]) -> str:
    """The schedule's class of a failure: its recorded cause, or a nan streak that rolled back."""
    if failure.get("cause") in CLASSES:
        return failure["cause"]
    near = [f for f in faults if f["class"] == "nan" and f["step"] <= failure["after_step"] <= f["step"] + 4]
    return "nan" if near else "other"


def analyse(run: Path, faults: list[dict]) -> dict:
    """Per class and overall, from goodput.json, metrics.jsonl and faults.jsonl."""
    log = run / "log"
    good = json.loads((log / "goodput.json").read_text())
    records = _lines(log / "metrics.jsonl")
    fired = {}
    for e in _lines(log / "faults.jsonl"):
        fired.setdefault(e["kind"], set()).add(e["fault"])
    failures = [{**f, "class": classify(f, faults)} for f in good["failures"]]
    step_s = statistics.mean(r["step_time_s"] for r in records if not r.get("step_skipped"))
    for f in failures:
        f["regain_s"] = f["mttr_s"] + f["lost_s"]
    per_class = {}
    for kind in CLASSES:
        mine = [f for f in failures if f["class"] == kind]
        # A slow drill acts on every attempt and is not recorded: it is there when scheduled.
        count = sum(f["class"] == kind for f in faults) if kind == "slow" else len(fired.get(kind, ()))
        row = {"fired": count, "failures": len(mine)}
        for key in ("detect_s", "restart_s", "preflight_s", "load_s", "rewarm_s", "mttr_s", "lost_steps", "regain_s"):
            row[key] = statistics.mean(f[key] for f in mine) if mine else None
        row["sources"] = sorted({f["source"] for f in mine})
        per_class[kind] = row
    first = records[0]
    startup = first["time"] - first["step_time_s"] - good["started"]
    return {
        "good": good,
        "failures": failures,
        "per_class": per_class,
        "step_s": step_s,
        "startup_s": startup,
        "measured": good["productive_s"] / (good["wall_s"] - startup),
        "predicted": predict(good, records, failures, step_s),
    }


def predict(good: dict, records: list[dict], failures: list[dict], step_s: float) -> dict:
    """Daly's goodput per tier for the run's measured quantities, multiplied: each tier loses its
    own stall C/tau and, for the failures it recovers from (`source`), the work since its last
    save and the restart R. The drills fire at steps, so failures come with work, never during
    a restart: M is the work time (steps kept, lost and skipped, and save stalls) per failure,
    and Daly's restart term is M + R (failure_model.goodput, restarts_fail=False)."""
    work = good["productive_s"] + good["lost_s"] + good["skipped_s"] + good["checkpoint_s"]
    out, total = {}, 1.0
    for tier, key, source in (("memory", "snapshot_block_s", "memory"), ("storage", "ckpt_block_s", "storage")):
        saves = [r[key] for r in records if r.get(key, 0) > 0]
        if not saves:
            continue
        mine = [f for f in failures if (f["source"] == "memory") == (source == "memory")]
        interval_s = len(records) / len(saves) * step_s  # the tier's mean interval, in work
        stall = statistics.mean(saves)
        restart = statistics.mean(f["mttr_s"] - step_s for f in mine) if mine else 0.0
        mtbf = work / len(mine) if mine else ENDLESS
        g = goodput(interval_s, stall, restart, mtbf, restarts_fail=False)
        out[tier] = {"interval_s": interval_s, "stall_s": stall, "restart_s": restart, "mtbf_s": mtbf, "goodput": g}
        total *= g
    out["goodput"] = total
    return out


def _cell(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def report(schedule: list[dict], results: dict, exact: dict, args) -> str:
    on, off = results["on"], results["off"]
    lines = [
        f"`python bench/chaos.py --faults {args.faults} --seed {args.seed} --steps {args.steps}` "
        f"(replicas on {on['job']['wall_s']:.0f} s, off {off['job']['wall_s']:.0f} s, "
        f"reference {results['reference']['job']['wall_s']:.0f} s)",
        "",
        "Schedule: " + ", ".join(f"{k} {sum(f['class'] == k for f in schedule)}" for k in CLASSES),
        "",
        "| class | replicas | fired | failures | detect s | restart s | preflight s | load s | rewarm s | MTTR s "
        "| lost steps | regain s | loaded from |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in CLASSES:
        for name, r in (("on", on), ("off", off)):
            c = r["per_class"][kind]
            lines.append(
                f"| {kind} | {name} | {c['fired']} | {c['failures']} | {_cell(c['detect_s'])} | "
                f"{_cell(c['restart_s'])} | {_cell(c['preflight_s'])} | {_cell(c['load_s'], '{:.3f}')} | "
                f"{_cell(c['rewarm_s'])} | "
                f"{_cell(c['mttr_s'])} | {_cell(c['lost_steps'], '{:.1f}')} | {_cell(c['regain_s'])} | "
                f"{', '.join(c['sources']) or '-'} |"
            )
    pairs = [
        (a, b)
        for a in on["failures"]
        for b in off["failures"]
        if a["class"] == b["class"] == "kill" and a["after_step"] == b["after_step"]
    ]
    lines.append("")
    if pairs:
        mttr = paired_ratio([a["mttr_s"] for a, _ in pairs], [b["mttr_s"] for _, b in pairs], unit="kill")
        regain = paired_ratio([a["regain_s"] for a, _ in pairs], [b["regain_s"] for _, b in pairs], unit="kill")
        lines.append(f"Killed rank, replicas on / off (paired by fault, {len(pairs)} kills): MTTR {show(mttr)}; ")
        lines[-1] += f"time to regain the lost work (MTTR + lost steps) {show(regain)}."
        results["kill_ratio"] = {"mttr": mttr.value, "mttr_ci": [mttr.lo, mttr.hi], "regain": regain.value}
    lines += ["", "| replicas | failures | goodput measured | predicted (Daly) | memory tier | storage tier |"]
    lines.append("|---|---|---|---|---|---|")
    for name, r in (("on", on), ("off", off)):
        p = r["predicted"]
        tiers = [
            f"every {p[t]['interval_s']:.2f} s, C {p[t]['stall_s'] * 1e3:.1f} ms, R {p[t]['restart_s']:.1f} s, "
            f"M {_cell(p[t]['mtbf_s'] if p[t]['mtbf_s'] < ENDLESS else None, '{:.0f}')} s"
            if t in p
            else "-"
            for t in ("memory", "storage")
        ]
        lines.append(
            f"| {name} | {len(r['failures'])} | {r['measured']:.3f} | {p['goodput']:.3f} | {tiers[0]} | {tiers[1]} |"
        )
    lines.append("")
    verdict = ", ".join(f"replicas {k}: {'bitwise equal' if v else 'DIFFERENT'}" for k, v in exact.items())
    present = [k for k in EXACT if any(f["class"] == k for f in schedule)]
    lines.append(
        f"Nothing lost ({', '.join(present)} in the schedule; nan and slow also in the reference): "
        f"final weights vs the reference, {verdict}."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="bench/chaos.py", description=__doc__.splitlines()[0])
    ap.add_argument("--faults", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lock", default="", help="a lock file each job holds while it runs (shared machines)")
    ap.add_argument("--dir", default="", help="keep the runs here (default: a temporary directory)")
    ap.add_argument("--timeout", type=float, default=1500.0, help="seconds one job may take")
    ap.add_argument("--json", default="", help="also write the results here")
    args = ap.parse_args(argv)
    schedule = draw(args.faults, args.seed, args.steps)
    import tempfile

    root = Path(args.dir or tempfile.mkdtemp(prefix="threefold-chaos-"))
    inexact = [f for f in schedule if f["class"] not in EXACT]
    results = {}
    for name, faults, replicas in (("reference", inexact, False), ("on", schedule, True), ("off", schedule, False)):
        with locked(args.lock):
            job = run_job(root / name, args.steps, faults, replicas, args.timeout)
        results[name] = {"job": job, **(analyse(root / name, schedule) if name != "reference" else {})}
        print(f"chaos: {name} done in {job['wall_s']:.0f} s", file=sys.stderr, flush=True)
    reference = weights(root / "reference", args.steps)
    exact = {name: bitwise(weights(root / name, args.steps), reference) for name in ("on", "off")}
    text = report(schedule, results, exact, args)
    print(text)
    if args.json:
        keep = {k: {kk: vv for kk, vv in v.items() if kk != "good"} for k, v in results.items() if isinstance(v, dict)}
        Path(args.json).write_text(json.dumps({"schedule": schedule, "results": keep, "exact": exact}, indent=1))
    return results


if __name__ == "__main__":
    main()
