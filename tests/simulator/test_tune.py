"""``fedray tune``: searches on Ray Tune from a scenario's ``tune:`` block (simulator.run.tuning).

The search layer finds a quadratic's optimum; a real search's trial scores are recomputed
from its point runs' MLflow histories (the worst over attacks of the mean over seeds); ASHA
stops trials and their runs say so; the same search seed gives the same trials; a trial that
fails is marked FAILED and the search goes on; an interrupted search resumes without
repeating its finished trials."""

from __future__ import annotations

import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from simulator.config import ScenarioError
from simulator.config.load import load
from simulator.config.schema import Tune
from simulator.run.tuning import Score, domain, run_tune, scheduler, searcher

ROOT = Path(__file__).resolve().parents[2]

SCENARIO = """\
name: tune-digits
rounds: 6
seeds: [0, 1]
data:
  dataset: {name: digits}
  partitioner: {name: iid}
model: {name: mlp, hidden: [16]}
clients: {total: 10, byzantine: 2, b_hat: {rule: fixed, value: 2}}
local: {steps: 2, batch_size: 16, lr: 0.1}
aggregator: {name: cwtm}
attack: {name: sign_flip}
evaluation: {every: 2}
sweep:
  attack: [{name: sign_flip}, {name: gaussian, sigma: 10.0}]
tune:
  space:
    local.lr: {log_uniform: [0.005, 0.5]}
  metric: test_accuracy:final
  trials: 6
  parallel: 1
  grace: 1
  reduction: 2
  seed: 7
  worst_over: [attack]
"""


def _write(tmp_path: Path, text: str = SCENARIO, name: str = "tune.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("search,trials,tolerance", [("random", 24, 0.1), ("optuna", 40, 0.03)])
def test_the_search_finds_the_optimum_of_a_quadratic(shared_ray, tmp_path, search, trials,
                                                     tolerance):
    """fedray's search algorithms and scheduler (``searcher``, ``domain``, ``scheduler``)
    on -(x - 0.7)^2 over [-2, 2]: the best trial lies within the tolerance (TPE, after its
    10 random start-up trials, closes in: 40 trials get within 0.03)."""
    from ray import tune as rt

    t = Tune.model_validate({"space": {"x": {"uniform": [-2.0, 2.0]}}, "trials": trials,
                             "search": search, "seed": 3, "mode": "max", "parallel": 1})
    seen: dict[float, float] = {}

    class Scores(rt.Callback):
        def on_trial_result(self, iteration, trials, trial, result, **info):
            seen[trial.config["x"]] = result["score"]

    def quadratic(config):
        for _ in range(3):
            rt.report({"score": -(config["x"] - 0.7) ** 2})

    tuner = rt.Tuner(quadratic, param_space={"x": domain(t.space["x"])},
                     tune_config=rt.TuneConfig(metric="score", mode="max", reuse_actors=True,
                                               num_samples=t.trials, search_alg=searcher(t, 1),
                                               scheduler=scheduler(t, 3)),
                     run_config=rt.RunConfig(name="q", storage_path=str(tmp_path), verbose=0,
                                             callbacks=[Scores()]))
    tuner.fit()
    assert len(seen) == trials
    best = max(seen, key=lambda x: seen[x])
    assert abs(best - 0.7) < tolerance, sorted(seen, key=lambda x: -seen[x])[:3]


def _runs(uri: str, experiment: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id], max_results=1000)


def _history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in
                  MlflowClient(tracking_uri=uri).get_metric_history(run_id, key))


