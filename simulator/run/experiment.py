"""One lifecycle for ``fedray run``, ``fedray sweep`` and ``fedray resume``: an ``Experiment``
owns a scenario's runs in MLflow (a parent run, a child run per point; ``simulator.run.layout``),
their statuses and what is left unfinished, and hands each point to an executor
(``simulator.run.executors``: the actor pool, or Ray tasks) with the same callbacks.

A command's result (``ExperimentResult``) says what it ran, skipped, failed and left
unfinished; when the command raises, the exception carries the unfinished runs
(``simulator.run.interrupts.unfinished_of``).

A process that ran an experiment skips the interpreter's last garbage collection when it
exits (``exit_without_collection``): with torch and MLflow loaded it walked their object
graphs for 0.9-1.1 s after the command's work was done, longer than the last round of a
short run. Everything is in MLflow (or the journal) by then; the memory goes back to the
system with the process.
"""

from __future__ import annotations

import atexit
import gc
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simulator.config import RunPoint
from simulator.config.load import LoadedScenario
from simulator.log import logger
from simulator.metric_names import mlflow_name
from simulator.run.callbacks import Callback, PointRun
from simulator.run.interrupts import Unfinished, carry_unfinished, end_status
from simulator.run.layout import Opening, point_key, sweep_key
from simulator.run.removed import Needs
from simulator.run.tracking import Tracker, journaled_steps

ROUND_MARKERS = ("sampled", "participants", "byzantine_peers")


def exit_without_collection() -> None:
    """At the interpreter's exit (an ``atexit`` handler): no more garbage collection. The
    objects still alive are frozen out of the collector's reach, so the final collections
    walk nothing; objects freed by reference counting are still finalized (files closed)."""
    gc.disable()
    gc.freeze()


_AT_EXIT: list[bool] = []  # whether exit_without_collection is registered in this process


@dataclass
class ExperimentResult:
    """What a command did: the parent run, each finished point (``summary``), the labels of
    the points skipped (FINISHED before) and failed, and the runs it left unfinished."""

    tracking_uri: str
    parent_run_id: str | None = None
    experiment_id: str | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    unfinished: list[Unfinished] = field(default_factory=list)


@dataclass
class Work:
    """A point to run: in a new child run (``run_id`` None), or in its unfinished child run
    ``run_id`` (named ``name``), from ``state`` (its newest checkpoint; None: round 0)."""

    point: RunPoint
    run_id: str | None = None
    state: dict[str, Any] | None = None
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or self.point.label


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


