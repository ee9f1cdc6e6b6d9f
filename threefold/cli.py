"""`threefold` command line: `threefold train [--config FILE] [--section.key VALUE ...]`."""

from __future__ import annotations

import argparse
import sys

from threefold.errors import UserError

USAGE = """threefold train [--config FILE] [--section.key VALUE ...]
  e.g. threefold train --model.preset tiny --parallel.dp 2 --train.steps 20
  threefold train --help-config   lists every key with its default and meaning"""

OTHER_USAGE = """threefold eval --checkpoint DIR [--json] [--data.* / --parallel.* ...]
threefold generate --checkpoint DIR --prompt TEXT [--temperature T --top-k K --top-p P]
threefold data prepare --out DIR [--data.path CORPUS] [--json-key text] [--workers N]
                       [--tokenizer FILE | --vocab N] [--max-bad N]
threefold checkpoint {info,export,import-hf,export-hf} ...
threefold plan ...
threefold tune --nproc N [--space KEY=V1,V2 ...] [--trials N] [--minutes M] [--out DIR]"""


def _train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="threefold train", usage=USAGE, add_help=True)
    parser.add_argument("--config", help="TOML file with [model], [parallel], [train], ... tables")
    parser.add_argument("--help-config", action="store_true", help="print every key, default and meaning")
    args, rest = parser.parse_known_args(argv)
    from threefold.config import describe

    if args.help_config:
        print(describe())
        return 0
    # A user of the library API (threefold/api.py), as a script would be.
    from threefold.api import configure, train
    from threefold.distributed.launch import WorkersFailed

    cfg = configure(args.config, rest)
    try:
        train(cfg)
    except WorkersFailed as err:
        if str(err):  # empty: the workers stopped on a signal and said so themselves
            print(f"threefold: {err}", file=sys.stderr)
        return err.exit_code
    return 0


def _bench(argv: list[str]) -> int:
    """The benchmark suite lives beside the package (bench/run.py), in a source checkout."""
    from pathlib import Path

    run = Path(__file__).resolve().parents[1] / "bench" / "run.py"
    if not run.is_file():
        raise UserError(f"threefold bench: {run} not found (the suite runs from a source checkout of threefold)")
    sys.path.insert(0, str(run.parent))
    import run as bench_run

    return bench_run.main(argv)


def _lazy(target: str):
    """A command whose module is imported only when it runs (start-up stays fast)."""
    module, function = target.split(":")

    def run(argv: list[str]) -> int:
        import importlib

        return getattr(importlib.import_module(module), function)(argv)

    return run


COMMANDS = {
    "train": _train,
    "memory": _lazy("threefold.train.memory_command:memory_command"),
    "plan": _lazy("threefold.planner.command:plan_command"),
    "tune": _lazy("threefold.planner.tune.command:tune_command"),
    "checkpoint": _lazy("threefold.checkpoint.command:checkpoint_command"),
    "bench": _bench,
    "data": _lazy("threefold.data.prepare:data_command"),
    "eval": _lazy("threefold.inference.evaluate_command:eval_command"),
    "generate": _lazy("threefold.inference.generate:generate_command"),
    "report": _lazy("threefold.observe.report_command:report_command"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: threefold {" + ",".join(COMMANDS) + "} ...\n\n" + USAGE + "\n" + OTHER_USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"threefold: error: unknown command {command!r} (valid: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    try:
        return COMMANDS[command](rest)
    except UserError as err:
        print(f"threefold: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("threefold: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
