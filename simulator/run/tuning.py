"""Searches on Ray Tune (``fedray tune``; the scenario's ``tune`` block, docs/tuning.md).

A *trial* is one setting of the searched keys. It runs the scenario's sweep points x seeds
with those values, in one Ray Tune trial (one process, the inline backend), all points in
lockstep (``Engine.steps``): at each evaluation round the trial scores what its points have
computed (``Score``: ``metric`` reduced per point, averaged over the points, or the worst over
``worst_over``'s values of the mean over the rest) and reports it to Tune, whose scheduler
(ASHA) may stop it there. ``per`` runs one search per value of those sweep keys (each
aggregator is tuned on its own: ASHA never compares a mean's trial with a median's).

Only the driver talks to MLflow (``TrialRuns``, a Tune callback in the driver): the search is
the parent run, each trial a child run (the searched values as params, ``score`` per
evaluation, its end: finished, stopped by ASHA, failed), each of its points a grandchild with
its rounds, as ``fedray run`` logs them. The best trial of each search is tagged
``fedray.best``. Ray Tune keeps the search's state in ``.fedray/tune/PARENT_RUN_ID``: the same
command run again after an interruption restores it (Ray Tune's own restore); finished trials
are not run again, unfinished ones start over.

Departures: a trial's points run in one process (``runtime.num_cpus`` CPUs, a GPU share
for a point on a GPU), not on the actor pool; a trial keeps no checkpoint, so an
interrupted trial starts over on resume.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import math
import os
import statistics
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from simulator import registry
from simulator.config import RunPoint, ScenarioError
from simulator.config.dotted import set_path
from simulator.config.load import LoadedScenario
from simulator.config.schema import Distribution, Tune, short
from simulator.config.sweep import expand
from simulator.config.tune_checks import evaluations
from simulator.errors import UsageError, brief_text
from simulator.log import logger
from simulator.run.callbacks import MLflowArtifacts, MLflowMetrics, PointRun
from simulator.run.experiment import Experiment, ExperimentResult, Work
from simulator.run.interrupts import raise_received, stopping_ray_tune, trap_sigterm
from simulator.run.layout import Opening, sweep_key
from simulator.run.reductions import (
    TimeTo,
    lower_is_better,
    parse_how,
    parse_metrics,
    run_summary,
    time_to,
)
from simulator.run.tracking import Tracker, default_uri, flatten

# the Tune loggers fedray does not use (its results go to MLflow), before Ray Tune is imported
os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # no configuration box, no result tables
from ray.tune import Callback as TuneCallback

SCORE = "score"
TUNE_HOME = Path(".fedray") / "tune"


# ------------------------------------------------------------------ what a trial runs


def groups(sc: Any) -> list[dict[str, Any]]:
    """The searches of a scenario: one per combination of the ``per`` keys' sweep values."""
    keys = sc.tune.per
    return [dict(zip(keys, combo)) for combo in itertools.product(*(sc.sweep[k] for k in keys))]


def group_label(group: dict[str, Any], alone: str = "search") -> str:
    """``aggregator.name=cwtm`` -> ``cwtm``, as a point's label shows sweep values;
    ``alone`` for the one search of a scenario without ``per``."""
    parts = [short(v) if k.split(".")[-1] == "name" else f"{k.split('.')[-1]}={short(v)}"
             for k, v in group.items()]
    return " ".join(parts) or alone


def _value(v: Any) -> str:
    """A searched value in a label: floats to 4 significant digits (MLflow's params keep
    every digit)."""
    return f"{v:.4g}" if isinstance(v, float) else short(v)


def trial_points(raw: dict, group: dict[str, Any], config: dict[str, Any]) -> list[RunPoint]:
    """The points of a trial: the scenario's sweep (``per`` keys at the group's values) x
    seeds, with the searched keys at ``config``'s values."""
    out = copy.deepcopy({k: v for k, v in raw.items() if k != "tune"})
    sweep = dict(out.get("sweep") or {})
    sweep.update({k: [v] for k, v in group.items()})
    out["sweep"] = sweep
    for k, v in config.items():
        set_path(out, k, v)
    points, _ = expand(out)
    return points


