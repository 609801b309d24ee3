from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from mlflow.tracking import MlflowClient

from simulator.config.load import load
from simulator.log import to_stderr
from simulator.metric_names import mlflow_name
from simulator.run.runner import run_loaded
from simulator.run.tracking import Tracker, flatten

ROOT = Path(__file__).resolve().parents[2]

SWEEP = """\
name: sweep-test
description: two aggregators x two seeds
rounds: 3
seeds: [0, 1]
data:
  dataset: {name: digits}
model: {name: logreg}
clients: {total: 10, per_round: 5}
local: {steps: 2, batch_size: 16, lr: 0.2}
sweep:
  aggregator.name: [mean, median]
runtime: {backend: inline}
"""


def test_sweep_leaves_one_parent_and_four_children(tmp_path, mlflow_uri):
    p = tmp_path / "sweep.yaml"
    p.write_text(SWEEP)
    out = run_loaded(load(p), tracking_uri=mlflow_uri, quiet=True)
    client = MlflowClient(mlflow_uri)
    exp = client.get_experiment_by_name("sweep-test")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 5
    parent = client.get_run(out.parent_run_id)
    assert parent.data.tags["mlflow.note.content"] == "two aggregators x two seeds"
    assert parent.data.params["sweep.aggregator.name"] == "[mean, median]"
    children = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert len(children) == 4
    assert sorted(r.data.tags["mlflow.runName"] for r in children) == [
        "mean seed=0", "mean seed=1", "median seed=0", "median seed=1"]
    for r in children:
        assert r.info.status == "FINISHED"
        hist = client.get_metric_history(r.info.run_id, mlflow_name("test_accuracy"))
        assert [m.step for m in hist] == [0, 1, 2]
        assert r.data.tags["aggregator"] == r.data.params["aggregator.name"]
        assert r.data.tags["backend"] == "inline" and r.data.tags["n"] == "10"
        assert r.data.params["clients.per_round"] == "5"
    # findable by their params
    found = client.search_runs([exp.experiment_id],
                               filter_string="params.`aggregator.name` = 'median' and params.`seeds` = '[1]'")
    assert [r.data.tags["mlflow.runName"] for r in found] == ["median seed=1"]
    by_id = {r["run_id"]: r for r in out.runs}
    for r in children:
        acc = r.data.metrics[mlflow_name("test_accuracy")]
        assert acc == pytest.approx(by_id[r.info.run_id]["final_test_accuracy"])
        assert r.data.params["seed"] == r.data.tags["seed"]  # the seed is a param too
        # metric names grouped by prefix, so the MLflow UI folds them into sections
        sections = {k.split("/")[0] for k in r.data.metrics}
        assert sections == {"eval", "robust", "round", "comm"}, sorted(r.data.metrics)
        assert "eval/test_accuracy" in r.data.metrics and "test_accuracy" not in r.data.metrics
        # the data set as an MLflow input: name, a digest of the clients' data, the partition
        (inp,) = client.get_run(r.info.run_id).inputs.dataset_inputs
        assert inp.dataset.name == "digits" and inp.tags[0].value == "train"
        assert json.loads(inp.dataset.profile)["partitioner"] == {"name": "iid"}
    digests = {(c.data.params["seed"], client.get_run(c.info.run_id).inputs.dataset_inputs[0]
                .dataset.digest) for c in children}
    assert len({d for _, d in digests}) == 2  # one per seed, shared by the aggregators
    # the parent holds what the points share, not the first point's swept values: a filter
    # on a swept param finds children only
    mean = client.search_runs([exp.experiment_id],
                              filter_string="params.`aggregator.name` = 'mean'")
    assert sorted(r.info.run_name for r in mean) == ["mean seed=0", "mean seed=1"]
    assert "aggregator.name" not in parent.data.params and "aggregator" not in parent.data.tags
    assert parent.data.params["seeds"] == "[0, 1]" and "seed" not in parent.data.params
    assert parent.data.params["clients.per_round"] == "5" and parent.data.tags["n"] == "10"
    in_group = client.search_runs([exp.experiment_id], filter_string="params.`seeds` = '[0]'")
    assert sorted(r.info.run_name for r in in_group) == ["mean seed=0", "median seed=0"]


