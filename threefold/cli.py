"""`threefold` command line: `threefold train [--config FILE] [--section.key VALUE ...]`."""
from __future__ import annotations

import argparse
import sys

from threefold.errors import UserError

USAGE = """threefold train [--config FILE] [--section.key VALUE ...]
  e.g. threefold train --model.preset tiny --parallel.dp 2 --train.steps 20
  threefold train --help-config   lists every key with its default and meaning"""


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


def _checkpoint(argv: list[str]) -> int:
    from threefold.checkpoint.command import checkpoint_command

    return checkpoint_command(argv)


def _report(argv: list[str]) -> int:
    from threefold.observe.report_command import report_command

    return report_command(argv)


COMMANDS = {"train": _train, "plan": _plan, "checkpoint": _checkpoint, "report": _report}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: threefold {" + ",".join(COMMANDS) + "} ...\n\n" + USAGE)
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
