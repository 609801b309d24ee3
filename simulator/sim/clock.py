"""The simulated clock of the asynchronous modes: a deterministic event queue that decides,
before any training, who trains from which model version and which updates each server
step applies.

What happens, in simulated seconds (``Schedule``):

* at most ``concurrency`` clients are in flight. A client starts a task from the current
  model version ``v``; its task ends ``duration(client, task)`` seconds later, when its
  update reaches the server (the clock does not depend on how long the real computation
  takes, nor on what the update holds);
* a client is in flight at most once, and starts at most one task per model version (a
  second task from the same model would be the same computation); the clients that may
  start are drawn uniformly among those, and among those active at that time when an
  availability trace says who is (``next_start``);
* an update that arrives ``tau`` steps after the version it started from is dropped when
  ``tau > max_staleness``, else buffered; the server steps when the buffer is full
  (``rule``): ``K`` updates (FedBuff; FedAsync is ``K = 1``), or one update in each of
  ``B`` buffers, client id mod ``B`` (BASGD). A freed slot is filled right after the step,
  so the new client starts from the new version;
* events at the same time are taken in client id order (the event heap's key is
  ``(finish time, client, start order)``); the draws come from one seeded stream, so the
  whole schedule is a function of the seed and the scenario.

Since nothing in it depends on the updates' values, the engine computes the schedule ahead
and trains each step's arrivals grouped by start version (one worker call per version),
and a resumed run computes the same schedule again up to its checkpoint.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from simulator.errors import ClockStalled
from simulator.seeding import numpy_rng

if TYPE_CHECKING:
    from simulator.config.schema import Asynchrony, Scenario

REJECTION_TRIES = 64  # uniform draws tried before listing the eligible clients


@dataclass(frozen=True)
class Task:
    """One client's task: from model ``version`` started at ``start``, its update arriving
    at ``finish``; ``seq`` is the start order (unique)."""

    client: int
    version: int
    start: float
    finish: float
    seq: int


@dataclass(frozen=True)
class Rule:
    """When the server steps: ``buffer_size`` updates (FedBuff, FedAsync), or one update in
    each of ``buffers`` buffers (BASGD) when ``buffers`` is set."""

    buffer_size: int = 1
    buffers: int | None = None


@dataclass(frozen=True)
class StepPlan:
    """One server step: its index (the model version it makes is ``index + 1``), its
    simulated time, the updates it applies (in arrival order) and, per update, how many
    updates its client has had applied so far (this one included); the updates dropped as
    too stale and the tasks started since the step before; the versions still in flight
    after it (the server keeps those models)."""

    index: int
    time: float
    arrivals: tuple[Task, ...]
    contributed: tuple[int, ...]
    dropped: int
    started: int
    in_flight: tuple[int, ...]
    clients_applied: int = 0  # distinct clients with an update applied, this step included
    # each client's updates applied, this step included (only with ``Schedule.tables``)
    applied: tuple[tuple[int, int], ...] = ()


@dataclass
class Schedule:
    """The event queue (see the module docstring). ``duration(client, task)``: the
    simulated seconds of the ``task``-th task (0-based) of ``client``; ``next_start(client,
    t)``: the earliest time >= t the client is active (None: always)."""

    total: int
    concurrency: int
    rule: Rule
    max_staleness: int | None
    duration: Callable[[int, int], float]
    seed: int
    next_start: Callable[[int, float], float] | None = None
    # clients whose updates claim to be fresh (a timing attack): never dropped as stale
    fresh: frozenset[int] = frozenset()
    # who starts next: uniformly (0), or in proportion to (id + 1) ** draw_power (Dahan &
    # Levy's arrival models: 1, 2)
    draw_power: int = 0
    # each step's plan carries every client's count of updates applied (server.mode latest)
    tables: bool = False
    # the state, advanced by ``next_step``
    time: float = 0.0
    version: int = 0
    # (time, client, start order, task); a wake-up (availability) is (time, -1, order, None)
    _heap: list[tuple[float, int, int, Task | None]] = field(default_factory=list)
    _wake_at: float = math.inf
    _busy: set[int] = field(default_factory=set)
    _started_now: set[int] = field(default_factory=set)  # started from the current version
    _tasks: dict[int, int] = field(default_factory=dict)  # tasks started per client
    _applied: dict[int, int] = field(default_factory=dict)  # updates applied per client
    _buffer: list[Task] = field(default_factory=list)
    _dropped: int = 0
    _started: int = 0
    _seq: int = 0
    _filled: bool = False

    def __post_init__(self) -> None:
        self._rng = numpy_rng(self.seed, "async-schedule")
        self._cumulative = None if not self.draw_power else \
            np.cumsum((np.arange(self.total, dtype=np.float64) + 1.0) ** self.draw_power)

    def _eligible(self, c: int, t: float) -> bool:
        if c in self._busy or c in self._started_now:
            return False
        return self.next_start is None or self.next_start(c, t) <= t

    def _draw(self, t: float) -> int | None:
        """A client that may start now, drawn uniformly, or in proportion to ``draw_power``
        of (its id + 1) (None: none may)."""
        cum = self._cumulative
        for _ in range(REJECTION_TRIES):
            c = int(self._rng.integers(self.total)) if cum is None else \
                int(np.searchsorted(cum, self._rng.random() * cum[-1], side="right"))
            if self._eligible(c, t):
                return c
        ok = [c for c in range(self.total) if self._eligible(c, t)]
        if not ok:
            return None
        if cum is None:
            return ok[int(self._rng.integers(len(ok)))]
        p = (np.asarray(ok, dtype=np.float64) + 1.0) ** self.draw_power
        return ok[int(np.searchsorted(np.cumsum(p), self._rng.random() * p.sum(), side="right"))]

    def _start(self, c: int, t: float) -> None:
        k = self._tasks.get(c, 0)
        self._tasks[c] = k + 1
        task = Task(c, self.version, t, t + float(self.duration(c, k)), self._seq)
        self._seq += 1
        self._started += 1
        self._busy.add(c)
        self._started_now.add(c)
        heapq.heappush(self._heap, (task.finish, c, task.seq, task))

    def _fill(self, t: float) -> None:
        """Start clients until ``concurrency`` are in flight; with an availability trace,
        when too few may start now, a wake-up at the first time one more may."""
        while len(self._busy) < self.concurrency:
            c = self._draw(t)
            if c is None:
                break
            self._start(c, t)
        if len(self._busy) < self.concurrency and self.next_start is not None:
            when = min((self.next_start(c, t) for c in range(self.total)
                        if c not in self._busy and c not in self._started_now),
                       default=math.inf)
            if t < when < self._wake_at:
                self._wake_at = when
                heapq.heappush(self._heap, (when, -1, self._seq, None))
                self._seq += 1

    def _ready(self) -> bool:
        r = self.rule
        if r.buffers is None:
            return len(self._buffer) >= r.buffer_size
        return len({t.client % r.buffers for t in self._buffer}) == r.buffers

    def next_step(self) -> StepPlan:
        """Simulate until the next server step and return it. Raises ClockStalled when no
        client will ever be active again before the buffer fills."""
        if not self._filled:
            self._filled = True
            self._fill(self.time)
        while True:
            if not self._heap:
                raise ClockStalled(
                    f"server step {self.version + 1}: no client can start a task any more "
                    "(speeds.availability has no later active window) before the server's "
                    f"buffer fills, with {len(self._buffer)} update(s) in it; give more "
                    "clients or later windows, or fewer rounds")
            finish, c, _, task = heapq.heappop(self._heap)
            self.time = finish
            if task is None:  # a wake-up: clients may start now
                if finish == self._wake_at:
                    self._wake_at = math.inf
                self._fill(self.time)
                continue
            self._busy.discard(c)
            if self.max_staleness is not None and c not in self.fresh and \
                    self.version - task.version > self.max_staleness:
                self._dropped += 1
            else:
                self._buffer.append(task)
            step = None
            if self._ready():
                contributed = []
                for a in self._buffer:
                    self._applied[a.client] = self._applied.get(a.client, 0) + 1
                    contributed.append(self._applied[a.client])
                step = StepPlan(self.version, self.time, tuple(self._buffer),
                                tuple(contributed), self._dropped, self._started, (),
                                len(self._applied),
                                tuple(sorted(self._applied.items())) if self.tables else ())
                self.version += 1
                self._buffer, self._dropped, self._started = [], 0, 0
                self._started_now = set()
            self._fill(self.time)
            if step is not None:
                # versions in flight after the step's replacements started (the new one too)
                kept = tuple(sorted({e[3].version for e in self._heap if e[3] is not None}))
                return dataclasses.replace(step, in_flight=kept)


def settings(sc: Scenario) -> Asynchrony:
    """The scenario's ``asynchrony`` block, or its defaults."""
    from simulator.config.schema import Asynchrony

    return sc.asynchrony or Asynchrony()


