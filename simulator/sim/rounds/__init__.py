"""Round protocols: what a round is, composed with the engine's loop (``simulator.sim.engine``).

The engine owns the loop, fault handling and checkpoint timing; a protocol owns its actors
besides the ClientWorker pool, and what one round does with them: server rounds (the FedAvg
family, ``ServerRounds``) and gossip rounds (D-SGD, ``GossipRounds``). A protocol that
drives time by events instead of rounds (an asynchronous server) implements the same
hooks, one "round" being one server step.
"""

from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from simulator import data as fdata
from simulator.config.plan import Plan
from simulator.messages import RoundReport
from simulator.runtime.backend import Backend
from simulator.sim.accounting import PrivacyAccountant
from simulator.sim.placement import WorkerPool

_REGISTERED: dict[str, type[RoundProtocol]] = {}


def protocols() -> dict[str, type[RoundProtocol]]:
    """Every round protocol by name: each module of this package imported once, so that a
    new protocol is one new module (and the ``server.mode`` that names it)."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
    return dict(_REGISTERED)


@dataclass
class RunContext:
    """What a protocol works with: the run's Plan, backend, data, worker pool, privacy
    accountant and Byzantine clients (the first set, with switching identities)."""

    plan: Plan
    backend: Backend
    data: fdata.FederatedData
    pool: WorkerPool
    accountant: PrivacyAccountant
    byzantine: set[int]

    def byzantine_at(self, round_: int) -> set[int]:
        """The Byzantine clients of round ``round_``: the one set, or with switching
        identities (``clients.byzantine_period``) the set of its period."""
        c = self.plan.scenario.clients
        epoch = round_ // c.byzantine_period if c.byzantine_period else 0
        if epoch == 0:
            return self.byzantine
        from simulator.sim.sampling import byzantine_clients

        return set(byzantine_clients(self.plan.seed, c.total, c.byzantine, epoch).tolist())

    def evaluate_now(self, round_: int) -> bool:
        """Whether round ``round_`` (0-based) ends with an evaluation: every
        ``evaluation.every`` rounds, and the last."""
        sc = self.plan.scenario
        return (round_ + 1) % sc.evaluation.every == 0 or round_ + 1 == sc.rounds


class RoundProtocol(ABC):
    """The hooks the engine calls, in this order: ``start`` (spawn the protocol's actors,
    while the workers start), ``ready`` (the workers are up), then ``run_round`` per round,
    with ``checkpoint`` / ``restore`` between rounds, ``workers_moved`` after a lost worker's
    clients moved, ``final`` at the end.

    A subclass with a ``name`` is the protocol of that name (``Plan.protocol``: a
    ``server.mode``'s ``ModePlan.protocol``, or ``gossip``): defining it in a module of this
    package registers it (:func:`protocols`)."""

    # the name a Plan gives it; a class without one (a base) is not registered
    name: ClassVar[str | None] = None
    # whether a round's training may be submitted before the last round ends
    prefetch: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in vars(cls) and cls.name is not None:
            if _REGISTERED.get(cls.name, cls) is not cls:
                raise TypeError(f"two round protocols are named {cls.name!r}: "
                                f"{_REGISTERED[cls.name].__qualname__} and {cls.__qualname__}")
            _REGISTERED[cls.name] = cls

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    @classmethod
    def trainings_per_round(cls, plan: Plan) -> float:
        """How many clients train in one of the protocol's rounds, on average: what the
        run's work is estimated from before a backend is chosen (``simulator.sim.work``).
        Server rounds: the sampled clients."""
        return float(plan.scenario.clients.sampled)

    @abstractmethod
    def start(self) -> list[Any]:
        """Spawn the protocol's actors; returns them (the engine releases them at the end)."""

    @abstractmethod
    def ready(self) -> dict[str, str]:
        """The workers have started: read what the run needs from the actors; returns run
        params the protocol derived (logged with the run's)."""

    @property
    def has_buffers(self) -> bool:
        """Whether the model has buffers (BatchNorm statistics) the protocol carries."""
        return False

    @abstractmethod
    def run_round(self, round_: int, prefetch: bool = False) -> RoundReport:
        """Round ``round_``. ``prefetch``: the next round's work may be submitted before
        this round's results are read (only where ``prefetch`` is allowed)."""

    def drop_prefetched(self) -> None:
        """Forget work submitted ahead (the round is computed again after a loss)."""
        return

    @abstractmethod
    def checkpoint(self) -> dict[str, Any]:
        """The protocol's part of the run's state after a round."""

    @abstractmethod
    def restore(self, state: dict[str, Any]) -> list[Any]:
        """Restore the protocol's part of ``state``; returns the calls to wait for."""

    def workers_moved(self, round_: int, redo_round: bool) -> None:
        """A lost worker's clients moved (``redo_round``: round ``round_`` is computed
        again)."""
        return

    def tables(self) -> dict[str, dict[str, list]]:
        """The protocol's tables logged as artifacts at the end (an audit's canaries)."""
        return {}

    @abstractmethod
    def final(self) -> tuple[np.ndarray, dict[str, Any], dict[str, str]]:
        """(final flat parameters, model state_dict, run params derived at the end)."""
