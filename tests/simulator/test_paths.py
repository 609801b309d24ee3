"""Every key that holds a path goes through the one guard (``strategies.paths.guard``): the
schema's keys marked ``PathKey`` and every registered plugin's ``traits.path_params`` are
found by walking, and each is fed a FIFO, a character device, a symbolic-link loop, a
missing path and the wrong kind of path (a folder for a file, a file for a folder). Each is
refused in one line at validation, in bounded time, before anything opens it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import pytest
from pydantic import BaseModel

from simulator import registry
from simulator.config import ScenarioError
from simulator.config.blocks import PLUGIN_FIELDS
from simulator.config.load import load
from simulator.config.paths import check_paths, path_keys, schema_path_keys
from simulator.config.schema import PathKey
from strategies.paths import PathRefused, guard, open_file, read_bytes

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {"file": "a regular file", "folder": "a folder",
            "either": "a regular file or a folder"}


def _plugin_path_keys() -> list[tuple[tuple, str, str, str]]:
    """(location of the plugin block, kind, plugin name, key) of every registered plugin's
    path key."""
    where = {kind: loc for loc, kind in PLUGIN_FIELDS} | {"preaggregators": ("preaggregators", 0)}
    out = []
    for kind in registry.KINDS:
        for name in registry.available(kind):
            try:
                cls = registry.get(kind, name)
            except ImportError:  # an entry point of another checkout's installed metadata
                continue
            for key in cls.traits.path_params:
                assert kind in where, f"{kind} plugin {name} has a path key but no place in a scenario"
                out.append((where[kind], kind, name, key))
    return out


PLUGIN_KEYS = _plugin_path_keys()
SCHEMA_KEYS = schema_path_keys()


def test_the_walk_finds_the_known_path_keys():
    """The walk is not empty: the schema's trace files and the data sets' and the edge
    list's paths are among what it finds (with what each names)."""
    assert (("speeds", "trace"), "file") in SCHEMA_KEYS
    assert (("speeds", "availability"), "file") in SCHEMA_KEYS
    found = {(kind, name, key) for _, kind, name, key in PLUGIN_KEYS}
    assert {("datasets", "mnist", "root"), ("datasets", "cifar10", "root"),
            ("datasets", "parquet", "path"), ("datasets", "parquet", "test_path"),
            ("datasets", "huggingface", "path"), ("topologies", "edge_list", "path")} <= found
    kinds = {(name, key): registry.get(kind, name).traits.path_kind(key)
             for _, kind, name, key in PLUGIN_KEYS}
    assert kinds[("mnist", "root")] == "folder"
    assert kinds[("parquet", "path")] == "either"
    assert kinds[("edge_list", "path")] == "file"


def test_a_new_schema_key_marked_as_a_path_is_found_anywhere():
    """A future key is found through Optional, nested models, lists and mappings."""

    class Inner(BaseModel):
        log: Annotated[str, PathKey("file")] | None = None
        plain: str = ""

    class Outer(BaseModel):
        folder: Annotated[str, PathKey("folder")]
        inner: Inner | None = None
        many: list[Inner] = []
        named: dict[str, Inner] = {}

    assert schema_path_keys(Outer) == [(("folder",), "folder"), (("inner", "log"), "file"),
                                       (("many", "*", "log"), "file"),
                                       (("named", "*", "log"), "file")]


@pytest.fixture(scope="module")
def bad_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    fifo = d / "fifo"
    os.mkfifo(fifo)
    (d / "loop_a").symlink_to(d / "loop_b")
    (d / "loop_b").symlink_to(d / "loop_a")
    (d / "self").symlink_to(d / "self")
    (d / "folder").mkdir()
    (d / "file.txt").write_text("x\n")
    (d / "link_to_fifo").symlink_to(fifo)
    return d


