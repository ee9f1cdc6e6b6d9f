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
threefold data prepare --out DIR [--vocab N] [--data.path CORPUS]
threefold checkpoint {info,export,import-hf,export-hf} ...
threefold plan ..."""


def _train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="threefold train", usage=USAGE, add_help=True)
    parser.add_argument("--config", help="TOML file with [model], [parallel], [train], ... tables")
    parser.add_argument("--help-config", action="store_true", help="print every key, default and meaning")
    args, rest = parser.parse_known_args(argv)
    from threefold.config import build_config, describe, parse_overrides

    if args.help_config:
        print(describe())
        return 0
    cfg = build_config(args.config, parse_overrides(rest))
    from threefold.train.entry import run_train

    return run_train(cfg)


def _plan(argv: list[str]) -> int:
    from threefold.planner.command import plan_command

    return plan_command(argv)


def _memory(argv: list[str]) -> int:
    from threefold.train.memory_command import memory_command

    return memory_command(argv)


def _checkpoint(argv: list[str]) -> int:
    from threefold.checkpoint.command import checkpoint_command

    return checkpoint_command(argv)


def _data(argv: list[str]) -> int:
    from threefold.data.prepare import data_command

    return data_command(argv)


def _eval(argv: list[str]) -> int:
    from threefold.inference.evaluate_command import eval_command

    return eval_command(argv)


def _generate(argv: list[str]) -> int:
    from threefold.inference.generate import generate_command

    return generate_command(argv)


def _bench(argv: list[str]) -> int:
    """The benchmark suite lives beside the package (bench/run.py), in a source checkout."""
    from pathlib import Path

    run = Path(__file__).resolve().parents[1] / "bench" / "run.py"
    if not run.is_file():
        raise UserError(f"threefold bench: {run} not found (the suite runs from a source checkout of threefold)")
    sys.path.insert(0, str(run.parent))
    import run as bench_run

    return bench_run.main(argv)


def _report(argv: list[str]) -> int:
    from threefold.observe.report_command import report_command

    return report_command(argv)


COMMANDS = {"train": _train, "memory": _memory, "plan": _plan, "checkpoint": _checkpoint, "bench": _bench,
            "data": _data, "eval": _eval, "generate": _generate, "report": _report}


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
