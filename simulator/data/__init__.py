"""Federated data: a dataset split over clients, and where workers read each client's rows.

``data.load: all`` (the default) loads the data set once into one Arrow table sorted by
client (:class:`TableSource`); the table goes into Ray's object store once and workers slice
their clients' rows zero-copy with the ``offsets`` array (client ``k`` owns rows
``offsets[k]:offsets[k+1]``). ``data.load: cohort`` keeps only the data set's
:class:`~strategies.protocols.Population` (its parameters, or where its files are, and each
client's sample count): a worker generates or reads the clients of its call, and memory
grows with the cohort, not with the population. The test and train-loss samples are then
those of a seeded subset of clients (:data:`EVAL_CLIENTS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa

from simulator import registry
from simulator.data.datasets import DataError, DatasetSplit
from simulator.errors import UsageError
from simulator.messages import EvalData
from strategies.protocols import Population, PopulationDataset, gather

__all__ = ["DataError", "DatasetSplit", "FederatedData", "TableSource", "build", "client_arrays",
           "with_candidates"]

TRAIN_EVAL_MAX = 10_000
TEST_MAX = 10_000  # data.load cohort: held-out samples of the evaluation clients, at most
EVAL_CLIENTS = 1_000  # data.load cohort: the clients whose samples evaluate the model


class TableSource:
    """Every client's training rows in one Arrow table sorted by client (``data.load:
    all``): client ``k`` owns rows ``offsets[k]:offsets[k+1]``; a worker reads them as
    zero-copy NumPy views of the table (shared through Ray's object store)."""

    def __init__(self, table: pa.Table, offsets: np.ndarray, input_shape: tuple[int, ...]) -> None:
        self.table = table  # client int32, x fixed_size_list<float32 or uint8>, y; by client
        self.offsets = np.asarray(offsets, dtype=np.int64)  # (num_clients + 1,)
        self.input_shape = tuple(input_shape)
        self._views: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_views": None}  # views of this process's buffers

    def train(self, clients: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each client's rows ``(x, y)``, read-only views of the table."""
        if self._views is None:
            self._views = client_arrays(self.table, self.input_shape)
        x, y = self._views
        return [(x[self.offsets[k]:self.offsets[k + 1]], y[self.offsets[k]:self.offsets[k + 1]])
                for k in map(int, clients)]


ClientSource = TableSource | Population  # what a ClientWorker reads its clients' rows from


@dataclass(frozen=True)
class FederatedData:
    source: ClientSource
    input_shape: tuple[int, ...]
    num_classes: int
    x_test: np.ndarray
    y_test: np.ndarray
    x_train_eval: np.ndarray  # a fixed seeded subsample of the training data for train loss
    y_train_eval: np.ndarray
    c_test: np.ndarray | None = None  # each test sample's client (-1: none), natural partitions
    vocabulary: int | None = None  # token data: the number of token ids
    # a shadow-run membership attack's candidates (x, y as stored, included: bool), the ones
    # not included removed from their clients (``with_candidates``)
    candidates: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def eval_data(self) -> EvalData:
        """What the evaluating actor receives: test and train-loss samples, test clients."""
        return EvalData(self.x_test, self.y_test, self.x_train_eval, self.y_train_eval,
                        self.c_test)

    @property
    def num_clients(self) -> int:
        return len(self.source.sizes)

    def client_sizes(self) -> np.ndarray:
        return np.asarray(self.source.sizes, dtype=np.int64)


def with_candidates(data: FederatedData, rows: np.ndarray, included: np.ndarray
                    ) -> FederatedData:
    """``data`` (``load: all``) with the candidate ``rows`` of its table whose ``included``
    is False removed from their clients' training rows, every candidate's sample kept in
    ``candidates`` (a shadow-run membership attack scores them on the final model)."""
    src = data.source
    if not isinstance(src, TableSource):
        raise UsageError("privacy_attacks: a shadow-run attack removes samples from the "
                         "clients' table: use data.load: all")
    x, y = client_arrays(src.table, src.input_shape)
    drop = np.asarray(rows)[~np.asarray(included, dtype=bool)]
    keep = np.setdiff1d(np.arange(len(y)), drop)
    owner = np.searchsorted(src.offsets, drop, side="right") - 1
    sizes = src.sizes - np.bincount(owner, minlength=len(src.sizes))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    source = TableSource(src.table.take(arrow_view(keep.astype(np.int64))), offsets,
                         src.input_shape)
    return replace(data, source=source,
                   candidates=(x[rows].copy(), y[rows].copy(), np.asarray(included, bool)))


def partition_table(x: np.ndarray, y: np.ndarray, parts: list[np.ndarray]) -> tuple[pa.Table, np.ndarray]:
    """One Arrow table with every client's rows, in client order, and the row offsets."""
    order = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    sizes = np.array([len(p) for p in parts], dtype=np.int64)
    width = int(np.prod(x.shape[1:]))
    xdtype, ydtype = stored_dtypes(x.dtype, y.dtype)
    flat: np.ndarray = np.ascontiguousarray(x[order].reshape(len(order), width), dtype=xdtype)
    return client_table(flat, np.ascontiguousarray(y[order], dtype=ydtype), sizes)


def stored_dtypes(x: np.dtype, y: np.dtype) -> tuple[type, type]:
    """How the table stores samples and targets: uint8 images stay uint8 (a quarter of the
    memory and of the object store's bytes; the worker scales them to [0, 1],
    runtime.common.model_input), int32 token ids stay int32, other features float32; class
    ids int64, real-valued targets (regression) float32."""
    xdtype = x.type if x in (np.uint8, np.int32) else np.float32
    return xdtype, (np.float32 if np.issubdtype(y, np.floating) else np.int64)


def client_table(flat: np.ndarray, y: np.ndarray, sizes: np.ndarray) -> tuple[pa.Table, np.ndarray]:
    """The table over ``flat`` (``(rows, width)``, in client order, stored dtypes) and
    ``y`` without a copy, ``sizes[k]`` rows of client ``k``; and the row offsets."""
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    xs = pa.FixedSizeListArray.from_arrays(arrow_view(flat.reshape(-1)), flat.shape[1])
    client = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
    return pa.table({"client": arrow_view(client), "x": xs, "y": arrow_view(y)}), offsets


CHUNK = 4096  # clients generated or read at a time when a population is loaded whole


def _whole(pop: Population, seed: int) -> FederatedData:
    """``data.load: all`` of a population under a partitioner that keeps its clients: the
    clients' rows written a chunk at a time straight into the table's buffers, so the peak
    is the data (the training rows once, the test rows twice while they are joined), not
    the several copies loading, splitting and partitioning would make. The same table,
    test and train-loss samples as ``partition_table`` of ``gather(pop)``."""
    sizes = np.asarray(pop.sizes, dtype=np.int64)
    _no_empty_client(sizes)
    width = int(np.prod(pop.input_shape))
    tests: list[tuple[np.ndarray, np.ndarray, Any]] = []  # each chunk's held-out rows
    at = 0
    for lo in range(0, len(sizes), CHUNK):
        part = gather(pop, range(lo, min(lo + CHUNK, len(sizes))))
        if not tests:  # the table's buffers, in the dtypes the samples are stored in
            dtypes = part.x_train.dtype, part.y_train.dtype
            xdtype, ydtype = stored_dtypes(*dtypes)
            flat: np.ndarray = np.empty((int(sizes.sum()), width), dtype=xdtype)
            y: np.ndarray = np.empty(len(flat), dtype=ydtype)
        m = len(part.y_train)
        flat[at:at + m] = part.x_train.reshape(m, width)
        y[at:at + m] = part.y_train
        at += m
        tests.append((part.x_test, part.y_test, part.clients_test))  # not the chunk's train
    table, offsets = client_table(flat, y, sizes)
    pick = np.sort(np.random.default_rng([seed, 0xE7]).permutation(len(y))[:TRAIN_EVAL_MAX])
    shape = tuple(pop.input_shape)
    return FederatedData(
        source=TableSource(table, offsets, shape), input_shape=shape,
        num_classes=pop.num_classes,
        x_test=np.concatenate([t[0] for t in tests]),
        y_test=np.concatenate([t[1] for t in tests]),
        x_train_eval=flat[pick].reshape(-1, *shape).astype(dtypes[0], copy=False),
        y_train_eval=y[pick].astype(dtypes[1], copy=False),
        c_test=np.concatenate([t[2] for t in tests]),
        vocabulary=pop.vocabulary,
    )


def arrow_view(a: np.ndarray) -> pa.Array:
    """A contiguous 1-D numeric array as an Arrow array over the same memory. ``pa.array``
    would do the same, but its first call imports pandas (0.4 s) to ask whether ``a`` is a
    pandas object."""
    return pa.Array.from_buffers(pa.from_numpy_dtype(a.dtype), len(a), [None, pa.py_buffer(a)])


def client_arrays(table: pa.Table, input_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Zero-copy NumPy views ``(x, y)`` of all rows of a partition table."""
    xcol = _one_chunk(table.column("x"))
    x = numpy_view(xcol.flatten()).reshape(len(xcol), *input_shape)  # offset kept
    y = numpy_view(_one_chunk(table.column("y")))
    return x, y


def _one_chunk(column: pa.ChunkedArray) -> pa.Array:
    """The column as one array: its one chunk as it is (``combine_chunks`` copies even a
    single chunk, which was a second copy of the data in every worker), else joined."""
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


_NUMPY_NAMES = {"float": "float32", "double": "float64", "halffloat": "float16"}


def numpy_view(a: pa.Array) -> np.ndarray:
    """A zero-copy read-only NumPy view of a numeric Arrow array without nulls: what
    ``a.to_numpy(zero_copy_only=True)`` gives, without its first call importing pandas."""
    if a.null_count or not (pa.types.is_integer(a.type) or pa.types.is_floating(a.type)):
        raise ValueError(f"numpy_view takes numeric arrays without nulls, got {a.type}")
    dtype = np.dtype(_NUMPY_NAMES.get(str(a.type), str(a.type)))
    view = np.frombuffer(a.buffers()[1], dtype=dtype, count=len(a),
                         offset=a.offset * dtype.itemsize)
    view.flags.writeable = False  # shared with the table (and with other clients' views)
    return view


def build(dataset: dict, partitioner: dict, num_clients: int, seed: int, test_fraction: float,
          load: str = "all") -> FederatedData:
    """Load the named dataset and split it over ``num_clients`` with the named partitioner
    (``load: all``), or keep its population to read a cohort at a time (``load: cohort``).

    ``dataset`` and ``partitioner`` are validated plugin specs ``{"name": ..., **params}``.
    """
    ds_params = {k: v for k, v in dataset.items() if k != "name"}
    ds = registry.get("datasets", dataset["name"])(**ds_params)
    if load == "cohort":
        return _cohort(ds, num_clients, seed, test_fraction)
    if isinstance(ds, PopulationDataset) and ds.whole_is_gathered and \
            registry.get("partitioners", partitioner["name"]).traits.natural:
        return _whole(ds.population(num_clients, seed, test_fraction), seed)
    split: DatasetSplit = ds.load(num_clients, seed, test_fraction)
    part_params = {k: v for k, v in partitioner.items() if k != "name"}
    rng = np.random.default_rng([seed, 0xA7])
    part = registry.get("partitioners", partitioner["name"])(**part_params)
    parts = part(split.y_train, num_clients, rng, split.clients_train)
    c_test = (part.test_clients(split.clients_train, split.clients_test)
              if split.clients_train is not None and split.clients_test is not None else None)
    _no_empty_client(np.array([len(p) for p in parts]))
    table, offsets = partition_table(split.x_train, split.y_train, parts)
    n = len(split.y_train)
    pick = np.sort(np.random.default_rng([seed, 0xE7]).permutation(n)[:TRAIN_EVAL_MAX])
    return FederatedData(
        source=TableSource(table, offsets, tuple(split.input_shape)),
        input_shape=tuple(split.input_shape),
        num_classes=split.num_classes,
        x_test=split.x_test,
        y_test=split.y_test,
        x_train_eval=split.x_train[pick],
        y_train_eval=split.y_train[pick],
        c_test=c_test,
        vocabulary=split.vocabulary,
    )


def _no_empty_client(sizes: np.ndarray) -> None:
    empty = np.flatnonzero(sizes == 0)
    if len(empty):
        raise DataError(
            f"data.partitioner: {len(empty)} of {len(sizes)} clients got no sample "
            f"(first: client {int(empty[0])}); use fewer clients or another partitioner"
        )


def _cohort(ds: Any, num_clients: int, seed: int, test_fraction: float) -> FederatedData:
    """``data.load: cohort``: the data set's population, read a cohort at a time; the model
    is evaluated on the held-out samples (at most :data:`TEST_MAX`) and the training
    samples (at most :data:`TRAIN_EVAL_MAX`) of :data:`EVAL_CLIENTS` clients drawn once."""
    if not isinstance(ds, PopulationDataset):  # config checks refuse it before this
        raise UsageError("data.load: cohort needs a data set that gives one client at a time")
    pop = ds.population(num_clients, seed, test_fraction)
    _no_empty_client(np.asarray(pop.sizes))
    rng = np.random.default_rng([seed, 0xE7])
    n = len(pop.sizes)
    chosen = np.sort(rng.choice(n, size=min(n, EVAL_CLIENTS), replace=False))
    ev = gather(pop, chosen.tolist())
    test = np.sort(rng.permutation(len(ev.y_test))[:TEST_MAX])
    train = np.sort(rng.permutation(len(ev.y_train))[:TRAIN_EVAL_MAX])
    assert ev.clients_test is not None
    return FederatedData(
        source=pop,
        input_shape=tuple(pop.input_shape),
        num_classes=pop.num_classes,
        x_test=ev.x_test[test],
        y_test=ev.y_test[test],
        x_train_eval=ev.x_train[train],
        y_train_eval=ev.y_train[train],
        c_test=ev.clients_test[test],
        vocabulary=pop.vocabulary,
    )
