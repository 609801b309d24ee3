"""What happens around a point's run, as a list of callbacks (pfl-research's shape: a run is a
loop plus callbacks): per-round metrics to MLflow, the progress line, checkpoints, the
artifacts at the end. ``simulator.runner`` owns the loop and the runs' lifecycle; a caller
adds its own callbacks (``dashboards.figures.RunFigure`` draws each run's curves).

Also here: the layout of a scenario's runs in MLflow (a parent run per scenario, a child run
per point) and the tags and params they carry.
"""

from __future__ import annotations

import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

import simulator
from simulator.config import LoadedScenario, RunPoint
from simulator.errors import brief_text
from simulator.tracking import Tracker, check_uri, flatten, git_commit, write_metrics


class PointRun:
    """A point being run into its MLflow child run: what every hook receives. ``logged``:
    the rounds MLflow (or the journal) holds already, when a run is resumed; ``tmp``: a
    directory for the run's artifact files; ``rows``: the rounds computed so far.

    The MLflow run may still be opening on a background thread when the point starts
    (``opening``, a future of ``(tracker, run_id)``; see ``Opening``): reading ``run_id`` or
    ``tracker`` waits for it and raises its error, such as a tracking store that cannot be
    used; ``is_open`` asks without waiting."""

    def __init__(self, point: RunPoint, run_id: str | None, tracker: Tracker | None, tmp: Path,
                 logged: set[int] | None = None, rows: list[dict[str, float]] | None = None,
                 opening: Future[tuple[Tracker, str]] | None = None) -> None:
        self.point, self.tmp = point, tmp
        self.logged = logged if logged is not None else set()
        self.rows = rows if rows is not None else []
        self.started = time.perf_counter()  # when the point's run began
        if opening is None:
            assert run_id is not None and tracker is not None
            opening = Future()
            opening.set_result((tracker, run_id))
        self.opening = opening
        self.backlog: list[tuple[int, dict[str, float]]] = []  # rounds before it was open

    @property
    def tracker(self) -> Tracker:
        return self.opening.result()[0]

    @property
    def run_id(self) -> str:
        return self.opening.result()[1]

    def is_open(self) -> bool:
        """Whether the MLflow run is open; raises its opening's error once that failed."""
        if not self.opening.done():
            return False
        self.opening.result()
        return True


class Callback:
    """Hooks of a point's run; every default does nothing."""

    def on_round(self, run: PointRun, round_: int, metrics: dict[str, float]) -> None:
        """After round ``round_`` (0-based) with its metrics (each round once)."""

    def on_checkpoint(self, run: PointRun, round_: int, state: dict[str, Any]) -> None:
        """Every ``runtime.checkpoint_every`` rounds: the run's whole state after ``round_``."""

    def on_end(self, run: PointRun, result: Any, status: str) -> None:
        """The run ended: ``status`` FINISHED (``result``, a RunResult), FAILED or KILLED
        (``result`` None; ``run.rows`` holds what was computed). Before its status is set.
        After the last point of ``fedray run`` finished, the backend (Ray) is already
        shutting down: an end uses the result, not the actors."""


class MLflowMetrics(Callback):
    """Per-round metrics to the run (through the tracker's background sender); the rounds
    that end before the MLflow run is open wait in ``run.backlog``."""

    def on_round(self, run: PointRun, round_: int, metrics: dict[str, float]) -> None:
        if round_ not in run.logged:
            run.backlog.append((round_, metrics))
        if run.is_open():
            self._send(run)

    def on_end(self, run: PointRun, result: Any, status: str) -> None:
        self._send(run)

    @staticmethod
    def _send(run: PointRun) -> None:
        for r, m in run.backlog:
            run.tracker.log_round(run.run_id, r, m)
        run.backlog.clear()