class Score:
    """A trial's score from its points' rounds: ``metric`` reduced per point (``HOW`` as
    ``fedray table`` reduces a run's history, ``simulator.run.reductions``), then the mean over
    the points, or with ``worst_over`` the worst over those keys' values of the mean over
    the rest (ByzFL's worst case). A point with no number (a diverged run: nan) counts as
    the worst number there is (-inf when maximizing)."""

    def __init__(self, tune: Tune, points: list[RunPoint]) -> None:
        ((self.metric, self.how),) = parse_metrics([tune.metric])
        self.maximize = tune.mode == "max"
        cells: dict[str, list[int]] = {}
        for i, p in enumerate(points):
            key = json.dumps([p.values.get(k) for k in tune.worst_over], sort_keys=True)
            cells.setdefault(key, []).append(i)
        self.cells = list(cells.values())

    def point_value(self, rows: list[dict[str, float]]) -> float:
        """One point's number from its rows so far."""
        k = parse_how(self.how)
        if isinstance(k, TimeTo):
            hist = [(r, row[self.metric]) for r, row in enumerate(rows) if self.metric in row]
            clock = [(r, row["sim_time"]) for r, row in enumerate(rows) if "sim_time" in row]
            return time_to(hist, clock, k.threshold, lower_is_better(self.metric))
        return run_summary([row[self.metric] for row in rows if self.metric in row], self.how)

    def __call__(self, rows: list[list[dict[str, float]]]) -> float:
        worst = -math.inf if self.maximize else math.inf
        values = [self.point_value(r) for r in rows]
        values = [worst if math.isnan(v) else v for v in values]
        means = [statistics.fmean(values[i] for i in cell) for cell in self.cells]
        return min(means) if self.maximize else max(means)


def run_trial(config: dict[str, Any], raw: dict, group: dict[str, Any], tune: dict,
              plugins: Any = None) -> None:
    """A Ray Tune trial: the points of ``config`` in lockstep on the inline backend; at each
    evaluation round, ``tune.report`` of the score, the round, and each point's rounds since
    the last report (the driver logs them to MLflow). ``plugins``: the driver's session
    plugins (``registry.SessionPlugins``), registered in the trial's process by their
    unpickling, before the points are validated."""
    from ray import tune as rt

    from simulator.log import to_stderr
    from simulator.runtime.backend import InlineBackend
    from simulator.sim.engine import Engine

    t = Tune.model_validate(tune)
    points = trial_points(raw, group, searched_values(t, config))
    score = Score(t, points)
    rows: list[list[dict[str, float]]] = [[] for _ in points]
    fresh: dict[str, list[Any]] = {str(i): [] for i in range(len(points))}

    def keep(i: int, r: int, metrics: dict[str, float]) -> None:
        rows[i].append(metrics)
        fresh[str(i)].append([r, metrics])

    with to_stderr():
        steps = [Engine(p.scenario, InlineBackend()).steps(partial(keep, i))
                 for i, p in enumerate(points)]
        done = [False] * len(points)
        for r in range(max(p.scenario.rounds for p in points)):
            for i, gen in enumerate(steps):
                while not done[i] and len(rows[i]) <= r:
                    try:
                        next(gen)
                    except StopIteration:
                        done[i] = True
            if any(len(x) > r and score.metric in x[r] for x in rows):  # an evaluation round
                rt.report({SCORE: score(rows), "round": r + 1, "rows": dict(fresh)})
                fresh = {str(i): [] for i in range(len(points))}


# ------------------------------------------------------------------ the search space


SETTING = "setting"  # the trial config's key when a search draws settings from a list


def discrete_settings(t: Tune) -> list[dict[str, Any]] | None:
    """A random search over choices only: every setting of the space once, in an order
    drawn from the search's seed (a trial takes the next; sampling each key on its own
    would draw some settings twice and miss others). None for any other search."""
    import random

    if t.search != "random" or any(d.choice is None for d in t.space.values()):
        return None
    combos = [dict(zip(t.space, c))
              for c in itertools.product(*(d.choice or [] for d in t.space.values()))]
    return random.Random(t.seed).sample(combos, len(combos))


