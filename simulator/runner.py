"""Running a loaded scenario: every point into its MLflow child run, one after another on the
ClientWorker pool (``run_loaded``) or several at once as single-process Ray tasks
(``run_sweep``), with a list of callbacks around each point (``simulator.callbacks``).

What the process leaves unfinished (a failure, an interrupt) is recorded in
``simulator.interrupts.UNFINISHED`` for the one-line report of the command.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from simulator.callbacks import (
    Callback,
    MLflowArtifacts,
    Opening,
    PointRun,
    default_callbacks,
    open_child,
    open_parent,
    run_tags,
)
from simulator.config import LoadedScenario, RunPoint, Scenario
from simulator.errors import UsageError
from simulator.interrupts import UNFINISHED, end_status, trap_sigterm
from simulator.tracking import Tracker, default_uri


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def point_key(point: RunPoint) -> str:
    """Identity of a run point: a digest of its resolved single-seed scenario."""
    return _digest(point.scenario.model_dump(mode="json"))


def sweep_key(loaded: LoadedScenario) -> str:
    """Identity of a sweep: a digest of the resolved scenario with its sweep and seeds."""
    return _digest(loaded.scenario.model_dump(mode="json"))


def run_point(point: RunPoint, backend: Any, opening: Opening, tmp: Path,
              callbacks: list[Callback], workers: int | None = None,
              engine_done: Callable[[], None] | None = None) -> dict[str, Any]:
    """A new child run of the opening's parent for ``point``, run to its end; the child run
    opens on the opening's thread while the engine starts."""
    child = opening.open_child(point, point_key(point), backend, tmp)
    return execute(PointRun(point, None, None, tmp, opening=child), backend, callbacks, workers,
                   engine_done=engine_done)


def execute(run: PointRun, backend: Any, callbacks: list[Callback], workers: int | None = None,
            resume: dict | None = None, engine_done: Callable[[], None] | None = None
            ) -> dict[str, Any]:
    """Run one point into its child run (from ``resume``, a checkpoint, when given), the
    callbacks around it, then the run's final status. A failure keeps what was computed.
    ``engine_done`` is called when the engine has finished the point, before the callbacks'
    ends (the final model, the figure)."""
    from simulator.engine import make_engine

    point, status, error = run.point, "FAILED", None
    run.rows = list(resume["metrics"]) if resume else []

    def on_round(r: int, m: dict[str, float]) -> None:
        run.rows.append(m)
        for cb in callbacks:
            cb.on_round(run, r, m)

    def on_checkpoint(r: int, state: dict[str, Any]) -> None:
        for cb in callbacks:
            cb.on_checkpoint(run, r, state)

    result = None
    try:
        engine = make_engine(point.scenario, backend, workers)
        result = engine.run(on_round, on_checkpoint, resume)
        status = "FINISHED"
        if engine_done is not None:
            engine_done()
        return {**summary(run.run_id, point, result), "workers": engine.n_workers}
    except BaseException as e:
        error = e
        raise
    finally:
        status = end_status(status, error)
        run.opening.result()  # a store that could not be used: no MLflow run to end, its error
        _close(run, callbacks, result, status)


def _close(run: PointRun, callbacks: list[Callback], result: Any, status: str) -> None:
    """The callbacks' ends, then the run's final status (FAILED if an end failed)."""
    try:
        for cb in callbacks:
            cb.on_end(run, result if status == "FINISHED" else None, status)
    except BaseException as e:  # an end that failed fails the run; Ctrl-C there kills it
        status = end_status("FAILED", e) if status == "FINISHED" else status
        raise
    finally:
        run.tracker.end(run.run_id, status)
        if status != "FINISHED":
            UNFINISHED.append((run.run_id, run.point.label, status))