def test_a_run_without_sweep_is_named_after_its_scenario(tmp_path, mlflow_uri):
    p = tmp_path / "one.yaml"
    p.write_text(SWEEP.replace("seeds: [0, 1]", "seeds: [0]").replace(
        "sweep:\n  aggregator.name: [mean, median]\n", ""))
    out = run_loaded(load(p), tracking_uri=mlflow_uri, quiet=True)
    child = MlflowClient(mlflow_uri).get_run(out.runs[0]["run_id"])
    assert child.info.run_name == "sweep-test seed=0"


def test_zipped_sweep_is_tracked(tmp_path, mlflow_uri):
    p = tmp_path / "zip.yaml"
    p.write_text(SWEEP.replace("seeds: [0, 1]", "seeds: [0]").replace(
        "  aggregator.name: [mean, median]\n", "  'local.steps, local.lr': [[1, 0.4], [4, 0.1]]\n"))
    out = run_loaded(load(p), tracking_uri=mlflow_uri, quiet=True)
    client = MlflowClient(mlflow_uri)
    parent = client.get_run(out.parent_run_id)
    assert parent.data.params["sweep.local.steps / local.lr"] == "[[1, 0.4], [4, 0.1]]"
    assert [r["label"] for r in out.runs] == ["steps=1 lr=0.4 seed=0", "steps=4 lr=0.1 seed=0"]
    assert client.get_run(out.runs[1]["run_id"]).data.params["local.steps"] == "4"


def test_artifacts_metrics_parquet_and_model(tmp_path, mlflow_uri):
    p = tmp_path / "one.yaml"
    p.write_text(SWEEP.replace("seeds: [0, 1]", "seeds: [3]").replace(
        "sweep:\n  aggregator.name: [mean, median]\n", "tracking: {log_model: true}\n"))
    out = run_loaded(load(p), tracking_uri=mlflow_uri, quiet=True)
    client = MlflowClient(mlflow_uri)
    child = out.runs[0]["run_id"]
    names = {a.path for a in client.list_artifacts(child)} | {
        a.path for a in client.list_artifacts(child, "model")}
    assert {"metrics.parquet", "scenario.yaml", "model/model.pt"} <= names
    assert {a.path for a in client.list_artifacts(out.parent_run_id, "scenario")} == {
        "scenario/one.yaml", "scenario/resolved.yaml"}
    local = client.download_artifacts(child, "metrics.parquet", str(tmp_path))
    table = pq.read_table(local)
    assert table.num_rows == 3 and table.column("round").to_pylist() == [0, 1, 2]
    hist = client.get_metric_history(child, mlflow_name("test_loss"))
    assert table.column("test_loss").to_pylist() == pytest.approx([m.value for m in hist])
    model_path = client.download_artifacts(child, "model/model.pt", str(tmp_path))
    state = torch.load(model_path, weights_only=True)
    assert state["net.1.weight"].shape == (10, 64)
    # the same model as an MLflow pytorch model: torch.export's graph (no fedray class needed
    # to load it), with its signature, giving the state_dict's outputs
    import mlflow.pytorch

    from simulator.models import build_model

    loaded = mlflow.pytorch.load_model(f"runs:/{child}/model")
    assert type(loaded).__module__.startswith("torch.fx")  # a graph, not fedray's class
    assert not any(c.__module__.startswith(("simulator", "strategies"))
                   for c in type(loaded).__mro__)
    mine = build_model({"name": "logreg"}, (1, 8, 8), 10, seed=0)
    mine.load_state_dict(state)
    x = torch.rand(5, 1, 8, 8, generator=torch.Generator().manual_seed(0))  # any batch size
    torch.testing.assert_close(loaded(x), mine(x))
    from mlflow.models import get_model_info

    sig = get_model_info(f"runs:/{child}/model").signature
    spec = sig.inputs.to_dict()[0]["tensor-spec"]
    assert spec["dtype"] == "float32" and tuple(spec["shape"]) == (-1, 1, 8, 8)
    # artifacts of the embedded store live beside the DB
    assert (tmp_path / "mlartifacts").is_dir()
    assert client.get_run(child).data.params["tracking.log_model"] == "true"