def searched_values(t: Tune, config: dict[str, Any]) -> dict[str, Any]:
    """A trial's values of the searched keys, from its Tune config."""
    settings = discrete_settings(t)
    return settings[config[SETTING]] if settings is not None else config


def param_space(t: Tune) -> dict[str, Any]:
    """The Tune param space: each key's domain, or the indices of the first ``trials``
    settings of ``discrete_settings`` (a grid search over them: each once)."""
    from ray import tune as rt

    settings = discrete_settings(t)
    if settings is not None:
        return {SETTING: rt.grid_search(list(range(min(t.trials, len(settings)))))}
    return {k: domain(d) for k, d in t.space.items()}


def domain(dist: Distribution) -> Any:
    """A searched key's Ray Tune domain."""
    from ray import tune as rt

    if dist.uniform is not None:
        return rt.uniform(*dist.uniform)
    if dist.log_uniform is not None:
        return rt.loguniform(*dist.log_uniform)
    if dist.int_ is not None:
        return rt.randint(dist.int_[0], dist.int_[1] + 1)  # randint's high is excluded
    assert dist.choice is not None
    return rt.choice(dist.choice)


def searcher(t: Tune, parallel: int) -> Any:
    """Random search (Tune's variant generator, seeded), or Optuna's TPE (seeded). Random
    gives the same trials whatever the parallelism; TPE's first trials are its seeded
    random start, the later ones depend on the scores that came back before them (the same
    trials with ``parallel: 1``)."""
    from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter

    if t.search == "random":
        return BasicVariantGenerator(random_state=t.seed, max_concurrent=parallel)
    import optuna
    from optuna.samplers import TPESampler

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # "A new study created ..."
    from ray.tune.search.optuna import OptunaSearch

    return ConcurrencyLimiter(OptunaSearch(sampler=TPESampler(seed=t.seed), metric=SCORE,
                                           mode=t.mode), max_concurrent=parallel)


def scheduler(t: Tune, n_eval: int) -> Any:
    """ASHA (Li et al., MLSys 2020) on the evaluation rounds, or none (FIFO)."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if t.scheduler == "none":
        return FIFOScheduler()
    return ASHAScheduler(time_attr="training_iteration", max_t=n_eval, grace_period=t.grace,
                         reduction_factor=t.reduction)


# ------------------------------------------------------------------ MLflow, in the driver


@dataclass
class LiveTrial:
    """A trial's MLflow runs: its own (``run_id``) and its points' (``runs``)."""

    run_id: str
    label: str
    exp: Experiment
    runs: list[PointRun]
    scores: list[float] = field(default_factory=list)
    rounds: int = 0


_DRIVERS: dict[str, TrialRuns] = {}  # the live driver side of each search, by its key


class TrialCallback(TuneCallback):
    """The Tune callback: a thin proxy to the ``TrialRuns`` registered under ``key``. Ray
    Tune pickles it with a search and gives it back on restore: only the key travels, and
    it finds the driver side of the command that restored the search."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __reduce__(self) -> Any:
        return (TrialCallback, (self.key,))

    def on_trial_start(self, iteration: int, trials: Any, trial: Any, **info: Any) -> None:
        _DRIVERS[self.key].start(trial)

    def on_trial_result(self, iteration: int, trials: Any, trial: Any, result: dict,
                        **info: Any) -> None:
        _DRIVERS[self.key].result(trial, result)

    def on_trial_complete(self, iteration: int, trials: Any, trial: Any, **info: Any) -> None:
        _DRIVERS[self.key].complete(trial)

    def on_trial_error(self, iteration: int, trials: Any, trial: Any, **info: Any) -> None:
        _DRIVERS[self.key].error(trial)


