"""``fedray sweep``: points in parallel as Ray tasks, one child run each, resumable."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from dashboards.figures import RunFigure
from simulator.config.load import load
from simulator.metric_names import mlflow_name
from simulator.run.runner import point_key, run_sweep
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine

SWEEP = """\
name: par-sweep
rounds: 3
seeds: [0, 1]
data:
  dataset: {name: digits}
model: {name: logreg}
clients: {total: 10, per_round: 5, byzantine: 2}
attack: {name: sign_flip}
local: {steps: 2, batch_size: 16, lr: 0.2}
sweep:
  aggregator.name: [mean, median]
"""


# a sweep's points as Ray tasks, or one after another in the driver (auto, for short points)
SWEEP_BACKENDS = pytest.mark.parametrize("backend", ["ray", "inline"])


@SWEEP_BACKENDS
def test_parallel_sweep_then_resume_runs_only_unfinished_points(tmp_path, mlflow_uri, shared_ray,
                                                                backend):
    p = tmp_path / "sweep.yaml"
    p.write_text(SWEEP + f"runtime: {{backend: {backend}}}\n")
    loaded = load(p)
    first = run_sweep(loaded, tracking_uri=mlflow_uri, parallel=2, callbacks=[RunFigure()])
    assert first.skipped == [] and first.failed == [] and len(first.runs) == 4
    client = MlflowClient(mlflow_uri)
    parent = first.parent_run_id
    children = client.search_runs([client.get_experiment_by_name("par-sweep").experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    assert sorted(r.data.tags["mlflow.runName"] for r in children) == [
        "mean seed=0", "mean seed=1", "median seed=0", "median seed=1"]
    assert all(r.info.status == "FINISHED" for r in children)
    assert client.get_run(parent).info.status == "FINISHED"
    # each point's artifacts, logged by the driver as it collected the point: its metrics,
    # its final state_dict (no MLflow model: nobody asked) and its figure
    for r in children:
        run_id = r.info.run_id
        assert {"metrics.parquet", "scenario.yaml"} <= {a.path for a in client.list_artifacts(run_id)}
        assert [a.path for a in client.list_artifacts(run_id, "model")] == ["model/model.pt"]
        assert [a.path for a in client.list_artifacts(run_id, "figures")] == ["figures/curves.svg"]

    # each child's numbers are those of the same point run alone, in this process
    by_label = {pt.label: pt for pt in loaded.points}
    for r in children:
        alone = Engine(by_label[r.data.tags["mlflow.runName"]].scenario, InlineBackend()).run()
        hist = client.get_metric_history(r.info.run_id, mlflow_name("test_accuracy"))
        assert [m.value for m in sorted(hist, key=lambda m: m.step)] == pytest.approx(
            [m["test_accuracy"] for m in alone.metrics], abs=0)
        byz = client.get_metric_history(r.info.run_id, mlflow_name("byzantine_sampled"))
        assert len(byz) == 3
        assert r.data.tags["fedray.point_key"] == point_key(by_label[r.data.tags["mlflow.runName"]])

    # one point "died": the next sweep of the same file runs it alone, in the same parent
    victim = next(r for r in children if r.data.tags["mlflow.runName"] == "median seed=1")
    client.set_terminated(victim.info.run_id, status="FAILED")
    again = run_sweep(load(p), tracking_uri=mlflow_uri, parallel=2)
    assert again.parent_run_id == parent
    assert sorted(again.skipped) == ["mean seed=0", "mean seed=1", "median seed=0"]
    assert [r["label"] for r in again.runs] == ["median seed=1"]
    assert again.runs[0]["final_test_accuracy"] == pytest.approx(
        next(r for r in first.runs if r["label"] == "median seed=1")["final_test_accuracy"])
    # an edited scenario is another sweep: a new parent, every point runs
    other = run_sweep(load(p, ["rounds=2"]), tracking_uri=mlflow_uri, parallel=2)
    assert other.parent_run_id != parent and len(other.runs) == 4
    assert other.skipped == []


@SWEEP_BACKENDS
def test_an_interrupt_while_a_finished_point_is_logged_marks_it_killed(tmp_path, mlflow_uri,
                                                                       shared_ray, backend):
    """Ctrl-C (or SIGTERM) while the sweep logs a finished point's model and figure (a second
    or two a point): that point is marked KILLED and named beside the points in flight, not
    left RUNNING; the next sweep runs it again."""
    from simulator.run.callbacks import Callback
    from simulator.run.interrupts import unfinished_of

    class CtrlC(Callback):
        def on_end(self, run, result, status):
            raise KeyboardInterrupt

    p = tmp_path / "sweep.yaml"
    p.write_text(SWEEP.replace("seeds: [0, 1]", "seeds: [0]") +
                 f"runtime: {{backend: {backend}}}\n")
    with pytest.raises(KeyboardInterrupt) as e:
        run_sweep(load(p), tracking_uri=mlflow_uri, parallel=1, callbacks=[CtrlC()])
    client = MlflowClient(mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name("par-sweep").experiment_id])
    status = {r.data.tags["mlflow.runName"]: r.info.status for r in runs}
    assert status == {"mean seed=0": "KILLED", "par-sweep": "KILLED"}  # median never opened
    assert [(label, s) for _, label, s in unfinished_of(e.value)] == [
        ("mean seed=0", "KILLED"), ("sweep parent", "KILLED")]
    again = run_sweep(load(p), tracking_uri=mlflow_uri, parallel=1)
    assert [r["label"] for r in again.runs] == ["mean seed=0", "median seed=0"]


def test_auto_runs_short_points_here_and_long_ones_as_ray_tasks(tmp_path):
    """fedray sweep's points on runtime.backend auto: one after another in this process where
    that is estimated to finish first (Ray's start and its task processes' would outweigh
    the rounds), as Ray tasks where the rounds outweigh it; a point needing its own process
    (strict), --address or runtime.backend ray: Ray tasks."""
    from simulator.run.runner import sweep_backend

    p = tmp_path / "sweep.yaml"
    p.write_text(SWEEP)
    short = sweep_backend(load(p), None, None, None)
    assert short.name == "inline"
    assert short.reason.startswith("fedray sweep: its points one after another in this "
                                   "process (auto: the rounds' work is estimated at ")
    long = sweep_backend(load(p, ["rounds=20000"]), None, None, None)
    assert long.name == "ray" and "on Ray" in long.reason
    # one slot: Ray's tasks could not run at once
    assert sweep_backend(load(p, ["rounds=20000"]), None, 1, None).name == "inline"
    assert sweep_backend(load(p, ["runtime.backend=ray"]), None, None, None).name == "ray"
    assert sweep_backend(load(p), "auto", None, None).name == "ray"
    strict = sweep_backend(load(p, ["runtime.deterministic=strict"]), None, None, None)
    assert strict.reason == "fedray sweep: its points run at once, as Ray tasks"