def step_rule(sc: Scenario) -> Rule:
    """When the server steps, by ``server.mode`` (its ``steps_on``)."""
    a, on = settings(sc), sc.server.resolved_mode.steps_on
    if on == "arrival":
        return Rule(1)
    if on == "buffers":
        return Rule(buffers=a.buffers)
    return Rule(a.buffer_size or concurrency(sc))


DRAW_POWER = {"uniform": 0, "id": 1, "id_squared": 2}


def concurrency(sc: Scenario) -> int:
    """Clients in flight: ``asynchrony.concurrency``, by default ``clients.per_round``."""
    return int(settings(sc).concurrency or sc.clients.sampled)


def rows_per_step(sc: Scenario) -> int:
    """How many rows the aggregation pipeline receives a step."""
    rule = step_rule(sc)
    if sc.server.resolved_mode.table:  # every client that has sent an update
        return sc.clients.total
    return rule.buffers if rule.buffers is not None else rule.buffer_size


def staleness_scale(function: str, a: float, b: int, tau: np.ndarray) -> np.ndarray:
    """s(tau) of ``asynchrony.staleness`` (``simulator.config.schema.Staleness``)."""
    tau = np.asarray(tau, dtype=np.float64)
    if function == "constant":
        return np.ones_like(tau)
    if function == "polynomial":
        return np.power(1.0 + tau, -a)
    return np.where(tau <= b, 1.0, 1.0 / (a * (tau - b) + 1.0))
