"""The loop of a run point, shared by every backend and every round protocol.

``Engine`` resolves the point into its Plan (``simulator.config.plan``), starts the ClientWorker
pool (``simulator.sim.placement``) and the round protocol the Plan names (``simulator.sim.rounds``:
server rounds or gossip rounds), and runs the rounds: faults (a lost worker's clients move
and the round is computed again; lost per-client state sends the run back to its newest
state in memory), checkpoint timing, the callbacks. Privacy accounting is
``simulator.sim.accounting``.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simulator import data as fdata
from simulator.config import Scenario
from simulator.config.data_load import LoadChoice, choose_load
from simulator.config.plan import Plan, resolve, shadow_run
from simulator.errors import ClientStateLost, UsageError, WorkerLost
from simulator.messages import RoundReport
from simulator.runtime.backend import Backend
from simulator.runtime.privacy_attacks import shadow_candidates
from simulator.sim.accounting import PrivacyAccountant
from simulator.sim.placement import WorkerPool
from simulator.sim.rounds import RoundProtocol, RunContext, protocols
from simulator.sim.sampling import byzantine_clients
from strategies.trainers import step_counts

LOG = logging.getLogger("fedray.engine")

# called after each round with its metrics; True asks the run to stop after this round
RoundCallback = Callable[[int, dict[str, float]], bool | None]
CheckpointCallback = Callable[[int, dict[str, Any]], None]

PROTOCOLS: dict[str, type[RoundProtocol]] = protocols()  # by name: Plan.protocol


@dataclass
class RunResult:
    metrics: list[dict[str, float]]  # one row per round, deterministic values only
    final_params: np.ndarray
    model_state: dict[str, Any]
    timings: list[dict[str, float]] = field(default_factory=list)  # wall-clock, per round
    params: dict[str, str] = field(default_factory=dict)  # run params the engine derives
    tables: dict[str, dict[str, list]] = field(default_factory=dict)  # artifacts, by name
    # what the model takes (input_shape, num_classes, vocabulary, tokens): to rebuild it
    model_info: dict[str, Any] = field(default_factory=dict)

    def final(self, key: str) -> float:
        for row in reversed(self.metrics):
            if key in row:
                return row[key]
        return float("nan")


_data_cache: dict[tuple, fdata.FederatedData] = {}
_data_lock = threading.Lock()


def load_data(sc: Scenario) -> fdata.FederatedData:
    """The scenario's federated data (cached per dataset/partition/seed within a process).
    Thread-safe: ``fedray run`` loads the first point's data on a thread while Ray starts
    (``prefetch_data``), and the engine's call then waits for it and finds it here."""
    seed = sc.seeds[0]
    key = (repr(sc.data.model_dump()), sc.clients.total, seed)
    with _data_lock:
        if key not in _data_cache:
            _data_cache.clear()
            load, reason = data_load(sc)
            LOG.debug("fedray: data.load %s (%s)", load, reason)
            _data_cache[key] = fdata.build(
                sc.data.dataset, sc.data.partitioner, sc.clients.total, seed,
                sc.data.test_fraction, load)
        data = _data_cache[key]
    shadow = shadow_run(sc)
    if shadow is None:
        return data
    rows, included = shadow_candidates(data.client_sizes(), seed, shadow)
    return fdata.with_candidates(data, rows, included)


def forget_data() -> None:
    """Drop the data ``load_data`` keeps: a process that outlives a command (the warm pool,
    ``fedray.pool``) loads the next command's data again, as a new process would (a data
    file may have changed between them)."""
    with _data_lock:
        _data_cache.clear()


def data_load(sc: Scenario) -> tuple[str, str]:
    """How the scenario's data loads (all or cohort) and why: as validation resolved it,
    or, for a scenario that did not go through validation with ``load: auto``, chosen now
    (``simulator.config.data_load``; a choice it refuses is raised in one line)."""
    if sc.data.load != "auto":
        return sc.data.load, sc.data.load_reason or "as the scenario gives it"
    choice = choose_load(sc)
    if not isinstance(choice, LoadChoice):
        raise UsageError(choice.format(None) if choice else "data.load: auto chose nothing")
    return choice.load, f"auto: {choice.reason}"


