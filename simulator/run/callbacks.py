"""What happens around a point's run, as a list of callbacks (pfl-research's shape: a run is a
loop plus callbacks): per-round metrics to MLflow, the progress line, checkpoints, the
artifacts at the end. ``simulator.run.experiment`` owns the runs' lifecycle and its executors call
the same callbacks, whether a point runs on the actor pool or in a Ray task; a caller adds its
own callbacks (``dashboards.figures.RunFigure`` draws each run's curves). The MLflow layout
(parent and child runs, their tags and params) is ``simulator.run.layout``.

The ends run in the driver after a point's last round, and the last point's are on the user's
path to the command's end: ``fedray run`` returns once MLflow holds them (never a background
process that a `fedray report` started at once would miss). What each costs and where it
goes (a one-round quickstart on the inline backend, docs/performance.md, "Start-up"):

* ``metrics.parquet``, the privacy tables and ``model/model.pt`` (the final state_dict,
  ``torch.save``): always, 0.01-0.02 s in all; what ``fedray report`` and ``fedray resume``
  read, and the model itself.
* The final model as an MLflow pytorch model (``log_model``, torch.export's graph): only when
  the scenario asks (``tracking.log_model: true``). It cost 1.9-2.3 s a run (torch.export
  imports dynamo and sympy, then traces the model) and made the process's exit 0.5 s longer;
  most runs are compared, not deployed, and the state_dict it is made from is logged
  anyway. Not moved to a thread or the background sender instead: the export is Python
  work under the GIL, so on a thread it slows whatever runs beside it by about what it
  costs, and it must be done before the command returns.
* The run's figure (``dashboards.figures``): an SVG drawn without matplotlib, milliseconds
  (matplotlib's PNG cost 0.5-0.6 s, most of it the import).
* Per-round metrics go through the tracker's background sender while the rounds run; the
  end only flushes what is left.
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simulator.config import RunPoint
from simulator.errors import brief_text
from simulator.log import logger
from simulator.run.tracking import Tracker, write_metrics


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


@dataclass(frozen=True)
class RoundAnswer:
    """What a callback may answer after a round (``Callback.after_round``; pfl-research's
    ``(should_stop, metrics)``): ``metrics`` logged with the round's own, and ``stop``: end
    the point's run after this round."""

    metrics: dict[str, float] = field(default_factory=dict)
    stop: bool = False


class Callback:
    """Hooks of a point's run; every default does nothing."""

    def after_round(self, run: PointRun, round_: int, metrics: dict[str, float]
                    ) -> RoundAnswer | None:
        """After round ``round_`` (0-based), before any ``on_round`` sees it: metrics of the
        callback's own to log with the round, or a request to stop the point after it (the
        run ends FINISHED with the model of that round, the run param
        ``stopped_after_round`` saying when). ``metrics`` holds the round's and those of
        the callbacks before this one. A stop is honoured where the point runs on the actor
        pool (``fedray run``, ``resume``); a point of a parallel sweep or a search trial
        runs in a Ray task or a Tune trial and goes on to its last round (Tune's own
        schedulers stop trials)."""
        return None

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
    finished run the privacy tables, the final model (``model/model.pt``; with
    ``tracking.log_model: true`` also as an MLflow model in ``model/``) and the params the
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
            logger.warning("warning: could not write metrics.parquet for run %s: %s", run_id, e)
        if result is None:
            return
        for name, columns in result.tables.items():  # privacy profile, trade-off curve
            pq.write_table(pa.table(columns), tmp / f"{name}.parquet")
            tracker.log_artifact(run_id, tmp / f"{name}.parquet", "privacy")
        torch.save(result.model_state, tmp / "model.pt")
        tracker.log_artifact(run_id, tmp / "model.pt", "model")
        if result.model_info and run.point.scenario.tracking.log_model:
            log_model(tracker, run_id, run.point.scenario, result, tmp / "mlflow-model")
        if result.params:
            tracker.log_params(run_id, result.params)


