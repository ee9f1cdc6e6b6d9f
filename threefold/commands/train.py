"""`threefold train [--config FILE] [--section.key VALUE ...]`: a user of the library API
(threefold/api.py), as a script would be."""

from __future__ import annotations

import argparse
import sys

USAGE = """threefold train [--config FILE] [--section.key VALUE ...]
  e.g. threefold train --model.preset tiny --parallel.dp 2 --train.steps 20
  threefold train --help-config   lists every key with its default and meaning"""


def train_command(argv: list[str]) -> int:
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
