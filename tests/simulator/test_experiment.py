"""One lifecycle for run, sweep and resume (``simulator.run.experiment``): sweep points stream
their rounds and checkpoints to the driver's callbacks, an interrupted sweep point goes on
from its checkpoint when the sweep runs again, and what is left unfinished comes back in the
result (or on the exception)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from mlflow.tracking import MlflowClient

from fedray.cli import main
from simulator.config.load import load
from simulator.metric_names import mlflow_name
from simulator.run import checkpoint
from simulator.run.callbacks import Callback
from simulator.run.interrupts import unfinished_of
from simulator.run.runner import run_loaded, run_sweep
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine

SWEEP = """\
name: ckpt-sweep
rounds: 6
seeds: [0]
data:
  dataset: {name: digits}
model: {name: logreg}
clients: {total: 8, per_round: 5, byzantine: 1}
attack: {name: sign_flip}
local: {steps: 2, batch_size: 16, lr: 0.2}
server: {optimizer: {name: sgd, lr: 1.0, momentum: 0.5}}
runtime: {checkpoint_every: 2}
sweep:
  aggregator.name: [mean, median]
"""


class Seen(Callback):
    """What the driver's callbacks see of each point: its rounds and its checkpoints, with
    the newest checkpoint file of the run at that moment."""

    def __init__(self, stop: tuple[str, int] | None = None) -> None:
        self.rounds: dict[str, list[int]] = {}
        self.checkpoints: dict[str, list[tuple[int, int, list[float]]]] = {}
        self.stop = stop

    def on_round(self, run, round_, metrics):
        self.rounds.setdefault(run.point.label, []).append(round_)
        if self.stop == (run.point.label, round_):
            raise KeyboardInterrupt  # Ctrl-C while the sweep runs

    def on_checkpoint(self, run, round_, state):
        saved = checkpoint.latest(run.run_id)  # the Checkpoints callback has written it
        self.checkpoints.setdefault(run.point.label, []).append(
            (round_, int(saved["round"]), [m["test_accuracy"] for m in saved["metrics"]]))


def _alone(loaded, label):
    point = next(p for p in loaded.points if p.label == label)
    return Engine(point.scenario, InlineBackend()).run()


def _history(client, run_id, key):
    return sorted(client.get_metric_history(run_id, mlflow_name(key)), key=lambda m: m.step)


# a sweep's points as Ray tasks, or one after another in the driver (auto, for short points)
SWEEP_BACKENDS = pytest.mark.parametrize("backend", ["ray", "inline"])


@SWEEP_BACKENDS
def test_sweep_points_stream_their_rounds_and_checkpoint_as_fedray_run_does(
        tmp_path, mlflow_uri, shared_ray, backend):
    p = tmp_path / "sweep.yaml"
    p.write_text(SWEEP)
    loaded = load(p, [f"runtime.backend={backend}"])
    seen = Seen()
    out = run_sweep(loaded, tracking_uri=mlflow_uri, parallel=2, callbacks=[seen])
    assert out.failed == [] and out.unfinished == [] and len(out.runs) == 2
    client = MlflowClient(mlflow_uri)
    for label in ("mean seed=0", "median seed=0"):
        alone = _alone(loaded, label)
        acc = [m["test_accuracy"] for m in alone.metrics]
        assert seen.rounds[label] == [0, 1, 2, 3, 4, 5]  # each round, in the driver, once
        # every 2 rounds (not after the last): the state after rounds 2 and 4, on disk then
        assert seen.checkpoints[label] == [(1, 1, acc[:2]), (3, 3, acc[:4])]
        run_id = next(r["run_id"] for r in out.runs if r["label"] == label)
        for key in ("test_accuracy", "sampled"):
            hist = _history(client, run_id, key)
            assert [m.step for m in hist] == list(range(6))
            assert [m.value for m in hist] == [row[key] for row in alone.metrics]
        assert checkpoint.latest(run_id) is None  # forgotten once FINISHED


@SWEEP_BACKENDS
def test_an_interrupted_sweep_point_goes_on_from_its_checkpoint(tmp_path, mlflow_uri,
                                                                shared_ray, caplog, backend):
    p = tmp_path / "sweep.yaml"
    p.write_text(SWEEP)
    loaded = load(p, [f"runtime.backend={backend}"])
    with pytest.raises(KeyboardInterrupt) as e:  # Ctrl-C after round 4 of the second point
        run_sweep(loaded, tracking_uri=mlflow_uri, parallel=1,
                  callbacks=[Seen(stop=("median seed=0", 3))])
    unfinished = unfinished_of(e.value)
    assert [(label, s) for _, label, s in unfinished] == [("median seed=0", "KILLED"),
                                                          ("sweep parent", "KILLED")]
    killed = unfinished[0].run_id
    client = MlflowClient(mlflow_uri)
    assert client.get_run(killed).info.status == "KILLED"
    assert checkpoint.latest(killed)["round"] == 1  # after round 2; round 4's never came

    seen = Seen()
    with caplog.at_level(logging.INFO, logger="fedray"):
        again = run_sweep(load(p, [f"runtime.backend={backend}"]), tracking_uri=mlflow_uri,
                          parallel=1, callbacks=[seen])
    assert again.parent_run_id == unfinished[1].run_id and again.unfinished == []
    assert again.skipped == ["mean seed=0"]
    assert [(r["label"], r["run_id"]) for r in again.runs] == [("median seed=0", killed)]
    assert f"resuming median seed=0 ({killed}) at round 3/6" in caplog.messages
    # the rounds before the checkpoint were not computed again: the task began at round 3
    assert seen.rounds == {"median seed=0": [2, 3, 4, 5]}
    assert seen.checkpoints["median seed=0"][0][:2] == (3, 3)
    alone = _alone(loaded, "median seed=0")
    for key in ("test_accuracy", "test_loss", "aggregation_error", "sampled"):
        hist = _history(client, killed, key)
        assert [m.step for m in hist] == list(range(6)), key  # every round exactly once
        assert [m.value for m in hist] == [row[key] for row in alone.metrics], key
    assert again.runs[0]["final_test_accuracy"] == alone.metrics[-1]["test_accuracy"]
    assert client.get_run(killed).info.status == "FINISHED"
    assert client.get_run(again.parent_run_id).info.status == "FINISHED"
    assert checkpoint.latest(killed) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the cuda point must fail: no GPU")
@SWEEP_BACKENDS
def test_what_a_sweep_leaves_unfinished_comes_back_in_its_result(tmp_path, mlflow_uri,
                                                                 shared_ray, backend):
    p = tmp_path / "sweep.yaml"
    p.write_text(SWEEP.replace("rounds: 6", "rounds: 2").replace(
        "aggregator.name: [mean, median]", "runtime.device: [cpu, cuda]"))
    out = run_sweep(load(p, [f"runtime.backend={backend}"]), tracking_uri=mlflow_uri,
                    parallel=2)
    assert [r["label"] for r in out.runs] == ["device=cpu seed=0"]
    assert out.failed == ["device=cuda seed=0"]
    client = MlflowClient(mlflow_uri)
    (failed,) = [c for c in client.search_runs(
        [client.get_experiment_by_name("ckpt-sweep").experiment_id],
        "tags.`fedray.kind` = 'point'") if c.info.run_name == "device=cuda seed=0"]
    assert out.unfinished == [(failed.info.run_id, "device=cuda seed=0", "FAILED"),
                              (out.parent_run_id, "sweep parent", "FAILED")]
    assert failed.info.status == "FAILED"
    assert client.get_run(out.parent_run_id).info.status == "FAILED"

    done = run_loaded(load(p, ["sweep={}", f"runtime.backend={backend}"]), "inline",
                      tracking_uri=mlflow_uri, quiet=True)
    assert done.unfinished == [] and len(done.runs) == 1


def test_verbose_shows_the_debug_messages_and_the_default_does_not(tmp_path, mlflow_uri,
                                                                   capsys):
    p = tmp_path / "one.yaml"
    p.write_text(SWEEP.replace("rounds: 6", "rounds: 2").replace(
        "sweep:\n  aggregator.name: [mean, median]\n", ""))
    args = ["run", str(p), "--backend", "inline", "--quiet", "--tracking-uri", mlflow_uri]
    assert main(args) == 0
    assert "marked FINISHED" not in capsys.readouterr().err
    assert main([*args, "-v"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert any(line.startswith("seed=0: run ") and
               line.endswith(" marked FINISHED") for line in err), err
    assert any(line.startswith("seed=0: round 2/2 acc ") for line in err)  # progress as before


def test_a_process_that_ran_an_experiment_exits_without_its_last_collection(tmp_path):
    """``Experiment.running`` registers the exit handler once; at exit the collector is off
    and every object alive is frozen out of its reach."""
    code = """
import atexit, gc
from simulator.run.experiment import Experiment, _AT_EXIT, exit_without_collection

class Fake:
    parent = None
    start = None
    def close(self): pass

before = atexit._ncallbacks()
exp = Experiment(Fake(), [], "sqlite:///x.db", "parent")
for _ in range(2):
    with exp.running():
        pass
print(atexit._ncallbacks() - before, len(_AT_EXIT), gc.isenabled(), gc.get_freeze_count() == 0)
exit_without_collection()
print(gc.isenabled(), gc.get_freeze_count() > 1000)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, check=True).stdout.split("\n")
    assert out[:2] == ["1 1 True True", "False True"]
