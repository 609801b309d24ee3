"""Scenario files: reading YAML safely (size and alias bounds), ``--set`` overrides, paths
relative to the file, and every problem mapped to its line."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from simulator.config.dotted import MAX_DEPTH, PathError, path_problem, set_path, sweep_paths
from simulator.config.errors import Loc, Problem, ScenarioError
from simulator.config.paths import path_keys
from simulator.config.schema import RunPoint, Scenario
from simulator.config.sweep import expand
from simulator.errors import brief, brief_text
from strategies.paths import PathRefused, read_bytes


def _line_of(root: yaml.Node | None, loc: Loc) -> int | None:
    node, line = root, None
    if node is not None:
        line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == str(part):
                    node, line = v, k.start_mark.line + 1
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


@dataclass
class LoadedScenario:
    path: Path
    text: str
    raw: dict
    scenario: Scenario
    points: list[RunPoint] = field(default_factory=list)


def _resolve_paths(raw: dict, base: Path) -> None:
    """Relative paths of every path key (the schema's keys marked ``PathKey`` and each
    plugin's ``traits.path_params``: ``simulator.config.paths``) are relative to the
    scenario file's directory, wherever ``fedray`` is started from."""
    for at in path_keys(raw):
        _resolve(at.block, at.key, base)


def _resolve(block: dict, key: str, base: Path) -> None:
    value = block.get(key)
    if isinstance(value, str) and value and not Path(value).is_absolute():
        block[key] = str((base / value).resolve())


MAX_FILE_BYTES = 1 << 20  # a scenario file is text of a few kB
MAX_VALUES = 100_000  # values in a scenario once YAML aliases are expanded


def _too_deep(loc: Loc, line: int | None = None) -> ScenarioError:
    return ScenarioError([Problem(loc, f"nested more than {MAX_DEPTH} levels deep; at most "
                                  f"{MAX_DEPTH} are allowed (a scenario is a few levels "
                                  "deep)", line)])


def _check_event_depth(text: str, loc: Loc) -> None:
    """Refuse a text nested more than MAX_DEPTH levels before it is composed: PyYAML's
    parser is a state machine (no recursion), its composer recurses once per level."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise _too_deep(loc, event.start_mark.line + 1 if not loc else None)
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for kv in node.value for n in kv]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _node_depth(root: yaml.Node, limit: int) -> int:
    """How deep the node graph goes once aliases are followed (a shared node is one node,
    an alias inside itself is infinitely deep), computed without recursion; stops past
    ``limit`` (returns ``limit + 1``)."""
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = _children(node)
        if done:
            on_path.discard(key)
            depth[key] = 1 + max((depth[id(c)] for c in children), default=0)
            if depth[key] > limit:
                return limit + 1
            continue
        if key in depth:
            continue
        if key in on_path:  # an alias of a node inside itself
            return limit + 1
        on_path.add(key)
        stack.append((node, True))
        for c in children:
            if id(c) in on_path:
                return limit + 1
            if id(c) not in depth:
                stack.append((c, False))
    return depth.get(id(root), 0)


def _expanded_size(root: yaml.Node | None, limit: int) -> int:
    """How many values the YAML document holds once its aliases are expanded (counted on the
    node graph, where an alias is a shared node: a small file cannot make this walk big);
    stops counting past ``limit``. The graph is at most MAX_DEPTH deep here."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        sizes[id(node)] = 1  # a recursive alias counts once
        if isinstance(node, yaml.MappingNode):
            total = 1 + sum(size(k) + size(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(v) for v in node.value)
        else:
            total = 1
        sizes[id(node)] = total = min(total, limit + 1)
        return total

    return 0 if root is None else size(root)


def _key_text(node: yaml.Node) -> str:
    return str(node.value) if isinstance(node, yaml.ScalarNode) else "?"


def _duplicate_keys(root: yaml.Node | None, loc: Loc) -> list[Problem]:
    """A problem per key given twice in one mapping (YAML keeps the last one silently),
    with both lines. The graph is at most MAX_DEPTH deep here."""
    problems: list[Problem] = []
    seen: set[int] = set()

    def walk(node: yaml.Node, path: Loc) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    line = k.start_mark.line + 1
                    at = first.get((k.tag, k.value))
                    if at is None:
                        first[(k.tag, k.value)] = line
                    else:
                        problems.append(Problem(
                            loc + path + (k.value,), f"given twice (lines {at} and {line}); "
                            "YAML would keep the last one silently: keep one",
                            None if loc else line))
                walk(v, path + (_key_text(k),))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, path + (i,))

    if root is not None:
        walk(root, ())
    return problems


def read_yaml(text: str, loc: Loc = ()) -> tuple[Any, yaml.Node | None]:
    """``(value, node tree)`` of a YAML text; ``ScenarioError`` (one line) when it is not
    valid YAML, is nested more than MAX_DEPTH levels, gives a key twice in one mapping or
    holds more than MAX_VALUES values once its aliases are expanded."""
    try:
        _check_event_depth(text, loc)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is not None and _node_depth(root, MAX_DEPTH) > MAX_DEPTH:
            raise _too_deep(loc)  # through aliases
        n = _expanded_size(root, MAX_VALUES)
        if n > MAX_VALUES:
            raise ScenarioError([Problem(loc, f"more than {MAX_VALUES:,} values once its YAML "
                                         "aliases are expanded; a scenario is far smaller")])
        duplicates = _duplicate_keys(root, loc)
        if duplicates:
            raise ScenarioError(duplicates)
        return yaml.safe_load(text), root
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        msg = brief_text(str(getattr(e, "problem", None) or e).strip().splitlines()[0], 160)
        raise ScenarioError([Problem(loc, f"not valid YAML: {msg}",
                                     mark.line + 1 if mark and not loc else None)]) from None


def parse_override(item: str) -> tuple[str, Any]:
    """``key.path=value`` from ``--set``; the value is read as YAML (``rounds=5`` -> 5)."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ScenarioError([Problem(("--set",), f"expected KEY=VALUE, got {brief(item)}")])
    key = key.strip()
    where = (f"--set {brief_text(key, 60)}",)
    bad = path_problem(key)
    if bad:
        raise ScenarioError([Problem(where, bad)])
    if not value.strip():
        return key, None
    return key, read_yaml(value, where)[0]


def _overlaps(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _swept_overrides(raw: dict, keys: list[str]) -> list[Problem]:
    """``--set`` keys that the scenario's sweep also sets (the sweep would silently win)."""
    paths = sweep_paths(raw)
    out = []
    for key in keys:
        if key == "sweep" or key.startswith("sweep."):
            continue
        hit = next((p for p in paths if _overlaps(key, p)), None)
        if hit is not None:
            out.append(Problem((f"--set {brief_text(key, 60)}",), f"the scenario's sweep also "
                               f"sets {brief_text(hit, 60)} (each point would override it); "
                               "change the sweep's values instead"))
    return out


def _read_text(path: Path) -> str:
    """The text of a scenario file: a regular text file of at most MAX_FILE_BYTES."""
    source = str(path)
    try:
        return read_bytes(path, MAX_FILE_BYTES).decode()
    except PathRefused as e:
        raise ScenarioError([Problem((), str(e))], source) from None
    except UnicodeDecodeError:
        raise ScenarioError([Problem((), "not a text file")], source) from None


def load(path: str | Path, overrides: list[str] | None = None) -> LoadedScenario:
    """Read, validate and expand a scenario file; ``overrides`` are ``--set`` items."""
    path = Path(path)
    text = _read_text(path)
    return load_text(text, path, overrides)


def load_text(text: str, path: Path, overrides: list[str] | None = None,
              source: str | None = None, lines: bool = True) -> LoadedScenario:
    """Validate and expand a scenario given as YAML ``text``, as if read from ``path``
    (its name, by default the experiment's; its folder, where relative paths start: a
    scenario given as text or a mapping, the working directory's). A problem names
    ``source`` (default: the path) and, with ``lines``, its line in ``text``."""
    source = source or str(path)
    try:
        raw, root = read_yaml(text)
        raw = {} if raw is None else raw
        if isinstance(raw, dict):
            keys = []
            for item in overrides or []:
                k, v = parse_override(item)
                try:
                    set_path(raw, k, v)
                except PathError as e:
                    raise ScenarioError([Problem((f"--set {brief_text(k, 60)}",), str(e))]
                                        ) from None
                keys.append(k)
            swept = _swept_overrides(raw, keys)
            if swept:
                raise ScenarioError(swept)
    except ScenarioError as e:
        raise ScenarioError(e.problems, source) from None
    if isinstance(raw, dict):
        raw.setdefault("name", path.stem)
        _resolve_paths(raw, path.parent)
    try:
        points, sc = expand(raw)
    except ScenarioError as e:
        for p in e.problems:
            loc = ("sweep", p.sweep_key) if p.sweep_key else p.loc
            p.line = _line_of(root, loc) if loc and lines else None
        raise ScenarioError(e.problems, source) from None
    return LoadedScenario(path, text, raw, sc, points)


def json_schema() -> dict:
    """JSON Schema of a scenario file (plugin blocks are open mappings with a ``name``)."""
    return Scenario.model_json_schema()
