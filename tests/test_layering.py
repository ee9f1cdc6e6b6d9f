"""The package is built in floors (tests/import_graph.py: FLOORS): no module imports from a floor
above its own, and no import circle exists. Both read the imports from the source, so a new
upward import or circle fails here with the edge named."""

from __future__ import annotations

from pathlib import Path

import pytest
from import_graph import FLOORS, PACKAGE, circles, floor_of, imports, modules, upward


def test_every_top_level_name_has_a_floor():
    tops = {name.split(".")[1] if "." in name else "" for name in modules()}
    assert tops - set(FLOORS) == set(), "add the new top-level module or package to FLOORS"


def test_no_import_runs_up_a_floor():
    assert upward(imports()) == []


def test_no_import_circle():
    assert circles(imports()) == []


def test_the_core_floors_never_import_the_layers_above():
    """The issue's own example, stated directly: distributed/, model/ and data/ import nothing from
    analysis, the planner, training or the commands."""
    above = ("analysis", "planner", "training", "commands", "api")
    for module, targets in imports().items():
        if module.split(".")[1:2] and module.split(".")[1] in ("distributed", "model", "data"):
            assert not [t for t in targets if t.split(".")[1:2] and t.split(".")[1] in above], module


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "threefold"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checks_see_an_upward_import_and_a_circle(tmp_path):
    """The checker itself: a deliberate upward import (distributed -> planner, also as a
    function-level and a relative import) and a two-module circle are both reported."""
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "distributed/__init__.py": "",
            "distributed/comm.py": "def f():\n    from threefold.planner.cost import g\n",
            "distributed/grid.py": "from ..planner import cost\n",
            "planner/__init__.py": "",
            "planner/cost.py": "from threefold.planner import search\n",
            "planner/search.py": "import threefold.planner.cost\n",
        },
    )
    edges = imports(root)
    assert upward(edges) == [
        "threefold.distributed.comm (2) -> threefold.planner.cost (8)",
        "threefold.distributed.grid (2) -> threefold.planner (8)",
        "threefold.distributed.grid (2) -> threefold.planner.cost (8)",
    ]
    assert circles(edges) == [["threefold.planner.cost", "threefold.planner.search"]]


def test_an_unknown_top_level_name_is_named():
    with pytest.raises(KeyError, match="'newthing' has no floor"):
        floor_of("threefold.newthing.x")


def test_the_real_package_is_read():
    """Guards the checks above against reading nothing: the package has its core modules and
    their known downward edges."""
    edges = imports()
    assert PACKAGE.name == "threefold"
    assert "threefold.distributed.comm" in edges["threefold.distributed.grid"]
    assert "threefold.training.trainer" in edges["threefold.training.worker"]