def _cases(d: Path, kind: str) -> list[tuple[str, str]]:
    """(path, the problem's message) for every bad path of a key of ``kind``."""
    exp = EXPECTED[kind]
    noun = {"file": "file", "folder": "folder", "either": "file or folder"}[kind]
    out = [(str(d / "fifo"), f"{d / 'fifo'} is a FIFO (named pipe); expected {exp}"),
           (str(d / "link_to_fifo"), f"{d / 'link_to_fifo'} is a FIFO (named pipe); expected {exp}"),
           ("/dev/zero", f"/dev/zero is a character device; expected {exp}"),
           ("/dev/null", f"/dev/null is a character device; expected {exp}"),
           (str(d / "loop_a"), (f"{d / 'loop_a'} is a symbolic link loop (too many levels of "
            f"links); expected {exp}")),
           (str(d / "self"), (f"{d / 'self'} is a symbolic link loop (too many levels of "
            f"links); expected {exp}")),
           (str(d / "missing"), f"no such {noun}: {d / 'missing'}; expected {exp}"),
           (str(d / "file.txt" / "below"), (f"no such {noun}: {d / 'file.txt' / 'below'}; "
            f"expected {exp}"))]
    if kind == "file":
        out.append((str(d / "folder"), f"{d / 'folder'} is a folder; expected {exp}"))
    if kind == "folder":
        out.append((str(d / "file.txt"), f"{d / 'file.txt'} is a regular file; expected {exp}"))
    return out


def _doc_with(loc: tuple, key: str, value: str, name: str | None = None) -> dict:
    """A scenario mapping with ``value`` at ``loc + (key,)`` (in a block of plugin
    ``name`` when given)."""
    doc: dict = {}
    block: dict = {"name": name} if name else {}
    block[key] = value
    parent = doc
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(part, int):
            parent[loc[i - 1]] = [block if last else {}]
            continue
        nxt = loc[i + 1] if not last else None
        if last:
            parent[part] = block
        elif isinstance(nxt, int):
            pass
        else:
            parent = parent.setdefault(part, {})
    return doc


@pytest.mark.parametrize(("loc", "kind", "name", "key"), PLUGIN_KEYS,
                         ids=[f"{k}-{n}-{key}" for _, k, n, key in PLUGIN_KEYS])
def test_every_plugin_path_key_is_guarded(bad_paths, loc, kind, name, key):
    traits = registry.get(kind, name).traits
    path_kind = traits.path_kind(key)
    for value, message in _cases(bad_paths, path_kind):
        doc = _doc_with(loc, key, value, name)
        if key in traits.created_params and value == str(bad_paths / "missing"):
            assert check_paths(doc) == []  # created by the plugin (a download's root)
            continue
        assert [(p.loc, p.message) for p in check_paths(doc)] == [((*loc, key), message)]
    good = bad_paths / ("folder" if path_kind == "folder" else "file.txt")
    assert check_paths(_doc_with(loc, key, str(good), name)) == []


@pytest.mark.parametrize(("loc", "kind"), SCHEMA_KEYS, ids=[".".join(loc) for loc, _ in SCHEMA_KEYS])
def test_every_schema_path_key_is_guarded(bad_paths, loc, kind):
    for value, message in _cases(bad_paths, kind):
        doc = _doc_with(loc[:-1], loc[-1], value)
        assert [(p.loc, p.message) for p in check_paths(doc)] == [(loc, message)]
    good = bad_paths / ("folder" if kind == "folder" else "file.txt")
    assert check_paths(_doc_with(loc[:-1], loc[-1], str(good))) == []


BASE = """\
name: t
rounds: 2
data:
  dataset: {name: digits}
model: {name: logreg}
clients: {total: 4}
"""


def _scenario_keys() -> list[tuple[str, str]]:
    """Each path key as a ``--set`` override of a scenario that is otherwise valid."""
    sets = [(".".join(loc), "") for loc, _ in SCHEMA_KEYS]
    for loc, _, name, key in PLUGIN_KEYS:
        if loc in (("data", "dataset"), ("topology",)):
            sets.append((".".join(loc), name + ":" + key))
    return sets


@pytest.mark.parametrize(("at", "plugin"), _scenario_keys())
def test_load_refuses_each_bad_path_in_one_line_without_blocking(tmp_path, bad_paths, at,
                                                                  plugin):
    """Through ``load`` (what ``fedray validate`` and every command call): one line, and
    quickly (a FIFO is never opened for reading, /dev/zero never read)."""
    scenario = tmp_path / "s.yaml"
    scenario.write_text(BASE)
    kind = dict(SCHEMA_KEYS).get(tuple(at.split(".")), "file")
    name, key = plugin.split(":") if plugin else (None, None)
    if name:
        kind = registry.get("datasets" if at.startswith("data") else "topologies",
                            name).traits.path_kind(key)
    for value, message in [*_cases(bad_paths, kind)[:5], _cases(bad_paths, kind)[6]]:
        other = f", path: '{bad_paths / 'file.txt'}'" if key == "test_path" else ""
        override = f"{at}={{name: {name}, {key}: '{value}'{other}}}" if name else f"{at}={value}"
        started = time.monotonic()
        with pytest.raises(ScenarioError) as e:
            load(scenario, [override])
        assert time.monotonic() - started < 10
        where = f"{at}.{key}" if name else at
        [line] = e.value.lines
        assert line.split(": ", 1) == [f"{scenario}:{4 if at == 'data.dataset' else 1}", f"{where}: {message}"]


