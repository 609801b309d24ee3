"""Datasets addressed by name: generated, shipped with a package, or read from user files.

A dataset's ``load(num_clients, seed, test_fraction)`` returns a :class:`DatasetSplit` of
NumPy arrays; the partitioner and :func:`simulator.data.build` turn it into Arrow tables.
Every random draw comes from ``seed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
from annotated_types import Ge, Gt


class DataError(ValueError):
    """A dataset or partition that cannot be built from the scenario as written."""


@dataclass(frozen=True)
class DatasetSplit:
    x_train: np.ndarray  # float32, (N, *input_shape)
    y_train: np.ndarray  # int64, (N,)
    x_test: np.ndarray
    y_test: np.ndarray
    input_shape: tuple[int, ...]
    num_classes: int
    clients_train: np.ndarray | None = None  # natural client of each train sample, if any


def _holdout(n: int, test_fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    perm = rng.permutation(n)
    n_test = round(n * test_fraction)
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


class Synthetic:
    """Synthetic(alpha, beta) of Li et al., "Federated Optimization in Heterogeneous Networks"
    (FedProx, MLSys 2020), following the authors' generator: client k has its own softmax
    regression model W_k ~ N(u_k, 1), b_k ~ N(u_k, 1), u_k ~ N(0, alpha), and its own input
    distribution x ~ N(v_k, Sigma), v_k ~ N(B_k, 1), B_k ~ N(0, beta), Sigma = diag(j^-1.2);
    y = argmax softmax(W_k x + b_k). Sample counts are lognormal(4, 2) + 50 as in the
    authors' code, capped at ``max_samples``. Each client is a natural client; ``test_fraction``
    of each client's samples are held out and pooled into the test set.
    """

    def __init__(
        self,
        alpha: Annotated[float, Ge(0)] = 1.0,
        beta: Annotated[float, Ge(0)] = 1.0,
        dimension: Annotated[int, Ge(1)] = 60,
        classes: Annotated[int, Ge(2)] = 10,
        max_samples: Annotated[int, Ge(60)] = 1000,
    ) -> None:
        self.alpha, self.beta = alpha, beta
        self.dimension, self.classes, self.max_samples = dimension, classes, max_samples

    def load(self, num_clients: int, seed: int, test_fraction: float) -> DatasetSplit:
        rng = np.random.default_rng([seed, 0x5F])
        d, c = self.dimension, self.classes
        counts = np.minimum(rng.lognormal(4, 2, num_clients).astype(np.int64) + 50, self.max_samples)
        u = rng.normal(0, self.alpha, num_clients)
        big_b = rng.normal(0, self.beta, num_clients)
        sd = np.power(np.arange(1, d + 1, dtype=np.float64), -1.2) ** 0.5
        xs_tr, ys_tr, cs_tr, xs_te, ys_te = [], [], [], [], []
        for k in range(num_clients):
            v = rng.normal(big_b[k], 1, d)
            w = rng.normal(u[k], 1, (d, c))
            b = rng.normal(u[k], 1, c)
            x = v + rng.standard_normal((counts[k], d)) * sd
            y = np.argmax(x @ w + b, axis=1)
            tr, te = _holdout(int(counts[k]), test_fraction, rng)
            xs_tr.append(x[tr]), ys_tr.append(y[tr]), cs_tr.append(np.full(len(tr), k))
            xs_te.append(x[te]), ys_te.append(y[te])
        return DatasetSplit(
            x_train=np.concatenate(xs_tr).astype(np.float32),
            y_train=np.concatenate(ys_tr).astype(np.int64),
            x_test=np.concatenate(xs_te).astype(np.float32),
            y_test=np.concatenate(ys_te).astype(np.int64),
            input_shape=(d,),
            num_classes=c,
            clients_train=np.concatenate(cs_tr).astype(np.int64),
        )


class GaussianMixture:
    """A mixture of ``classes`` isotropic Gaussians in ``dimension`` dimensions: class means
    drawn N(0, separation^2 I), unit-variance noise around them."""

    def __init__(
        self,
        samples: Annotated[int, Ge(10)] = 5000,
        dimension: Annotated[int, Ge(1)] = 20,
        classes: Annotated[int, Ge(2)] = 4,
        separation: Annotated[float, Gt(0)] = 1.0,
    ) -> None:
        self.samples, self.dimension = samples, dimension
        self.classes, self.separation = classes, separation

    def load(self, num_clients: int, seed: int, test_fraction: float) -> DatasetSplit:
        rng = np.random.default_rng([seed, 0x6A])
        means = rng.normal(0, self.separation, (self.classes, self.dimension))
        y = rng.integers(0, self.classes, self.samples)
        x = means[y] + rng.standard_normal((self.samples, self.dimension))
        tr, te = _holdout(self.samples, test_fraction, rng)
        x = x.astype(np.float32)
        return DatasetSplit(x[tr], y[tr], x[te], y[te], (self.dimension,), self.classes)


class Digits:
    """scikit-learn's handwritten digits (1,797 8x8 images, 10 classes; UCI optical
    recognition of handwritten digits), scaled to [0, 1], shape (1, 8, 8)."""

    def load(self, num_clients: int, seed: int, test_fraction: float) -> DatasetSplit:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        x = (bunch.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
        y = bunch.target.astype(np.int64)
        tr, te = _holdout(len(y), test_fraction, np.random.default_rng([seed, 0xD1]))
        return DatasetSplit(x[tr], y[tr], x[te], y[te], (1, 8, 8), 10)


class ParquetDataset:
    """A user's Parquet file: numeric feature columns (or one fixed-size list column), an
    integer label column and, optionally, a client column for the ``natural`` partitioner.
    ``test_path`` gives a separate test file; otherwise ``test_fraction`` is held out.
    Relative paths are relative to the scenario file's directory."""

    PATH_PARAMS = ("path", "test_path")

    def __init__(
        self,
        path: str,
        label: str = "label",
        features: list[str] | None = None,
        client: str | None = None,
        test_path: str | None = None,
    ) -> None:
        self.path, self.label, self.features = path, label, features
        self.client, self.test_path = client, test_path

    def check(self) -> None:
        for key in ("path", "test_path"):
            p = getattr(self, key)
            if p is not None and not Path(p).is_file():
                raise ValueError(f"{key}: file not found: {p}")

    def _read(self, path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        names = table.column_names
        for col in [self.label] + ([self.client] if self.client else []) + (self.features or []):
            if col not in names:
                raise DataError(f"data.dataset: column {col!r} not in {path}; columns: {', '.join(names)}")
        feats = self.features or [c for c in names if c not in (self.label, self.client)]
        cols = []
        for c in feats:
            arr = table.column(c).combine_chunks()
            if hasattr(arr, "flatten") and arr.type.num_fields == 0 and str(arr.type).startswith(("fixed_size_list", "list")):
                cols.append(np.asarray(arr.flatten().to_numpy(), dtype=np.float32).reshape(len(arr), -1))
            else:
                cols.append(np.asarray(arr.to_numpy(zero_copy_only=False), dtype=np.float32)[:, None])
        x = np.concatenate(cols, axis=1)
        y_raw = table.column(self.label).to_numpy()
        if not np.issubdtype(y_raw.dtype, np.integer):
            raise DataError(f"data.dataset.label: column {self.label!r} must hold integers, got {y_raw.dtype}")
        clients = table.column(self.client).to_numpy().astype(np.int64) if self.client else None
        return x, y_raw.astype(np.int64), clients

    def load(self, num_clients: int, seed: int, test_fraction: float) -> DatasetSplit:
        self.check()
        x, y, clients = self._read(self.path)
        if self.test_path:
            x_te, y_te, _ = self._read(self.test_path)
            tr = np.arange(len(y))
        else:
            tr, te = _holdout(len(y), test_fraction, np.random.default_rng([seed, 0x9A]))
            x_te, y_te = x[te], y[te]
        num_classes = int(max(y.max(), y_te.max() if len(y_te) else 0)) + 1
        return DatasetSplit(
            x[tr], y[tr], x_te, y_te, (x.shape[1],), num_classes,
            None if clients is None else clients[tr],
        )
