"""What crosses the actor boundary, typed: requests, results, Byzantine rows, evaluation data
and the parts of a checkpoint. This module imports no torch (NumPy arrays travel; the
actors wrap them with ``torch.from_numpy``), so the driver's and the actors' signatures are
checked by mypy without loading a model.

``Ref[T]`` is what a backend call returns: an object-store reference on Ray, the value
itself in-process. A ``Ref`` passed as a top-level argument of another call reaches the
actor as its value (Ray resolves it), so an actor method typed ``x: np.ndarray`` is called
with a ``Ref[np.ndarray]`` by its typed handle (``simulator.runtime.handles``).

Checkpoint parts are ``TypedDict``s, not dataclasses: a checkpoint is saved with
``torch.save`` and read back with ``torch.load(weights_only=True)``, which loads tensors,
numbers, strings, lists and dicts only (``simulator.run.checkpoint``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, NotRequired, TypedDict, TypeVar

import numpy as np

T_co = TypeVar("T_co", covariant=True)


class Ref(Generic[T_co]):
    """A backend's handle on a value of type ``T_co`` (typing only: never instantiated;
    covariant, since a reference is only read)."""

    __slots__ = ()


@dataclass(frozen=True)
class TrainRequest:
    """Train ``clients`` in ``round``. ``poison``: the spec of a data-poisoning attack these
    (Byzantine) clients run. ``expect_state``: clients whose state the worker must hold
    (they took part before); a worker that lost it says so instead of going on with other
    numbers. ``partial``: (client, steps) of the stragglers that complete only that many
    minibatch steps this round (``clients.stragglers.partial``). ``attackers``: (client, its
    index among the Byzantine clients) of the poisoned clients (a distributed trigger is
    split by it)."""

    round: int
    clients: tuple[int, ...]
    poison: dict[str, Any] | None = None
    expect_state: tuple[int, ...] = ()
    partial: tuple[tuple[int, int], ...] = ()
    attackers: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Encoded:
    """A payload a codec chain made (``codecs:``; ``strategies.protocols.Codec``): named
    arrays, one leading row a message (top-k's int32 ``indices`` and float32 ``values``;
    float16 rows), as they cross the object store."""

    parts: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(next(iter(self.parts.values()))) if self.parts else 0

    @property
    def nbytes(self) -> int:
        """The bytes of its arrays."""
        return sum(int(a.nbytes) for a in self.parts.values())


@dataclass(frozen=True)
class ClientRows:
    """Per-client results of one worker call, rows following ``clients``: a round's
    ``updates`` (float32 rows; with a codec chain, the :class:`Encoded` payload the server
    decodes; in D-SGD, the peers' models), the clients' training ``losses``
    (NaN where a peer did not train), the model ``buffers`` each client ends with (a model
    with BatchNorm statistics) and the call's ``seconds``."""

    clients: np.ndarray  # (k,) int64
    updates: np.ndarray | Encoded  # (k, d) float32, or a codec chain's payload
    losses: np.ndarray  # (k,) float64
    seconds: float = 0.0
    buffers: np.ndarray | None = None  # (k, d_b) float32

    @property
    def dense(self) -> np.ndarray:
        """``updates`` as float32 rows (D-SGD's models, a decoded payload: never encoded)."""
        assert isinstance(self.updates, np.ndarray), "an encoded payload, not rows"
        return self.updates


@dataclass(frozen=True)
class ByzantineRows:
    """The Byzantine clients' rows of a round (``(f, d)``) and, for a model with buffers,
    their buffer rows (``(f, d_b)``)."""

    rows: np.ndarray | Encoded
    buffers: np.ndarray | None = None


@dataclass(frozen=True)
class EvalData:
    """What an evaluating actor holds: the test samples and labels, the samples and labels
    the train loss is measured on, and each test sample's client (None: no per-client
    test sets)."""

    x_test: np.ndarray
    y_test: np.ndarray
    x_train: np.ndarray
    y_train: np.ndarray
    test_clients: np.ndarray | None = None


@dataclass(frozen=True)
class EvalScores:
    """A share of a data-parallel evaluation of the global model: for the test samples
    (``part`` "test") or the train-loss samples ("train"), each sample's loss and accuracy
    (None for a task without accuracy) over ``spans`` (``runtime.common.eval_spans``)."""

    part: str
    spans: tuple[tuple[int, int], ...]
    losses: np.ndarray  # float64, one per sample of the spans, in their order
    hits: np.ndarray | None


@dataclass(frozen=True)
class PersonalScores:
    """A worker's personal models (Ditto) measured on their clients' own test samples:
    the clients and each one's accuracy."""

    clients: np.ndarray  # int64
    accuracy: np.ndarray  # float64, one per client


class ServerCheckpoint(TypedDict):
    """Everything the server's future depends on (tensors, as torch.load reads them)."""

    x: Any  # the global parameters, a (d,) float32 tensor
    buffers: Any  # the global model's buffers, a (d_b,) float32 tensor
    optimizer: dict[str, Any]  # the server optimizer's state_dict
    pipeline: dict[str, Any]  # the stateful aggregation rules' state_dicts
    # asynchronous modes: the model version and the older versions clients train from
    # ({version: [parameters, buffers]}); absent from a synchronous run's checkpoint
    version: NotRequired[int]
    versions: NotRequired[dict[int, list[Any]]]
    latest: NotRequired[dict[int, Any]]  # server.mode latest: each client's latest row
    replica: NotRequired[Any]  # downlink compression: the clients' replica of the model
    codecs: NotRequired[dict[int, dict[str, Any]]]  # EF21: the server's estimate a client
    audit_x0: NotRequired[Any]  # an audit: the model its canaries' cosines measure from
    # privacy attacks: each reconstruction's target ({attack: {client, x, update}})
    attacks: NotRequired[dict[int, dict[str, Any]]]


Group = tuple[int, tuple[int, ...], int]  # (start version, clients, number of results)


@dataclass(frozen=True)
class StepLayout:
    """The rows of a server step: the honest ``groups`` (the clients that trained from one
    model version, in one train call whose ``ClientRows`` come in that many results, in
    turn), then the Byzantine rows, each from ``(client, version)``. A synchronous round is
    one group of its round's version. The asynchronous modes add, per row (honest then
    Byzantine): its staleness ``scales`` (None: every row as sent), its aggregation
    ``weights`` (None: unweighted) and its BASGD buffer (``buffer_of``); ``keep``: the
    versions still in flight after the step, whose models the server keeps; ``table``: the
    clients whose latest rows the step aggregates (``server.mode: latest``)."""

    groups: tuple[Group, ...]
    byzantine: tuple[tuple[int, int], ...] = ()
    scales: tuple[float, ...] | None = None
    weights: tuple[float, ...] | None = None
    buffer_of: tuple[int, ...] | None = None
    keep: tuple[int, ...] = ()
    # server.mode latest: the clients whose latest rows the step aggregates (the arrivals'
    # replace theirs), and which of them are Byzantine; weights then follow ``table``
    table: tuple[int, ...] | None = None
    table_byzantine: tuple[int, ...] = ()

    @property
    def honest_versions(self) -> list[int]:
        return [v for v, clients, _ in self.groups for _ in clients]

    @property
    def honest_count(self) -> int:
        return sum(len(clients) for _, clients, _ in self.groups)


@dataclass(frozen=True)
class RoundReport:
    """A round as the engine hands it on: its deterministic metrics (logged, compared
    across backends) and its wall-clock timings."""

    metrics: dict[str, float]
    timings: dict[str, float] = field(default_factory=dict)


def _fill_rows(out: np.ndarray, order: Sequence[int] | np.ndarray,
               results: Sequence[ClientRows], part: str) -> None:
    """Write the results' rows of ``part`` into ``out`` (one row per client of ``order``,
    in that order), where the rows of a result that already follow ``order`` go in with one
    contiguous copy and the others row by row: never a temporary of the whole matrix."""
    pos = {int(c): i for i, c in enumerate(np.asarray(order, dtype=np.int64))}
    if not pos:
        return
    for r in results:
        if not len(r.clients):
            continue
        where = np.fromiter((pos[int(c)] for c in r.clients), dtype=np.int64,
                            count=len(r.clients))
        rows = getattr(r, part)
        assert isinstance(rows, np.ndarray), "an encoded payload is decoded before stacking"
        lo = int(where[0])
        if np.array_equal(where, np.arange(lo, lo + len(where))):
            out[lo:lo + len(where)] = rows  # a block in place: one copy, no fancy index
        else:
            for i, w in enumerate(where):
                out[w] = rows[i]


def stack_rows(order: Sequence[int] | np.ndarray, results: Sequence[ClientRows], d: int,
               part: str = "updates") -> np.ndarray:
    """The results' rows of ``part`` (``updates``, ``buffers``: ``(len(order), d)``;
    ``losses``: ``(len(order),)`` when ``d == 0``) in ``order`` of client ids, whichever
    worker computed them: the layout, and so every floating-point sum over it, does not
    depend on the number of workers."""
    return stack_groups([(order, len(results))], results, d, part)


class RowBuffer:
    """One float32 matrix of update rows, reused from one round to the next while nothing
    kept the previous round's: a fresh 325 MB array every round (50 rows of a 1.6 M-parameter
    CNN) costs its page faults each time (30 ms warm, up to 0.4 s on pages this machine had
    not touched yet: measured in a server actor stacking two workers' results); reused, the
    pages stay mapped. Whether anything still holds the last matrix (an aggregator that
    keeps its rows, a tensor view of them) is the array's reference count, so a plugin that
    keeps what it was given gets a new matrix next round instead of having its rows
    overwritten."""

    def __init__(self) -> None:
        self._buf: np.ndarray | None = None
        self._alone = 0  # its reference count when only this object holds it

    def take(self, n: int, d: int) -> np.ndarray:
        """An uninitialised ``(n, d)`` float32 matrix: the kept one's first rows when it is
        wide enough, tall enough and nobody else holds it, else a new one (then kept)."""
        buf = self._buf
        free = buf is not None and sys.getrefcount(buf) <= self._alone + 1  # + ``buf``
        del buf
        if not free or self._buf is None or self._buf.shape[1] != d or len(self._buf) < n:
            self._buf = None  # let the old one go before the new one exists
            self._buf = np.empty((n, d), dtype=np.float32)
            self._alone = sys.getrefcount(self._buf)  # the interpreter's own count, measured
        return self._buf[:n]


def stack_groups(groups: Sequence[tuple[Sequence[int] | np.ndarray, int]], results: Sequence[ClientRows],
                 d: int, part: str = "updates", into: RowBuffer | None = None) -> np.ndarray:
    """``stack_rows`` of several train calls in turn: group ``g`` holds its clients' rows
    (in the order given) from the next ``n_g`` of ``results``. A client may appear in two
    groups (two tasks, from two model versions). The rows are copied once, into the one
    array returned (a round's matrix is the largest thing the server touches: 50 rows of a
    1.6 M-parameter CNN are 325 MB), which ``into`` gives when it is given."""
    total = sum(len(clients) for clients, _ in groups)
    out = into.take(total, d) if into is not None and d else \
        np.empty((total, d) if d else (total,), dtype=np.float32 if d else np.float64)
    at, i = 0, 0
    for clients, n in groups:
        _fill_rows(out[at:at + len(clients)], clients, results[i:i + n], part)
        at += len(clients)
        i += n
    return out


def stack_payloads(groups: Sequence[tuple[Sequence[int] | np.ndarray, int]],
                   results: Sequence[ClientRows]) -> np.ndarray | Encoded:
    """``stack_groups`` of the results' ``updates`` whichever form they travel in: float32
    rows, or each part of an :class:`Encoded` payload stacked in the same order."""
    if not results or not isinstance(results[0].updates, Encoded):
        return stack_groups(groups, results, results[0].dense.shape[1] if results else 0)
    first = results[0].updates
    out: dict[str, np.ndarray] = {}
    for name, a in first.parts.items():
        size = sum(len(clients) for clients, _ in groups)
        out[name] = np.empty((size, *a.shape[1:]), dtype=a.dtype)
    at, i = 0, 0
    for clients, n in groups:
        pos = {int(c): at + j for j, c in enumerate(np.asarray(clients, dtype=np.int64))}
        for r in results[i:i + n]:
            assert isinstance(r.updates, Encoded)
            where = [pos[int(c)] for c in r.clients]
            for name, a in r.updates.parts.items():
                out[name][where] = a
        at += len(clients)
        i += n
    return Encoded(out)