def run_loaded(
    loaded: LoadedScenario,
    backend_name: str | None = None,
    address: str | None = None,
    tracking_uri: str | None = None,
    quiet: bool = False,
    workers: int | None = None,
    ray_init: dict | None = None,
    callbacks: list[Callback] | None = None,
) -> dict[str, Any]:
    """Run every point of a loaded scenario, one after another, and track it in MLflow;
    ``callbacks`` are added to the defaults (progress, checkpoints, MLflow).

    Returns ``{"parent_run_id", "experiment_id", "tracking_uri", "runs": [{run_id, label,
    values, seed, final_test_accuracy}]}``.
    """
    from simulator.runtime.backend import make_backend

    sc = loaded.scenario
    uri = tracking_uri or default_uri()
    opening = Opening(uri, sc.name)  # MLflow opens on its own thread while Ray starts
    status, parent, error = "FAILED", None, None
    stopping: Future[None] | None = None
    try:
        backend = make_backend(backend_name or sc.runtime.backend, address, **(ray_init or {}))

        def stop_backend() -> None:
            """Once the last point's engine is done, Ray shuts down on a thread while that
            point's model and figure are logged: its shutdown is mostly waiting (1.0 of its
            1.2-1.4 s is the autoscaler monitor's exit)."""
            nonlocal stopping
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedray-shutdown")
            stopping = pool.submit(backend.shutdown)
            pool.shutdown(wait=False)

        try:
            trap_sigterm()
            if opening.tracker.done():  # a store that cannot be used stops it here
                opening.tracker.result()
            cbs = default_callbacks(quiet) + list(callbacks or [])
            with tempfile.TemporaryDirectory(prefix="fedray-") as tmp:
                opening.open_parent(loaded, backend, Path(tmp))
                last = len(loaded.points) - 1
                runs = [run_point(point, backend, opening, Path(tmp) / str(i), cbs, workers,
                                  stop_backend if i == last else None)
                        for i, point in enumerate(loaded.points)]
                parent = opening.parent.result() if opening.parent else None
            status = "FINISHED"
            return {"parent_run_id": parent, "experiment_id": opening.tracker.result().experiment_id,
                    "tracking_uri": uri, "runs": runs}
        finally:
            if stopping is None:
                backend.shutdown()
            else:
                stopping.result()  # Ray's shutdown is over (its error, if it failed)
    except BaseException as e:
        error = e
        raise
    finally:
        if opening.parent is not None and opening.parent.exception() is None:
            parent = opening.parent.result()
            status = end_status(status, error)
            opening.tracker.result().end(parent, status)
            if status != "FINISHED":
                UNFINISHED.append((parent, f"parent of {len(loaded.points)} point(s)", status))
        opening.close()


# --------------------------------------------------------------------------- sweeps


def _simulate(scenario: Scenario, label: str = "") -> Any:
    """One point as a single-process simulation (the inline backend): a Ray task of a sweep.
    Its progress lines (about ten per point, with elapsed time and time left) reach the
    driver's terminal through Ray's log forwarding."""
    from simulator.engine import make_engine
    from simulator.progress import Progress
    from simulator.runtime.backend import InlineBackend

    bar = Progress(label, scenario.rounds, quiet=True, stream=sys.stderr) if label else None
    return make_engine(scenario, InlineBackend()).run(
        (lambda r, m: bar.update(r, m)) if bar is not None else None)


def _task_resources(sc: Scenario, gpus: float, parallel: int) -> dict[str, float]:
    """A sweep point's Ray task: ``runtime.num_cpus`` CPUs and, for a point on a GPU, its
    ``num_gpus`` or the cluster's GPUs shared out among the points run at once."""
    from simulator.runtime.backend import gpu_share

    rt = sc.runtime
    share = gpu_share(rt.num_gpus, rt.device != "cpu" or rt.server_device != "cpu", gpus,
                      parallel)
    return {"num_cpus": rt.num_cpus, **({"num_gpus": share} if share > 0 else {})}


def _sweep_parent(loaded: LoadedScenario, backend: Any, tracker: Tracker, tmp: Path,
                  fresh: bool) -> tuple[str, set[str]]:
    """(parent run, keys of its FINISHED points): the last sweep of the same resolved
    scenario, reopened (children a dead driver left RUNNING are marked KILLED), or a new one."""
    key = sweep_key(loaded)
    parent = None if fresh else tracker.find_run({"fedray.sweep_key": key, "fedray.kind": "scenario"})
    done: set[str] = set()
    if parent is None:
        return open_parent(loaded, run_tags(backend), tracker, tmp,
                           {"fedray.sweep_key": key}), done
    tracker.reopen(parent)
    for child in tracker.children(parent):
        if child.info.status == "FINISHED":
            done.add(child.data.tags.get("fedray.point_key", ""))
        elif child.info.status == "RUNNING":  # left by a driver that died
            tracker.end(child.info.run_id, "KILLED")
    return parent, done


def _collect(ray: Any, ref: Any, point: RunPoint, run_id: str, tracker: Tracker, tmp: Path,
             callbacks: list[Callback], out: dict[str, Any], total: int) -> None:
    """A finished sweep task into its run: the history, the callbacks' ``on_end``, the
    status; a failed one is marked FAILED and named in ``out["failed"]``."""
    try:
        result = ray.get(ref)
    except Exception as e:  # noqa: BLE001 - one failed point does not stop the sweep
        cause = getattr(e, "cause", None) or e  # a RayTaskError wraps the real error
        text = (str(cause).strip().splitlines() or [""])[-1]
        print(f"{point.label}: FAILED ({type(cause).__name__}: {text})", file=sys.stderr)
        tracker.end(run_id, "FAILED")
        out["failed"].append(point.label)
        return
    tracker.log_history(run_id, result.metrics)
    run = PointRun(point, run_id, tracker, tmp / run_id, rows=result.metrics)
    for cb in callbacks:
        cb.on_end(run, result, "FINISHED")
    tracker.end(run_id, "FINISHED")
    done = summary(run_id, point, result)
    out["runs"].append(done)
    print(f"{point.label}: {final_text(done)}  (run {run_id}; "
          f"{len(out['runs']) + len(out['failed'])}/{total})", file=sys.stderr)