class MLflowArtifacts(Callback):
    """At the end: ``metrics.parquet`` (what was computed, whatever the status), and for a
    finished run the privacy tables, the final model (``model/model.pt``) and the params the
    engine derived."""

    def on_end(self, run: PointRun, result: Any, status: str) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq
        import torch

        tracker, run_id, tmp = run.tracker, run.run_id, run.tmp
        rows = result.metrics if result is not None else run.rows
        if not rows:
            return
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            tracker.log_artifact(run_id, write_metrics(rows, tmp / "metrics.parquet"))
        except OSError as e:  # a local file could not be written; the status still is
            print(f"warning: could not write metrics.parquet for run {run_id}: {e}",
                  file=sys.stderr)
        if result is None:
            return
        for name, columns in result.tables.items():  # privacy profile, trade-off curve
            pq.write_table(pa.table(columns), tmp / f"{name}.parquet")
            tracker.log_artifact(run_id, tmp / f"{name}.parquet", "privacy")
        torch.save(result.model_state, tmp / "model.pt")
        tracker.log_artifact(run_id, tmp / "model.pt", "model")
        if result.model_info:
            log_model(tracker, run_id, run.point.scenario, result, tmp / "mlflow-model")
        if result.params:
            tracker.log_params(run_id, result.params)


class Progress(Callback):
    """The live progress line of a point."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.bar: Any = None

    def on_round(self, run: PointRun, round_: int, metrics: dict[str, float]) -> None:
        from simulator.progress import Progress as Bar

        if self.bar is None:
            self.bar = Bar(run.point.label, run.point.scenario.rounds, self.quiet,
                           start=run.started)
        self.bar.update(round_, metrics)

    def on_end(self, run: PointRun, result: Any, status: str) -> None:
        self.bar = None  # the next point has its own line


class Checkpoints(Callback):
    """Checkpoints in ``.fedray/checkpoints/RUN_ID/``, removed once the run FINISHED."""

    def on_checkpoint(self, run: PointRun, round_: int, state: dict[str, Any]) -> None:
        from simulator import checkpoint

        checkpoint.save(run.run_id, round_, state)

    def on_end(self, run: PointRun, result: Any, status: str) -> None:
        from simulator import checkpoint

        if status == "FINISHED":
            checkpoint.remove(run.run_id)


def default_callbacks(quiet: bool = False) -> list[Callback]:
    """What every point run of ``fedray run`` has: MLflow, progress, checkpoints. The order
    is the order of the hooks: a round's metrics are queued for MLflow before anything else
    sees the round (an interrupt in a later hook loses none)."""
    return [MLflowMetrics(), Progress(quiet), Checkpoints(), MLflowArtifacts()]


# --------------------------------------------------------------------------- MLflow layout


_COMMIT: list[str] = []


def _commit() -> str:
    if not _COMMIT:
        _COMMIT.append(git_commit())
    return _COMMIT[0]


def run_tags(backend: Any) -> dict[str, str]:
    """The tags of where a run ran: fedray's version, the commit, the backend, its nodes.
    Read on the thread that drives the backend, while it runs: the MLflow runs open on a
    thread of their own (``Opening``), which may get to them only after the last point's end
    has shut Ray down (a one-round run beside a slow new store)."""
    return {"fedray.version": simulator.__version__, "mlflow.source.git.commit": _commit(),
            "backend": backend.name, "ray_nodes": str(backend.num_nodes())}


def scenario_tags(sc: Any) -> dict[str, str]:
    """The tags a scenario point decides (aggregator, attack, n, f, data set, model, ...)."""
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
    }


def sweep_param(key: str) -> str:
    """The MLflow param name of a sweep key (names cannot hold commas: the paths of a zipped
    key are joined with ' / ')."""
    return "sweep." + " / ".join(part.strip() for part in key.split(","))


def common_params(loaded: LoadedScenario) -> dict[str, str]:
    """The params every point of the scenario shares: the parent holds only these, so a
    search on a swept param (``params.`aggregator.name` = 'mean'``) finds children alone."""
    flats = [flatten(p.scenario.model_dump(mode="json", exclude={"sweep"}))
             for p in loaded.points]
    return {k: v for k, v in flats[0].items() if all(f.get(k) == v for f in flats[1:])}


def common_tags(loaded: LoadedScenario, where: dict[str, str]) -> dict[str, str]:
    """The tags every point of the scenario shares (a swept aggregator is no parent tag), and
    ``where`` it runs (``run_tags``)."""
    per = [scenario_tags(p.scenario) for p in loaded.points]
    shared = {k: v for k, v in per[0].items() if all(t.get(k) == v for t in per[1:])}
    return {**shared, **where}


def run_name(point: RunPoint) -> str:
    """A child run's name: the values that differ between points and the seed; a scenario
    without a sweep adds its name (``quickstart seed=0``), not a bare ``seed=0``."""
    if point.values or not point.scenario.name:
        return point.label
    return f"{point.scenario.name} {point.label}"


def open_parent(loaded: LoadedScenario, where: dict[str, str], tracker: Tracker, tmp: Path,
                final_tags: dict[str, str] | None = None) -> str:
    """The parent run of a scenario: tags, the resolved scenario as params, the scenario file
    as given and resolved as artifacts; ``final_tags`` are set last, once all that is logged
    (a sweep finds its parent by them). A failure marks the run FAILED and is raised."""
    sc = loaded.scenario
    parent = tracker.create_run(sc.name, {**common_tags(loaded, where),
                                          "fedray.kind": "scenario",
                                          "sweep": ",".join(sc.sweep) or "none"},
                                description=sc.description)
    try:
        tracker.log_params(parent, common_params(loaded) |
                           {"seeds": yaml.safe_dump(sc.seeds, default_flow_style=True).strip()} |
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


def open_child(point: RunPoint, key: str, where: dict[str, str], tracker: Tracker, parent: str,
               tmp: Path) -> str:
    """A point's child run: tags, params and, from the start, the resolved scenario as the
    ``scenario.yaml`` artifact (what ``fedray resume`` rebuilds the run from); ``key`` is
    the point's identity (``runner.point_key``)."""
    sc = point.scenario
    desc = sc.description + (f"\n\nSweep point: {point.values}" if point.values else "") + \
        f"\nSeed: {point.seed}"
    run_id = tracker.create_run(run_name(point), {**scenario_tags(sc), **where, "seed": str(point.seed),
                                              "fedray.kind": "point",
                                              "fedray.point_key": key},
                                parent_id=parent, description=desc.strip())
    tracker.log_params(run_id, flatten(sc.model_dump(mode="json", exclude={"sweep"})) |
                       {"seed": str(point.seed)})
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "scenario.yaml").write_text(yaml.safe_dump(sc.model_dump(mode="json"), sort_keys=False))
    tracker.log_artifact(run_id, tmp / "scenario.yaml")
    log_dataset(tracker, run_id, sc)
    return run_id


