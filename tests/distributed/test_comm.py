"""The communication layer: the one module that talks to torch.distributed, device checks,
and the bytes and calls it records per group."""

import ast
from pathlib import Path

import pytest
import torch

from threefold.distributed import comm
from threefold.distributed.comm import Group

PACKAGE = Path(__file__).resolve().parents[2] / "threefold"
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


FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "as_tensor"}
COLLECTIVES = {n for n in dir(comm) if n.startswith(("all_", "reduce_", "gather_", "broadcast")) and n[-1] != "s"}


def _hostbound(path: Path) -> list[str]:
    """Tensors made by a torch factory without `device=` that reach a collective in the same
    function (directly, or through one name): on NCCL each would be a CPU tensor. The device
    check in comm.py catches them when the code runs; this catches them on paths no test runs."""
    found = []

    def made_without_device(node) -> bool:
        return (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and ast.unparse(node.func.value) == "torch"
            and node.func.attr in FACTORIES
            and not any(k.arg == "device" for k in node.keywords)
        )

    for fn in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        host = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and made_without_device(node.value):
                host |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name not in COLLECTIVES:
                continue
            arg = node.args[0]
            if made_without_device(arg) or (isinstance(arg, ast.Name) and arg.id in host):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_no_host_tensor_is_handed_to_a_collective():
    bad = [u for f in sorted(PACKAGE.rglob("*.py")) for u in _hostbound(f)]
    assert bad == [], "tensors created without device= enter a collective:\n" + "\n".join(bad)


def test_the_host_tensor_scan_finds_both_shapes(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f(g, d):\n"
        "    x = torch.zeros(3)\n    comm.all_reduce(x, g)\n"
        "    all_reduce_max(torch.tensor([1.0]), g)\n"
        "    comm.all_reduce(torch.zeros(3, device=d), g)\n"
    )
    assert [line.split(": ", 1)[0].rsplit(":", 1)[1] for line in _hostbound(probe)] == ["3", "4"]


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


def _reduce_scatter_worker() -> dict:
    """gloo's reduce-scatter (composed in comm as an all-to-all and a local sum) against the sum
    computed here: blocking, asynchronous (summed only once waited for), and in place into this
    rank's own slice of the input, in fp32 and bf16."""
    import torch.distributed as dist

    from threefold.distributed.grid import Grid, RankLayout
    from threefold.distributed.runtime import init_distributed, shutdown_distributed

    init_distributed(torch.device("cpu"), timeout_s=60)
    grid = Grid.build(RankLayout(dp=dist.get_world_size()))
    size, rank = grid.dp.size, grid.dp.rank
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        inputs = [torch.randn(size * 48, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(size)]
        want = torch.stack(inputs).float().sum(0).to(dtype)[rank * 48 : (rank + 1) * 48]
        blocking = torch.empty(48, dtype=dtype)
        comm.reduce_scatter_into(blocking, inputs[rank].clone(), grid.dp)
        later = torch.empty(48, dtype=dtype)
        work = comm.reduce_scatter_into(later, inputs[rank].clone(), grid.dp, async_op=True)
        comm.wait(work, grid.dp)
        full = inputs[rank].clone()
        own = full[rank * 48 : (rank + 1) * 48]
        comm.wait(comm.reduce_scatter_into(own, full, grid.dp, async_op=True), grid.dp)
        tol = 1e-6 if dtype == torch.float32 else 2e-2
        out[str(dtype)] = [
            float((got.float() - want.float()).abs().max()) <= tol * float(want.float().abs().max())
            for got in (blocking, later, own)
        ]
    out["stats"] = grid.dp.stats.snapshot()
    shutdown_distributed()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_reduce_scatter_sums_every_ranks_slice(world):
    from harness import run_ranks

    for r in run_ranks(_reduce_scatter_worker, world, timeout=120):
        assert r["torch.float32"] == [True] * 3 and r["torch.bfloat16"] == [True] * 3
        assert r["stats"]["reduce_scatter"][0] == 6  # recorded as reduce-scatters, input bytes