def summary(run_id: str, point: RunPoint, result: Any) -> dict[str, Any]:
    """A finished point as the commands return and print it."""
    return {"run_id": run_id, "label": point.label, "values": point.values,
            "seed": point.seed, "final_test_accuracy": result.final("test_accuracy"),
            "final_test_loss": result.final("test_loss"), "rounds": len(result.metrics),
            "skipped_rounds": int(sum(row.get("aggregation_skipped", 0.0)
                                      for row in result.metrics))}


def final_text(run: dict[str, Any]) -> str:
    """A finished run's headline: its final test accuracy, or its final test loss for a
    task without accuracy (regression); and how many rounds skipped their aggregation (the
    model stayed), when any did."""
    acc = run["final_test_accuracy"]
    text = (f"final test loss {run['final_test_loss']:.4f}" if math.isnan(acc) else
            f"final test accuracy {acc:.4f}")
    if run.get("skipped_rounds"):
        text += (f"; aggregation skipped in {run['skipped_rounds']} of {run['rounds']} "
                 "rounds")
    return text


def run_sweep(
    loaded: LoadedScenario,
    address: str | None = None,
    tracking_uri: str | None = None,
    parallel: int | None = None,
    fresh: bool = False,
    ray_init: dict | None = None,
    callbacks: list[Callback] | None = None,
) -> dict[str, Any]:
    """Run a scenario's points several at a time, each a single-process simulation in a Ray
    task of ``runtime.num_cpus`` CPUs (and a GPU share for a point on a GPU; at most
    ``parallel`` at once, default: the cluster's CPUs), and resume: the parent run of an earlier sweep of the same resolved scenario is reused and its
    FINISHED points are not run again (``fresh`` starts a new parent). Points that fail are
    marked FAILED and the others go on. Each finished point's history is logged at once,
    then its artifacts; ``callbacks``' ``on_end`` follow.

    Returns ``{"parent_run_id", "tracking_uri", "skipped": [labels], "runs": [...],
    "failed": [labels]}``; each run as in ``run_loaded``.
    """
    from simulator.runtime.backend import RayBackend

    if parallel is not None and parallel < 1:  # the CLI refuses it; here for the API
        raise UsageError(f"parallel: must be an integer >= 1, got {parallel}")
    uri = tracking_uri or default_uri()
    tracker = Tracker(uri, loaded.scenario.name)  # before Ray: a store that cannot be used stops it
    backend = RayBackend(address, **(ray_init or {}))
    trap_sigterm()
    ray = backend.ray
    cbs = [MLflowArtifacts(), *(callbacks or [])]
    out: dict[str, Any] = {"tracking_uri": uri, "skipped": [], "runs": [], "failed": []}
    pending: dict[Any, tuple[RunPoint, str]] = {}
    collecting: tuple[RunPoint, str] | None = None  # a finished task being logged
    parent, status = None, ""
    try:
        with tempfile.TemporaryDirectory(prefix="fedray-") as tmp:
            parent, done = _sweep_parent(loaded, backend, tracker, Path(tmp), fresh)
            out["parent_run_id"] = parent
            out["skipped"] = [p.label for p in loaded.points if point_key(p) in done]
            todo = [p for p in loaded.points if point_key(p) not in done]
            cap = max(1, min(parallel or backend.default_workers(), len(todo) or 1))
            remote = ray.remote(num_cpus=1, max_retries=1)(_simulate)
            print(f"sweep: {len(loaded.points)} points, {len(out['skipped'])} already finished, "
                  f"running {len(todo)}, {cap} at a time", file=sys.stderr)
            queue = list(todo)
            while queue or pending:
                while queue and len(pending) < cap:
                    point = queue.pop(0)
                    run_id = open_child(point, point_key(point), run_tags(backend), tracker, parent,
                                        Path(tmp) / "open")
                    task = remote.options(**_task_resources(point.scenario, backend.gpus(), cap))
                    pending[task.remote(point.scenario, point.label)] = (point, run_id)
                ready, _ = ray.wait(list(pending), num_returns=1)
                collecting = pending.pop(ready[0])
                _collect(ray, ready[0], *collecting, tracker, Path(tmp), cbs, out, len(todo))
                collecting = None
        return out
    except KeyboardInterrupt:
        logged = {r["run_id"] for r in out["runs"]}
        # the points in flight, and one whose result was being logged (its model, figure and
        # status take a second or two): not FINISHED, so the next sweep runs it again
        for point, run_id in [*pending.values(), *([collecting] if collecting else [])]:
            if run_id not in logged:
                tracker.end(run_id, "KILLED")
                UNFINISHED.append((run_id, point.label, "KILLED"))
        status = "KILLED"
        raise
    finally:
        if parent is not None:
            if status != "KILLED":
                status = "FAILED" if out["failed"] or len(out["runs"]) + len(out["skipped"]) \
                    < len(loaded.points) else "FINISHED"
            tracker.end(parent, status)
            if status != "FINISHED":
                UNFINISHED.append((parent, "sweep parent", status))
        backend.shutdown()