class TrialRuns:
    """The driver side of one search: each trial's MLflow runs as Tune reports on it."""

    def __init__(self, search: SearchRun, group: dict[str, Any], n_eval: int) -> None:
        self.search, self.group, self.n_eval = search, group, n_eval
        self.live: dict[str, LiveTrial] = {}

    def start(self, trial: Any) -> None:
        s = self.search
        tracker = s.tracker
        assert s.loaded.scenario.tune is not None
        config = searched_values(s.loaded.scenario.tune, trial.config)
        values = " ".join(f"{k.split('.')[-1]}={_value(v)}" for k, v in config.items())
        number = _trial_number(trial)
        label = " ".join(x for x in (group_label(self.group, ""), f"trial {number}:", values)
                         if x)
        old = tracker.find_run({"fedray.trial_id": trial.trial_id,
                                "mlflow.parentRunId": s.parent})
        if old is not None:  # started before an interruption: it starts over
            tracker.client.set_tag(old, "fedray.trial_end", "started over on resume")
            tracker.end(old, "KILLED")
        run_id = tracker.create_run(label, {
            "fedray.kind": "trial", "fedray.trial_id": trial.trial_id,
            "fedray.search": group_label(self.group), **{k: str(short(v)) for k, v in
                                                         self.group.items()}},
            parent_id=s.parent)
        tracker.log_params(run_id, flatten(config) |
                           {f"search.{k}": short(v) for k, v in self.group.items()})
        exp = Experiment(Opening.existing(tracker, run_id), [MLflowMetrics(), MLflowArtifacts()],
                         tracker.uri, label)
        try:
            points = trial_points(s.loaded.raw, self.group, config)
        except ScenarioError:  # a file the values name went bad since validation: the
            points = []        # trial fails with the same error, reported in its end
        tmp = s.tmp / trial.trial_id
        runs = [exp.start(Work(p), s.backend, tmp / str(i)) for i, p in enumerate(points)]
        self.live[trial.trial_id] = LiveTrial(run_id, label, exp, runs)

    def result(self, trial: Any, result: dict) -> None:
        t = self.live[trial.trial_id]
        for i, rows in result.get("rows", {}).items():
            for r, m in rows:
                t.exp.on_round(t.runs[int(i)], r, m)
        step = int(result["training_iteration"])
        t.scores.append(float(result[SCORE]))
        t.rounds = int(result["round"])
        self.search.tracker.log_round(t.run_id, step, {SCORE: result[SCORE],
                                                        "round": result["round"]})

    def complete(self, trial: Any) -> None:
        t = self.live.pop(trial.trial_id)
        evals = len(t.scores)
        stopped = evals < self.n_eval
        status = "KILLED" if stopped else "FINISHED"
        text = (f"stopped by ASHA after evaluation {evals} of {self.n_eval} (round {t.rounds})"
                if stopped else "finished")
        self._end(t, status, text)
        score = t.scores[-1] if t.scores else math.nan
        logger.info("%s: score %.4f, %s  (run %s)", t.label, score, text, t.run_id)

    def error(self, trial: Any) -> None:
        t = self.live.pop(trial.trial_id, None)
        text = _trial_error(trial)
        if t is None:
            return
        self._end(t, "FAILED", f"failed: {text}")
        logger.warning("%s: FAILED (%s)  (run %s)", t.label, text, t.run_id)

    def _end(self, t: LiveTrial, status: str, text: str) -> None:
        tracker = self.search.tracker
        for run in t.runs:
            tracker.client.set_tag(run.run_id, "fedray.trial_end", text)
            t.exp.end(run, None, status)
        tracker.client.set_tag(t.run_id, "fedray.trial_end", text)
        tracker.end(t.run_id, status)
        t.exp.opening.close()

    def abandon(self) -> None:
        """The trials still running when the search stopped (an interrupt): KILLED."""
        for trial_id in list(self.live):
            t = self.live.pop(trial_id)
            self._end(t, "KILLED", "interrupted")


def _trial_number(trial: Any) -> int:
    """A trial's number in its search: the index Tune's experiment tag starts with
    (``3_lr=0.05``; from 0 for the random search's variant generator, from 1 for a searcher
    such as Optuna, whose trial ids are random), shown from 1."""
    head = str(getattr(trial, "experiment_tag", "")).split("_")[0]
    if not head.isdigit():
        return int(trial.trial_id[-5:], 16) + 1
    return int(head) + (0 if "_" in trial.trial_id and not trial.trial_id.split("_")[-1]
                        .isdigit() else 1)


