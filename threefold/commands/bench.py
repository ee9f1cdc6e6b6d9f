"""`threefold bench ...`: the benchmark suite, which lives beside the package (bench/run.py) in a
source checkout."""

from __future__ import annotations

import sys

from threefold.errors import UserError


def bench_command(argv: list[str]) -> int:
    """The benchmark suite lives beside the package (bench/run.py), in a source checkout."""
    from pathlib import Path

    run = Path(__file__).resolve().parents[2] / "bench" / "run.py"
    if not run.is_file():
        raise UserError(f"threefold bench: {run} not found (the suite runs from a source checkout of threefold)")
    sys.path.insert(0, str(run.parent))
    import run as bench_run

    return bench_run.main(argv)