def save_model(sc: Any, result: Any, folder: Path) -> Path:
    """The final model as an MLflow pytorch model in ``folder``: torch.export's graph (the
    ``pt2`` format: no pickle, and ``mlflow.pytorch.load_model`` needs no fedray code), with
    its signature (float32 values in [0, 1] for images, int64 token ids for text)."""
    import logging

    import mlflow.pytorch
    import torch
    from mlflow.models import infer_signature

    from simulator.models import build_model

    info = result.model_info
    model = build_model(sc.model, info["input_shape"], info["num_classes"], sc.seeds[0],
                        info["vocabulary"])
    model.load_state_dict(result.model_state)
    model.eval()
    example = torch.zeros((2, *info["input_shape"]),
                          dtype=torch.int64 if info["tokens"] else torch.float32)
    with torch.no_grad():
        out = model(example)
    # MLflow's notes on local version labels and torch's graph dumps when an export fails
    # (that failure is reported in one line by log_model)
    loggers = [logging.getLogger(n) for n in ("mlflow.pytorch", "mlflow.utils.requirements_utils",
                                              "mlflow.models.model", "torch")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        shutil.rmtree(folder, ignore_errors=True)
        mlflow.pytorch.save_model(
            model, str(folder), signature=infer_signature(example.numpy(), out.numpy()),
            serialization_format="pt2", input_example=example.numpy(),
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"])
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    return folder


def log_model(tracker: Tracker, run_id: str, sc: Any, result: Any, folder: Path) -> None:
    """``save_model`` into the run's ``model/`` artifacts (beside ``model.pt``). A model that
    torch.export cannot capture keeps its state_dict only, said in one line."""
    import contextlib
    import io

    said = io.StringIO()  # torch prints the graph it could not export: kept back on failure
    try:
        with contextlib.redirect_stderr(said):
            save_model(sc, result, folder)
    except Exception as e:  # noqa: BLE001 - a plugin model torch.export cannot capture
        print(f"fedray: run {run_id}: the final model is kept as model/model.pt only; "
              f"torch.export could not capture it ({type(e).__name__}: "
              f"{brief_text((str(e).strip().splitlines() or [''])[0], 200)})",
              file=sys.stderr)
        return
    sys.stderr.write(said.getvalue())  # on success nothing is held back
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = f.parent.relative_to(folder)
        tracker.log_artifact(run_id, f, "model" + ("" if str(rel) == "." else f"/{rel}"))


def dataset_input(sc: Any) -> Any:
    """The run's data as an MLflow dataset input: the data set's name, a digest of what
    decides the clients' samples (data block, clients, seed), the data block as its source
    and the partition as its profile; runs on the same clients share the digest."""
    import hashlib
    import json

    from mlflow.entities import Dataset, DatasetInput, InputTag

    data = sc.data.model_dump(mode="json")
    what = {"data": data, "clients": sc.clients.total, "seed": sc.seeds[0]}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    profile = {"clients": sc.clients.total, "partitioner": data["partitioner"],
               "test_fraction": data["test_fraction"], "seed": sc.seeds[0]}
    ds = Dataset(name=sc.data.dataset["name"], digest=digest, source_type="fedray",
                 source=json.dumps(data["dataset"], sort_keys=True),
                 profile=json.dumps(profile, sort_keys=True))
    return DatasetInput(ds, [InputTag("mlflow.data.context", "train")])


def log_dataset(tracker: Tracker, run_id: str, sc: Any) -> None:
    """``log_input`` of the run's data (see :func:`dataset_input`)."""
    tracker.client.log_inputs(run_id, datasets=[dataset_input(sc)])


class Opening:
    """The MLflow side of ``fedray run``, opened on one background thread while the engine
    starts: MLflow's import and store set-up (about 2 s here, 3.7 s for a new store) go on
    while Ray starts, the data loads and the first rounds run, not before them. The tracker,
    the parent run and each point's child run are opened in that order; a store that cannot
    be used fails each of them with its one-line error, which the run raises where it first
    needs its MLflow run (``PointRun``)."""

    def __init__(self, uri: str, experiment: str) -> None:
        check_uri(uri)  # what can be refused without opening the store, before anything runs
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedray-opening")
        self.tracker = self._pool.submit(Tracker, uri, experiment)
        self.parent: Future[str] | None = None

    @classmethod
    def existing(cls, tracker: Tracker, parent: str) -> Opening:
        """An opening whose tracker and parent run exist already (a resumed sweep)."""
        opening = cls.__new__(cls)
        opening._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedray-opening")
        opening.tracker, opening.parent = Future(), Future()
        opening.tracker.set_result(tracker)
        opening.parent.set_result(parent)
        return opening

    def open_parent(self, loaded: LoadedScenario, backend: Any, tmp: Path) -> None:
        where = run_tags(backend)  # here, while the backend runs (see run_tags)
        self.parent = self._pool.submit(
            lambda: open_parent(loaded, where, self.tracker.result(), tmp))

    def open_child(self, point: RunPoint, key: str, backend: Any, tmp: Path
                   ) -> Future[tuple[Tracker, str]]:
        parent = self.parent
        assert parent is not None, "open_parent first"
        where = run_tags(backend)

        def child() -> tuple[Tracker, str]:
            tracker = self.tracker.result()
            return tracker, open_child(point, key, where, tracker, parent.result(), tmp)

        return self._pool.submit(child)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