def test_a_search_in_mlflow_its_worst_case_scores_asha_and_its_seed(tmp_path, mlflow_uri,
                                                                     shared_ray):
    loaded = load(_write(tmp_path))
    out = run_tune(loaded, tracking_uri=mlflow_uri)
    runs = _runs(mlflow_uri, "tune-digits")
    parent = next(r for r in runs if r.info.run_id == out.parent_run_id)
    assert parent.data.tags["fedray.kind"] == "tune" and parent.info.status == "FINISHED"
    trials = [r for r in runs if r.data.tags.get("fedray.kind") == "trial"]
    assert len(trials) == 6
    assert all(r.data.tags["mlflow.parentRunId"] == out.parent_run_id for r in trials)
    points = {t.info.run_id: [r for r in runs
                              if r.data.tags.get("mlflow.parentRunId") == t.info.run_id]
              for t in trials}
    assert all(len(p) == 4 for p in points.values())  # 2 attacks x 2 seeds, grandchildren

    for trial in trials:  # the logged score, recomputed from the points' histories
        scores = _history(mlflow_uri, trial.info.run_id, "score")
        per_attack: dict[str, list[float]] = {}
        for point in points[trial.info.run_id]:
            acc = _history(mlflow_uri, point.info.run_id, "eval/test_accuracy")
            assert len(acc) == len(scores)  # one score per evaluation round
            per_attack.setdefault(point.data.tags["attack"], []).append(acc[-1][1])
        assert len(per_attack) == 2 and all(len(v) == 2 for v in per_attack.values())
        worst = min(statistics.fmean(v) for v in per_attack.values())
        assert scores[-1][1] == pytest.approx(worst, abs=1e-12)

    finished = [t for t in trials if t.info.status == "FINISHED"]
    stopped = [t for t in trials if t.info.status == "KILLED"]
    assert stopped and finished and len(stopped) + len(finished) == 6
    for t in stopped:  # ASHA's stops, said by the trial and its points
        assert t.data.tags["fedray.trial_end"].startswith("stopped by ASHA after evaluation")
        for point in points[t.info.run_id]:
            assert point.info.status == "KILLED"
            assert len(_history(mlflow_uri, point.info.run_id, "round/sampled")) < 6
    best = max(finished, key=lambda t: t.data.metrics["score"])
    assert best.data.tags.get("fedray.best") == "true"
    assert out.best[0]["run_id"] == best.info.run_id
    assert out.best[0]["score"] == pytest.approx(best.data.metrics["score"])
    assert sum(t.data.tags.get("fedray.best") == "true" for t in trials) == 1

    # the same search seed gives the same trials (a new search: --fresh)
    again = run_tune(load(_write(tmp_path)), tracking_uri=mlflow_uri, fresh=True)
    assert again.parent_run_id != out.parent_run_id
    second = [r for r in _runs(mlflow_uri, "tune-digits")
              if r.data.tags.get("mlflow.parentRunId") == again.parent_run_id]

    def settings(rs: list) -> list[tuple[str, str]]:
        return sorted((r.data.tags["fedray.trial_id"].split("_")[-1], r.data.params["local.lr"])
                      for r in rs)

    assert settings(second) == settings(trials)


def test_a_failed_trial_is_marked_and_the_search_goes_on(tmp_path, mlflow_uri, shared_ray):
    """A trial whose data file went bad after validation fails in one line; the others
    finish and the best is chosen among them."""
    rows = {"f0": [float(i % 7) for i in range(60)], "f1": [float(i % 5) for i in range(60)],
            "label": [i % 2 for i in range(60)]}
    good, bad = tmp_path / "good.parquet", tmp_path / "bad.parquet"
    pq.write_table(pa.table(rows), good)
    pq.write_table(pa.table(rows), bad)
    text = f"""\
name: tune-failing
rounds: 2
data:
  dataset: {{name: parquet, path: {good}, features: [f0, f1]}}
model: {{name: logreg}}
clients: {{total: 4}}
tune:
  space:
    data.dataset.path: {{choice: ["{good}", "{bad}"]}}
  trials: 2
  parallel: 1
  scheduler: none
  seed: 1
"""
    loaded = load(_write(tmp_path, text))
    bad.write_bytes(b"not a parquet file")  # after validation, before the trials read it
    out = run_tune(loaded, tracking_uri=mlflow_uri)
    trials = [r for r in _runs(mlflow_uri, "tune-failing")
              if r.data.tags.get("fedray.kind") == "trial"]
    failed = [t for t in trials if t.info.status == "FAILED"]
    done = [t for t in trials if t.info.status == "FINISHED"]
    assert len(trials) == 2 and len(failed) == 1 and len(done) == 1  # each path once
    assert all(t.data.params["data.dataset.path"] == str(bad) for t in failed)
    assert all(t.data.params["data.dataset.path"] == str(good) for t in done)
    assert all(t.data.tags["fedray.trial_end"].startswith("failed: ") and
               "\n" not in t.data.tags["fedray.trial_end"] for t in failed)
    assert out.best[0]["trials"] == len(done)


