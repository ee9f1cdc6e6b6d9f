"""The communication layer: the one module that talks to torch.distributed, device checks,
and the bytes and calls it records per group."""

import ast
from pathlib import Path

import pytest
import torch

from threefold.distributed import comm
from threefold.distributed.comm import Group

PACKAGE = Path(__file__).resolve().parents[1] / "threefold"
# The elastic agent launches workers; it is not communication between them.
LAUNCHER = ("torch.distributed.elastic", "torch.distributed.launcher")


def _direct_uses(path: Path) -> list[str]:
    """Lines of `path` that import or call torch.distributed other than its launcher."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if node.module == "torch":
                names = [f"torch.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and ast.unparse(node).startswith("torch.distributed"):
            names = [ast.unparse(node)]
        else:
            continue
        for name in names:
            if name.startswith("torch.distributed") and not name.startswith(LAUNCHER):
                found.append(f"{path}:{node.lineno}: {name}")
    return found


def test_only_comm_talks_to_torch_distributed():
    uses = [
        u
        for f in sorted(PACKAGE.rglob("*.py"))
        if f.name != "comm.py" or f.parent.name != "distributed"
        for u in _direct_uses(f)
    ]
    assert uses == [], "torch.distributed used outside threefold/distributed/comm.py:\n" + "\n".join(uses)


def test_the_scan_sees_every_spelling(tmp_path):
    bad = tmp_path / "probe.py"
    bad.write_text(
        "import torch.distributed as dist\nfrom torch import distributed\n"
        "from torch.distributed import all_reduce\nimport torch\ntorch.distributed.barrier()\n"
        "from torch.distributed.elastic.multiprocessing.errors import ChildFailedError\n"
    )
    assert [u.split(": ")[-1] for u in _direct_uses(bad)] == [
        "torch.distributed",
        "torch.distributed",
        "torch.distributed",
        "torch.distributed.all_reduce",
        "torch.distributed.barrier",
        "torch.distributed",
    ]


def test_a_tensor_off_the_groups_device_is_refused_even_alone():
    """NCCL refuses a CPU tensor; gloo would not say so, and a group of one never communicates.
    The check runs anyway, so a single-GPU run finds a CPU tensor bound for a collective."""
    alone = Group("dp", [0], None, device=torch.device("cuda"))
    for call in (
        lambda x: comm.all_reduce(x, alone),
        lambda x: comm.all_gather_dim0(x, alone),
        lambda x: comm.reduce_scatter_dim0(x, alone),
    ):
        with pytest.raises(RuntimeError, match="dp group: the tensor is on cpu, the group communicates on cuda"):
            call(torch.ones(4))
    unchecked = Group("dp", [0], None)
    assert comm.all_reduce(torch.ones(2), unchecked).tolist() == [1.0, 1.0]


def _stats_worker() -> dict:
    from threefold.distributed.grid import Grid, RankLayout
    from threefold.distributed.runtime import init_distributed, shutdown_distributed

    init_distributed(torch.device("cpu"), timeout_s=60)
    grid = Grid.build(RankLayout(dp=2))
    x = torch.ones(8)
    comm.all_reduce(x, grid.dp)
    out = torch.empty(16)
    comm.all_gather_into(out, x, grid.dp)
    comm.reduce_scatter_dim0(torch.ones(8, 2), grid.dp)
    work = comm.all_reduce(torch.ones(3, dtype=torch.float64), grid.world, async_op=True)
    work.wait()
    result = {"dp": grid.dp.stats.snapshot(), "world": grid.world.stats.snapshot(), "sum": x.tolist()}
    shutdown_distributed()
    return result


def test_every_call_is_recorded_on_its_group():
    from harness import run_ranks

    dp_stats = {"all_reduce": (1, 32), "all_gather": (1, 64), "reduce_scatter": (1, 64)}
    for r in run_ranks(_stats_worker, 2, timeout=120):
        assert r["dp"] == dp_stats and r["world"] == {"all_reduce": (1, 24)} and r["sum"] == [2.0] * 8
