"""``fedray``: run | sweep | resume | sync | report | privacy compare | validate | list | ui."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import yaml

import simulator
from simulator import registry
from simulator.data.datasets import DataError
from simulator.errors import (
    ClientStateLost,
    FedrayError,
    Terminated,
    UsageError,
    WorkerLost,
)
from simulator.scenario import LoadedScenario, RunPoint, ScenarioError, load

EXIT_INVALID = 2

# Runs this process ended without finishing them: (run_id, label, status), for the one-line
# report of a failure or an interrupt.
UNFINISHED: list[tuple[str, str, str]] = []


_SIGNALS: list[int] = []  # the signals received (Ray's get re-raises a bare KeyboardInterrupt)


def _raise_terminated(signum: int, frame: Any) -> None:
    _SIGNALS.append(signum)
    raise Terminated(signum)


def trap_sigterm() -> None:
    """SIGTERM ends a run like Ctrl-C: runs marked KILLED, the resume command printed. Called
    again after ray.init, which installs its own SIGTERM handler. Only the main thread can."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


def _end_status(status: str, error: BaseException | None) -> str:
    return "KILLED" if isinstance(error, KeyboardInterrupt) else status


def _tags(sc: Any, backend: Any) -> dict[str, str]:
    return {
        "aggregator": sc.aggregator["name"],
        "preaggregators": ",".join(p["name"] for p in sc.preaggregators) or "none",
        "meta": sc.meta["name"] if sc.meta else "none",
        "attack": sc.attack["name"] if sc.attack else "none",
        "topology": sc.topology["name"] if sc.topology else "none",
        "n": str(sc.clients.total),
        "f": str(sc.clients.byzantine),
        "dataset": sc.data.dataset["name"],
        "model": sc.model["name"],
        "fedray.version": simulator.__version__,
        "mlflow.source.git.commit": _commit(),
        "backend": backend.name,
        "ray_nodes": str(backend.num_nodes()),
    }


_COMMIT: list[str] = []


def _commit() -> str:
    from simulator.tracking import git_commit

    if not _COMMIT:
        _COMMIT.append(git_commit())
    return _COMMIT[0]


def sweep_param(key: str) -> str:
    """The MLflow param name of a sweep key (names cannot hold commas: the paths of a zipped
    key are joined with ' / ')."""
    return "sweep." + " / ".join(part.strip() for part in key.split(","))


def _open_parent(loaded: LoadedScenario, backend: Any, tracker: Any, tmp: Path,
                 final_tags: dict[str, str] | None = None) -> str:
    """The parent run of a scenario: tags, the resolved scenario as params, the scenario file
    as given and resolved as artifacts; ``final_tags`` are set last, once all that is logged
    (a sweep finds its parent by them). A failure marks the run FAILED and is raised."""
    from simulator.tracking import flatten

    sc = loaded.scenario
    parent = tracker.create_run(sc.name, {**_tags(sc, backend), "fedray.kind": "scenario",
                                          "sweep": ",".join(sc.sweep) or "none"},
                                description=sc.description)
    try:
        tracker.log_params(parent, flatten(sc.model_dump(mode="json", exclude={"sweep"})) |
                           {sweep_param(k): yaml.safe_dump(v, default_flow_style=True).strip()
                            for k, v in sc.sweep.items()})
        given = tmp / "given" / loaded.path.name
        given.parent.mkdir(parents=True, exist_ok=True)
        given.write_text(loaded.text)
        tracker.log_artifact(parent, given, "scenario")
        resolved = tmp / "resolved.yaml"
        resolved.write_text(yaml.safe_dump(sc.model_dump(mode="json"), sort_keys=False))
        tracker.log_artifact(parent, resolved, "scenario")
        for k, v in (final_tags or {}).items():
            tracker.client.set_tag(parent, k, v)
    except BaseException:
        tracker.end(parent, "FAILED")
        raise
    return parent