def test_by_default_the_model_is_its_state_dict_and_no_mlflow_model(tmp_path, mlflow_uri):
    """Nobody asked for the MLflow model (``tracking.log_model`` left out): ``model/`` holds
    the final state_dict alone, which is the run's final model; metrics.parquet is there."""
    p = tmp_path / "one.yaml"
    p.write_text(SWEEP.replace("seeds: [0, 1]", "seeds: [0]").replace(
        "sweep:\n  aggregator.name: [mean, median]\n", "").replace("rounds: 3", "rounds: 2"))
    out = run_loaded(load(p), tracking_uri=mlflow_uri, quiet=True)
    client = MlflowClient(mlflow_uri)
    child = out.runs[0]["run_id"]
    run = client.get_run(child)
    assert run.info.status == "FINISHED"
    assert run.data.params["tracking.log_model"] == "false"
    assert {a.path for a in client.list_artifacts(child, "model")} == {"model/model.pt"}
    assert {"metrics.parquet", "scenario.yaml"} <= {a.path for a in client.list_artifacts(child)}
    state = torch.load(client.download_artifacts(child, "model/model.pt", str(tmp_path)),
                       weights_only=True)
    assert state["net.1.weight"].shape == (10, 64)
    table = pq.read_table(client.download_artifacts(child, "metrics.parquet", str(tmp_path)))
    assert table.column("round").to_pylist() == [0, 1]


def test_a_tracking_block_at_its_defaults_keeps_the_points_identity(tmp_path):
    """Runs made before ``tracking:`` existed keep their point and sweep keys (a sweep goes
    on in its parent); asking for the MLflow model makes another point."""
    from simulator.run.layout import _digest, point_key, sweep_key

    p = tmp_path / "s.yaml"
    p.write_text(SWEEP)
    plain, explicit = load(p), load(p, ["tracking={log_model: false}"])
    asked = load(p, ["tracking.log_model=true"])
    before = {k: v for k, v in plain.scenario.model_dump(mode="json").items() if k != "tracking"}
    assert sweep_key(plain) == sweep_key(explicit) == _digest(before)
    assert sweep_key(asked) != sweep_key(plain)
    assert [point_key(q) for q in explicit.points] == [point_key(q) for q in plain.points]
    assert point_key(asked.points[0]) != point_key(plain.points[0])


def test_tracking_log_model_is_validated_in_one_line(tmp_path):
    from simulator.config import ScenarioError

    p = tmp_path / "s.yaml"
    p.write_text(SWEEP)
    with pytest.raises(ScenarioError) as e:
        load(p, ["tracking.log_model=maybe"])
    assert e.value.lines == [f"{p}:1: tracking.log_model: must be true or false, got 'maybe'"]
    with pytest.raises(ScenarioError) as e:
        load(p, ["tracking.model=true"])
    assert e.value.lines == [f"{p}:1: tracking.model: unknown key; did you mean 'log_model'?"]


def test_failed_log_batch_is_kept_and_resent(mlflow_uri):
    tracker = Tracker(mlflow_uri, "outage")
    run = tracker.create_run("r", {})
    real = tracker.client.log_batch
    calls = {"n": 0}

    def flaky(run_id, metrics=(), params=(), tags=()):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ConnectionError("tracking server down")
        return real(run_id, metrics=metrics, params=params, tags=tags)

    tracker.client.log_batch = flaky
    tracker.log_round(run, 0, {"a": 1.0})  # queued for the background sender
    assert not tracker.flush(run, wait=None)  # the send fails: kept in memory and the journal
    assert tracker.down()  # for RETRY_SECONDS calls go to the journal without trying
    journal = list((tracker.journal / run).glob("metrics-*.parquet"))
    assert len(journal) == 1 and pq.read_table(journal[0]).column("step").to_pylist() == [0]
    tracker.log_round(run, 1, {"a": 2.0})
    assert tracker.flush(run, wait=None, force=True)  # sends both
    assert not journal[0].exists()
    tracker.end(run)
    hist = MlflowClient(mlflow_uri).get_metric_history(run, mlflow_name("a"))
    assert sorted((m.step, m.value) for m in hist) == [(0, 1.0), (1, 2.0)]


