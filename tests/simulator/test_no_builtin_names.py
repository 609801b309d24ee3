"""The core decides from declared traits, never from a built-in plugin's name: no built-in
name is compared, looked up or written as a plugin block outside ``strategies/`` and the
scenario defaults (``simulator/config/schema.py``). A test that reads the source."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ("simulator", "fedray", "dashboards")
DEFAULTS = {Path("simulator/config/schema.py")}  # the scenario defaults name plugins


def builtin_names() -> set[str]:
    """Every name a built-in plugin is registered under (the project's entry points)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {name for group, entries in project["entry-points"].items()
            if group.startswith("fedray.") for name in entries}


def _names_a_plugin(node: ast.AST) -> bool:
    """Whether ``node`` reads a plugin's name: ``x["name"]``, ``x.get("name")``,
    ``x.name`` or a variable called ``name``/``*_name``."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "name"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr == "get" and any(
            isinstance(a, ast.Constant) and a.value == "name" for a in node.args)
    if isinstance(node, ast.Attribute):
        return node.attr == "name" or node.attr.endswith("_name")
    if isinstance(node, ast.Name):
        return node.id == "name" or node.id.endswith("_name")
    return False


def _constants(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [v for e in node.elts for v in _constants(e)]
    return []


def uses_of_names(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each built-in name the code decides on: compared with a plugin's
    name, written as a plugin block's ``name``, or looked up in the registry."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_names_a_plugin(s) for s in sides):
                found += [(node.lineno, f"compared: {v!r}") for s in sides
                          for v in _constants(s) if v in names]
        elif isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and k.value == "name":
                    found += [(node.lineno, f"plugin block: {c!r}") for c in _constants(v)
                              if c in names]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("get", "keys", "instantiate") and len(node.args) >= 2 and \
                isinstance(node.func.value, ast.Name) and node.func.value.id == "registry":
            found += [(node.lineno, f"looked up: {c!r}") for c in _constants(node.args[1])
                      if c in names]
    return found


def test_the_detector_finds_each_form():
    names = {"mean", "sgd"}
    code = ('a = sc.aggregator["name"] != "mean"\nb = spec.get("name") in ("sgd", "x")\n'
            'c = {"name": "sgd"}\nd = registry.get("trainers", "sgd")\n'
            'e = rule == "median"\nf = sc.server.buffers == "mean"\n')
    assert [line for line, _ in uses_of_names(ast.parse(code), names)] == [1, 2, 3, 4]


def test_no_builtin_plugin_name_outside_strategies_and_the_defaults():
    names = builtin_names()
    assert {"mean", "sgd", "vectorized_sgd", "dp_fedavg", "ring"} <= names
    found = []
    for package in CORE:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel in DEFAULTS:
                continue
            found += [f"{rel}:{line}: {what}"
                      for line, what in uses_of_names(ast.parse(path.read_text()), names)]
    assert found == []
