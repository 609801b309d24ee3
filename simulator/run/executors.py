"""How an experiment's points are computed. Both executors call the experiment's callbacks in
the driver, round by round (``Experiment.on_round`` / ``on_checkpoint`` / ``end``), so a
point logs its metrics, shows its progress and checkpoints the same way under either:

* ``PoolExecutor``: one point after another on one backend's ClientWorker pool
  (``fedray run``, ``fedray resume``);
* ``TaskExecutor``: several points at once, each a single-process simulation (the inline
  backend) in a Ray task (``fedray sweep``). A task streams its rounds and checkpoints to the
  driver through a queue (a small Ray actor); only the driver talks to MLflow;
* ``SerialExecutor``: a sweep's points one after another in the driver (``fedray sweep`` of
  short points), with the sweep's handling of a point that fails.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from simulator import registry
from simulator.config import Scenario
from simulator.log import logger, to_stderr
from simulator.run.callbacks import PointRun
from simulator.run.experiment import Experiment, Work, final_text, summary
from simulator.run.interrupts import end_status

POLL_SECONDS = 0.2  # how often the driver drains the tasks' queue while it waits


class PoolExecutor:
    """Points one after another on ``backend``'s ClientWorker pool (``workers`` actors)."""

    def __init__(self, backend: Any, workers: int | None = None) -> None:
        self.backend, self.workers = backend, workers

    def run(self, exp: Experiment, works: list[Work], tmp: Path,
            last_done: Callable[[], None] | None = None) -> None:
        """Every point of ``works`` into ``exp.result.runs``; ``last_done`` is called once the
        last point's engine is done, before its callbacks' ends (the model, the figure)."""
        for i, work in enumerate(works):
            run = exp.start(work, self.backend, tmp / str(i))
            done = self.execute(exp, run, work.state, last_done if i == len(works) - 1 else None)
            if work.name:
                done["label"] = work.name
            exp.result.runs.append(done)

    def execute(self, exp: Experiment, run: PointRun, state: dict[str, Any] | None = None,
                engine_done: Callable[[], None] | None = None) -> dict[str, Any]:
        """Run one point into its child run (from ``state``, a checkpoint, when given), then
        its end; a failure keeps what was computed."""
        from simulator.sim.engine import Engine

        status, error, result = "FAILED", None, None
        try:
            engine = Engine(run.point.scenario, self.backend, self.workers)
            result = engine.run(partial(exp.on_round, run), partial(exp.on_checkpoint, run),
                                state, exp.store_answered)
            status, workers = "FINISHED", engine.n_workers
            # the engine's actor handles go now, not while Ray shuts down on engine_done's
            # thread: a handle released during the shutdown made Ray's core worker end the
            # process (exit status 1, "The core worker has already been shutdown")
            del engine
            if engine_done is not None:
                engine_done()
            return {**summary(run.run_id, run.point, result), "workers": workers}
        except BaseException as e:
            error = e
            raise
        finally:
            exp.end(run, result, end_status(status, error))


# --------------------------------------------------------------------------- Ray tasks


def _simulate(scenario: Scenario, label: str = "", resume: dict[str, Any] | None = None,
              events: Any = None, token: int = 0, plugins: Any = None) -> Any:
    """One point as a single-process simulation (the inline backend), from ``resume`` (a
    checkpoint) when given: a Ray task of a sweep; ``plugins``, the driver's session plugins
    (``registry.SessionPlugins``), are registered here by their unpickling. With ``events``
    (a queue), each round's metrics and each checkpoint go to the driver as ``(kind, token,
    round, payload)``, and the driver shows the progress; alone, it prints its own progress
    lines. The engine's
    messages are printed on the task's stderr, which Ray forwards to the driver's terminal."""
    from simulator.run.progress import ProgressLine
    from simulator.runtime.backend import InlineBackend
    from simulator.sim.engine import Engine

    with to_stderr():
        engine = Engine(scenario, InlineBackend())
        if events is not None:
            return engine.run(lambda r, m: events.put(("round", token, r, m)),
                              lambda r, s: events.put(("checkpoint", token, r, s)), resume)
        bar = ProgressLine(label, scenario.rounds, quiet=True, stream=sys.stderr) if label else None
        return engine.run(bar.update if bar is not None else None, None, resume)


def task_resources(sc: Scenario, gpus: float, parallel: int) -> dict[str, Any]:
    """A sweep point's Ray task: ``runtime.num_cpus`` CPUs and, for a point on a GPU, its
    ``num_gpus`` or the cluster's GPUs shared out among the points run at once; a fresh
    pinned process under ``deterministic: strict``."""
    from simulator.pinning import strict_options
    from simulator.runtime.backend import gpu_share

    rt = sc.runtime
    share = gpu_share(rt.num_gpus, rt.device != "cpu" or rt.server_device != "cpu", gpus,
                      parallel)
    return {"num_cpus": rt.num_cpus, **({"num_gpus": share} if share > 0 else {}),
            **strict_options(rt.strict)}