def test_flatten():
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": "x", "e": None}) == {
        "a.b": "1", "a.c": "[1, 2]", "d": "x", "e": "null"}


def test_a_model_torch_export_cannot_capture_keeps_its_state_dict(tmp_path, mlflow_uri,
                                                                  monkeypatch, capfd):
    """Data-dependent control flow in a model's forward: torch.export fails; the run is
    FINISHED with ``model/model.pt``, and that is said in one line (no graph dump)."""
    from simulator import models

    def forward(self, x):
        out = self.net(x)
        return out * 0 if float(out.detach().sum()) > 1e9 else out

    monkeypatch.setattr(models.LogisticRegression, "forward", forward)
    p = tmp_path / "one.yaml"
    p.write_text(SWEEP.replace("seeds: [0, 1]", "seeds: [0]").replace(
        "sweep:\n  aggregator.name: [mean, median]\n", "tracking: {log_model: true}\n")
        .replace("rounds: 3", "rounds: 1"))
    with to_stderr():  # what the command line shows of fedray's messages
        out = run_loaded(load(p), tracking_uri=mlflow_uri, quiet=True)
    child = out.runs[0]["run_id"]
    client = MlflowClient(mlflow_uri)
    assert client.get_run(child).info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(child, "model")} == {"model/model.pt"}
    err = capfd.readouterr().err
    ours = [line for line in err.splitlines() if "torch.export could not capture" in line]
    assert len(ours) == 1 and ours[0].startswith(f"fedray: run {child}: the final model is "
                                                 "kept as model/model.pt only")
    assert "def forward" not in err


def test_mlflow_opens_while_the_first_rounds_run_and_loses_none(tmp_path, mlflow_uri,
                                                                 monkeypatch):
    """The tracker, parent and child runs open on a background thread while the engine
    starts. The store's first answer (the tracker) is awaited before round 0: with a store
    that takes 1.5 s to answer, no round ends before it has. The parent and child runs may
    still be opening while the first rounds run (here their opening takes 1.5 s more): those
    rounds wait in the backlog, and MLflow still gets every round once, in order."""
    import time

    import simulator.run.layout as cb
    from simulator.run.callbacks import Callback

    opened: list[float] = []
    parents: list[float] = []

    class SlowTracker(Tracker):
        def __init__(self, *args, **kwargs):
            time.sleep(1.5)
            super().__init__(*args, **kwargs)
            opened.append(time.perf_counter())

    real_parent = cb.open_parent

    def slow_parent(*args, **kwargs):
        time.sleep(1.5)
        parent = real_parent(*args, **kwargs)
        parents.append(time.perf_counter())
        return parent

    ends: list[float] = []

    class Clock(Callback):
        def on_round(self, run, round_, metrics):
            ends.append(time.perf_counter())

    monkeypatch.setattr(cb, "Tracker", SlowTracker)
    monkeypatch.setattr(cb, "open_parent", slow_parent)
    p = tmp_path / "one.yaml"
    p.write_text(SWEEP.replace("seeds: [0, 1]", "seeds: [0]").replace(
        "sweep:\n  aggregator.name: [mean, median]\n", "").replace("rounds: 3", "rounds: 12"))
    out = run_loaded(load(p), tracking_uri=mlflow_uri, quiet=True, callbacks=[Clock()])
    assert len(opened) == 1 and len(ends) == 12 and opened[0] < ends[0] < parents[0]
    history = MlflowClient(mlflow_uri).get_metric_history(out.runs[0]["run_id"],
                                                          mlflow_name("client_loss"))
    assert sorted(m.step for m in history) == list(range(12))


