"""Bad input of the classes of issue 29, each refused in one line before anything runs
(in ``load``, or in the command before Ray starts and before any MLflow run exists)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from simulator.config import ScenarioError
from simulator.config.load import load

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


def test_a_path_steps_into_a_list_by_index_in_set_sweep_and_tune(tmp_path):
    """``privacy_attacks.0.iterations`` is the first attack's key in --set, a sweep and a
    tune space; an index the list does not have is one line naming the path and its
    indices (it used to replace the list by a mapping and say the list was not one)."""
    p = _file(tmp_path, BASE + "privacy_attacks: [{name: dlg}, {name: loss_threshold}]\n")
    sc = load(p, ["privacy_attacks.0.iterations=7"]).scenario
    assert sc.privacy_attacks[0]["iterations"] == 7 and len(sc.privacy_attacks) == 2
    assert _refused(p, ["privacy_attacks.2.iterations=7"]) == [
        (f"{p}: --set privacy_attacks.2.iterations: privacy_attacks is a list of 2: '2' is not "
        "one of its indices 0..1")]
    assert _refused(p, ["privacy_attacks.first.iterations=7"])[0].endswith(
        "'first' is not one of its indices 0..1")
    swept = _file(tmp_path, BASE + "privacy_attacks: [{name: dlg}]\n"
                  "sweep: {privacy_attacks.0.iterations: [5, 9]}\n", "w.yaml")
    assert [pt.scenario.privacy_attacks[0]["iterations"] for pt in load(swept).points] == [5, 9]
    bad = _file(tmp_path, BASE + "privacy_attacks: [{name: dlg}]\n"
                "sweep: {privacy_attacks.1.iterations: [5, 9]}\n", "b.yaml")
    lines = _refused(bad)
    assert len(lines) == 1 and "sweep.privacy_attacks.1.iterations" in lines[0] and \
        "privacy_attacks is a list of 1: '1' is not one of its indices 0..0" in lines[0]


# ---------------------------------------------------------------- 2. integers that exhaust

@pytest.mark.parametrize(("key", "allowed"), [
    ("rounds", "<= 1000000"), ("local.epochs", "<= 1000"), ("local.steps", "<= 100000"),
    ("local.batch_size", "<= 65536"), ("clients.total", "<= 10000000"),
    ("clients.per_round", "<= 10000000"), ("clients.byzantine", "<= 10000000"),
    ("dsgd.gossip_steps", "<= 1000"), ("evaluation.every", "<= 1000000"),
    ("runtime.workers", "<= 10000"), ("runtime.checkpoint_every", "<= 1000000"),
    ("runtime.threads", "<= 1024"), ("runtime.eval_threads", "<= 1024"),
    ("runtime.num_cpus", "<= 1024.0"), ("runtime.num_gpus", "<= 64.0"),
    ("clients.byzantine_period", "<= 1000000"), ("asynchrony.concurrency", "<= 10000000"),
    ("asynchrony.buffer_size", "<= 10000000"), ("asynchrony.buffers", "<= 10000000"),
    ("asynchrony.max_staleness", "<= 1000000"), ("asynchrony.staleness.b", "<= 1000000"),
    ("server.root_samples", "<= 10000"),
])
def test_every_integer_of_the_schema_has_an_upper_bound(tmp_path, key, allowed):
    p = _file(tmp_path, BASE)
    big = 2**63 - 1
    lines = _refused(p, [f"{key}={big}"])
    assert len(lines) == 1 and lines[0].endswith(f" {key}: must be {allowed}, got {big}")


def _integer_fields(model, prefix=""):
    """(dotted path, whether every int in its type has an upper bound) of each field of the
    schema whose type holds an int, nested blocks included."""
    import types
    import typing

    import annotated_types as at
    from pydantic import BaseModel

    def walk(ann, meta):
        upper = any(isinstance(m, (at.Le, at.Lt)) for m in meta)
        origin = typing.get_origin(ann)
        if origin is typing.Annotated:
            base, *more = typing.get_args(ann)
            has, up = walk(base, more)
            return has, up or upper
        if origin in (typing.Union, types.UnionType, list):
            parts = [walk(a, meta) for a in typing.get_args(ann)]
            ints = [up for has, up in parts if has]
            return bool(ints), all(ints) if ints else upper
        return ann is int, upper

    for name, field in model.model_fields.items():
        for a in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(a, type) and issubclass(a, BaseModel):
                yield from _integer_fields(a, f"{prefix}{name}.")
        has, up = walk(field.annotation, field.metadata)
        if has:
            yield f"{prefix}{name}", up


def test_every_integer_field_found_by_walking_the_schema_has_an_upper_bound():
    """The class, not the list above: a new integer key without a bound fails here."""
    from simulator.config.schema import Scenario

    fields = dict(_integer_fields(Scenario))
    assert {"rounds", "asynchrony.concurrency", "asynchrony.staleness.b",
            "clients.byzantine_period", "runtime.threads"} <= set(fields)
    assert [k for k, bounded in fields.items() if not bounded] == []


def test_seeds_are_bounded_in_number(tmp_path):
    p = _file(tmp_path, BASE)
    assert _refused(p, [f"seeds={list(range(1001))}"]) == [
        (f"{p}:1: seeds: list should have at most 1000 items after validation, not 1001, "
        "got [0, 1, 2, 3, 4, 5, ...]")]


@pytest.mark.parametrize(("override", "loc", "got"), [
    ("aggregator={name: cwtm, f: 9223372036854775807}", "aggregator.f", 2**63 - 1),
    ("model={name: mlp, hidden: [4, 4294967296]}", "model.hidden", 2**32),
    ("data.partitioner={name: shards, k: 4294967296}", "data.partitioner.k", 2**32),
])
def test_a_plugins_integer_keys_are_bounded(tmp_path, override, loc, got):
    p = _file(tmp_path, BASE)
    lines = _refused(p, [override])
    assert len(lines) == 1 and lines[0].endswith(
        f" {loc}: must be > -2**31 and < 2**31 (a plugin's integer), got {got}")


def test_a_third_party_plugins_unbounded_int_hint_is_bounded():
    from simulator import registry
    from strategies.protocols import Aggregator

    class Scaled(Aggregator):
        def __init__(self, k: int = 1, sizes: list[int] | None = None) -> None:
            self.k, self.sizes = k, sizes

    model = registry.params_model(Scaled)
    assert model.model_validate({"k": 2**31 - 1, "sizes": [1, -(2**31) + 1]}).k == 2**31 - 1
    for bad in ({"k": 2**31}, {"sizes": [1, 2**40]}):
        with pytest.raises(Exception, match=r"must be > -2\*\*31 and < 2\*\*31"):
            model.model_validate(bad)


def test_the_total_work_is_estimated_and_refused_past_the_limit(tmp_path):
    p = _file(tmp_path, BASE)
    lines = _refused(p, ["rounds=1000000", "local.steps=100000", "local.batch_size=65536"])
    assert lines == [
        (f"{p}: scenario: the total work is about 3.4e+19 parameter x example products "
        "(rounds 1,000,000 x 8 clients a round x (local.steps 100,000 x local.batch_size "
        "65,536) x 650 model parameters); at most 1e+18 (hours of a large GPU): lower rounds, "
        "clients.per_round, the local work or the model")]
    assert load(p, ["rounds=1000", "local.steps=100"]).points  # a large study is fine


def test_huge_gossip_work_is_refused(tmp_path):
    p = _file(tmp_path, BASE.replace("per_round: 8", "per_round: 10") + "topology: {name: ring}\n")
    assert load(p).points
    lines = _refused(p, ["rounds=1000000", "dsgd.gossip_steps=1000", "clients.total=1000",
                         "clients.per_round=1000", "local.steps=1",
                         "model={name: mlp, hidden: [4096]}"])
    assert len(lines) == 1 and "dsgd.gossip_steps 1,000 x 1,000^2 peers" in lines[0]


# ---------------------------------------------------------------- 3. names MLflow refuses

@pytest.mark.parametrize(("name", "why"), [
    ("''", "must not be empty, got ''"),
    ("'   '", "must not be empty, got '   '"),
    ("x" * 257, "must be at most 256 characters (MLflow's limit), got 257"),
    ('"a\\eb"', ("must hold no control characters (ESC, BEL, NUL, direction overrides such as "
     "U+202E: a terminal would act on them), got 'a\\x1bb'")),
    ('"a\\u202eb"', ("must hold no control characters (ESC, BEL, NUL, direction overrides "
     "such as U+202E: a terminal would act on them), got 'a\\u202eb'")),
])
def test_the_experiment_name_is_one_mlflow_accepts(tmp_path, name, why):
    p = _file(tmp_path, BASE)
    lines = _refused(p, [f"name={name}"])
    assert lines == [f"{p}:1: name: the experiment's name {why}"]


def test_the_file_name_as_experiment_name_is_checked(tmp_path):
    p = _file(tmp_path, BASE.replace("name: t\n", ""), "a\x07b.yaml")
    assert _refused(p) == [
        (f"{str(p).replace(chr(7), chr(92) + 'x07')}:1: name: the experiment's name must hold no "
        "control characters (ESC, BEL, NUL, direction overrides such as U+202E: a terminal "
        "would act on them), got 'a\\x07b'")]


def test_run_names_mlflow_would_refuse_are_refused(tmp_path):
    p = _file(tmp_path, BASE + f"sweep: {{description: [short, {'x' * 300}]}}\n")
    lines = _refused(p)
    assert len(lines) == 1 and lines[0].startswith(
        f"{p}:7: sweep.description: a run's name must be at most 250 characters (MLflow's "
        "limit), got 319 ('description=xxx")
    assert lines[0].endswith("; a run is named after its sweep values and seed")
    p = _file(tmp_path, BASE + 'sweep: {description: ["\\0x"]}\n', "b.yaml")
    assert _refused(p) == [
        (f"{p}:7: sweep.description: a run's name must hold no control characters (ESC, BEL, "
        "NUL, direction overrides such as U+202E: a terminal would act on them), got "
        "'description=\\x00x seed=0'; a run is named after its sweep values and seed")]


def test_control_characters_in_error_lines_are_escaped(tmp_path):
    p = _file(tmp_path, BASE + '"\\e[2J\\a\\u202e": 1\n')
    line, = _refused(p)
    assert line.startswith(f"{p}:7: \\x1b[2J\\x07\\u202e: unknown key; allowed: name, ")
    assert line.isprintable()
    r = fedray("resume", "ab\x1b[2Jc\x07", "--tracking-uri", f"sqlite:///{tmp_path}/m.db",
               cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.isprintable() is False  # its one newline
    assert r.stderr.splitlines() == [
        (f"fedray resume: no run 'ab\\x1b[2Jc\\x07' in sqlite:///{tmp_path}/m.db: there is no "
        f"tracking store there (no m.db in {tmp_path}); pass --tracking-uri, or run the "
        "command where the runs were made")]


# ---------------------------------------------------------------- 5. workers a local run cannot place

def test_more_workers_than_this_machine_has_is_refused_before_ray_starts(tmp_path):
    p = _file(tmp_path, BASE)
    have = os.cpu_count()
    r = fedray("run", str(p), "--workers", "99999", cwd=tmp_path)
    assert (r.returncode, r.stderr.splitlines()) == (2, [
        (f"fedray run: --workers: 99999 ClientWorkers need 99999 CPUs (1 each, "
        f"runtime.num_cpus), and this machine has {have}; use --workers {have} or fewer, a "
        "smaller runtime.num_cpus, or --address a cluster")])
    assert not (tmp_path / "mlflow.db").exists()  # no MLflow run (and no Ray line above)
    r = fedray("run", str(p), "--set", "runtime.workers=5000", "--set", "runtime.num_cpus=0.5",
               cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith(
        "fedray run: runtime.workers: 5000 ClientWorkers need 2500 CPUs (0.5 each")
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("cmd", ["run", "resume"])
def test_workers_past_the_schemas_bound_are_refused_on_a_cluster_too(tmp_path, cmd):
    target = str(_file(tmp_path, BASE)) if cmd == "run" else "0123abc"
    r = fedray(cmd, target, "--workers", "99999999999999999999", "--address", "127.0.0.1:1",
               cwd=tmp_path)
    assert (r.returncode, r.stderr.splitlines()) == (2, [
        (f"fedray {cmd}: --workers: must be <= 10000 (as runtime.workers), got "
        "99999999999999999999")])
    assert list(tmp_path.iterdir()) == ([] if cmd == "resume" else [tmp_path / "s.yaml"])


def test_a_sweep_point_needing_more_cpus_than_this_machine_has_is_refused(tmp_path):
    p = _file(tmp_path, BASE + "sweep: {local.lr: [0.1, 0.2]}\n")
    have = os.cpu_count()
    r = fedray("sweep", str(p), "--set", f"runtime.num_cpus={have + 1}", cwd=tmp_path)
    assert (r.returncode, r.stderr.splitlines()) == (2, [
        (f"fedray sweep: runtime.num_cpus: a sweep point's Ray task needs {have + 1} CPUs, and "
        f"this machine has {have}; use {have} or fewer, or --address a cluster")])
    assert not (tmp_path / "mlflow.db").exists()


def test_resume_refuses_more_workers_than_this_machine_has_before_ray_starts(monkeypatch):
    from simulator.config import Scenario
    from simulator.errors import UsageError
    from simulator.run.resume import _Pool

    def no_ray(*a, **k):
        raise AssertionError("Ray started")

    monkeypatch.setattr("simulator.runtime.backend.make_backend", no_ray)
    monkeypatch.setattr("ray.is_initialized", lambda: False)  # as in `fedray resume`
    sc = Scenario.model_validate({"rounds": 1, "data": {"dataset": {"name": "digits"}},
                                  "model": {"name": "logreg"}, "clients": {"total": 4}})
    with pytest.raises(UsageError, match=r"^--workers: 99999 ClientWorkers need 99999 CPUs"):
        _Pool(None, None, 99999, None).executor(sc)


# ---------------------------------------------------------------- 6. tracking

def test_a_sqlite_store_in_a_missing_folder_is_refused(tmp_path):
    p = _file(tmp_path, BASE)
    uri = f"sqlite:///{tmp_path}/nonexistent/dir/mlflow.db"
    for cmd in ("run", "sweep"):
        r = fedray(cmd, str(p), "--tracking-uri", uri, cwd=tmp_path)
        assert (r.returncode, r.stderr.splitlines()) == (2, [
            (f"fedray {cmd}: --tracking-uri {uri}: the folder {tmp_path}/nonexistent/dir does "
            "not exist; create it, or give a path in an existing folder (fedray creates the "
            "database file, not its folder)")])
    assert not (tmp_path / "nonexistent").exists()


@pytest.mark.parametrize("cmd", ["resume", "report"])
def test_resume_or_report_of_an_empty_folder_creates_no_store(tmp_path, cmd):
    r = fedray(cmd, "0123abc", cwd=tmp_path)
    what = "no run '0123abc'" if cmd == "resume" else "no experiment or run '0123abc'"
    assert (r.returncode, r.stderr.splitlines()) == (2, [
        (f"fedray {cmd}: {what} in sqlite:///{tmp_path.resolve()}/mlflow.db: there is no "
        f"tracking store there (no mlflow.db in {tmp_path.resolve()}); pass --tracking-uri, "
        "or run the command where the runs were made")])
    assert list(tmp_path.iterdir()) == []


def test_sync_skips_a_stray_folder_in_pending(tmp_path):
    stray = tmp_path / ".fedray" / "pending" / "junk"
    stray.mkdir(parents=True)
    (stray / "notes.txt").write_text("mine")
    r = fedray("sync", cwd=tmp_path)
    assert (r.returncode, r.stderr.splitlines()) == (0, [
        (f"fedray sync: {stray.resolve()} is not a run's journal (no tracking_uri file); "
        "skipped")])
    assert (stray / "notes.txt").read_text() == "mine"  # left alone
    assert r.stdout.startswith("synced 0 run(s)")


@pytest.mark.parametrize("out", ["file.txt", "file.txt/sub"])
def test_report_out_onto_a_file_is_one_line(tmp_path, mlflow_uri, out):
    (tmp_path / "file.txt").write_text("keep")
    r = fedray("report", "anything", "--out", str(tmp_path / out), "--tracking-uri", mlflow_uri,
               cwd=tmp_path)
    what = "is" if out == "file.txt" else f"is under {tmp_path / 'file.txt'}, which is"
    assert (r.returncode, r.stderr.splitlines()) == (2, [
        (f"fedray report: --out {tmp_path / out}: {what} not a folder; give a folder (the "
        "report writes report.html, figures/ and tables/ into it)")])
    assert (tmp_path / "file.txt").read_text() == "keep"