class TaskExecutor:
    """Points several at a time (at most ``cap``), each a Ray task on ``backend`` (a
    RayBackend). One failed point does not stop the others: it is marked FAILED and named
    in ``exp.result.failed``. On an interrupt the points in flight are cancelled and marked
    KILLED."""

    def __init__(self, backend: Any, cap: int) -> None:
        self.backend, self.cap, self.ray = backend, cap, backend.ray
        self.live: dict[int, PointRun] = {}  # token -> the point run its task streams to

    def run(self, exp: Experiment, works: list[Work], tmp: Path) -> None:
        from ray.util.queue import Queue

        if not works:
            return
        self.backend.evict_idle()  # a warm pool's idle actors hold the CPUs the tasks need
        events = Queue(actor_options={"num_cpus": 0})
        remote = self.ray.remote(num_cpus=1, max_retries=1)(_simulate)
        pending: dict[Any, tuple[int, Work]] = {}
        todo = list(enumerate(works))
        try:
            while todo or pending:
                while todo and len(pending) < self.cap:
                    token, work = todo.pop(0)
                    self.live[token] = exp.start(work, self.backend, tmp / str(token))
                    resources = task_resources(work.point.scenario, self.backend.gpus(),
                                                self.cap)
                    logger.debug("%s: a Ray task with %s%s", work.label, resources,
                                 f", from round {work.state['round'] + 2}" if work.state else "")
                    task = remote.options(**resources)
                    ref = task.remote(work.point.scenario, work.label, work.state, events, token,
                                      registry.session_plugins())
                    pending[ref] = (token, work)
                ready, _ = self.ray.wait(list(pending), num_returns=1, timeout=POLL_SECONDS)
                self._drain(exp, events)  # a finished task's puts are all in the queue
                for ref in ready:
                    self._collect(exp, ref, *pending.pop(ref), len(works))
        except BaseException as e:
            for ref in pending:
                self.ray.cancel(ref, force=True)
            for run in list(self.live.values()):  # in flight, or being collected
                exp.end(run, None, end_status("FAILED", e))
            raise
        finally:
            self.ray.kill(events.actor)

    def _drain(self, exp: Experiment, events: Any) -> None:
        """The rounds and checkpoints the tasks streamed, to the callbacks of their runs. A
        task retried after its worker died sends again rounds the driver has: skipped."""
        n = events.qsize()
        for kind, token, r, payload in events.get_nowait_batch(n) if n else []:
            run = self.live[token]
            if kind == "round" and r >= len(run.rows):
                exp.on_round(run, r, payload)
            elif kind == "checkpoint" and r + 1 >= len(run.rows):
                exp.on_checkpoint(run, r, payload)

    def _collect(self, exp: Experiment, ref: Any, token: int, work: Work, total: int) -> None:
        """A task that ended: its run's end (FINISHED, or FAILED with its error in one
        line), its headline."""
        run = self.live[token]
        try:
            result = self.ray.get(ref)
        except Exception as e:  # noqa: BLE001 - one failed point does not stop the sweep
            exp.end(run, None, "FAILED")
            del self.live[token]
            point_failed(exp, work, e)
            return
        exp.end(run, result, "FINISHED")
        del self.live[token]
        point_done(exp, work, run.run_id, summary(run.run_id, run.point, result), total)


class SerialExecutor:
    """A sweep's points one after another in this process, on the inline backend: ``fedray
    sweep`` where that is estimated to finish first (``runtime.backend: auto``; short
    points, whose Ray tasks would cost more to start than they compute) or asked for
    (``inline``). As under ``TaskExecutor``, a point that fails is marked FAILED, named in
    ``exp.result.failed``, and the others go on; an interrupt marks the point running
    KILLED."""

    def __init__(self, backend: Any) -> None:
        self.pool = PoolExecutor(backend)

    def run(self, exp: Experiment, works: list[Work], tmp: Path) -> None:
        for token, work in enumerate(works):
            run = exp.start(work, self.pool.backend, tmp / str(token))
            try:
                done = self.pool.execute(exp, run, work.state)  # ends the run, either way
            except Exception as e:  # noqa: BLE001 - one failed point does not stop the sweep
                point_failed(exp, work, e)
                continue
            point_done(exp, work, run.run_id, done, len(works))


def point_failed(exp: Experiment, work: Work, error: Exception) -> None:
    """A sweep's point that failed: named in ``exp.result.failed``, its error in one line."""
    cause = getattr(error, "cause", None) or error  # a RayTaskError wraps the real error
    removed = exp.needs.explain(error)  # a file it needed, removed: said as that
    text = (str(removed or cause).strip().splitlines() or [""])[-1]
    logger.warning("%s: FAILED (%s: %s)", work.label, type(removed or cause).__name__, text)
    exp.result.failed.append(work.label)


def point_done(exp: Experiment, work: Work, run_id: str, done: dict[str, Any],
               total: int) -> None:
    """A sweep's point that finished: into ``exp.result.runs``, its headline."""
    exp.result.runs.append(done)
    logger.info("%s: %s  (run %s; %d/%d)", work.label, final_text(done), run_id,
                len(exp.result.runs) + len(exp.result.failed), total)