class Experiment:
    """A scenario's runs in MLflow, from the parent's opening to its final status.

    The parent is new (``new_parent``) or continued (``continue_parent``: a sweep run again,
    a resume); ``plan`` says which points are left. Each point goes ``start`` (its child run
    opened, or reopened from a checkpoint) -> ``on_round`` / ``on_checkpoint`` (the callbacks,
    called by the executor) -> ``end`` (the callbacks' ends and the status). ``running`` is
    the parent's lifecycle: its final status, and the unfinished runs on the exception that
    ends it."""

    def __init__(self, opening: Opening, callbacks: list[Callback], uri: str,
                 parent_label: str) -> None:
        self.opening, self.callbacks, self.parent_label = opening, callbacks, parent_label
        self.result = ExperimentResult(uri)
        self._ended: set[PointRun] = set()  # the point runs whose status is set
        # what the runs need on disk: the working directory, the store, each point's paths
        self.needs = Needs(uri, opening.start)

    @property
    def tracker(self) -> Tracker:
        return self.opening.tracker.result()

    def store_answered(self) -> None:
        """Wait for the tracking store's first answer (the tracker, opening on its own thread
        while the engine started), raising its error: called before a point's first round, so
        that nothing trains for a store that cannot take it (TrackingUnavailable, one line).
        The parent and child runs may still be opening; the rounds wait in their backlog."""
        self.opening.tracker.result()

    # ------------------------------------------------------------------ the parent

    def new_parent(self, loaded: LoadedScenario, backend: Any, tmp: Path,
                   final_tags: dict[str, str] | None = None) -> None:
        """A new parent run, opened on the opening's thread."""
        self.opening.open_parent(loaded, backend, tmp, final_tags)

    def continue_parent(self, parent: str) -> None:
        """Go on in the existing parent run ``parent`` (marked RUNNING again)."""
        self.tracker.reopen(parent)
        self.opening.adopt(parent)

    def sweep_parent(self, loaded: LoadedScenario, backend: Any, tmp: Path,
                     fresh: bool) -> list[Work]:
        """The last sweep of the same resolved scenario, continued (``plan``), or a new
        parent (``fresh``, or none before); the points left to run."""
        key = sweep_key(loaded)
        found = None if fresh else self.tracker.find_run({"fedray.sweep_key": key,
                                                          "fedray.kind": "scenario"})
        if found is None:
            self.new_parent(loaded, backend, tmp, {"fedray.sweep_key": key})
            return [Work(p) for p in loaded.points]
        self.continue_parent(found)
        return self.plan(loaded.points)

    def plan(self, points: list[RunPoint]) -> list[Work]:
        """The points of the parent left to run, in order: a point with a FINISHED child run
        is skipped (``result.skipped``); one whose unfinished child run has a checkpoint goes
        on from it in that run (the newest such run); the others start over in a new child
        run. Children a dead driver left RUNNING and that do not go on are marked KILLED."""
        from simulator.run import checkpoint

        assert self.opening.parent is not None
        finished: set[str] = set()
        partial: dict[str, tuple[str, dict[str, Any], str]] = {}  # key: (run, state, name)
        for child in self.tracker.children(self.opening.parent.result()):  # newest first
            key, run_id = child.data.tags.get("fedray.point_key", ""), child.info.run_id
            if child.info.status == "FINISHED":
                finished.add(key)
                continue
            state = checkpoint.latest(run_id) if key not in partial else None
            if state is not None:
                partial[key] = (run_id, state, child.info.run_name)
            elif child.info.status == "RUNNING":  # left by a driver that died
                self.tracker.end(run_id, "KILLED")
        self.result.skipped = [p.label for p in points if point_key(p) in finished]
        return [Work(p, *partial[k]) if (k := point_key(p)) in partial else Work(p)
                for p in points if point_key(p) not in finished]

    @contextmanager
    def running(self) -> Iterator[Experiment]:
        """The parent's lifecycle: FINISHED when the block ends and no point failed, KILLED
        on an interrupt, else FAILED; an exception leaving the block carries the runs left
        unfinished. The opening closes at the end. The process will exit without its last
        garbage collection (``exit_without_collection``). An error that a file or folder the
        runs need was removed under them is raised as that removal (``Needs.explain``)."""
        status, error = "FAILED", None
        if not _AT_EXIT:
            atexit.register(exit_without_collection)
            _AT_EXIT.append(True)
        try:
            yield self
            status = "FAILED" if self.result.failed else "FINISHED"
        except BaseException as e:
            removed = self.needs.explain(e)
            error = removed or e
            carry_unfinished(error, self.result.unfinished)
            if removed is not None and removed is not e:
                raise removed from e
            raise
        finally:
            try:
                self._end_parent(end_status(status, error))
            finally:
                self.opening.close()

    def _end_parent(self, status: str) -> None:
        parent = self.opening.parent
        if parent is None or parent.exception() is not None:
            return
        self.result.parent_run_id = parent.result()
        self.result.experiment_id = self.tracker.experiment_id
        self.tracker.end(parent.result(), status)
        if status != "FINISHED":
            self.result.unfinished.append(Unfinished(parent.result(), self.parent_label, status))

    # ------------------------------------------------------------------ the points

    def start(self, work: Work, backend: Any, tmp: Path) -> PointRun:
        """``work``'s point run: a new child run, opened on the opening's thread while the
        engine starts, or its unfinished child run, reopened with the rounds its checkpoint
        holds that MLflow lacks (queued when the driver died) logged."""
        self.needs.add(work.point.scenario)
        if work.run_id is None:
            child = self.opening.open_child(work.point, point_key(work.point), backend, tmp)
            return PointRun(work.point, None, None, tmp, opening=child)
        run_id, state, tracker = work.run_id, work.state, self.tracker
        # the rounds logged: a metric each round protocol logs every round (server rounds:
        # sampled, asynchronous steps: participants, D-SGD: byzantine_peers)
        logged = {m.step for key in ROUND_MARKERS
                  for m in tracker.client.get_metric_history(run_id, mlflow_name(key))}
        logged |= journaled_steps(run_id)  # still in the journal: `fedray sync` sends them
        start = state["round"] + 1 if state else 0
        logger.info("resuming %s (%s) at round %d/%d%s", work.label, run_id, start + 1,
                    work.point.scenario.rounds,
                    "" if state else " (no checkpoint: from the start)")
        tracker.reopen(run_id)
        rows = [dict(m) for m in state["metrics"]] if state else []
        for r, row in enumerate(rows):
            if r not in logged:
                tracker.log_round(run_id, r, row)
                logged.add(r)
        return PointRun(work.point, run_id, tracker, tmp, logged, rows)

    def on_round(self, run: PointRun, round_: int, metrics: dict[str, float]) -> bool:
        """The round through every callback: first their answers (``after_round``: metrics
        added to the round's, a request to stop), then ``on_round``. Returns whether one
        asked the point to stop."""
        stop = False
        for cb in self.callbacks:
            answer = cb.after_round(run, round_, metrics)
            if answer is not None:
                metrics.update(answer.metrics)
                stop = stop or answer.stop
        run.rows.append(metrics)
        for cb in self.callbacks:
            cb.on_round(run, round_, metrics)
        return stop

    def on_checkpoint(self, run: PointRun, round_: int, state: dict[str, Any]) -> None:
        for cb in self.callbacks:
            cb.on_checkpoint(run, round_, state)

    def end(self, run: PointRun, result: Any, status: str) -> None:
        """The callbacks' ends, then the run's final status (FAILED if an end failed, KILLED
        if one was interrupted); an unfinished run goes on ``result.unfinished``. A run whose
        MLflow run could not be opened raises that error instead (no run to end)."""
        if run in self._ended:
            return
        self._ended.add(run)
        run.opening.result()
        try:
            for cb in self.callbacks:
                cb.on_end(run, result if status == "FINISHED" else None, status)
        except BaseException as e:  # an end that failed fails the run; Ctrl-C there kills it
            status = end_status("FAILED", e) if status == "FINISHED" else status
            raise
        finally:
            run.tracker.end(run.run_id, status)
            logger.debug("%s: run %s marked %s", run.point.label, run.run_id, status)
            if status != "FINISHED":
                self.result.unfinished.append(Unfinished(run.run_id, run.point.label, status))
