"""Two backward mechanics, each on vs off in the same run: the tensor-parallel dW overlap and
freeing a pipeline stage's output once it is sent.

- `parallel.tp_comm_overlap`: the column-parallel layers' weight-gradient matmuls run while
  their input gradient is all-reduced (reduce-scattered under SP). Measured: tp2 step time
  through `threefold train`, rounds of one run each way, the order alternating between rounds;
  on / off is the median per-round ratio of median step times with its 95% bootstrap interval.
- `parallel.free_sent_outputs`: a stage keeps only the graph of an output it has sent, not
  the [seq, micro-batch, hidden] buffer. Measured: stage 0's peak activation bytes of one step
  through `threefold memory` (what autograd saved plus the outputs the executor holds;
  deterministic), and pp2 step time each way (sends are then waited on with their batch's
  receives instead of at the end of the step).

    python bench/overlap_free.py [--rounds 4] [--steps 12] [--warmup 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats import show  # noqa: E402
from timing import cell, on_off_rounds, ratio, steps_of  # noqa: E402

TINY = ["--model.preset", "tiny", "--train.warmup_steps", "2"]
TP_RUNS = {"tp2": [*TINY, "--parallel.tp", "2"], "tp2 sp": [*TINY, "--parallel.tp", "2", "--parallel.sp", "true"]}
PP_RUN = [*TINY, "--parallel.pp", "2", "--train.global_batch", "16", "--train.micro_batch", "2"]
MEMORY = {"1f1b": PP_RUN, "gpipe": [*PP_RUN, "--parallel.schedule", "gpipe"]}


def stage0_activations(args: list[str], free: bool) -> dict:
    """Stage 0's measured and predicted peak activation bytes, from `threefold memory --json`."""
    cmd = [
        sys.executable,
        "-m",
        "threefold",
        "memory",
        *args,
        "--parallel.free_sent_outputs",
        "true" if free else "false",
        "--json",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    row = next(r for r in json.loads(out.stdout) if r["pp"] == 0)
    return {"measured": row["measured"]["activations"], "predicted": row["predicted"]["activations"]}


def output_bytes(args: list[str]) -> int:
    """One micro-batch's stage output: [seq, micro-batch, hidden] in fp32, from the run's config."""
    from threefold.config import build_config

    m = build_config(None, [(k.removeprefix("--"), v) for k, v in zip(args[::2], args[1::2], strict=True)]).model
    micro = int(args[args.index("--train.micro_batch") + 1])
    return m.seq_len * micro * m.hidden * 4


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="rounds of one run with the setting off and one on")
    ap.add_argument("--steps", type=int, default=12, help="training steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="step intervals dropped at the start of each run")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 5 steps: indicative only")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 5, 2
    timed = {
        name: on_off_rounds(run, "parallel.tp_comm_overlap", args.rounds, args.steps, args.warmup)
        for name, run in TP_RUNS.items()
    }
    timed["pp2 1f1b"] = on_off_rounds(PP_RUN, "parallel.free_sent_outputs", args.rounds, args.steps, args.warmup)
    memory = {
        name: {
            "on": stage0_activations(run, True),
            "off": stage0_activations(run, False),
            "output_bytes": output_bytes(run),
        }
        for name, run in MEMORY.items()
    }

    print(
        f"Step time: {args.rounds} rounds of one `threefold train` run each way (order alternating) x "
        f"{args.steps} steps, the first {args.warmup} intervals dropped; median [IQR] ms/step; on / off: median "
        "per-round ratio [95% bootstrap interval]. Tiny preset, global batch 16.\n"
    )
    print("| run | setting | off (ms/step) | on (ms/step) | on / off |")
    print("|---|---|---|---|---|")
    for name, blocks in timed.items():
        key = "free_sent_outputs" if name.startswith("pp") else "tp_comm_overlap"
        print(
            f"| {name} | `parallel.{key}` | {cell(steps_of(blocks['off']))} | {cell(steps_of(blocks['on']))} | "
            f"{show(ratio(blocks, 'on', 'off'))} |"
        )
    print(
        "\nStage 0 peak activation memory of one pp2 step (`threefold memory`; micro-batch 2, 8 micro-batches; "
        "measured bytes, exact). Saved = off - on, in stage outputs of one micro-batch.\n"
    )
    print(
        "| schedule | free_sent_outputs off (MiB) | on (MiB) | on / off | saved (outputs) | on: measured / predicted |"
    )
    print("|---|---|---|---|---|---|")
    for name, m in memory.items():
        on, off = m["on"]["measured"], m["off"]["measured"]
        print(
            f"| {name} | {off / 2**20:.3f} | {on / 2**20:.3f} | {on / off:.3f} | {(off - on) / m['output_bytes']:.2f} "
            f"| {on / m['on']['predicted']:.3f} |"
        )
    return {"timed": timed, "memory": memory}


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