def test_an_interrupted_search_resumes_without_repeating_finished_trials(tmp_path,
                                                                        mlflow_uri):
    text = SCENARIO.replace("rounds: 6", "rounds: 60").replace("every: 2", "every: 20") \
        .replace("trials: 6", "trials: 4").replace("seeds: [0, 1]", "seeds: [0]") \
        .replace("reduction: 2", "reduction: 2\n  scheduler: none")
    path = _write(tmp_path, text)
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_uri}
    cmd = [sys.executable, "-m", "fedray", "tune", str(path)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            trials = [r for r in _runs(mlflow_uri, "tune-digits")
                      if r.data.tags.get("fedray.kind") == "trial"]
        except Exception:  # noqa: BLE001 - the store or experiment is still being created
            trials = []
        if any(t.info.status == "FINISHED" for t in trials):
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err
    last = err.strip().splitlines()[-1]
    assert "interrupted by SIGINT" in last and "run the same `fedray tune` command again" in last
    first = {r.data.tags["fedray.trial_id"]: r.info.run_id
             for r in _runs(mlflow_uri, "tune-digits")
             if r.data.tags.get("fedray.kind") == "trial" and r.info.status == "FINISHED"}
    assert 1 <= len(first) < 4

    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, check=False,
                           timeout=300)
    assert again.returncode == 0, again.stderr
    assert "resuming the search" in again.stderr
    trials = [r for r in _runs(mlflow_uri, "tune-digits")
              if r.data.tags.get("fedray.kind") == "trial"]
    finished = [t for t in trials if t.info.status == "FINISHED"]
    ids = [t.data.tags["fedray.trial_id"] for t in finished]
    assert len(finished) == 4 and len(set(ids)) == 4  # every trial once
    for trial_id, run_id in first.items():  # finished before: not run again
        assert [t.info.run_id for t in trials
                if t.data.tags["fedray.trial_id"] == trial_id] == [run_id]
    parents = {t.data.tags["mlflow.parentRunId"] for t in trials}
    assert len(parents) == 1  # the same search parent, continued


def test_the_score_is_the_worst_attack_of_the_mean_over_seeds():
    """Score on hand-made rows: two attacks x two seeds, the metric at its last
    evaluation; a diverged point (nan) is the worst number there is."""
    loaded_points = _points()
    t = Tune.model_validate({"space": {"local.lr": {"uniform": [0.01, 0.1]}},
                             "mode": "max", "worst_over": ["attack"]})
    score = Score(t, loaded_points)
    by_label = {p.label: i for i, p in enumerate(loaded_points)}
    rows: list[list[dict[str, float]]] = [[] for _ in loaded_points]
    final = {"attack=sign_flip seed=0": 0.8, "attack=sign_flip seed=1": 0.6,
             "attack=gaussian(sigma=10.0) seed=0": 0.9,
             "attack=gaussian(sigma=10.0) seed=1": 0.5}
    for label, value in final.items():
        rows[by_label[label]] = [{"test_accuracy": 0.1}, {"sampled": 10.0},
                                 {"test_accuracy": value}]
    assert score(rows) == pytest.approx(min((0.8 + 0.6) / 2, (0.9 + 0.5) / 2))
    rows[by_label["attack=gaussian(sigma=10.0) seed=1"]][-1]["test_accuracy"] = math.nan
    assert score(rows) == -math.inf
    mean = Score(Tune.model_validate({"space": {"local.lr": {"uniform": [0.01, 0.1]}},
                                      "metric": "test_loss:last2", "mode": "min"}),
                 loaded_points)
    losses = [[{"test_loss": 1.0 + i}, {"test_loss": 2.0 + i}] for i in range(4)]
    assert mean(losses) == pytest.approx(statistics.fmean(1.5 + i for i in range(4)))