def prefetch_data(sc: Scenario) -> None:
    """Start loading ``sc``'s data on a thread (``fedray run`` does while ``ray.init`` waits
    for its processes, about 2 s of it idle). The engine's own ``load_data`` call takes the
    result; when loading failed, the error stays in the thread's future, unread, and the
    engine's call loads again and raises it itself, in the run it belongs to."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedray-data")
    pool.submit(load_data, sc)
    pool.shutdown(wait=False)


@dataclass
class _Progress:
    """Where the loop is: the rows and timings so far, the next round, the last round the
    callback saw, the state to go back to when per-client state is lost, and the round
    after which a callback asked the run to stop."""

    rows: list[dict[str, float]]
    timings: list[dict[str, float]]
    round_: int
    reported: int
    rewind: tuple[int, dict[str, Any]] | None
    stopped: int | None = None


class Engine:
    """Runs one single-seed scenario (a sweep point) on a backend, with the round protocol
    its Plan names."""

    def __init__(self, scenario: Scenario, backend: Backend, workers: int | None = None) -> None:
        if len(scenario.seeds) != 1 or scenario.sweep:
            raise ValueError("Engine runs one point: expand the sweep and seeds first")
        if workers is not None and workers < 1:  # the CLI refuses it; here for the API
            raise UsageError(f"workers: must be an integer >= 1, got {workers}")
        self.plan: Plan = resolve(scenario)
        self.sc = scenario
        self.backend = backend
        self.seed = self.plan.seed
        self.n_workers = workers or scenario.runtime.workers or backend.default_workers()
        self.data = load_data(scenario)
        c = scenario.clients
        byzantine = set(byzantine_clients(self.seed, c.total, c.byzantine).tolist())
        # each client's local work in minibatch steps (its simulated time at speed 1)
        local_steps = step_counts(self.data.client_sizes(), scenario.local)
        self.pool = WorkerPool(self.plan, backend, self.data, self.n_workers, local_steps)
        self.accountant = PrivacyAccountant(self.plan, self.data.client_sizes(), local_steps)
        ctx = RunContext(self.plan, backend, self.data, self.pool, self.accountant, byzantine)
        self.protocol: RoundProtocol = PROTOCOLS[self.plan.protocol](ctx)
        self.derived: dict[str, str] = {}  # params the engine chose (logged with the run's)
        self._handles: list[Any] = []

    def actor_options(self) -> tuple[dict[str, float], dict[str, float]]:
        """Ray resources of (each ClientWorker, the server): ``WorkerPool.actor_options``."""
        return self.pool.actor_options()

    def start(self) -> None:
        """Start the workers and the protocol's actors (in parallel), then wait for the
        workers and let the protocol read what it needs."""
        self.pool.spawn()
        self._handles = self.pool.actors()
        self._handles += self.protocol.start()
        self.pool.await_workers()
        self.derived.update(self.protocol.ready())
        self.pool.stateful = self.plan.stateful_clients(self.protocol.has_buffers)

    def run(self, on_round: RoundCallback | None = None,
            on_checkpoint: CheckpointCallback | None = None,
            resume: dict[str, Any] | None = None,
            before_rounds: Callable[[], None] | None = None) -> RunResult:
        """Every round (from the one after ``resume["round"]`` when resuming a checkpoint),
        then the final model; every ``runtime.checkpoint_every`` rounds ``on_checkpoint``
        gets the run's whole state. The actors are released whatever happens.

        Per-client state that dies with a worker (worker momentum, mu2-SGD) is not lost for
        the run: it goes back to the newest state it holds in memory (the last checkpoint
        round, or the start) and computes the rounds since then again, on the live workers,
        with the same numbers; ``on_round`` is not called again for rounds it has seen.
        ``before_rounds`` is called once the actors are up, before the first round (the
        run's tracking store must have answered by then). When ``on_round`` returns True
        the run ends after that round, with its model then (the run param
        ``stopped_after_round`` says which)."""
        steps = self.steps(on_round, on_checkpoint, resume, before_rounds)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def steps(self, on_round: RoundCallback | None = None,
              on_checkpoint: CheckpointCallback | None = None,
              resume: dict[str, Any] | None = None,
              before_rounds: Callable[[], None] | None = None
              ) -> Generator[int, None, RunResult]:
        """``run`` one round at a time: yields the next round to compute after each step
        (a step that went back yields an earlier one) and returns the RunResult. Several
        engines in one process advance in lockstep this way (a trial of ``fedray tune``
        scores its points at each evaluation round). The actors are released when the
        generator ends or is closed."""
        try:
            self.start()
            if before_rounds is not None:
                before_rounds()
            p = self._begin(resume)
            while p.round_ < self.sc.rounds and p.stopped is None:
                self._step(p, on_round, on_checkpoint)
                if p.round_ < self.sc.rounds and p.stopped is None:
                    yield p.round_
            if p.stopped is not None:  # a callback asked: the prefetched round is not run
                self.protocol.drop_prefetched()
                self.derived["stopped_after_round"] = str(p.stopped + 1)
            return self._result(p)
        finally:
            self.backend.release(self._handles)

    def _begin(self, resume: dict[str, Any] | None) -> _Progress:
        rows: list[dict[str, float]] = []
        start = 0
        if resume is not None:
            self._restore(resume)
            rows = [dict(m) for m in resume["metrics"]]
            start = int(resume["round"]) + 1
        # (round, state) to go back to when per-client state is lost
        rewind = (start - 1, self._snapshot(rows)) if self.pool.stateful else None
        return _Progress(rows, [], start, start - 1, rewind)

    def _step(self, p: _Progress, on_round: RoundCallback | None,
              on_checkpoint: CheckpointCallback | None) -> None:
        """One round of the loop, its callbacks and its checkpoint when one is due."""
        r, every = p.round_, self.sc.runtime.checkpoint_every
        due = bool(every) and (r + 1) % every == 0 and r + 1 < self.sc.rounds and \
            (on_checkpoint is not None or p.rewind is not None)
        # the next round's training goes out before this round's results come back, unless
        # a checkpoint is due (it must see the workers between rounds) or the clients keep
        # state (a round computed again would advance it twice)
        prefetch = (self.backend.pipelined and self.protocol.prefetch
                    and not self.pool.stateful and not due and r + 1 < self.sc.rounds)
        try:
            report = self._round_surviving_losses(r, prefetch)
            saved = self._checkpoint_surviving_losses(r) if due else None
        except ClientStateLost as e:
            self._go_back(p, e)
            return
        p.rows.append(report.metrics)
        p.timings.append(report.timings)
        if on_round is not None and r > p.reported:
            if on_round(r, report.metrics):
                p.stopped = r
            p.reported = r
        if saved is not None:
            state = {**saved, "metrics": p.rows}
            if on_checkpoint is not None:
                on_checkpoint(r, state)
            if p.rewind is not None:
                p.rewind = (r, self._snapshot(p.rows, state))
        p.round_ = r + 1

    def _go_back(self, p: _Progress, e: ClientStateLost) -> None:
        """Per-client state was lost in round ``p.round_``: back to the newest state held."""
        if p.rewind is None:
            raise e
        r0, state = p.rewind
        where = "its start" if r0 < 0 else f"its state after round {r0 + 1}"
        LOG.warning("fedray: %s; the run goes back to %s and computes rounds %d-%d again",
                    e, where, r0 + 2, p.round_ + 1)
        self._restore(copy.deepcopy(state))
        p.rows = [dict(x) for x in state["metrics"]]
        del p.timings[len(p.timings) - (p.round_ - r0 - 1):]
        p.round_ = r0 + 1

    def _result(self, p: _Progress) -> RunResult:
        final, state, params = self.protocol.final()
        privacy_params, tables = self.accountant.outputs()
        tables = {**tables, **self.protocol.tables()}
        d = self.data
        info = {"input_shape": tuple(d.input_shape), "num_classes": d.num_classes,
                "vocabulary": d.vocabulary, "tokens": d.vocabulary is not None}
        return RunResult(p.rows, final, state, p.timings,
                         {**params, **privacy_params, **self.derived}, tables, info)

    def _snapshot(self, rows: list[dict[str, float]],
                  state: dict[str, Any] | None = None) -> dict[str, Any]:
        """A private copy of the run's state (``state``, or the current one) and ``rows``."""
        return copy.deepcopy({**(state or self._checkpoint()), "metrics": rows})

    def _round_surviving_losses(self, round_: int, prefetch: bool = False) -> RoundReport:
        """The protocol's round; when a ClientWorker is lost, its clients move to the live
        workers and the round is computed again: the same numbers, since a client's
        computation is a pure function of (seed, round, client) and the round's server step
        never ran."""
        while True:
            trained = set(self.pool.trained)
            try:
                return self.protocol.run_round(round_, prefetch)
            except WorkerLost as e:
                self.pool.trained = trained  # the round's training did not happen
                self.protocol.drop_prefetched()  # nor the next round's, if it was submitted
                self._move_clients(round_, e)

    def _checkpoint_surviving_losses(self, round_: int) -> dict[str, Any]:
        """``_checkpoint`` after ``round_``; a worker lost meanwhile has its clients moved
        (its per-client state, if any, raises ClientStateLost: the run goes back)."""
        while True:
            try:
                return self._checkpoint()
            except WorkerLost as e:
                self._move_clients(round_, e, redo_round=False)

    def _move_clients(self, round_: int, error: WorkerLost, redo_round: bool = True) -> None:
        self.pool.move_clients(round_, error, redo_round)
        self.protocol.workers_moved(round_, redo_round)

    def _checkpoint(self) -> dict[str, Any]:
        """The protocol's state and every live worker's client states (after a round)."""
        return {**self.protocol.checkpoint(), "clients": self.pool.client_states()}

    def _restore(self, state: dict[str, Any]) -> None:
        calls = self.protocol.restore(state)
        calls += self.pool.load_client_states(state["clients"])
        self.backend.get(calls)

    def privacy_mechanism(self, rounds: int) -> Any:
        """The run's DP mechanism after ``rounds`` rounds (``PrivacyAccountant.mechanism``)."""
        return self.accountant.mechanism(rounds)
