"""Datasets addressed by name: generated, shipped with a package, or read from user files.

A dataset's ``load(num_clients, seed, test_fraction)`` returns a :class:`DatasetSplit` of
NumPy arrays; the partitioner and :func:`simulator.data.build` turn it into Arrow tables.
Every random draw comes from ``seed``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import numpy as np
from annotated_types import Ge, Gt

from simulator.errors import DataError
from strategies.protocols import Dataset, DatasetInfo, DatasetSplit, Traits


def _is_list(arr: Any) -> bool:
    import pyarrow.types as pt

    return bool(pt.is_list(arr.type) or pt.is_large_list(arr.type) or
                pt.is_fixed_size_list(arr.type))


def feature_matrix(arr: Any, name: str, path: str) -> np.ndarray:
    """One feature column as a ``(rows, width)`` matrix: a numeric column is one feature; a
    list column (list, large_list or fixed_size_list, every row the same length) holds a
    row's features. uint8 values stay uint8 (pixels, see :func:`feature_block`); any other
    type becomes float32."""
    import pyarrow.compute as pc

    if not _is_list(arr):
        return _numeric(_finite(arr.to_numpy(zero_copy_only=False), name, path, 1))[:, None]
    if arr.null_count:
        raise DataError(f"features: column {name!r} of {path} has {arr.null_count} missing rows")
    lengths = pc.list_value_length(arr)
    lo, hi = (v.as_py() for v in pc.min_max(lengths).values())
    if len(arr) and lo != hi:
        raise DataError(f"features: the rows of list column {name!r} of {path} have "
                        f"{lo} to {hi} values; every sample needs the same number")
    values = arr.flatten()  # the rows' values in order (offsets of a slice respected)
    width = max(int(hi or 0), 1)
    return _numeric(_finite(values.to_numpy(zero_copy_only=False), name, path, width)
                    ).reshape(len(arr), -1)


FLOAT32_MAX = float(np.finfo(np.float32).max)


def _finite(values: np.ndarray, name: str, path: str, width: int) -> np.ndarray:
    """``values`` when they are numbers a float32 model can take: not NaN, not infinite, not
    beyond float32's range (1e300 would become inf); DataError naming the first row else."""
    if values.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            bad = np.flatnonzero(~(np.abs(values) <= FLOAT32_MAX))
        if len(bad):
            i = int(bad[0])
            raise DataError(f"features: column {name!r} of {path} holds {values[i]:g} in row "
                            f"{i // width}; expected finite numbers within float32's range "
                            f"(|x| <= {FLOAT32_MAX:.3g})")
    elif values.dtype.kind not in "iub":
        raise DataError(f"features: column {name!r} of {path} holds {values.dtype} values; "
                        "expected numbers")
    return values


def _numeric(values: np.ndarray) -> np.ndarray:
    return values if values.dtype == np.uint8 else np.asarray(values, dtype=np.float32)


def unit_pixels(x: np.ndarray) -> np.ndarray:
    """uint8 pixels, 0..255, as the float32 values in [0, 1] that a model sees."""
    return np.asarray(x, dtype=np.float32) / np.float32(255.0)


def feature_block(columns: list[np.ndarray]) -> np.ndarray:
    """The samples' features from :func:`feature_matrix` columns, side by side. uint8 values
    are pixels, 0..255, and the model sees them in [0, 1], as it sees the built-in image
    data sets' (MNIST, CIFAR-10, FEMNIST): when every column is uint8 the block stays uint8
    (a quarter of the memory; the worker scales it), otherwise the uint8 columns are scaled
    into the float32 block here."""
    if all(c.dtype == np.uint8 for c in columns):
        return np.concatenate(columns, axis=1)
    return np.concatenate([unit_pixels(c) if c.dtype == np.uint8 else c for c in columns],
                          axis=1)


def pa_is_float(values: object) -> bool:
    import pyarrow.types as pt

    return bool(pt.is_floating(values.type))  # type: ignore[attr-defined]


def _n_train(n: int, test_fraction: float) -> int:
    return n - round(n * test_fraction)


