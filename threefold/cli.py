"""`threefold` command line: one name per command, each a module of threefold/commands/ imported only
when it runs (start-up stays fast)."""

from __future__ import annotations

import sys

from threefold.commands.train import USAGE
from threefold.errors import UserError

OTHER_USAGE = """threefold eval --checkpoint DIR [--json] [--data.* / --parallel.* ...]
threefold generate --checkpoint DIR --prompt TEXT [--temperature T --top-k K --top-p P]
threefold data prepare --out DIR [--data.path CORPUS] [--json-key text] [--workers N]
                       [--tokenizer FILE | --vocab N] [--max-bad N]
threefold checkpoint {info,export,import-hf,export-hf} ...
threefold plan ...
threefold tune --nproc N [--space KEY=V1,V2 ...] [--trials N] [--minutes M] [--out DIR]
threefold doctor [--parallel.* ...] [--nproc N] [--json]"""


def _lazy(target: str):
    """A command whose module is imported only when it runs (start-up stays fast)."""
    module, function = target.split(":")

    def run(argv: list[str]) -> int:
        import importlib

        return getattr(importlib.import_module(module), function)(argv)

    return run


COMMANDS = {
    "train": _lazy("threefold.commands.train:train_command"),
    "memory": _lazy("threefold.commands.memory:memory_command"),
    "plan": _lazy("threefold.commands.plan:plan_command"),
    "tune": _lazy("threefold.commands.tune:tune_command"),
    "checkpoint": _lazy("threefold.commands.checkpoint:checkpoint_command"),
    "bench": _lazy("threefold.commands.bench:bench_command"),
    "data": _lazy("threefold.commands.data:data_command"),
    "eval": _lazy("threefold.commands.eval:eval_command"),
    "generate": _lazy("threefold.commands.generate:generate_command"),
    "report": _lazy("threefold.commands.report:report_command"),
    "doctor": _lazy("threefold.commands.doctor:doctor_command"),
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