def run_loaded(
    loaded: LoadedScenario,
    backend_name: str | None = None,
    address: str | None = None,
    tracking_uri: str | None = None,
    quiet: bool = False,
    workers: int | None = None,
    ray_init: dict | None = None,
) -> dict[str, Any]:
    """Run every point of a loaded scenario, one after another, and track it in MLflow.

    Returns ``{"parent_run_id", "experiment_id", "tracking_uri", "runs": [{run_id, label,
    values, seed, final_test_accuracy}]}``.
    """
    from simulator.runtime.backend import make_backend
    from simulator.tracking import Tracker, default_uri

    sc = loaded.scenario
    uri = tracking_uri or default_uri()
    tracker = Tracker(uri, sc.name)  # before Ray: a store that cannot be used stops it here
    backend = make_backend(backend_name or sc.runtime.backend, address, **(ray_init or {}))
    trap_sigterm()
    status, parent, error = "FAILED", None, None
    try:
        with tempfile.TemporaryDirectory(prefix="fedray-") as tmp:
            parent = _open_parent(loaded, backend, tracker, Path(tmp))
            out: dict[str, Any] = {"parent_run_id": parent, "experiment_id": tracker.experiment_id,
                                   "tracking_uri": uri, "runs": []}
            for i, point in enumerate(loaded.points):
                out["runs"].append(_run_point(point, backend, tracker, parent, Path(tmp) / str(i),
                                              quiet, workers))
        status = "FINISHED"
        return out
    except BaseException as e:
        error = e
        raise
    finally:
        if parent is not None:
            status = _end_status(status, error)
            tracker.end(parent, status)
            if status != "FINISHED":
                UNFINISHED.append((parent, f"parent of {len(loaded.points)} point(s)", status))
        backend.shutdown()


def _open_child(point: RunPoint, backend: Any, tracker: Any, parent: str, tmp: Path) -> str:
    """A point's child run: tags, params and, from the start, the resolved scenario as the
    ``scenario.yaml`` artifact (what ``fedray resume`` rebuilds the run from)."""
    from simulator.tracking import flatten

    sc = point.scenario
    desc = sc.description + (f"\n\nSweep point: {point.values}" if point.values else "") + \
        f"\nSeed: {point.seed}"
    run_id = tracker.create_run(point.label, {**_tags(sc, backend), "seed": str(point.seed),
                                              "fedray.kind": "point",
                                              "fedray.point_key": point_key(point)},
                                parent_id=parent, description=desc.strip())
    tracker.log_params(run_id, flatten(sc.model_dump(mode="json", exclude={"sweep"})))
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "scenario.yaml").write_text(yaml.safe_dump(sc.model_dump(mode="json"), sort_keys=False))
    tracker.log_artifact(run_id, tmp / "scenario.yaml")
    return run_id


