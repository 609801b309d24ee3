"""Bad input of the classes of issue 29, each refused in one line before anything runs
(in ``load``, or in the command before Ray starts and before any MLflow run exists)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from simulator.config import ScenarioError, load

ROOT = Path(__file__).resolve().parents[2]

BASE = """\
name: t
rounds: 3
data:
  dataset: {name: digits}
model: {name: logreg}
clients: {total: 10, per_round: 8}
"""


def _file(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _refused(path: Path, overrides: list[str] | None = None) -> list[str]:
    with pytest.raises(ScenarioError) as e:
        load(path, overrides)
    return e.value.lines


def fedray(*args: str, cwd: Path | None = None, env: dict | None = None
           ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedray", *args], check=False, capture_output=True,
                          text=True, cwd=cwd or ROOT, env={**os.environ, **(env or {})},
                          timeout=120)


# ---------------------------------------------------------------- 1. deep nesting

DEEP = "nested more than 32 levels deep; at most 32 are allowed (a scenario is a few levels deep)"


@pytest.mark.parametrize("value", ["[" * 600 + "]" * 600, "{a: " * 600 + "1" + "}" * 600],
                         ids=["lists", "maps"])
def test_deep_nesting_in_a_file_is_one_line(tmp_path, value):
    p = _file(tmp_path, BASE + "model: " + value + "\n")
    assert _refused(p) == [f"{p}:7: scenario: {DEEP}"]


@pytest.mark.parametrize("value", ["[" * 600 + "]" * 600, "{a: " * 600 + "1" + "}" * 600],
                         ids=["lists", "maps"])
def test_deep_nesting_through_set_is_one_line(tmp_path, value):
    p = _file(tmp_path, BASE)
    assert _refused(p, [f"model={value}"]) == [f"{p}: --set model: {DEEP}"]


def test_deep_nesting_through_aliases_and_long_paths_is_one_line(tmp_path):
    chain = "".join(f"a{i}: &a{i} [[*a{i - 1}]]\n" for i in range(1, 40))
    p = _file(tmp_path, BASE + "a0: &a0 [1]\n" + chain)
    assert _refused(p) == [f"{p}: scenario: {DEEP}"]
    p = _file(tmp_path, BASE, "b.yaml")
    assert _refused(p, [".".join(["a"] * 600) + "=1"]) == [
        (f"{p}: --set {'.'.join(['a'] * 30)[:57]}...: a path of 600 parts; a scenario is at "
        "most 32 levels deep")]
    p = _file(tmp_path, BASE + f"sweep: {{{'.'.join(['a'] * 100)}: [1]}}\n", "c.yaml")
    assert _refused(p) == [(f"{p}:7: sweep.{'.'.join(['a'] * 100)}: a path of 100 parts; a "
                           "scenario is at most 32 levels deep")]


def test_deep_nesting_is_one_line_from_the_command(tmp_path):
    p = _file(tmp_path, BASE + "model: " + "[" * 600 + "]" * 600 + "\n")
    r = fedray("run", str(p), "--backend", "inline", cwd=tmp_path)
    assert (r.returncode, r.stderr.splitlines()) == (2, [f"{p}:7: scenario: {DEEP}"])
    assert not (tmp_path / "mlflow.db").exists()  # nothing ran


# ---------------------------------------------------------------- 4. duplicate keys, --set vs sweep

def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    p = _file(tmp_path, BASE + "local: {lr: 0.1, lr: 0.2}\nrounds: 5\n")
    assert _refused(p) == [
        (f"{p}:7: local.lr: given twice (lines 7 and 7); YAML would keep the last one "
        "silently: keep one"),
        (f"{p}:8: rounds: given twice (lines 2 and 8); YAML would keep the last one "
        "silently: keep one")]


def test_a_key_given_twice_in_set_is_refused(tmp_path):
    p = _file(tmp_path, BASE)
    assert _refused(p, ["aggregator={name: cwtm, name: mean}"]) == [
        (f"{p}: --set aggregator.name: given twice (lines 1 and 1); YAML would keep the last "
        "one silently: keep one")]


@pytest.mark.parametrize("key", ["local.lr", "local", "local.batch_size"])
def test_set_on_a_key_the_sweep_sets_is_refused(tmp_path, key):
    p = _file(tmp_path, BASE + "sweep: {'local.lr, local.batch_size': [[0.1, 4], [0.2, 8]]}\n")
    hit = "local.batch_size" if key == "local.batch_size" else "local.lr"
    value = "{lr: 0.3}" if key == "local" else "16"
    assert _refused(p, [f"{key}={value}"]) == [
        (f"{p}: --set {key}: the scenario's sweep also sets {hit} (each point would override "
        "it); change the sweep's values instead")]
    assert len(load(p, ["local.momentum=0.5"]).points) == 2  # a key the sweep leaves alone
