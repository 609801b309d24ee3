"""Running a loaded scenario: every point into its MLflow child run, one after another on the
ClientWorker pool (``run_loaded``, ``fedray run``) or several at once as single-process Ray
tasks (``run_sweep``, ``fedray sweep``). Both are one ``simulator.run.experiment.Experiment``
with the same callbacks (``simulator.run.callbacks``) and an executor
(``simulator.run.executors``); what they leave unfinished is in their result, or on the
exception they raise (``simulator.run.interrupts.unfinished_of``).
"""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from simulator.config.load import LoadedScenario
from simulator.data.prepare import fetch
from simulator.errors import UsageError
from simulator.log import logger
from simulator.run.callbacks import Callback, default_callbacks
from simulator.run.executors import PoolExecutor, SerialExecutor, TaskExecutor
from simulator.run.experiment import Experiment, ExperimentResult, Work, final_text, summary
from simulator.run.interrupts import trap_sigterm
from simulator.run.layout import Opening, point_key, sweep_key
from simulator.run.tracking import default_uri

if TYPE_CHECKING:
    from simulator.runtime.backend import Backend, BackendChoice

__all__ = ["final_text", "point_key", "run_loaded", "run_sweep", "summary", "sweep_key"]


def run_loaded(
    loaded: LoadedScenario,
    backend_name: str | None = None,
    address: str | None = None,
    tracking_uri: str | None = None,
    quiet: bool = False,
    workers: int | None = None,
    ray_init: dict | None = None,
    callbacks: list[Callback] | None = None,
    progress: bool = True,
) -> ExperimentResult:
    """Run every point of a loaded scenario, one after another, and track it in MLflow;
    ``callbacks`` are added to the defaults (progress unless not ``progress``, checkpoints,
    MLflow).

    Returns the experiment's result: ``parent_run_id``, ``experiment_id``,
    ``tracking_uri``, ``runs`` (``[{run_id, label, values, seed, final_test_accuracy,
    ...}]``) and ``unfinished``.
    """
    from simulator.pinning import require_pinned
    from simulator.runtime.backend import make_backend
    from simulator.sim.engine import prefetch_data
    from simulator.sim.work import backend_for

    require_pinned((p.scenario.runtime.deterministic for p in loaded.points), loaded.scenario.name)
    fetch(loaded)  # downloads and their checks, before any run exists
    sc = loaded.scenario
    uri = tracking_uri or default_uri()
    opening = Opening(uri, sc.name)  # MLflow opens on its own thread while Ray starts
    exp = Experiment(opening, default_callbacks(quiet, progress) + list(callbacks or []), uri,
                     f"parent of {len(loaded.points)} point(s)")
    with exp.running():
        if loaded.points:  # the first point's data loads while Ray starts (or auto probes)
            prefetch_data(loaded.points[0].scenario)
        choice = backend_for([p.scenario for p in loaded.points],
                             backend_name or sc.runtime.backend, address, workers, ray_init)
        backend = make_backend(choice, address, **(ray_init or {}))
        stopping: list[Future[None]] = []

        def stop_backend() -> None:
            """Once the last point's engine is done, Ray shuts down on a thread while that
            point's model and figure are logged: its shutdown is mostly waiting (1.0 of its
            1.2-1.4 s is the autoscaler monitor's exit)."""
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedray-shutdown")
            stopping.append(pool.submit(backend.shutdown))
            pool.shutdown(wait=False)

        try:
            trap_sigterm()
            if opening.tracker.done():  # a store that cannot be used stops it here
                opening.tracker.result()
            with tempfile.TemporaryDirectory(prefix="fedray-") as tmp:
                exp.new_parent(loaded, backend, Path(tmp))
                PoolExecutor(backend, workers).run(exp, [Work(p) for p in loaded.points],
                                                   Path(tmp), stop_backend)
                assert opening.parent is not None
                exp.result.parent_run_id = opening.parent.result()
                exp.result.experiment_id = opening.tracker.result().experiment_id
        finally:
            if stopping:
                stopping[0].result()  # Ray's shutdown is over (its error, if it failed)
            else:
                backend.shutdown()
    return exp.result