def test_fedray_validate_exits_2_in_one_line(tmp_path, bad_paths):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(BASE)
    for override in (f"speeds.trace={bad_paths / 'fifo'}",
                     f"data.dataset={{name: mnist, root: '{bad_paths / 'loop_a'}'}}"):
        out = subprocess.run([sys.executable, "-m", "fedray.cli", "validate", str(scenario),
                              "--set", override], check=False, capture_output=True, text=True, timeout=120,
                             cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert out.returncode == 2, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "Traceback" not in out.stderr
        assert not (tmp_path / "mlflow.db").exists()


def test_the_scenario_file_itself_is_guarded(tmp_path, bad_paths):
    for value, message in _cases(bad_paths, "file"):
        with pytest.raises(ScenarioError) as e:
            load(value)
        capped = message.replace("expected a regular file", "expected a regular file (files "
                                 "of at most 1 MiB)")
        assert e.value.lines == [f"{value}: scenario: {capped}"]


def test_the_opener_checks_what_it_opened(bad_paths, tmp_path):
    """``open_file`` refuses what ``guard`` refuses, never blocks on a FIFO, and
    ``read_bytes`` stops at its cap."""
    for value, _ in _cases(bad_paths, "file"):
        with pytest.raises(PathRefused):
            open_file(value)
    big = tmp_path / "big"
    big.write_bytes(b"a" * 100)
    assert read_bytes(big, 100) == b"a" * 100
    with pytest.raises(PathRefused, match=r"big holds 100 bytes, more than the 99 bytes"):
        read_bytes(big, 99)
    assert guard(bad_paths / "folder", "either") == bad_paths / "folder"
    with pytest.raises(PathRefused, match="NUL"):
        guard("a\0b")
    for kind in ("file", "folder", "either"):
        with pytest.raises(PathRefused, match=f"^an empty path; expected {EXPECTED[kind]}$"):
            guard("", kind)  # not the working folder


def test_path_keys_resolve_relative_to_the_scenario(tmp_path):
    """The same walk resolves relative paths (schema and plugin keys alike)."""
    (tmp_path / "sub").mkdir()
    doc = {"speeds": {"trace": "t.json"}, "data": {"dataset": {"name": "mnist", "root": "m"}},
           "topology": {"name": "edge_list", "path": "../e.txt"}}
    found = sorted(".".join(map(str, loc)) for loc, *_ in path_keys(doc))
    assert found == ["data.dataset.root", "speeds.trace", "topology.path"]


@pytest.mark.parametrize(("dataset", "layout", "key"), [
    ("femnist", ["train/a.json", "test/b.json"], "root"),
    ("shakespeare", ["train/a.json", "test/b.json"], "root"),
    ("huggingface", ["train/data-00000.parquet"], "path"),
    ("huggingface", ["train/x.arrow"], "path"),
])
@pytest.mark.parametrize("bad", ["fifo", "device"])
def test_a_file_inside_a_data_folder_is_guarded_too(tmp_path, dataset, layout, key, bad):
    """The files a data set reads inside its folder go through the same guard: a FIFO is
    named, never opened; a link to a device is never read."""
    root = tmp_path / "data"
    for rel in layout:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        if bad == "fifo":
            os.mkfifo(root / rel)
        else:
            (root / rel).symlink_to("/dev/zero")
    scenario = tmp_path / "s.yaml"
    scenario.write_text(BASE)
    started = time.monotonic()
    with pytest.raises(ScenarioError) as e:
        load(scenario, [f"data.dataset={{name: {dataset}, {key}: '{root}'}}"])
    assert time.monotonic() - started < 10
    what = "a FIFO (named pipe)" if bad == "fifo" else "a character device"
    assert e.value.lines == [(f"{scenario}:4: data.dataset.{key}: {root / layout[0]} is {what}; "
                             "expected a regular file")]
