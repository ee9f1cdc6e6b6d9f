"""threefold's import graph read from the source (module-level and function-level imports alike,
as the AST has them), the floor table the package is built in, and the two checks on it: no
import runs up a floor, and no import circle. Shared by tests/test_layering.py; pure Python, no
imports of threefold itself, so a broken module cannot hide an edge."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "threefold"

FLOORS: dict[str, int] = {
    # 0: facts every floor needs
    "errors": 0,
    "atomic": 0,
    "version": 0,
    "presets": 0,
    "config": 0,
    # 1: the plain model and the data
    "model": 1,
    "data": 1,
    # 2: parallelism, communication, launch
    "distributed": 2,
    # 3: what a run records and saves
    "observe": 3,
    "checkpoint": 3,
    # 4: what reads checkpoints and checks a config against a layout
    "interop": 4,
    "inference": 4,
    "validate": 4,
    "preflight": 4,
    # 5: the training loop
    "training": 5,
    # 6: the library API
    "api": 6,
    # 7-8: offline analysis of runs, and the planner beside it
    "analysis": 7,
    "planner": 8,
    # 9: the command line and the package's own surface
    "commands": 9,
    "cli": 9,
    "__main__": 9,
    "": 9,  # threefold/__init__.py
}
"""Each top-level module or package of threefold/ and its floor. A module may import from its own
floor or below, never above."""


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package is its __init__)."""
    found = {}
    for path in root.rglob("*.py"):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (a `from pkg import name` counts as
    pkg.name when that is a module, else as pkg)."""
    found = modules(root)

    def owner(name: str) -> str | None:
        while name and name not in found:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in found}
    for module, path in found.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for target in targets:
                if target.split(".")[0] == root.name:
                    resolved = owner(target)
                    if resolved and resolved != module:
                        edges[module].add(resolved)
    return edges


def floor_of(module: str, floors: dict[str, int] = FLOORS) -> int:
    """The floor of a dotted module name, by its top-level name under the package."""
    top = module.split(".")[1] if "." in module else ""
    if top not in floors:
        raise KeyError(f"{module}: its top-level name {top!r} has no floor in FLOORS (tests/import_graph.py)")
    return floors[top]


def upward(edges: dict[str, set[str]], floors: dict[str, int] = FLOORS) -> list[str]:
    """Every import from a module to one on a higher floor, as 'a (floor) -> b (floor)'."""
    out = []
    for module in sorted(edges):
        for target in sorted(edges[module]):
            if floor_of(target, floors) > floor_of(module, floors):
                out.append(f"{module} ({floor_of(module, floors)}) -> {target} ({floor_of(target, floors)})")
    return out


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted.
    A package's __init__ re-exporting its own modules is not a circle: edges into a package
    node are left out, as the import system loads a package before its modules anyway."""
    graph = {m: {t for t in ts if not _is_package(t, edges)} for m, ts in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _is_package(module: str, edges: dict[str, set[str]]) -> bool:
    prefix = module + "."
    return any(other.startswith(prefix) for other in edges)
