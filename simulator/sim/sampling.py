"""Who takes part in a round: the run's Byzantine clients, each round's sample, and who of
the sample drops out or misses the deadline. Every draw comes from (seed, purpose, round)
alone, so it does not depend on the backend, the worker count or the order of calls."""

from __future__ import annotations

from typing import Any

import numpy as np

from simulator.seeding import numpy_rng


def byzantine_clients(seed: int, total: int, f: int, epoch: int = 0) -> np.ndarray:
    """The Byzantine client ids of a run (seeded): its one set, or with switching identities
    (``clients.byzantine_period``) the set of ``epoch`` (epoch 0 is the one set)."""
    rng = numpy_rng(seed, "byzantine") if epoch == 0 else numpy_rng(seed, "byzantine", epoch)
    return np.sort(rng.choice(total, size=f, replace=False))


def missed_round(seed: int, round_: int, clients: list[int], steps: np.ndarray, dropout: float,
                 stragglers: Any, blocks: int = 1) -> tuple[set[int], dict[int, int]]:
    """(dropped, late): the ``clients`` that drop out of the round (probability ``dropout``)
    and the stragglers of the rest (``clients.stragglers``, by its ``kind``), each with the
    minibatch steps it finished (what it sends under ``stragglers.partial``; 0: none).

    ``deadline``: those whose simulated time ``steps[c] * exp(sigma z_c + jitter e_cr)``
    exceeds the deadline, having finished ``floor(steps[c] * deadline / time)`` steps
    (:func:`late_work`; fewer than ``steps[c]``). One draw per client id from (seed,
    purpose, round): the outcome of a client does not depend on who else was sampled.

    ``epochs``: :func:`straggler_work` of the rest, their full work ``steps[c]`` made of
    ``blocks`` whole blocks (``local.epochs``' epochs, or ``local.steps``' single steps)."""
    if not clients:
        return set(), {}
    ids = np.asarray(clients, dtype=np.int64)
    total = len(steps)
    dropped: set[int] = set()
    if dropout > 0:
        u = numpy_rng(seed, "dropout", round_).random(total)
        dropped = set(ids[u[ids] < dropout].tolist())
    late: dict[int, int] = {}
    if stragglers is not None and stragglers.kind == "epochs":
        kept = ids[~np.isin(ids, np.fromiter(dropped, np.int64, len(dropped)))]
        late = straggler_work(seed, round_, kept, steps, stragglers.fraction, blocks)
    elif stragglers is not None:
        z = numpy_rng(seed, "speed").standard_normal(total)
        e = numpy_rng(seed, "jitter", round_).standard_normal(total)
        duration = steps * np.exp(stragglers.sigma * z + stragglers.jitter * e)
        late = {c: k for c, k in late_work(ids, duration, stragglers.deadline, steps).items()
                if c not in dropped}
    return dropped, late


def straggler_work(seed: int, round_: int, ids: np.ndarray, steps: np.ndarray,
                   fraction: float, blocks: int) -> dict[int, int]:
    """FedProx's systems heterogeneity (Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith,
    "Federated Optimization in Heterogeneous Networks", MLSys 2020, Section 5.2): of the m
    clients ``ids`` that train this round, ``m - round(m (1 - fraction))`` (the count the
    authors' code takes) are stragglers, each doing x whole blocks of its ``blocks``
    (``steps[c] / blocks`` minibatch steps each: an epoch, or one step), x uniform in
    [1, blocks]. Returns {straggler: x * steps[c] / blocks}. The stragglers are the n of
    ``ids`` with the smallest of one uniform key per client id, and x is one draw per client
    id, both from (seed, round): the same clients do the same work whatever is done with
    it (``partial``, the client rule). No time is drawn: the work is the model's."""
    m = len(ids)
    n = m - round(m * (1.0 - fraction))
    if n <= 0:
        return {}
    rng = numpy_rng(seed, "stragglers", round_)
    total = len(steps)
    key, units = rng.random(total), rng.integers(1, blocks + 1, size=total)
    chosen = ids[np.argsort(key[ids], kind="stable")[:n]]
    done = units[chosen] * (steps[chosen].astype(np.int64) // blocks)
    return dict(zip(chosen.tolist(), done.tolist(), strict=True))


def late_work(ids: np.ndarray, duration: np.ndarray, deadline: float, steps: np.ndarray
              ) -> dict[int, int]:
    """The clients of ``ids`` whose task takes longer than ``deadline`` (``duration`` and
    ``steps`` indexed by client id), each with the minibatch steps it finished by then,
    ``floor(steps[c] * deadline / duration[c])``, at most ``steps[c] - 1``: the one deadline
    rule of both sources of stragglers (``clients.stragglers``' step times, and the devices
    of ``server.mode: deadline``)."""
    over = ids[duration[ids] > deadline]
    done = np.floor(steps[over] * (deadline / duration[over])).astype(np.int64)
    return {int(c): min(int(k), int(steps[c]) - 1)
            for c, k in zip(over.tolist(), done.tolist(), strict=True)}


def attacker_ranks(byzantine: set[int] | frozenset[int] | np.ndarray) -> dict[int, int]:
    """Each Byzantine client's index among them, by id (0 .. f - 1): which part of a
    distributed trigger it trains with (DBA's attackers in order)."""
    return {int(c): i for i, c in enumerate(sorted(int(b) for b in byzantine))}


def sample_clients(seed: int, round_: int, total: int, k: int) -> np.ndarray:
    """The ``k`` clients of a round, drawn without replacement, sorted by id."""
    if k >= total:
        return np.arange(total)
    return np.sort(numpy_rng(seed, "sample", round_).choice(total, size=k, replace=False))