def test_the_backend_shuts_down_while_the_last_points_model_is_logged(tmp_path, mlflow_uri,
                                                                        monkeypatch):
    """Once the last point's engine is done, the backend shuts down on its own thread while
    that point's ends (model, figure, artifacts) run; the command returns after both. When
    the last engine fails, the backend shuts down as before, on the main thread."""
    import threading
    import time

    from simulator.run.callbacks import Callback
    from simulator.runtime import backend as backends

    events: list[tuple[str, str]] = []

    class Slow(backends.InlineBackend):
        def shutdown(self):
            events.append(("shutdown starts", threading.current_thread().name))
            time.sleep(0.5)
            events.append(("shutdown ends", threading.current_thread().name))

    class Ends(Callback):
        def on_end(self, run, result, status):
            events.append((f"end of {run.point.label}", status))

    monkeypatch.setattr(backends, "make_backend", lambda *a, **k: Slow())
    p = tmp_path / "sweep.yaml"
    p.write_text(SWEEP.replace("seeds: [0, 1]", "seeds: [0]"))
    out = run_loaded(load(p), tracking_uri=mlflow_uri, quiet=True, callbacks=[Ends()])
    assert [r["label"] for r in out.runs] == ["mean seed=0", "median seed=0"]
    names = [e[0] for e in events]
    # the last point's ends run while the backend shuts down; which of the two is done first
    # depends on the machine (the model and figure take 0.3-2 s, the shutdown here 0.5 s)
    assert names[:2] == ["end of mean seed=0", "shutdown starts"]
    assert sorted(names[2:]) == ["end of median seed=0", "shutdown ends"]
    assert events[1][1].startswith("fedray-shutdown")
    assert MlflowClient(mlflow_uri).get_run(out.runs[1]["run_id"]).info.status == "FINISHED"

    events.clear()
    monkeypatch.setattr("simulator.sim.rounds.server.ServerRounds.run_round", _boom)
    with pytest.raises(RuntimeError, match="boom"):
        run_loaded(load(p, ["sweep={}"]), tracking_uri=mlflow_uri, quiet=True,
                   callbacks=[Ends()])
    assert events == [("end of seed=0", "FAILED"), ("shutdown starts", "MainThread"),
                      ("shutdown ends", "MainThread")]


def _boom(self, round_, prefetch=False):
    raise RuntimeError("boom")


def test_a_run_that_ends_before_mlflow_opens_tags_where_it_ran(tmp_path, mlflow_uri,
                                                               monkeypatch):
    """A one-round run beside a slow new store: the engine is done and the backend shut down
    before the MLflow thread opens the parent and child runs. Their ``backend`` and
    ``ray_nodes`` tags are read while the backend runs (Ray's ``ray.nodes()`` after its
    shutdown raised "Ray has not been started yet" on the MLflow thread and failed the run;
    seen once in CI)."""
    import time

    import simulator.run.layout as cb
    from simulator.runtime import backend as backends

    class SlowTracker(Tracker):
        def __init__(self, *args, **kwargs):
            time.sleep(1.5)
            super().__init__(*args, **kwargs)

    class GoneAfterShutdown(backends.InlineBackend):
        name = "gone"
        down = False

        def num_nodes(self):
            if self.down:
                raise RuntimeError("not started")
            return 3

        def shutdown(self):
            self.down = True

    monkeypatch.setattr(cb, "Tracker", SlowTracker)
    monkeypatch.setattr(backends, "make_backend", lambda *a, **k: GoneAfterShutdown())
    p = tmp_path / "one.yaml"
    p.write_text(SWEEP.replace("seeds: [0, 1]", "seeds: [0]").replace(
        "sweep:\n  aggregator.name: [mean, median]\n", "").replace("rounds: 3", "rounds: 1"))
    out = run_loaded(load(p), tracking_uri=mlflow_uri, quiet=True)
    client = MlflowClient(mlflow_uri)
    for run_id in (out.parent_run_id, out.runs[0]["run_id"]):
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED"
        assert (run.data.tags["backend"], run.data.tags["ray_nodes"]) == ("gone", "3")