def _trial_error(trial: Any) -> str:
    """A failed trial's error in one line (the last line of Tune's error file)."""
    try:
        text = Path(trial.error_file).read_text().strip().splitlines()[-1]
    except (OSError, TypeError, IndexError):
        text = "see Ray Tune's error file"
    return brief_text(text, 300)


# ------------------------------------------------------------------ the command


@dataclass
class SearchRun:
    """What the driver of ``fedray tune`` holds while it searches."""

    loaded: LoadedScenario
    tracker: Tracker
    parent: str
    backend: Any
    tmp: Path


@dataclass
class TuneResult(ExperimentResult):
    """``fedray tune``'s result: per search (``per`` value), its best trial."""

    best: list[dict[str, Any]] = field(default_factory=list)


def _resources(sc: Any, backend: Any, parallel: int) -> dict[str, float]:
    from simulator.run.executors import task_resources

    r = task_resources(sc, backend.gpus(), parallel)
    return {"cpu": r["num_cpus"], **({"gpu": r["num_gpus"]} if "num_gpus" in r else {})}


def _quiet_tune() -> None:
    """Ray Tune's own progress tables and per-trial tracebacks stay out of the terminal:
    fedray prints a line per trial (its error in one line) and MLflow holds the rest."""
    for name in ("ray.tune", "ray.train", "ray.air"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def search_group(s: SearchRun, gi: int, group: dict[str, Any], parallel: int,
                 storage: Path) -> TrialRuns:
    """One search (a ``per`` group) with Ray Tune: new, or restored from ``storage`` where
    an earlier command left it; returns its driver side (the trials it saw end)."""
    from ray import tune as rt

    sc = s.loaded.scenario
    t = sc.tune
    assert t is not None
    n_eval = evaluations(sc.rounds, sc.evaluation.every)
    key = f"{s.parent}/{gi}"
    runs = _DRIVERS[key] = TrialRuns(s, group, n_eval)
    trainable = rt.with_resources(
        rt.with_parameters(run_trial, raw=s.loaded.raw, group=group,
                           tune=t.model_dump(mode="json"), plugins=registry.session_plugins()),
        _resources(sc, s.backend, parallel))
    path = storage / f"search{gi}"
    try:
        if rt.Tuner.can_restore(str(path)):
            logger.info("%s: resuming the search from %s", group_label(group), path)
            tuner = rt.Tuner.restore(str(path), trainable, resume_unfinished=True,
                                     resume_errored=False, restart_errored=False)
        else:
            space = param_space(t)
            tuner = rt.Tuner(
                trainable, param_space=space,
                tune_config=rt.TuneConfig(metric=SCORE, mode=t.mode,
                                          num_samples=1 if SETTING in space else t.trials,
                                          search_alg=searcher(t, parallel),
                                          scheduler=scheduler(t, n_eval),
                                          max_concurrent_trials=parallel,
                                          # a trial's process goes on to the next trial:
                                          # 1.3 s of actor start a trial saved, and the data
                                          # it loaded is cached for the next
                                          reuse_actors=True),
                run_config=rt.RunConfig(name=path.name, storage_path=str(storage),
                                        callbacks=[TrialCallback(key)], verbose=0))
        with stopping_ray_tune() as received:
            tuner.fit()
        raise_received(received)
        runs.abandon()  # none, unless Tune ended a trial without telling its callbacks
    except BaseException:
        runs.abandon()
        raise
    finally:
        _DRIVERS.pop(key, None)
    return runs


def _finished_trials(tracker: Tracker, parent: str, group: dict[str, Any]
                     ) -> list[tuple[str, float, dict[str, str]]]:
    """(run id, final score, params) of the search's trials that ran every evaluation."""
    runs = tracker.client.search_runs(
        [tracker.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{parent}' and "
                      f"tags.`fedray.search` = '{group_label(group)}' and "
                      "attributes.status = 'FINISHED'")
    return [(r.info.run_id, r.data.metrics.get(SCORE, math.nan), r.data.params) for r in runs]


def tag_best(s: SearchRun, group: dict[str, Any], mode: str) -> dict[str, Any] | None:
    """The best trial of a search among those that ran every evaluation (a trial ASHA
    stopped early is not comparable), tagged ``fedray.best``; its values on the parent."""
    done = [x for x in _finished_trials(s.tracker, s.parent, group) if not math.isnan(x[1])]
    if not done:
        return None
    run_id, score, params = (max if mode == "max" else min)(done, key=lambda x: x[1])
    s.tracker.client.set_tag(run_id, "fedray.best", "true")
    label = group_label(group)
    searched = {k: v for k, v in params.items() if not k.startswith("search.")}
    s.tracker.client.set_tag(s.parent, f"fedray.best.{label}", run_id)
    return {"search": label, "run_id": run_id, "score": score, "values": searched,
            "trials": len(done)}


def run_tune(loaded: LoadedScenario, address: str | None = None,
             tracking_uri: str | None = None, fresh: bool = False,
             ray_init: dict | None = None) -> TuneResult:
    """Run the scenario's searches (``fedray tune``) on Ray Tune, tracked in MLflow; the
    last search of the same resolved scenario goes on where it stopped (``fresh``: a new
    one). Returns each search's best trial (``best``)."""
    from simulator.pinning import require_pinned, strict_options
    from simulator.runtime.backend import RayBackend

    sc = loaded.scenario
    if sc.tune is None:
        raise UsageError(f"{loaded.path}: no tune: block to search with; `fedray run` runs it")
    # a strict search: a driver started pinned, and every process of the job too (a trial's
    # own options cannot carry it; a local instance inherits it, a cluster's job is given it)
    modes = [p.scenario.runtime.deterministic for p in loaded.points]
    searched = sc.tune.space.get("runtime.deterministic")
    modes += searched.extremes if searched is not None else []  # a choice's every value
    require_pinned(modes, sc.name)
    ray_init = {**strict_options("strict" in modes), **(ray_init or {})}
    uri = tracking_uri or default_uri()
    opening = Opening(uri, sc.name)
    exp = Experiment(opening, [], uri, "search parent")
    out = TuneResult(uri)
    exp.result = out
    with exp.running():
        tracker = opening.tracker.result()
        backend = RayBackend(address, "fedray tune: its trials run at once, as Ray Tune "
                             "trials", **ray_init)
        backend.evict_idle()  # a warm pool's idle actors hold the CPUs the trials need
        _quiet_tune()
        try:
            trap_sigterm()
            with tempfile.TemporaryDirectory(prefix="fedray-") as tmp:
                parent = _parent(exp, loaded, backend, Path(tmp), fresh)
                out.parent_run_id = parent
                s = SearchRun(loaded, tracker, parent, backend, Path(tmp))
                storage = (TUNE_HOME / parent).resolve()
                parallel = sc.tune.parallel or max(1, int(backend.default_workers()))
                for gi, group in enumerate(groups(sc)):
                    search_group(s, gi, group, parallel, storage)
                    best = tag_best(s, group, str(sc.tune.mode))
                    if best is not None:
                        out.best.append(best)
        finally:
            backend.shutdown()
    return out


def _parent(exp: Experiment, loaded: LoadedScenario, backend: Any, tmp: Path,
            fresh: bool) -> str:
    """The search's parent run: the last one of the same resolved scenario (going on), or
    a new one."""
    key = sweep_key(loaded)
    tags = {"fedray.tune_key": key, "fedray.kind": "tune"}
    found = None if fresh else exp.tracker.find_run(tags)
    if found is not None:
        exp.continue_parent(found)
        return found
    exp.new_parent(loaded, backend, tmp, tags)
    assert exp.opening.parent is not None
    parent = exp.opening.parent.result()
    # the points' params hold no tune block: the search's own settings, on the parent
    exp.tracker.log_params(parent, flatten({"tune": loaded.scenario.model_dump(
        mode="json")["tune"]}))
    return parent
