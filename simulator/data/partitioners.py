"""Partitioners: split training sample indices over clients.

``partition(y, num_clients, rng, clients) -> list of index arrays`` (one per client).
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
from annotated_types import Ge, Gt

from simulator.errors import DataError
from strategies.protocols import DatasetInfo, Partitioner, Traits

WHERE = "data.partitioner."  # a loaded split's errors name the scenario key in full


def _enough_samples(key: str, num_clients: int, per_client: int, samples: int,
                    where: str = "") -> None:
    """``num_clients`` x ``per_client`` samples must exist (DataError is a ValueError:
    validation reports it at ``key``, a load at ``data.partitioner.key``)."""
    if per_client * num_clients > samples:
        raise DataError(f"{where}{key}: {num_clients} clients x {per_client} needs "
                        f"{per_client * num_clients} training samples, the data set has "
                        f"{samples}")


def as_many_clients(natural: int, num_clients: int) -> None:
    """``natural`` (0: the data has no client column) must be ``num_clients``."""
    if not natural:
        raise DataError("data.partitioner: 'natural' needs a dataset with a client column "
                        "(synthetic, a LEAF data set, or parquet with client: COLUMN)")
    if natural != num_clients:
        raise DataError(f"clients.total: must equal the dataset's {natural} natural clients "
                        f"with partitioner 'natural', got {num_clients}")


def _enough_classes(k: int, classes: int, where: str = "") -> None:
    if k > classes:
        raise DataError(f"{where}k: {k} classes per client, the data has {classes}")


class IID(Partitioner):
    """Uniformly random, equal-size (to within one sample) split."""

    def __call__(self, y: np.ndarray, num_clients: int, rng: np.random.Generator,
                 clients: np.ndarray | None = None) -> list[np.ndarray]:
        return [np.sort(p) for p in np.array_split(rng.permutation(len(y)), num_clients)]


class Dirichlet(Partitioner):
    """Label skew by a Dirichlet prior (Hsu, Qi, Brown 2019): for each class, the share of
    its samples given to each client is drawn from Dir(alpha). Small alpha -> few classes per
    client. Redrawn (up to 100 times) until every client holds at least ``min_size`` samples."""

    traits = Traits(by_label=True)

    def __init__(self, alpha: Annotated[float, Gt(0)] = 0.5, min_size: Annotated[int, Ge(1)] = 1) -> None:
        self.alpha, self.min_size = alpha, min_size

    def check_data(self, num_clients: int, info: DatasetInfo) -> None:
        _enough_samples("min_size", num_clients, self.min_size, info.train_samples)

    def __call__(self, y: np.ndarray, num_clients: int, rng: np.random.Generator,
                 clients: np.ndarray | None = None) -> list[np.ndarray]:
        _enough_samples("min_size", num_clients, self.min_size, len(y), WHERE)
        classes = np.unique(y)
        for _ in range(100):
            parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
            for c in classes:
                idx = rng.permutation(np.flatnonzero(y == c))
                p = rng.dirichlet(np.full(num_clients, self.alpha))
                cuts = (np.cumsum(p)[:-1] * len(idx)).astype(np.int64)
                for k, chunk in enumerate(np.split(idx, cuts)):
                    parts[k].append(chunk)
            out = [np.sort(np.concatenate(p)) for p in parts]
            if min(len(p) for p in out) >= self.min_size:
                return out
        raise DataError(
            f"data.partitioner: no Dirichlet(alpha={self.alpha}) draw in 100 gave every one of "
            f"{num_clients} clients >= {self.min_size} samples; raise alpha or lower min_size"
        )


class Shards(Partitioner):
    """Pathological non-IID split of McMahan et al. (AISTATS 2017): sort by label, cut into
    ``k * num_clients`` shards, give each client ``k`` random shards, so each client sees at
    most ``k`` classes."""

    def __init__(self, k: Annotated[int, Ge(1)] = 2) -> None:
        self.k = k

    def check_data(self, num_clients: int, info: DatasetInfo) -> None:
        _enough_samples("k", num_clients, self.k, info.train_samples)  # a sample per shard

    def __call__(self, y: np.ndarray, num_clients: int, rng: np.random.Generator,
                 clients: np.ndarray | None = None) -> list[np.ndarray]:
        _enough_samples("k", num_clients, self.k, len(y), WHERE)
        n_shards = self.k * num_clients
        order = np.lexsort((rng.random(len(y)), y))
        shards = np.array_split(order, n_shards)
        assign = rng.permutation(n_shards).reshape(num_clients, self.k)
        return [np.sort(np.concatenate([shards[s] for s in row])) for row in assign]


class Natural(Partitioner):
    """The dataset's own clients (Synthetic's clients, a Parquet file's client column, LEAF's
    users); their own test samples too, where the data set keeps them per client."""

    traits = Traits(natural=True)

    def test_clients(self, clients_train: np.ndarray, clients_test: np.ndarray
                     ) -> np.ndarray | None:
        ids = np.unique(clients_train)  # client k is the k-th natural id, as __call__ makes it
        pos = np.clip(np.searchsorted(ids, clients_test), 0, len(ids) - 1)
        return np.where(ids[pos] == clients_test, pos, -1).astype(np.int64)

    def check_data(self, num_clients: int, info: DatasetInfo) -> None:
        if info.natural_clients is not None:
            as_many_clients(info.natural_clients, num_clients)

    def __call__(self, y: np.ndarray, num_clients: int, rng: np.random.Generator,
                 clients: np.ndarray | None = None) -> list[np.ndarray]:
        if clients is None:
            clients = np.zeros(0, np.int64)  # no client column
        ids = np.unique(clients)
        as_many_clients(len(ids), num_clients)
        order = np.argsort(clients, kind="stable")
        counts = np.bincount(np.searchsorted(ids, clients), minlength=len(ids))
        return np.split(order, np.cumsum(counts)[:-1])


class Pathological(Partitioner):
    """Pathological label skew, ``k`` classes per client (as Flower Datasets'
    PathologicalPartitioner with random class assignment, after McMahan et al. 2017): each
    client draws ``k`` distinct classes at random, each class's samples are split evenly
    (shuffled) between the clients that hold it. A class no client draws is left out; a
    draw that leaves a client without samples is redrawn (up to 100 times)."""

    traits = Traits(by_label=True)

    def __init__(self, k: Annotated[int, Ge(1)] = 2) -> None:
        self.k = k

    def check_data(self, num_clients: int, info: DatasetInfo) -> None:
        _enough_classes(self.k, info.num_classes)

    def __call__(self, y: np.ndarray, num_clients: int, rng: np.random.Generator,
                 clients: np.ndarray | None = None) -> list[np.ndarray]:
        classes = np.unique(y)
        _enough_classes(self.k, len(classes), WHERE)
        for _ in range(100):
            held = [rng.choice(classes, self.k, replace=False) for _ in range(num_clients)]
            parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
            for c in classes:
                owners = [i for i, h in enumerate(held) if c in h]
                if owners:
                    idx = rng.permutation(np.flatnonzero(y == c))
                    for i, chunk in zip(owners, np.array_split(idx, len(owners))):
                        parts[i].append(chunk)
            out = [np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64) for p in parts]
            if min(len(p) for p in out) > 0:
                return out
        raise DataError(f"data.partitioner: no draw of {self.k} classes per client gave each "
                        f"of {num_clients} clients a sample; use fewer clients or a larger k")


class Sizes(Partitioner):
    """Quantity skew: client sizes in proportion to a Dirichlet(``alpha``) draw over the
    clients (small alpha: a few large clients, many small ones), at least ``min_size``
    samples each, the samples themselves spread uniformly (as Flower Datasets' size-based
    partitioners)."""

    def __init__(self, alpha: Annotated[float, Gt(0)] = 1.0,
                 min_size: Annotated[int, Ge(1)] = 1) -> None:
        self.alpha, self.min_size = alpha, min_size

    def check_data(self, num_clients: int, info: DatasetInfo) -> None:
        _enough_samples("min_size", num_clients, self.min_size, info.train_samples)

    def __call__(self, y: np.ndarray, num_clients: int, rng: np.random.Generator,
                 clients: np.ndarray | None = None) -> list[np.ndarray]:
        n = len(y)
        _enough_samples("min_size", num_clients, self.min_size, n, WHERE)
        spare = n - self.min_size * num_clients
        share = rng.dirichlet(np.full(num_clients, self.alpha))
        extra = np.floor(share * spare).astype(np.int64)
        extra[np.argsort(-(share * spare - extra))[: spare - int(extra.sum())]] += 1
        sizes = self.min_size + extra
        cuts = np.cumsum(sizes)[:-1]
        return [np.sort(p) for p in np.split(rng.permutation(n), cuts)]