class Progress(Callback):
    """The live progress line of each point (a sweep's points run several at a time: each
    has its own; ``quiet``: plain lines, no bar)."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.bars: dict[PointRun, Any] = {}

    def on_round(self, run: PointRun, round_: int, metrics: dict[str, float]) -> None:
        from simulator.run.progress import ProgressLine

        if run not in self.bars:  # one bar a point run at once, each on its own line
            taken = {b.position for b in self.bars.values()}
            free = next(i for i in range(len(self.bars) + 1) if i not in taken)
            self.bars[run] = ProgressLine(run.point.label, run.point.scenario.rounds, self.quiet,
                                          start=run.started, position=free)
        self.bars[run].update(round_, metrics)

    def on_end(self, run: PointRun, result: Any, status: str) -> None:
        bar = self.bars.pop(run, None)
        if bar is not None:
            bar.close()


class Checkpoints(Callback):
    """Checkpoints in ``.fedray/checkpoints/RUN_ID/``, removed once the run FINISHED."""

    def on_checkpoint(self, run: PointRun, round_: int, state: dict[str, Any]) -> None:
        from simulator.run import checkpoint

        path = checkpoint.save(run.run_id, round_, state)
        logger.debug("%s: checkpoint after round %d: %s", run.point.label, round_ + 1, path)

    def on_end(self, run: PointRun, result: Any, status: str) -> None:
        from simulator.run import checkpoint

        if status == "FINISHED":
            checkpoint.remove(run.run_id)


class EarlyStopping(Callback):
    """Stops a point once ``metric`` has not improved on its best by more than
    ``min_delta`` over ``patience`` evaluations in a row (Keras's and Lightning's
    ``EarlyStopping``; ``mode`` max for an accuracy, min for a loss). Rounds without the
    metric (no evaluation) do not count. It logs ``early_stopping_wait``, the evaluations
    since the best. An example of a callback that answers (``after_round``)."""

    def __init__(self, metric: str = "test_accuracy", patience: int = 3,
                 min_delta: float = 0.0, mode: str = "max") -> None:
        if patience < 1 or mode not in ("max", "min") or min_delta < 0:
            raise ValueError("EarlyStopping: patience >= 1, mode max or min, min_delta >= 0; "
                             f"got {patience}, {mode!r}, {min_delta}")
        self.metric, self.patience, self.min_delta = metric, patience, min_delta
        self.sign = 1.0 if mode == "max" else -1.0
        self.best: dict[int, tuple[float, int]] = {}  # per run: (best, evaluations since)

    def after_round(self, run: PointRun, round_: int, metrics: dict[str, float]
                    ) -> RoundAnswer | None:
        if self.metric not in metrics:
            return None
        value = self.sign * metrics[self.metric]
        best, wait = self.best.get(id(run), (float("-inf"), 0))
        best, wait = (value, 0) if value > best + self.min_delta else (best, wait + 1)
        self.best[id(run)] = (best, wait)
        return RoundAnswer({"early_stopping_wait": float(wait)}, stop=wait >= self.patience)


def default_callbacks(quiet: bool = False, progress: bool = True) -> list[Callback]:
    """What every point run of ``fedray run`` has: MLflow, progress (none without
    ``progress``: a program's run, ``fedray.run``), checkpoints. The order is the order of
    the hooks: a round's metrics are queued for MLflow before anything else sees the round
    (an interrupt in a later hook loses none)."""
    return [MLflowMetrics(), *([Progress(quiet)] if progress else []), Checkpoints(),
            MLflowArtifacts()]


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
        logger.warning("fedray: run %s: the final model is kept as model/model.pt only; "
                       "torch.export could not capture it (%s: %s)", run_id, type(e).__name__,
                       brief_text((str(e).strip().splitlines() or [''])[0], 200))
        return
    if said.getvalue().strip():  # on success nothing is held back
        logger.info("%s", said.getvalue().rstrip("\n"))
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = f.parent.relative_to(folder)
        tracker.log_artifact(run_id, f, "model" + ("" if str(rel) == "." else f"/{rel}"))