def holdout(n: int, test_fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    perm = rng.permutation(n)
    n_test = round(n * test_fraction)
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


class Synthetic(Dataset):
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

    def _counts(self, rng: np.random.Generator, num_clients: int) -> np.ndarray:
        return np.minimum(rng.lognormal(4, 2, num_clients).astype(np.int64) + 50, self.max_samples)

    def describe(self, num_clients: int, seed: int, test_fraction: float) -> DatasetInfo:
        counts = self._counts(np.random.default_rng([seed, 0x5F]), num_clients)
        return DatasetInfo(sum(_n_train(int(k), test_fraction) for k in counts),
                           (self.dimension,), self.classes, natural_clients=num_clients)

    def load(self, num_clients: int, seed: int, test_fraction: float) -> DatasetSplit:
        rng = np.random.default_rng([seed, 0x5F])
        d, c = self.dimension, self.classes
        counts = self._counts(rng, num_clients)
        u = rng.normal(0, self.alpha, num_clients)
        big_b = rng.normal(0, self.beta, num_clients)
        sd = np.power(np.arange(1, d + 1, dtype=np.float64), -1.2) ** 0.5
        xs_tr, ys_tr, cs_tr, xs_te, ys_te, cs_te = [], [], [], [], [], []
        for k in range(num_clients):
            v = rng.normal(big_b[k], 1, d)
            w = rng.normal(u[k], 1, (d, c))
            b = rng.normal(u[k], 1, c)
            x = v + rng.standard_normal((counts[k], d)) * sd
            y = np.argmax(x @ w + b, axis=1)
            tr, te = holdout(int(counts[k]), test_fraction, rng)
            xs_tr.append(x[tr])
            ys_tr.append(y[tr])
            cs_tr.append(np.full(len(tr), k))
            xs_te.append(x[te])
            ys_te.append(y[te])
            cs_te.append(np.full(len(te), k))
        return DatasetSplit(
            x_train=np.concatenate(xs_tr).astype(np.float32),
            y_train=np.concatenate(ys_tr).astype(np.int64),
            x_test=np.concatenate(xs_te).astype(np.float32),
            y_test=np.concatenate(ys_te).astype(np.int64),
            input_shape=(d,),
            num_classes=c,
            clients_train=np.concatenate(cs_tr).astype(np.int64),
            clients_test=np.concatenate(cs_te).astype(np.int64),
        )


class LinearRegression(Dataset):
    """Heterogeneous linear regression, in the manner of FedProx's Synthetic(alpha, beta)
    (Li et al., MLSys 2020) with real-valued targets: a shared w ~ N(0, I/d); client k has
    w_k = w + N(0, heterogeneity^2 I/d) and inputs x ~ N(m_k, I), m_k ~ N(0, shift^2);
    y = x . w_k + N(0, noise^2), float32. ``samples`` per client; each client is a natural
    client and ``test_fraction`` of its samples are pooled into the test set. The task is
    ``regression`` (one output)."""

    def __init__(self, dimension: Annotated[int, Ge(1)] = 20,
                 samples: Annotated[int, Ge(2)] = 100,
                 heterogeneity: Annotated[float, Ge(0)] = 0.5,
                 shift: Annotated[float, Ge(0)] = 0.5,
                 noise: Annotated[float, Ge(0)] = 0.1) -> None:
        self.dimension, self.samples = dimension, samples
        self.heterogeneity, self.shift, self.noise = heterogeneity, shift, noise

    def describe(self, num_clients: int, seed: int, test_fraction: float) -> DatasetInfo:
        return DatasetInfo(num_clients * _n_train(self.samples, test_fraction),
                           (self.dimension,), 1, targets="values", natural_clients=num_clients)

    def load(self, num_clients: int, seed: int, test_fraction: float) -> DatasetSplit:
        rng = np.random.default_rng([seed, 0x2E])
        d, n = self.dimension, self.samples
        w = rng.normal(0, 1 / np.sqrt(d), d)
        xs, ys, cs, test = [], [], [], []
        for k in range(num_clients):
            wk = w + rng.normal(0, self.heterogeneity / np.sqrt(d), d)
            x = rng.normal(rng.normal(0, self.shift, d), 1, (n, d))
            xs.append(x)
            ys.append(x @ wk + rng.normal(0, self.noise, n))
            cs.append(np.full(n, k))
            test.append(np.isin(np.arange(n), holdout(n, test_fraction, rng)[1]))
        x, y, c, te = (np.concatenate(a) for a in (xs, ys, cs, test))
        return DatasetSplit(x[~te].astype(np.float32), y[~te].astype(np.float32),
                            x[te].astype(np.float32), y[te].astype(np.float32), (d,), 1,
                            clients_train=c[~te].astype(np.int64),
                            clients_test=c[te].astype(np.int64))


class GaussianMixture(Dataset):
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

    def describe(self, num_clients: int, seed: int, test_fraction: float) -> DatasetInfo:
        return DatasetInfo(_n_train(self.samples, test_fraction), (self.dimension,), self.classes,
                           natural_clients=0)

    def load(self, num_clients: int, seed: int, test_fraction: float) -> DatasetSplit:
        rng = np.random.default_rng([seed, 0x6A])
        means = rng.normal(0, self.separation, (self.classes, self.dimension))
        y = rng.integers(0, self.classes, self.samples)
        x = means[y] + rng.standard_normal((self.samples, self.dimension))
        tr, te = holdout(self.samples, test_fraction, rng)
        x = x.astype(np.float32)
        return DatasetSplit(x[tr], y[tr], x[te], y[te], (self.dimension,), self.classes)


def _digits_table() -> np.ndarray:
    """The (1797, 65) table of scikit-learn's digits (64 pixels, then the label), read from the
    file scikit-learn ships without importing scikit-learn (0.7 s of imports, scipy's among
    them, for a 60 KB file); through ``load_digits`` where the file is not where it was."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sklearn")
    roots = spec.submodule_search_locations if spec is not None else None
    path = Path(next(iter(roots or [""]))) / "datasets" / "data" / "digits.csv.gz"
    if roots and path.is_file():
        return np.loadtxt(path, delimiter=",", dtype=np.float64)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return np.column_stack([bunch.data, bunch.target])


class Digits(Dataset):
    """scikit-learn's handwritten digits (1,797 8x8 images, 10 classes; UCI optical
    recognition of handwritten digits), scaled to [0, 1], shape (1, 8, 8)."""

    SAMPLES = 1797

    def describe(self, num_clients: int, seed: int, test_fraction: float) -> DatasetInfo:
        return DatasetInfo(_n_train(self.SAMPLES, test_fraction), (1, 8, 8), 10,
                           natural_clients=0)

    def load(self, num_clients: int, seed: int, test_fraction: float) -> DatasetSplit:
        data = _digits_table()
        x = (data[:, :-1] / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
        y = data[:, -1].astype(np.int64)
        tr, te = holdout(len(y), test_fraction, np.random.default_rng([seed, 0xD1]))
        return DatasetSplit(x[tr], y[tr], x[te], y[te], (1, 8, 8), 10)


class ParquetDataset(Dataset):
    """A user's Parquet file: numeric feature columns (or list columns: list, large_list or
    fixed_size_list, every row the same length), an integer label column and, optionally, a
    client column for the ``natural`` partitioner. ``shape`` gives one sample's shape (say
    ``[1, 28, 28]`` for images stored as 784 values), default the flat feature vector.
    ``test_path`` gives a separate test file; otherwise ``test_fraction`` is held out.
    Relative paths are relative to the scenario file's directory."""

    traits = Traits(path_params=("path", "test_path"))

    def __init__(
        self,
        path: str,
        label: str = "label",
        features: list[str] | None = None,
        client: str | None = None,
        test_path: str | None = None,
        shape: list[Annotated[int, Ge(1)]] | None = None,
    ) -> None:
        self.path, self.label, self.features = path, label, features
        self.client, self.test_path = client, test_path
        self.shape = shape

    def _shape(self, width: int) -> tuple[int, ...]:
        """One sample's shape: ``shape`` when given (its product must be the width)."""
        if self.shape is None:
            return (width,)
        if int(np.prod(self.shape)) != width:
            raise DataError(f"shape: {list(self.shape)} holds {int(np.prod(self.shape))} values, "
                            f"the samples of {self.path} have {width}")
        return tuple(self.shape)

    def check(self, n: int) -> None:
        """Both files exist, are regular files and are Parquet, with the named columns."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        for key in ("path", "test_path"):
            p = getattr(self, key)
            if p is None:
                continue
            if not Path(p).is_file():
                raise DataError(f"{key}: {'not a regular file' if Path(p).exists() else 'file not found'}: {p}")
            try:
                names = pq.read_schema(p).names
            except (pa.ArrowInvalid, OSError):
                raise DataError(f"{key}: not a Parquet file: {p}") from None
            for what, col in [("label", self.label), ("client", self.client)] + \
                    [("features", c) for c in self.features or []]:
                if col is not None and col not in names:
                    raise DataError(f"{what}: column {col!r} not in {p}; columns: "
                                     f"{', '.join(names[:20])}")
            self._check_types(pq.read_schema(p), p)

    def _check_types(self, schema: Any, path: str) -> None:
        """The columns' types, from the file's schema: integer labels and client ids,
        numeric features (or lists of numbers)."""
        import pyarrow.types as pt

        def kind(t: Any) -> Any:
            return t.value_type if pt.is_list(t) or pt.is_large_list(t) or \
                pt.is_fixed_size_list(t) else t

        label = schema.field(self.label).type
        if not pt.is_integer(label):
            raise DataError(f"label: column {self.label!r} must hold integers, got {label} "
                            f"(class ids, in {path})")
        if self.client is not None and not pt.is_integer(schema.field(self.client).type):
            raise DataError(f"client: column {self.client!r} of {path} must hold integer "
                            f"client ids, got {schema.field(self.client).type}")
        feats = self.features or [c for c in schema.names if c not in (self.label, self.client)]
        for name in feats:
            t = kind(schema.field(name).type)
            if not (pt.is_integer(t) or pt.is_floating(t)):
                raise DataError(f"features: column {name!r} of {path} must hold numbers (or "
                                f"lists of numbers), got {schema.field(name).type}")

    def describe(self, num_clients: int, seed: int, test_fraction: float) -> DatasetInfo:
        """Rows, feature width and classes, reading the label and feature columns in batches
        (labels must be integers >= 0, features finite); the file is never held whole."""
        self.check(num_clients)
        x_width, n, top = 0, 0, -1
        for path in [self.path] + ([self.test_path] if self.test_path else []):
            width, rows, hi = self._scan(path)
            if x_width and width != x_width:
                raise DataError(f"test_path: {width} features per sample, {self.path} has {x_width}")
            x_width, top = width, max(top, hi)
            n = n or rows
        train = n if self.test_path else _n_train(n, test_fraction)
        return DatasetInfo(train, self._shape(x_width), top + 1,
                           natural_clients=self._natural_clients(seed, test_fraction))

    def _natural_clients(self, seed: int, test_fraction: float) -> int:
        """Distinct ids of the client column among the training rows (as ``load`` splits
        them), reading that column alone; 0 without a client column."""
        import pyarrow.parquet as pq

        if self.client is None:
            return 0
        column = pq.read_table(self.path, columns=[self.client]).column(self.client)
        if column.null_count:
            raise DataError(f"client: column {self.client!r} of {self.path} has "
                            f"{column.null_count} missing client ids")
        ids = column.to_numpy()
        if not self.test_path:
            ids = ids[self._holdout(len(ids), seed, test_fraction)[0]]
        return len(np.unique(ids))

    @staticmethod
    def _holdout(n: int, seed: int, test_fraction: float) -> tuple[np.ndarray, np.ndarray]:
        """(training rows, held-out rows) of a file without a test file (``load``, and
        ``describe``'s count of natural clients)."""
        return holdout(n, test_fraction, np.random.default_rng([seed, 0x9A]))

    def _scan(self, path: str) -> tuple[int, int, int]:
        """(features per sample, rows, largest label) of one file, checked batch by batch."""
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        f = pq.ParquetFile(path)
        names = f.schema_arrow.names
        feats = self.features or [c for c in names if c not in (self.label, self.client)]
        width, rows, top = 0, 0, -1
        for batch in f.iter_batches(columns=[self.label, *feats], batch_size=65536):
            y = batch.column(0)
            if not pa.types.is_integer(y.type):
                raise DataError(f"label: column {self.label!r} must hold integers, got {y.type}")
            if y.null_count:
                raise DataError(f"label: column {self.label!r} of {path} has missing labels")
            lo, hi = pc.min_max(y).values()
            if lo.as_py() is not None and lo.as_py() < 0:
                raise DataError(f"label: column {self.label!r} holds {lo.as_py()}; labels are "
                                "class indices 0..classes-1")
            top = max(top, hi.as_py() if hi.as_py() is not None else -1)
            w = 0
            for name, col in zip(batch.schema.names[1:], batch.columns[1:]):
                values = col.flatten() if _is_list(col) else col
                if len(col) and (col.null_count or values.null_count):
                    raise DataError(f"features: {path} has missing feature values")
                # same lengths; finite, within float32's range
                w += feature_matrix(col, name, path).shape[1] if len(col) else 0
            width = width or w
            rows += batch.num_rows
        return width, rows, top

    def _read(self, path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        names = table.column_names
        for col in [self.label] + ([self.client] if self.client else []) + (self.features or []):
            if col not in names:
                raise DataError(f"data.dataset: column {col!r} not in {path}; columns: {', '.join(names)}")
        feats = self.features or [c for c in names if c not in (self.label, self.client)]
        x = feature_block([feature_matrix(table.column(c).combine_chunks(), c, path)
                           for c in feats])
        y_raw = table.column(self.label).to_numpy()
        if not np.issubdtype(y_raw.dtype, np.integer):
            raise DataError(f"data.dataset.label: column {self.label!r} must hold integers, got {y_raw.dtype}")
        clients = table.column(self.client).to_numpy().astype(np.int64) if self.client else None
        return x, y_raw.astype(np.int64), clients

    def load(self, num_clients: int, seed: int, test_fraction: float) -> DatasetSplit:
        self.check(num_clients)
        x, y, clients = self._read(self.path)
        if self.test_path:
            x_te, y_te, _ = self._read(self.test_path)
            tr = np.arange(len(y))
        else:
            tr, te = self._holdout(len(y), seed, test_fraction)
            x_te, y_te = x[te], y[te]
        num_classes = int(max(y.max(), y_te.max() if len(y_te) else 0)) + 1
        shape = self._shape(x.shape[1])
        return DatasetSplit(
            x[tr].reshape(-1, *shape), y[tr], x_te.reshape(-1, *shape), y_te, shape,
            num_classes, None if clients is None else clients[tr],
        )
