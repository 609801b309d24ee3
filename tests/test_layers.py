"""The packages form a stack: strategies -> simulator -> dashboards -> fedray.

Every import is read off the source with ``ast``: at module level and inside functions (an
import a function makes when it is called is an import all the same), ``import x`` and
``from x import y``, relative ones resolved. Importing ``a.b.c`` also runs ``a/__init__.py``
and ``a/b/__init__.py``, so those count as imported too (except the importer's own packages,
which have begun to run before it can). Over the modules of the four packages this test fails
on an import cycle, on a package importing one above it, and on a private name (``_x``)
imported from another module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Bottom first: a package may import only itself and the packages before it.
LAYERS = ("strategies", "simulator", "dashboards", "fedray")


def _module_files() -> dict[str, Path]:
    """Every module of the four packages by dotted name (a package by its ``__init__``)."""
    modules = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


MODULES = _module_files()


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _absolute(module: str, level: int, name: str | None) -> str:
    """The dotted name that ``from <level dots><name> import ...`` means inside ``module``."""
    if not level:
        return name or ""
    base = module.split(".")
    if not _is_package(module):
        base.pop()
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports(module: str) -> Iterator[tuple[str, list[str], int]]:
    """(the module named, the names taken from it, line) for every import in ``module``."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, node.level, node.module)
            yield target, [alias.name for alias in node.names], node.lineno


def _runs(importer: str, target: str, names: list[str]) -> set[str]:
    """The modules of the four packages that this import runs: the target (or, for ``from
    package import module``, the modules named) and the packages above it, whose
    ``__init__`` runs first; the importer's own packages have begun to run already."""
    parts = target.split(".")
    above = {".".join(parts[:i]) for i in range(1, len(parts))}
    named = {f"{target}.{name}" for name in names} & MODULES.keys()
    if names and len(named) == len(names):
        above.add(target)  # every name is a module: the package's __init__ merely runs
    else:
        named.add(target)  # ``import target``, or names the target defines
    own = {importer.rsplit(".", i)[0] for i in range(importer.count(".") + 1)}
    return ((above - own) | named) & MODULES.keys() - {importer}


def _graph() -> dict[str, dict[str, int]]:
    """module -> {module it runs: the line of the first import that does}."""
    graph: dict[str, dict[str, int]] = {m: {} for m in MODULES}
    for module in MODULES:
        for target, names, line in _imports(module):
            for other in _runs(module, target, names):
                graph[module].setdefault(other, line)
    return graph


def _reach(graph: dict[str, dict[str, int]], start: str) -> set[str]:
    """Every module that importing ``start`` runs, directly or not."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for other in graph[todo.pop()]:
            if other not in seen:
                seen.add(other)
                todo.append(other)
    return seen


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import cycles: each the modules that reach one another (a strongly connected
    component of more than one module)."""
    reach = {m: _reach(graph, m) for m in graph}
    found: list[list[str]] = []
    for module in graph:
        if module in reach[module] and not any(module in c for c in found):
            found.append(sorted(m for m in reach[module] if module in reach[m]))
    return found


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def test_the_walk_sees_function_local_imports_and_package_inits() -> None:
    graph = _graph()
    # fedray.cli imports the runner inside its command functions only
    assert "simulator.run.runner" in graph["fedray.cli"]
    # ``from simulator.config.schema import ...`` runs simulator/config/__init__.py
    assert "simulator.config" in graph["fedray.cli"]
    assert len(MODULES) > 80
    assert _absolute("simulator.config.checks", 1, "errors") == "simulator.config.errors"
    assert _absolute("simulator.config", 1, "errors") == "simulator.config.errors"
    assert _absolute("simulator.config.checks", 2, None) == "simulator"


def test_no_import_cycle() -> None:
    graph = _graph()
    cycles = _cycles(graph)
    report = [
        f"{len(c)} modules: "
        + "; ".join(f"{a} -> {b} (line {graph[a][b]})" for a in c for b in graph[a] if b in c)
        for c in cycles
    ]
    assert not cycles, "import cycles:\n" + "\n".join(report)


def test_no_package_imports_one_above_it() -> None:
    graph = _graph()
    upward = [
        f"{module}:{line} imports {other}"
        for module, targets in graph.items()
        for other, line in targets.items()
        if _layer(other) > _layer(module)
    ]
    assert not upward, "upward imports (order: " + " -> ".join(LAYERS) + "):\n" + "\n".join(upward)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_modules_bound(tree: ast.AST, module: str) -> set[str]:
    """The names in ``module`` bound to a module of the four packages by an import."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {a.asname or a.name.split(".")[0] for a in node.names
                      if a.name.split(".")[0] in LAYERS}
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, node.level, node.module)
            bound |= {a.asname or a.name for a in node.names if f"{target}.{a.name}" in MODULES}
    return bound


def _private_uses(module: str) -> Iterator[str]:
    """Where ``module`` takes a private name of another module of the four packages: by an
    import (``from a.b import _x``, ``import a._b``) or as an attribute of an imported
    module (``b._x``)."""
    for target, names, line in _imports(module):
        if target.split(".")[0] in LAYERS:
            for name in [*target.split("."), *names]:
                if _private(name):
                    yield f"{module}:{line} imports {name} ({target})"
    tree = ast.parse(MODULES[module].read_text())
    bound = _own_modules_bound(tree, module)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                yield f"{module}:{node.lineno} uses {base.id}...{node.attr}"


def test_no_private_name_imported_from_another_module() -> None:
    private = [use for module in MODULES for use in _private_uses(module)]
    assert not private, "private names imported across modules:\n" + "\n".join(private)
