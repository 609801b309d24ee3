"""``fedray resume``: an interrupted run continues in the same MLflow runs, from the newest
checkpoint of each point, then the points of its parent that never finished."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from simulator.callbacks import Callback, Opening, PointRun, default_callbacks
from simulator.config import RunPoint, Scenario, expand
from simulator.errors import FedrayError
from simulator.interrupts import UNFINISHED, end_status, trap_sigterm
from simulator.metric_names import mlflow_name
from simulator.runner import execute, point_key, run_point
from simulator.tracking import Tracker, default_uri, journaled_steps, sync


class ResumeRefused(FedrayError):
    """``fedray resume`` of a run that cannot be resumed."""


def resume_run(run_id: str, tracking_uri: str | None = None, backend_name: str | None = None,
               address: str | None = None, quiet: bool = False, workers: int | None = None,
               ray_init: dict | None = None, callbacks: list[Callback] | None = None
               ) -> dict[str, Any]:
    """Continue an interrupted ``fedray run`` in the same MLflow runs. ``run_id`` is a point
    (a child run): it goes on from its newest checkpoint in ``.fedray/checkpoints/`` (from
    round 0 without one) with the resolved scenario it logged when it started; then every
    point of its parent that has not FINISHED is run (resumed from its checkpoint, or from the
    start), and the parent is marked FINISHED. ``run_id`` may also be the parent itself.

    The run's own journal (``.fedray/pending``) is sent first, so that every round is logged
    exactly once: rounds MLflow or the journal already hold are not logged again (their
    values are the same: every draw is derived from the seed). A FINISHED run is refused."""
    from simulator.runtime.backend import make_backend

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
    cbs = default_callbacks(quiet) + list(callbacks or [])
    backend = None
    out: dict[str, Any] = {"runs": []}
    try:
        with tempfile.TemporaryDirectory(prefix="fedray-") as tmp:
            if kind == "point":
                backend = make_backend(
                    backend_name or _logged_scenario(tracker, run_id, Path(tmp)).runtime.backend,
                    address, **(ray_init or {}))
                trap_sigterm()
                out["runs"].append(_resume_point(run_id, tracker, backend, Path(tmp), cbs,
                                                 workers))
            if parent:
                tracker.reopen(parent)
                status, error = "FAILED", None
                try:
                    out["runs"] += _continue_parent(parent, tracker, backend, Path(tmp), cbs,
                                                    workers)
                    status = "FINISHED"
                except BaseException as e:
                    error = e
                    raise
                finally:
                    status = end_status(status, error)
                    tracker.end(parent, status)
                    if status != "FINISHED":
                        UNFINISHED.append((parent, "parent", status))
    finally:
        if backend is not None:
            backend.shutdown()
    return out


def _logged_scenario(tracker: Tracker, run_id: str, tmp: Path, name: str = "scenario.yaml"
                     ) -> Scenario:
    """The resolved scenario a run logged as an artifact."""
    local = tracker.client.download_artifacts(run_id, name, str(tmp / run_id))
    return Scenario.model_validate(yaml.safe_load(Path(local).read_text()))


def _resume_point(run_id: str, tracker: Tracker, backend: Any, tmp: Path,
                  callbacks: list[Callback], workers: int | None) -> dict[str, Any]:
    """One point run from its newest checkpoint, in its own MLflow run."""
    from simulator import checkpoint

    run = tracker.client.get_run(run_id)
    sc = _logged_scenario(tracker, run_id, tmp)
    state = checkpoint.latest(run_id)
    logged = {m.step for m in tracker.client.get_metric_history(run_id, mlflow_name("sampled"))} \
        or {m.step for m in tracker.client.get_metric_history(run_id,
                                                               mlflow_name("byzantine_peers"))}
    logged |= journaled_steps(run_id)  # still in the journal: `fedray sync` sends them
    start = state["round"] + 1 if state else 0
    print(f"resuming {run.info.run_name} ({run_id}) at round {start + 1}/{sc.rounds}"
          + ("" if state else " (no checkpoint: from the start)"), file=sys.stderr)
    tracker.reopen(run_id)
    # rounds the checkpoint holds that never reached MLflow (queued when the driver died)
    for r, row in enumerate(state["metrics"] if state else []):
        if r not in logged:
            tracker.log_round(run_id, r, row)
            logged.add(r)
    point = PointRun(RunPoint({}, sc.seeds[0], sc), run_id, tracker, tmp / "out", logged)
    out = execute(point, backend, callbacks, workers, state)
    out["label"] = run.info.run_name
    return out


def _continue_parent(parent: str, tracker: Tracker, backend: Any, tmp: Path,
                     callbacks: list[Callback], workers: int | None) -> list[dict[str, Any]]:
    """Every point of ``parent`` without a FINISHED child run: resumed where a child run has a
    checkpoint, else run from the start as a new child (on ``backend``, or on one made from
    the scenario's runtime when None)."""
    from simulator import checkpoint
    from simulator.runtime.backend import make_backend

    resolved = tracker.client.download_artifacts(parent, "scenario/resolved.yaml", str(tmp))
    points, full = expand(yaml.safe_load(Path(resolved).read_text()))
    children = tracker.children(parent)
    finished = {c.data.tags.get("fedray.point_key") for c in children
                if c.info.status == "FINISHED"}
    partial = {c.data.tags.get("fedray.point_key"): c.info.run_id for c in children
               if c.info.status != "FINISHED" and checkpoint.latest(c.info.run_id) is not None}
    todo = [p for p in points if point_key(p) not in finished]
    out: list[dict[str, Any]] = []
    if not todo:
        return out
    print(f"resume: {len(todo)} of {len(points)} point(s) of parent run {parent} left",
          file=sys.stderr)
    owned = backend is None
    if owned:
        backend = make_backend(full.runtime.backend)
        trap_sigterm()
    opening = Opening.existing(tracker, parent)
    try:
        for i, point in enumerate(todo):
            key = point_key(point)
            if key in partial:
                out.append(_resume_point(partial[key], tracker, backend, tmp / f"r{i}",
                                         callbacks, workers))
            else:
                out.append(run_point(point, backend, opening, tmp / f"p{i}", callbacks, workers))
    finally:
        opening.close()
        if owned:
            backend.shutdown()
    return out
