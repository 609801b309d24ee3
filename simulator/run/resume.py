"""``fedray resume``: an interrupted run continues in the same MLflow runs, from the newest
checkpoint of each point, then the points of its parent that never finished. The same
lifecycle as ``fedray run`` (``simulator.run.experiment``) on the actor pool."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml

from simulator.config import RunPoint, Scenario
from simulator.config.sweep import expand
from simulator.errors import UsageError
from simulator.log import logger
from simulator.pinning import require_pinned
from simulator.run.callbacks import Callback, default_callbacks
from simulator.run.executors import PoolExecutor
from simulator.run.experiment import Experiment, ExperimentResult, Work
from simulator.run.interrupts import trap_sigterm
from simulator.run.layout import Opening
from simulator.run.tracking import Tracker, default_uri, sync


class ResumeRefused(UsageError):
    """``fedray resume`` of a run that cannot be resumed (not fedray's, or FINISHED): a user
    error, exit 2."""


def resume_run(run_id: str, tracking_uri: str | None = None, backend_name: str | None = None,
               address: str | None = None, quiet: bool = False, workers: int | None = None,
               ray_init: dict | None = None, callbacks: list[Callback] | None = None,
               progress: bool = True) -> ExperimentResult:
    """Continue an interrupted ``fedray run`` in the same MLflow runs. ``run_id`` is a point
    (a child run): it goes on from its newest checkpoint in ``.fedray/checkpoints/`` (from
    round 0 without one) with the resolved scenario it logged when it started; then every
    point of its parent that has not FINISHED is run (resumed from its checkpoint, or from the
    start), and the parent is marked FINISHED. ``run_id`` may also be the parent itself.

    The run's own journal (``.fedray/pending``) is sent first, so that every round is logged
    exactly once: rounds MLflow or the journal already hold are not logged again (their
    values are the same: every draw is derived from the seed). A FINISHED run is refused."""
    uri = tracking_uri or default_uri()
    tracker = Tracker.of_run(uri, run_id)
    run = tracker.client.get_run(run_id)
    family = {run_id, run.data.tags.get("mlflow.parentRunId") or run_id}
    family |= {c.info.run_id for p in family for c in tracker.children(p)}
    sync(uri=tracking_uri, runs=family)  # what an outage left of these runs, before anything
    run = tracker.client.get_run(run_id)
    kind = run.data.tags.get("fedray.kind")
    if kind not in ("point", "scenario"):
        raise ResumeRefused(f"run {run_id} is not a fedray run (a child or parent run of "
                            "`fedray run`)")
    if run.info.status == "FINISHED":
        raise ResumeRefused(f"run {run.info.run_name} ({run_id}) is FINISHED: nothing to "
                            "resume (`fedray run` starts a new one)")
    parent = run_id if kind == "scenario" else run.data.tags.get("mlflow.parentRunId")
    _fetch_data(tracker, run_id if kind == "point" else None, parent)
    exp = Experiment(Opening.existing(tracker), default_callbacks(quiet, progress) + list(callbacks or []),
                     uri, "parent")
    pool = _Pool(backend_name, address, workers, ray_init)
    with tempfile.TemporaryDirectory(prefix="fedray-") as tmp:
        work = _point_work(tracker, run_id, Path(tmp)) if kind == "point" else None
        points = _parent_points(tracker, parent, Path(tmp)) if parent else None
        # strict points need a pinned process: found before anything runs again
        require_pinned([p.scenario.runtime.deterministic for p in
                        ([work.point] if work else []) + (points[0] if points else [])],
                       f"run {run_id}")
        with exp.running():
            try:
                if work is not None:
                    pool.executor(work.point.scenario, [work]).run(exp, [work],
                                                                   Path(tmp) / "point")
                if parent and points:
                    exp.continue_parent(parent)
                    _continue_parent(exp, parent, points, pool, Path(tmp))
            finally:
                pool.shutdown()
    return exp.result


def _fetch_data(tracker: Tracker, point: str | None, parent: str | None) -> None:
    """The published files the resumed point and its parent's points need, fetched and
    checked (``simulator.data.prepare.fetch``) before any run is opened again."""
    from simulator.data.prepare import fetch

    with tempfile.TemporaryDirectory(prefix="fedray-") as tmp:
        scenarios = [_logged_scenario(tracker, point, Path(tmp))] if point else []
        if parent:
            resolved = tracker.client.download_artifacts(parent, "scenario/resolved.yaml", tmp)
            scenarios += [p.scenario for p in
                          expand(yaml.safe_load(Path(resolved).read_text()))[0]]
        fetch(scenarios)


class _Pool:
    """The actor pool of a resume, made when a point first needs it (on the backend asked
    for, else the scenario's)."""

    def __init__(self, backend_name: str | None, address: str | None, workers: int | None,
                 ray_init: dict | None) -> None:
        self.name, self.address, self.workers = backend_name, address, workers
        self.ray_init = ray_init or {}
        self.backend: Any = None

    def executor(self, sc: Scenario, works: list[Work] | None = None) -> PoolExecutor:
        """The executor of ``works`` (points of ``sc``; default: ``sc`` from its start) on
        the pool's backend, chosen for the first works it is asked for
        (``simulator.sim.work.backend_for``: the rounds they have left)."""
        from simulator.runtime.backend import make_backend
        from simulator.sim.work import backend_for

        if self.backend is None:
            todo = works if works is not None else [Work(RunPoint({}, sc.seeds[0], sc))]
            choice = backend_for([w.point.scenario for w in todo],
                                 self.name or sc.runtime.backend, self.address, self.workers,
                                 self.ray_init,
                                 [w.state["round"] + 1 if w.state else 0 for w in todo])
            if choice.name == "ray" and self.address is None:
                import ray

                from simulator.config.checks import check_local_workers

                if not ray.is_initialized():  # a local instance is about to start
                    check_local_workers(self.workers or sc.runtime.workers,
                                        sc.runtime.num_cpus,
                                        "--workers" if self.workers else "runtime.workers",
                                        self.ray_init.get("num_cpus"))
            self.backend = make_backend(choice, self.address, **self.ray_init)
            trap_sigterm()
        return PoolExecutor(self.backend, self.workers)

    def shutdown(self) -> None:
        if self.backend is not None:
            self.backend.shutdown()


def _logged_scenario(tracker: Tracker, run_id: str, tmp: Path, name: str = "scenario.yaml"
                     ) -> Scenario:
    """The resolved scenario a run logged as an artifact."""
    local = tracker.client.download_artifacts(run_id, name, str(tmp / run_id))
    return Scenario.model_validate(yaml.safe_load(Path(local).read_text()))


def _point_work(tracker: Tracker, run_id: str, tmp: Path) -> Work:
    """The point run ``run_id`` to go on from its newest checkpoint (read before anything
    starts: a checkpoint that does not load stops the resume here)."""
    from simulator.run import checkpoint

    sc = _logged_scenario(tracker, run_id, tmp)
    state = checkpoint.latest(run_id)
    return Work(RunPoint({}, sc.seeds[0], sc), run_id, state,
                tracker.client.get_run(run_id).info.run_name)


def _parent_points(tracker: Tracker, parent: str, tmp: Path) -> tuple[list[RunPoint], Scenario]:
    """The points of ``parent`` (its resolved scenario, expanded) and the scenario whose
    runtime runs them."""
    resolved = tracker.client.download_artifacts(parent, "scenario/resolved.yaml", str(tmp))
    return expand(yaml.safe_load(Path(resolved).read_text()))


def _continue_parent(exp: Experiment, parent: str, family: tuple[list[RunPoint], Scenario],
                     pool: _Pool, tmp: Path) -> None:
    """Every point of ``parent`` without a FINISHED child run: resumed where a child run has a
    checkpoint, else run from the start as a new child."""
    points, full = family
    works = exp.plan(points)
    if not works:
        return
    logger.info("resume: %d of %d point(s) of parent run %s left", len(works), len(points),
                parent)
    pool.executor(full, works).run(exp, works, tmp / "parent")