def run_sweep(
    loaded: LoadedScenario,
    address: str | None = None,
    tracking_uri: str | None = None,
    parallel: int | None = None,
    fresh: bool = False,
    ray_init: dict | None = None,
    callbacks: list[Callback] | None = None,
) -> ExperimentResult:
    """Run a scenario's points several at a time, each a single-process simulation in a Ray
    task of ``runtime.num_cpus`` CPUs (and a GPU share for a point on a GPU; at most
    ``parallel`` at once, default: the cluster's CPUs); or, where the scenario's
    ``runtime.backend`` is ``inline``, or ``auto`` and the points are estimated to finish
    sooner one after another in this process than on Ray with its start
    (``sweep_backend``), one after another here. Each point logs its rounds as they end and
    checkpoints every ``runtime.checkpoint_every`` rounds, as under ``fedray run``.

    A sweep is resumable: the parent run of an earlier sweep of the same resolved scenario
    is reused, its FINISHED points are not run again, and a point interrupted after a
    checkpoint goes on from it in its own child run (``fresh`` starts a new parent). Points
    that fail are marked FAILED and the others go on.

    Returns the experiment's result: ``parent_run_id``, ``tracking_uri``, ``skipped``
    (labels), ``runs`` (as in ``run_loaded``), ``failed`` (labels) and ``unfinished``.
    """
    from simulator.runtime.backend import InlineBackend, RayBackend

    if parallel is not None and parallel < 1:  # the CLI refuses it; here for the API
        raise UsageError(f"parallel: must be an integer >= 1, got {parallel}")
    fetch(loaded)  # downloads and their checks, before any run exists
    uri = tracking_uri or default_uri()
    opening = Opening(uri, loaded.scenario.name)
    # the default callbacks with plain progress lines: several points run at once
    exp = Experiment(opening, default_callbacks(True) + list(callbacks or []), uri,
                     "sweep parent")
    with exp.running():
        choice = sweep_backend(loaded, address, parallel, ray_init)
        opening.tracker.result()  # before Ray: a store that cannot be used stops it
        serial = choice.name == "inline"
        backend: Backend = InlineBackend(choice.reason) if serial else \
            RayBackend(address, choice.reason, **(ray_init or {}))
        try:
            trap_sigterm()
            with tempfile.TemporaryDirectory(prefix="fedray-") as tmp:
                works = exp.sweep_parent(loaded, backend, Path(tmp), fresh)
                assert opening.parent is not None
                exp.result.parent_run_id = opening.parent.result()
                if serial:
                    _announce(len(loaded.points), exp, works, "here, one after another")
                    SerialExecutor(backend).run(exp, works, Path(tmp))
                else:
                    cap = max(1, min(parallel or backend.default_workers(), len(works) or 1))
                    _announce(len(loaded.points), exp, works, f"{cap} at a time")
                    TaskExecutor(backend, cap).run(exp, works, Path(tmp))
        finally:
            backend.shutdown()
    return exp.result


def sweep_backend(loaded: LoadedScenario, address: str | None, parallel: int | None,
                  ray_init: dict | None) -> BackendChoice:
    """How ``fedray sweep`` runs its points: as Ray tasks, ``parallel`` at a time (``ray``),
    or one after another in this process (``inline``): the scenario's ``runtime.backend``,
    and for ``auto`` the one estimated to finish first (``simulator.sim.work.backend_for``,
    with a point's task in the place of a ClientWorker: ``runtime.workers`` is not a
    sweep's, each point runs in one process)."""
    from simulator.runtime.backend import BackendChoice, cpus_per_worker
    from simulator.sim.work import backend_for

    asked = loaded.scenario.runtime.backend
    # strict points need a pinned process each: a task's (the driver's is not)
    if asked == "ray" or address is not None or \
            any(p.scenario.runtime.strict for p in loaded.points):
        return BackendChoice("ray", "fedray sweep: its points run at once, as Ray tasks")
    cpus = (ray_init or {}).get("num_cpus")
    if parallel is not None:  # the slots the tasks would have
        per = cpus_per_worker([p.scenario.runtime for p in loaded.points])
        cpus = min(float(cpus or os.cpu_count() or 1), parallel * per)
    points = [p.scenario.model_copy(update={"runtime": p.scenario.runtime.model_copy(
        update={"workers": None})}) for p in loaded.points]
    # a task's rounds run in its own process: Ray adds nothing a round (RAY_ROUND_SECONDS
    # is an actor run's calls and transfers), only its start
    choice = backend_for(points, asked, None, None, {"num_cpus": cpus} if cpus else None,
                         round_seconds=0.0)
    if choice.name == "ray":
        return BackendChoice("ray", f"fedray sweep: its points run at once, as Ray tasks "
                                    f"({choice.reason})")
    return BackendChoice("inline", f"fedray sweep: its points one after another in this "
                                   f"process ({choice.reason})")


def _announce(total: int, exp: Experiment, works: list[Work], how: str) -> None:
    going_on = sum(1 for w in works if w.run_id is not None)
    logger.info("sweep: %d points, %d already finished, running %d%s, %s", total,
                len(exp.result.skipped), len(works),
                f" ({going_on} from their checkpoints)" if going_on else "", how)