def _points():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return load(_write(Path(d), SCENARIO)).points


def test_fedray_tune_refuses_a_scenario_without_a_tune_block(tmp_path, capsys):
    from fedray.cli import main

    p = _write(tmp_path, SCENARIO.split("tune:")[0])
    assert main(["tune", str(p)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no tune block" in err[0]
    # a trial no local node could place would wait for ever: refused before Ray starts
    p = _write(tmp_path)
    assert main(["tune", str(p), "--set", "runtime.num_cpus=1000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "runtime.num_cpus: a search's trial needs 1000 CPUs" in err[0]


def test_every_problem_of_a_tune_block_is_one_line(tmp_path):
    bad = SCENARIO.split("tune:")[0] + """\
tune:
  space:
    local.lr: {log_uniform: [0.0, 0.5]}
    local.momentum: {uniform: [0.0, 0.9], choice: [0.5]}
  metric: test_acc:last0
  trials: 0
"""
    with pytest.raises(ScenarioError) as e:
        load(_write(tmp_path, bad))
    lines = [line.split(": ", 1)[1] for line in e.value.lines]
    assert lines == [
        "tune.space.local.lr: log_uniform needs low > 0, got 0.0",
        ("tune.space.local.momentum: must give exactly one of uniform: [low, high], "
        "log_uniform: [low, high], int: [low, high] or choice: [values], got uniform, choice"),
        "tune.trials: must be >= 1, got 0",
        ("tune.metric: must be METRIC:HOW with HOW one of final, lastK (K >= 1), mean or "
        "time_toX (X a number), got 'test_acc:last0'")]
    for old, new, line in [
            ("worst_over: [attack]", "worst_over: [attak]",
             "tune.worst_over[0]: must be a sweep key (attack), got 'attak'"),
            ("metric: test_accuracy:final", "metric: test_accuracy:time_to0.9",
             ("tune.metric: time_to0.9 needs the simulated clock (sim_time): a speeds: block "
             "or an asynchronous server.mode")),
            ("grace: 1", "grace: 3",
             ("tune.grace: must be < the 3 evaluation round(s) of a run for ASHA to stop "
             "anything; set scheduler: none, or more rounds"))]:
        with pytest.raises(ScenarioError) as e:
            load(_write(tmp_path, SCENARIO.replace(old, new)))
        assert [x.split(": ", 1)[1] for x in e.value.lines] == [line]


def test_a_random_search_over_choices_tries_each_setting_once_in_a_seeded_order(tmp_path):
    from simulator.run.tuning import SETTING, discrete_settings, param_space, searched_values

    space = {"local.lr": {"choice": [0.01, 0.1, 1.0]},
             "attack": {"choice": [{"name": "sign_flip"}, {"name": "alie"}]}}
    t = Tune.model_validate({"space": space, "trials": 4, "seed": 5})
    settings = discrete_settings(t)
    assert len(settings) == 6 and len({repr(s) for s in settings}) == 6  # each once
    assert discrete_settings(t) == settings  # the seed decides the order
    assert discrete_settings(t.model_copy(update={"seed": 6})) != settings
    assert param_space(t)[SETTING] == {"grid_search": [0, 1, 2, 3]}  # the first 4 trials
    assert searched_values(t, {SETTING: 2}) == settings[2]
    # a range anywhere, or Optuna: each key sampled by the search algorithm
    ranged = Tune.model_validate({"space": {**space, "local.momentum": {"uniform": [0, 1]}}})
    assert discrete_settings(ranged) is None and SETTING not in param_space(ranged)
    assert discrete_settings(t.model_copy(update={"search": "optuna"})) is None
    # more trials than settings would repeat some: refused in one line
    text = SCENARIO.replace("local.lr: {log_uniform: [0.005, 0.5]}",
                            "local.lr: {choice: [0.01, 0.1]}")
    with pytest.raises(ScenarioError) as e:
        load(_write(tmp_path, text))
    assert [x.split(": ", 1)[1] for x in e.value.lines] == [
        ("tune.trials: must be <= the 2 settings the space holds (choices only: more trials "
        "would repeat settings), got 6")]
