"""What the planner's tests share: a model section from key/value pairs, a CPU cluster with every
number given (so nothing is measured), and `threefold plan` run in-process."""

from __future__ import annotations

from threefold.cli import main
from threefold.config import build_config
from threefold.planner import build_cluster

GiB = 2**30


def model(pairs):
    """The model section a run with these (key, value) overrides would have."""
    return build_config(None, list(pairs)).model


def cpu_cluster(**kw):
    # Every number given, so nothing is measured.
    base = dict(device="cpu", peak_tflops=0.05, devices_per_node=8, host_cores=8, memory_gib=16)
    return build_cluster({**base, **kw})


def plan_cli(capsys, *args):
    """`threefold plan ARGS` in this process: (exit code, stdout, stderr)."""
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err