def _log_result(run_id: str, result: Any, tracker: Any, tmp: Path, label: str = "") -> None:
    """A finished point's artifacts: metrics.parquet, its curves (a PNG the MLflow UI shows)
    and the final model."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from dashboards.figures import run_figure
    from simulator.tracking import write_metrics

    tmp.mkdir(parents=True, exist_ok=True)
    tracker.log_artifact(run_id, write_metrics(result.metrics, tmp / "metrics.parquet"))
    if run_figure(result.metrics, tmp / "curves.png", label) is not None:
        tracker.log_artifact(run_id, tmp / "curves.png", "figures")
    for name, columns in result.tables.items():  # privacy profile, trade-off curve
        pq.write_table(pa.table(columns), tmp / f"{name}.parquet")
        tracker.log_artifact(run_id, tmp / f"{name}.parquet", "privacy")
    torch.save(result.model_state, tmp / "model.pt")
    tracker.log_artifact(run_id, tmp / "model.pt", "model")
    if result.params:
        tracker.log_params(run_id, result.params)


def _run_point(point: RunPoint, backend, tracker, parent, tmp: Path, quiet, workers) -> dict[str, Any]:
    run_id = _open_child(point, backend, tracker, parent, tmp)
    return _execute(point, run_id, backend, tracker, tmp, quiet, workers)


def _execute(point: RunPoint, run_id: str, backend: Any, tracker: Any, tmp: Path, quiet: bool,
             workers: int | None, resume: dict | None = None,
             logged: set[int] | None = None) -> dict[str, Any]:
    """Run one point into its child run: per-round metrics (rounds not in ``logged``: MLflow
    or the journal hold those already), checkpoints every ``runtime.checkpoint_every``
    rounds, the artifacts, the final status. A failure keeps what was computed."""
    from simulator import checkpoint
    from simulator.engine import make_engine
    from simulator.progress import Progress
    from simulator.tracking import write_metrics

    sc = point.scenario
    progress = Progress(point.label, sc.rounds, quiet)
    status, error = "FAILED", None
    rows: list[dict[str, float]] = list(resume["metrics"]) if resume else []

    def on_round(r: int, m: dict[str, float]) -> None:
        rows.append(m)
        if r not in (logged or ()):
            tracker.log_round(run_id, r, m)
        progress.update(r, m)

    try:
        engine = make_engine(sc, backend, workers)
        result = engine.run(on_round, lambda r, state: checkpoint.save(run_id, r, state), resume)
        _log_result(run_id, result, tracker, tmp, point.label)
        status = "FINISHED"
        checkpoint.remove(run_id)
        return {"run_id": run_id, "label": point.label, "values": point.values, "seed": point.seed,
                "final_test_accuracy": result.final("test_accuracy"), "workers": engine.n_workers}
    except BaseException as e:
        error = e
        raise
    finally:
        status = _end_status(status, error)
        if status != "FINISHED" and rows:  # keep what was computed
            try:
                tmp.mkdir(parents=True, exist_ok=True)
                tracker.log_artifact(run_id, write_metrics(rows, tmp / "metrics.parquet"))
            except OSError as e:  # a local file could not be written; the status still is
                print(f"warning: could not write metrics.parquet for run {run_id}: {e}",
                      file=sys.stderr)
        tracker.end(run_id, status)
        if status != "FINISHED":
            UNFINISHED.append((run_id, point.label, status))


def resume_run(run_id: str, tracking_uri: str | None = None, backend_name: str | None = None,
               address: str | None = None, quiet: bool = False, workers: int | None = None,
               ray_init: dict | None = None) -> dict[str, Any]:
    """Continue an interrupted ``fedray run`` in the same MLflow runs. ``run_id`` is a point
    (a child run): it goes on from its newest checkpoint in ``.fedray/checkpoints/`` (from
    round 0 without one) with the resolved scenario it logged when it started; then every
    point of its parent that has not FINISHED is run (resumed from its checkpoint, or from the
    start), and the parent is marked FINISHED. ``run_id`` may also be the parent itself.

    The run's own journal (``.fedray/pending``) is sent first, so that every round is logged
    exactly once: rounds MLflow or the journal already hold are not logged again (their
    values are the same: every draw is derived from the seed). A FINISHED run is refused."""
    from simulator.runtime.backend import make_backend
    from simulator.tracking import Tracker, default_uri, sync

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
    backend = None
    out: dict[str, Any] = {"runs": []}
    try:
        with tempfile.TemporaryDirectory(prefix="fedray-") as tmp:
            if kind == "point":
                backend = make_backend(
                    backend_name or _logged_scenario(tracker, run_id, Path(tmp)).runtime.backend,
                    address, **(ray_init or {}))
                trap_sigterm()
                out["runs"].append(_resume_point(run_id, tracker, backend, Path(tmp), quiet,
                                                 workers))
            if parent:
                tracker.reopen(parent)
                status, error = "FAILED", None
                try:
                    out["runs"] += _continue_parent(parent, tracker, lambda: backend, Path(tmp),
                                                    quiet, workers)
                    status = "FINISHED"
                except BaseException as e:
                    error = e
                    raise
                finally:
                    status = _end_status(status, error)
                    tracker.end(parent, status)
                    if status != "FINISHED":
                        UNFINISHED.append((parent, "parent", status))
    finally:
        if backend is not None:
            backend.shutdown()
    return out


class ResumeRefused(FedrayError):
    """``fedray resume`` of a run that cannot be resumed."""


def _logged_scenario(tracker: Any, run_id: str, tmp: Path, name: str = "scenario.yaml") -> Any:
    """The resolved scenario a run logged as an artifact."""
    from simulator.scenario import Scenario

    local = tracker.client.download_artifacts(run_id, name, str(tmp / run_id))
    return Scenario.model_validate(yaml.safe_load(Path(local).read_text()))


def _resume_point(run_id: str, tracker: Any, backend: Any, tmp: Path, quiet: bool,
                  workers: int | None) -> dict[str, Any]:
    """One point run from its newest checkpoint, in its own MLflow run."""
    from simulator import checkpoint
    from simulator.tracking import journaled_steps

    run = tracker.client.get_run(run_id)
    sc = _logged_scenario(tracker, run_id, tmp)
    state = checkpoint.latest(run_id)
    logged = {m.step for m in tracker.client.get_metric_history(run_id, "sampled")} or \
        {m.step for m in tracker.client.get_metric_history(run_id, "byzantine_peers")}
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
    out = _execute(RunPoint({}, sc.seeds[0], sc), run_id, backend, tracker, tmp / "out", quiet,
                   workers, state, logged)
    out["label"] = run.info.run_name
    return out


def _continue_parent(parent: str, tracker: Any, get_backend: Any, tmp: Path, quiet: bool,
                     workers: int | None) -> list[dict[str, Any]]:
    """Every point of ``parent`` without a FINISHED child run: resumed where a child run has a
    checkpoint, else run from the start as a new child."""
    from simulator import checkpoint
    from simulator.runtime.backend import make_backend
    from simulator.scenario import expand

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
    backend = get_backend()
    owned = backend is None
    if owned:
        backend = make_backend(full.runtime.backend)
        trap_sigterm()
    try:
        for i, point in enumerate(todo):
            key = point_key(point)
            if key in partial:
                out.append(_resume_point(partial[key], tracker, backend, tmp / f"r{i}", quiet,
                                         workers))
            else:
                out.append(_run_point(point, backend, tracker, parent, tmp / f"p{i}", quiet,
                                      workers))
    finally:
        if owned:
            backend.shutdown()
    return out


# --------------------------------------------------------------------------- sweeps


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def point_key(point: RunPoint) -> str:
    """Identity of a run point: a digest of its resolved single-seed scenario."""
    return _digest(point.scenario.model_dump(mode="json"))


def sweep_key(loaded: LoadedScenario) -> str:
    """Identity of a sweep: a digest of the resolved scenario with its sweep and seeds."""
    return _digest(loaded.scenario.model_dump(mode="json"))


def _simulate(scenario: dict) -> Any:
    """One point as a single-process simulation (the inline backend): a Ray task of a sweep."""
    from simulator.engine import make_engine
    from simulator.runtime.backend import InlineBackend
    from simulator.scenario import Scenario

    return make_engine(Scenario.model_validate(scenario), InlineBackend()).run()


def run_sweep(
    loaded: LoadedScenario,
    address: str | None = None,
    tracking_uri: str | None = None,
    parallel: int | None = None,
    fresh: bool = False,
    ray_init: dict | None = None,
) -> dict[str, Any]:
    """Run a scenario's points several at a time, each a single-process simulation in a Ray
    task of one CPU (at most ``parallel`` at once, default: the cluster's CPUs), and resume:
    the parent run of an earlier sweep of the same resolved scenario is reused and its
    FINISHED points are not run again (``fresh`` starts a new parent). Points that fail are
    marked FAILED and the others go on.

    Returns ``{"parent_run_id", "tracking_uri", "skipped": [labels], "runs": [...],
    "failed": [labels]}``; each run as in ``run_loaded``.
    """
    from simulator.runtime.backend import RayBackend
    from simulator.tracking import Tracker, default_uri

    sc = loaded.scenario
    uri = tracking_uri or default_uri()
    tracker = Tracker(uri, sc.name)  # before Ray: a store that cannot be used stops it here
    backend = RayBackend(address, **(ray_init or {}))
    trap_sigterm()
    ray = backend.ray
    key = sweep_key(loaded)
    out: dict[str, Any] = {"tracking_uri": uri, "skipped": [], "runs": [], "failed": []}
    parent = None if fresh else tracker.find_run({"fedray.sweep_key": key, "fedray.kind": "scenario"})
    pending: dict[Any, tuple[RunPoint, str]] = {}
    status = ""
    try:
        with tempfile.TemporaryDirectory(prefix="fedray-") as tmp:
            done: set[str] = set()
            if parent is None:
                parent = _open_parent(loaded, backend, tracker, Path(tmp),
                                      {"fedray.sweep_key": key})
            else:
                tracker.reopen(parent)
                for child in tracker.children(parent):
                    if child.info.status == "FINISHED":
                        done.add(child.data.tags.get("fedray.point_key", ""))
                    elif child.info.status == "RUNNING":  # left by a driver that died
                        tracker.end(child.info.run_id, "KILLED")
            out["parent_run_id"] = parent
            todo = []
            for point in loaded.points:
                if point_key(point) in done:
                    out["skipped"].append(point.label)
                else:
                    todo.append(point)
            cap = max(1, min(parallel or backend.default_workers(), len(todo) or 1))
            remote = ray.remote(num_cpus=1, max_retries=1)(_simulate)
            queue = list(enumerate(todo))
            print(f"sweep: {len(loaded.points)} points, {len(out['skipped'])} already finished, "
                  f"running {len(todo)}, {cap} at a time", file=sys.stderr)
            while queue or pending:
                while queue and len(pending) < cap:
                    _, point = queue.pop(0)
                    run_id = _open_child(point, backend, tracker, parent, Path(tmp) / "open")
                    ref = remote.remote(point.scenario.model_dump(mode="json"))
                    pending[ref] = (point, run_id)
                ready, _ = ray.wait(list(pending), num_returns=1)
                point, run_id = pending.pop(ready[0])
                try:
                    result = ray.get(ready[0])
                except Exception as e:  # noqa: BLE001 - one failed point does not stop the sweep
                    cause = getattr(e, "cause", None) or e  # a RayTaskError wraps the real error
                    text = (str(cause).strip().splitlines() or [""])[-1]
                    print(f"{point.label}: FAILED ({type(cause).__name__}: {text})", file=sys.stderr)
                    tracker.end(run_id, "FAILED")
                    out["failed"].append(point.label)
                    continue
                tracker.log_history(run_id, result.metrics)
                _log_result(run_id, result, tracker, Path(tmp) / run_id, point.label)
                tracker.end(run_id, "FINISHED")
                acc = result.final("test_accuracy")
                out["runs"].append({"run_id": run_id, "label": point.label, "values": point.values,
                                    "seed": point.seed, "final_test_accuracy": acc})
                print(f"{point.label}: final test accuracy {acc:.4f}  (run {run_id}; "
                      f"{len(out['runs']) + len(out['failed'])}/{len(todo)})", file=sys.stderr)
        return out
    except KeyboardInterrupt:
        for point, run_id in pending.values():  # the points in flight
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


# --------------------------------------------------------------------------- commands


def cmd_run(args: argparse.Namespace) -> int:
    try:
        loaded = load(args.scenario, args.set)
    except ScenarioError as e:
        print("\n".join(e.lines), file=sys.stderr)
        return EXIT_INVALID
    out = run_loaded(loaded, args.backend, args.address, args.tracking_uri, args.quiet, args.workers)
    for r in out["runs"]:
        print(f"{r['label']}: final test accuracy {r['final_test_accuracy']:.4f}  (run {r['run_id']})")
    print(f"MLflow parent run: {out['parent_run_id']}  experiment: {loaded.scenario.name}")
    print(f"tracking URI: {out['tracking_uri']}")
    ui = "fedray ui" if args.tracking_uri is None and "MLFLOW_TRACKING_URI" not in os.environ else \
        f"fedray ui --tracking-uri {out['tracking_uri']}"
    print(f"open the MLflow UI with: {ui}   (then http://127.0.0.1:5000)")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    try:
        loaded = load(args.scenario, args.set)
    except ScenarioError as e:
        print("\n".join(e.lines), file=sys.stderr)
        return EXIT_INVALID
    out = run_sweep(loaded, args.address, args.tracking_uri, args.parallel, args.fresh)
    for r in out["runs"]:
        print(f"{r['label']}: final test accuracy {r['final_test_accuracy']:.4f}  (run {r['run_id']})")
    print(f"MLflow parent run: {out['parent_run_id']}  experiment: {loaded.scenario.name}  "
          f"({len(out['runs'])} run, {len(out['skipped'])} already finished, "
          f"{len(out['failed'])} failed)")
    if out["failed"]:
        print(f"failed: {', '.join(out['failed'])}; run the same command again to retry them",
              file=sys.stderr)
        return 1
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    out = resume_run(args.run_id, args.tracking_uri, args.backend, args.address, args.quiet,
                     args.workers)
    for r in out["runs"]:
        print(f"{r['label']}: final test accuracy {r['final_test_accuracy']:.4f}  "
              f"(run {r['run_id']})")
    return 0


def cmd_sync(args: argparse.Namespace) -> int:
    from simulator.tracking import sync

    out = sync(uri=args.tracking_uri)
    print(f"synced {out['runs']} run(s): {out['metrics']} metric values, {out['artifacts']} "
          f"artifact(s), {out['statuses']} final status(es)"
          + (f"; {out['failed_runs']} run(s) still unreachable" if out["failed_runs"] else ""))
    return 1 if out["failed_runs"] else 0


def cmd_report(args: argparse.Namespace) -> int:
    from dashboards.report import build_report

    try:
        path = build_report(args.target, Path(args.out) if args.out else None, args.tracking_uri)
    except ValueError as e:
        print(f"fedray report: {e}", file=sys.stderr)
        return EXIT_INVALID
    print(f"report: {path.resolve()}")
    return 0


def privacy_compare(paths: list[str], overrides: list[str] | None = None,
                    delta: float | None = None) -> list[dict[str, Any]]:
    """Every distinct DP mechanism of the scenarios (a sweep over, say, the noise multiplier
    gives one per value; points that differ only in the aggregator share one): its epsilon at
    ``delta`` (default: the scenario's own), the best attacker's advantage, and the
    Delta-divergence between every ordered pair of their trade-off curves with the prior at
    which it binds. A mechanism is named by its file, plus the sweep values that set it when
    the file has more than one."""
    import numpy as np

    from simulator.engine import Engine
    from simulator.runtime.backend import InlineBackend
    from strategies.privacy import advantage, delta_divergence, excess_bayes_vulnerability

    alpha = np.linspace(0.0, 1.0, 2001)
    out = []
    for path in paths:
        found: dict[tuple, tuple[Any, Any]] = {}  # mechanism key -> (point, mechanism)
        for point in load(path, overrides).points:
            sc = point.scenario
            if sc.privacy is None:
                continue
            mech = Engine(sc, InlineBackend()).privacy_mechanism(sc.rounds)
            at = sc.privacy["delta"] if delta is None else delta
            found.setdefault((mech, at, sc.privacy["accountant"]), (point, mech))
        if not found:
            raise ValueError(f"{path}: has no privacy block")
        reps = [p for p, _ in found.values()]
        varying = [k for k in reps[0].values if len({str(p.values[k]) for p in reps}) > 1]
        for (mech, at, accountant), (point, _) in found.items():
            where = " ".join(f"{k.split('.')[-1]}={point.values[k]}" for k in varying)
            beta = mech.tradeoff(alpha)
            out.append({"path": f"{path} [{where}]" if where else path, "mechanism": mech,
                        "delta": at, "epsilon": mech.epsilon(at, accountant), "beta": beta,
                        "advantage": advantage(alpha, beta)})
    for a in out:
        a["divergence"] = {b["path"]: delta_divergence(alpha, a["beta"], b["beta"]) for b in out}
        a["binding_prior"] = {b["path"]: excess_bayes_vulnerability(alpha, a["beta"], b["beta"])[1]
                              for b in out if a["divergence"][b["path"]] > 0}  # printed only then
    return out


def cmd_privacy(args: argparse.Namespace) -> int:
    if args.delta is not None and not 0 < args.delta < 1:
        print(f"--delta: must be in (0, 1), got {args.delta:g}", file=sys.stderr)
        return EXIT_INVALID
    try:
        rows = privacy_compare(args.scenarios, args.set, args.delta)
    except (ScenarioError, ValueError) as e:
        print("\n".join(e.lines) if isinstance(e, ScenarioError) else str(e), file=sys.stderr)
        return EXIT_INVALID
    for r in rows:
        m = r["mechanism"]
        print(f"{r['path']}: epsilon {r['epsilon']:.4g} at delta {r['delta']:g}, attacker "
              f"advantage {r['advantage']:.4f}  (subsampled Gaussian: q = {m.q:.4g}, noise "
              f"multiplier {m.sigma:g}, {m.steps} compositions)")
    for a in rows:
        for b in rows:
            if a is not b:
                kappa = a["divergence"][b["path"]]
                print(f"Delta({a['path']} || {b['path']}) = {kappa:.4f}"
                      + (f"  (choosing {b['path']}: the best attacker's error falls by up to "
                         f"{kappa:.4f}, at prior {a['binding_prior'][b['path']]:.2f})"
                         if kappa > 0 else ""))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    bad = 0
    for f in args.scenarios:
        try:
            loaded = load(f, args.set)
        except ScenarioError as e:
            print("\n".join(e.lines), file=sys.stderr)
            bad += 1
            continue
        print(f"{f}: ok ({len(loaded.points)} run{'s' if len(loaded.points) != 1 else ''})")
    return EXIT_INVALID if bad else 0


LIST_KINDS = ("aggregators", "preaggregators", "meta", "attacks", "topologies", "datasets",
              "models", "optimizers", "client_optimizers", "partitioners", "privacy")


def cmd_list(args: argparse.Namespace) -> int:
    kinds = [args.kind] if args.kind else list(LIST_KINDS)
    for kind in kinds:
        names = registry.available(kind)
        if args.kind:
            print("\n".join(names))
        else:
            print(f"{kind}: {', '.join(names) or '(none installed)'}")
    return 0


def ui_command(tracking_uri: str, host: str, port: int) -> list[str]:
    """The ``mlflow ui`` command line ``fedray ui`` runs."""
    from simulator.tracking import artifact_root

    mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
    cmd = [mlflow, "ui", "--backend-store-uri", tracking_uri, "--host", host, "--port", str(port),
           "--workers", "1"]
    root = artifact_root(tracking_uri)
    if root:
        cmd += ["--default-artifact-root", root]
    return cmd


def cmd_ui(args: argparse.Namespace) -> int:
    from simulator.tracking import default_uri

    cmd = ui_command(args.tracking_uri or default_uri(), args.host, args.port)
    print(f"MLflow UI on http://{args.host}:{args.port}  ({' '.join(cmd)})", file=sys.stderr)
    os.execv(cmd[0], cmd) if os.path.isabs(cmd[0]) else os.execvp(cmd[0], cmd)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedray", description=__doc__)
    p.add_argument("--version", action="version", version=f"fedray {simulator.__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a scenario file (every sweep point x seed)")
    r.add_argument("scenario")
    r.add_argument("--backend", choices=["ray", "inline"], default=None,
                   help="default: the scenario's runtime.backend (ray)")
    r.add_argument("--address", default=None, help="an existing Ray cluster: auto or HOST:PORT")
    r.add_argument("--tracking-uri", default=None,
                   help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///./mlflow.db)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field by dotted path, e.g. --set rounds=50 (repeatable)")
    r.add_argument("--workers", type=int, default=None, help="number of ClientWorker actors")
    r.add_argument("--quiet", action="store_true", help="plain progress lines, no bar")
    r.set_defaults(func=cmd_run)

    w = sub.add_parser("sweep", help="run a scenario's sweep points in parallel on Ray; "
                       "resumes a partly finished sweep of the same scenario")
    w.add_argument("scenario")
    w.add_argument("--parallel", type=int, default=None,
                   help="simulations at once (default: the Ray cluster's CPUs)")
    w.add_argument("--fresh", action="store_true",
                   help="start a new parent run instead of resuming the last sweep")
    w.add_argument("--address", default=None, help="an existing Ray cluster: auto or HOST:PORT")
    w.add_argument("--tracking-uri", default=None)
    w.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    w.set_defaults(func=cmd_sweep)

    rs = sub.add_parser("resume", help="continue a run from its last checkpoint, in the same "
                        "MLflow run")
    rs.add_argument("run_id", help="the MLflow run id of a point (a child run)")
    rs.add_argument("--backend", choices=["ray", "inline"], default=None)
    rs.add_argument("--address", default=None)
    rs.add_argument("--tracking-uri", default=None)
    rs.add_argument("--workers", type=int, default=None)
    rs.add_argument("--quiet", action="store_true")
    rs.set_defaults(func=cmd_resume)

    sy = sub.add_parser("sync", help="send what runs could not log during a tracking outage "
                        "(.fedray/pending/)")
    sy.add_argument("--tracking-uri", default=None,
                    help="send there instead of where each run was logging")
    sy.set_defaults(func=cmd_sync)

    rp = sub.add_parser("report", help="a self-contained HTML report of an experiment or run")
    rp.add_argument("target", help="an experiment name (its latest scenario run) or a run id")
    rp.add_argument("--out", default=None, help="directory (default: ./fedray-report/TARGET)")
    rp.add_argument("--tracking-uri", default=None)
    rp.set_defaults(func=cmd_report)

    pv = sub.add_parser("privacy", help="compare the DP mechanisms of scenario files")
    pv_sub = pv.add_subparsers(dest="privacy_command", required=True)
    pc = pv_sub.add_parser("compare", help="epsilon at each delta and the Delta-divergence "
                           "between the trade-off curves, both ways")
    pc.add_argument("scenarios", nargs="+")
    pc.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    pc.add_argument("--delta", type=float, default=None,
                    help="report every epsilon at this delta (default: each scenario's own)")
    pc.set_defaults(func=cmd_privacy)

    v = sub.add_parser("validate", help="validate scenario files; exit 2 if any is invalid")
    v.add_argument("scenarios", nargs="+")
    v.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    v.set_defaults(func=cmd_validate)

    ls = sub.add_parser("list", help="list registered plugins")
    ls.add_argument("kind", nargs="?", choices=LIST_KINDS)
    ls.set_defaults(func=cmd_list)

    u = sub.add_parser("ui", help="the MLflow UI over the tracking store")
    u.add_argument("--tracking-uri", default=None)
    u.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (this machine only)")
    u.add_argument("--port", type=int, default=5000)
    u.set_defaults(func=cmd_ui)
    return p


def _unfinished(command: str, resumable: bool) -> str:
    """``; label (run id) marked KILLED, ...`` and, when going on makes sense (an interrupt,
    a lost worker), the command that continues them."""
    if not UNFINISHED:
        return ""
    text = "; " + ", ".join(f"{label} ({run_id}) marked {status}"
                            for run_id, label, status in UNFINISHED)
    if resumable and command == "sweep":
        text += "; run the same `fedray sweep` command again to continue"
    elif resumable:
        text += f"; continue with `fedray resume {UNFINISHED[0][0]}`"
    return text


def _pending_note() -> None:
    """What a tracking outage left in the journal, and the command that sends it."""
    from simulator.tracking import pending

    for run_id, what in pending().items():
        print(f"fedray: run {run_id}: {what} not yet in MLflow (kept in .fedray/pending/); "
              "`fedray sync` sends it", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tracked = args.command in ("run", "sweep", "resume")
    if tracked:
        trap_sigterm()
    UNFINISHED.clear()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM through trap_sigterm
        signum = e.signum if isinstance(e, Terminated) else \
            (_SIGNALS[-1] if _SIGNALS else int(signal.SIGINT))
        print(f"fedray {args.command}: interrupted by {signal.Signals(signum).name}"
              f"{_unfinished(args.command, True)}", file=sys.stderr)
        return 128 + signum
    except (FedrayError, DataError) as e:
        resumable = isinstance(e, (WorkerLost, ClientStateLost))
        print(f"fedray {args.command}: {e}{_unfinished(args.command, resumable)}",
              file=sys.stderr)
        return EXIT_INVALID if isinstance(e, (DataError, UsageError)) else 1
    except Exception:
        if UNFINISHED:  # a bug: its traceback follows, after the runs it ended
            print(f"fedray {args.command}: failed{_unfinished(args.command, False)}",
                  file=sys.stderr)
        raise
    finally:
        if tracked:
            _pending_note()


if __name__ == "__main__":
    sys.exit(main())