def test_a_store_that_cannot_be_used_is_one_line_before_anything_runs(tmp_path, monkeypatch,
                                                                       capsys):
    """A file store (a path or file:), which MLflow 3 refuses unless MLFLOW_ALLOW_FILE_STORE
    is set, failed `fedray run` after its first round as "cannot be reached" and `fedray
    table` with a traceback; a server that does not answer held `fedray report` and `table`
    for minutes of MLflow's HTTP retries. Each is now one line, in seconds."""
    import socket

    from fedray.cli import main
    from simulator.errors import UsageError
    from simulator.run.tracking import HTTP_DEFAULTS, check_uri

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    for k in HTTP_DEFAULTS:  # restored after the test: ensure_store sets them for http
        monkeypatch.delenv(k, raising=False)
    for uri in ("file:///tmp/mlruns", "./mlruns", "/abs/mlruns"):
        with pytest.raises(UsageError, match="a file store .* MLFLOW_ALLOW_FILE_STORE"):
            check_uri(uri)
    for uri in (f"sqlite:///{tmp_path}/mlflow.db", "http://127.0.0.1:5000", "https://example.org"):
        check_uri(uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    check_uri("./mlruns")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")

    monkeypatch.chdir(tmp_path)
    quick = str(ROOT / "scenarios" / "quickstart.yaml")
    assert main(["run", quick, "--backend", "inline", "--quiet", "--set", "rounds=2",
                 "--tracking-uri", "./mlruns"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        ("fedray run: --tracking-uri ./mlruns: a file store (a path or file:), which MLflow 3 no "
        "longer opens; use sqlite:///PATH/mlflow.db (`mlflow migrate-filestore` moves its runs "
        "there), or set MLFLOW_ALLOW_FILE_STORE=true")]
    assert not (tmp_path / "mlruns").exists()
    assert main(["table", "quickstart", "--by", "seed", "--tracking-uri", "file:///x"]) == 2
    assert capsys.readouterr().err.startswith("fedray table: --tracking-uri file:///x: a file")

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = f"http://127.0.0.1:{port}"
    for args in (["report", "quickstart"], ["table", "quickstart", "--by", "seed"]):
        assert main([*args, "--tracking-uri", dead]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"fedray {args[0]}: tracking store {dead} cannot be reached")


# ---------------------------------------------------------------- the store template


def _experiments(db: Path) -> list[tuple]:
    import sqlite3
    from contextlib import closing

    with closing(sqlite3.connect(db)) as conn:
        return conn.execute("SELECT experiment_id, name, artifact_location FROM experiments "
                            "ORDER BY experiment_id").fetchall()


def test_a_new_store_is_a_copy_of_this_mlflow_versions_template(tmp_path, monkeypatch):
    """The first new store of an MLflow version is migrated by MLflow and kept in the cache
    folder (XDG_CACHE_HOME) as the template; every later new store is a copy of it (MLflow's
    migrations do not run), with the Default experiment's artifacts in its own folder, as
    MLflow would have set them, and nothing left of the copies' temporary files."""
    import mlflow

    from simulator.run import tracking

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    migrated = []
    real = tracking.save_template
    monkeypatch.setattr(tracking, "save_template", lambda db: migrated.append(db) or real(db))
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        tracking.ensure_store(f"sqlite:///{tmp_path / name / 'mlflow.db'}")
    assert migrated == [tmp_path / "a" / "mlflow.db"]
    (template,) = (tmp_path / "cache" / "fedray").iterdir()
    assert template.name.startswith(f"mlflow-{mlflow.__version__}-")
    assert template.stem.rpartition("-")[2] == tracking._pristine(template)
    assert _experiments(tmp_path / "b" / "mlflow.db") == [
        (0, "Default", str(tmp_path / "b" / "mlruns" / "0"))]
    assert tracking.store_template() == template
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["mlflow.db", "mlflow.db.lock"]
    # the copy is a store fedray and MLflow use as any other
    tracker = Tracker(f"sqlite:///{tmp_path / 'b' / 'mlflow.db'}", "exp")
    run_id = tracker.create_run("r", {})
    tracker.log_params(run_id, {"a": "1"})
    assert MlflowClient(tracker.uri).get_run(run_id).data.params == {"a": "1"}
    assert tracking._pristine(tmp_path / "b" / "mlflow.db") is None  # no longer new


@pytest.mark.parametrize("spoil", ["garbage", "revision", "written"])
def test_a_template_that_is_not_a_new_store_of_its_revision_is_rebuilt(tmp_path, monkeypatch,
                                                                      spoil):
    """A corrupt template, one whose schema revision is not the one its name says (another
    MLflow's, a hand-made file), or one something wrote runs into, is removed: the next new
    store is migrated by MLflow and kept as the template again."""
    import shutil

    from simulator.run import tracking

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    tracking.ensure_store(f"sqlite:///{tmp_path / 'first.db'}")
    (good,) = (tmp_path / "cache" / "fedray").iterdir()
    kept = good.read_bytes()
    if spoil == "garbage":
        good.write_bytes(b"SQLite format 3\x00" + b"\x07" * 4000)
    elif spoil == "revision":
        shutil.move(good, good.with_name(good.name.replace(good.stem.rpartition("-")[2],
                                                           "0123456789ab")))
    else:
        MlflowClient(f"sqlite:///{good}").create_experiment("written")
    assert tracking.store_template() is None
    assert list((tmp_path / "cache" / "fedray").iterdir()) == []
    tracking.ensure_store(f"sqlite:///{tmp_path / 'second.db'}")
    assert [p.name for p in (tmp_path / "cache" / "fedray").iterdir()] == [good.name]
    assert tracking._pristine(good) == good.stem.rpartition("-")[2]
    assert len(good.read_bytes()) == len(kept)


def test_a_cache_folder_that_cannot_be_written_costs_only_the_template(tmp_path, monkeypatch):
    """Where the cache folder cannot be made (XDG_CACHE_HOME is a file), the store is
    created by MLflow's migrations as before and no template is kept."""
    from simulator.run import tracking

    (tmp_path / "cache").write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    tracking.ensure_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert tracking.store_template() is None
    assert _experiments(tmp_path / "mlflow.db")[0][:2] == (0, "Default")


def test_the_codecs_tag_names_each_codecs_arguments_that_differ_from_its_defaults():
    """`fedray table --by codecs` groups by this tag: two chains of the same codecs with
    other arguments (top-k with and without error feedback) must not share a row."""
    from simulator.run.layout import plugin_label

    assert plugin_label("codecs", {"name": "top_k", "k": None, "fraction": 0.01,
                        "error_feedback": False}) == "top_k(fraction=0.01)"
    assert plugin_label("codecs", {"name": "top_k", "k": None, "fraction": 0.01,
                        "error_feedback": True}) == "top_k(fraction=0.01, error_feedback=true)"
    assert plugin_label("codecs", {"name": "sign", "scale": True, "error_feedback": False}) == "sign"
    assert plugin_label("codecs", {"name": "sign", "scale": False, "error_feedback": False}) == \
        "sign(scale=false)"
    assert plugin_label("codecs", {"name": "secagg", "group_size": 5, "bits": 32, "range": 1.0,
                        "threshold": 0.5, "dropout": 0.0}) == "secagg(group_size=5)"
    assert plugin_label("codecs", {"name": "float16"}) == "float16"
    # the privacy tag: `fedray table --by privacy` tells a run without DP from two noises
    assert plugin_label("privacy", {"name": "dp_sgd", "clip": 1.0, "noise_multiplier": 4.0,
                        "delta": 1e-5, "accountant": "pld"}) == "dp_sgd(noise_multiplier=4.0)"
