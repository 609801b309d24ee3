"""Datasets addressed by name: generated, shipped with a package, or read from user files.

A dataset's ``load(num_clients, seed, test_fraction)`` returns a :class:`DatasetSplit` of
NumPy arrays; the partitioner and :func:`simulator.data.build` turn it into Arrow tables.
Every random draw comes from ``seed``.
"""

from __future__ import annotations

import functools
import os
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from annotated_types import Ge, Gt

from simulator.data.partitioners import as_many_clients
from simulator.errors import DataError
from strategies.paths import PathRefused, guard
from strategies.protocols import (
    Dataset,
    DatasetInfo,
    DatasetSplit,
    Population,
    PopulationDataset,
    Traits,
)


def _is_list(arr: Any) -> bool:
    import pyarrow.types as pt

    return bool(pt.is_list(arr.type) or pt.is_large_list(arr.type) or
                pt.is_fixed_size_list(arr.type))


def feature_matrix(arr: Any, name: str, path: str) -> np.ndarray:
    """One feature column as a ``(rows, width)`` matrix: a numeric column is one feature; a
    list column (list, large_list or fixed_size_list, every row the same length) holds a
    row's features; a fixed_size_binary column holds a row's bytes as uint8 values (pixels:
    Parquet decodes it several times faster than a list of uint8, which stores levels per
    value). uint8 values stay uint8 (pixels, see :func:`feature_block`); any other type
    becomes float32."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_fixed_size_binary(arr.type):
        if arr.null_count:
            raise DataError(f"features: column {name!r} of {path} has {arr.null_count} "
                            "missing rows")
        width = arr.type.byte_width
        return np.frombuffer(arr.buffers()[1], dtype=np.uint8, count=len(arr) * width,
                             offset=arr.offset * width).reshape(len(arr), width)
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


def _n_train(n: int, test_fraction: float) -> int:
    return n - round(n * test_fraction)


def holdout(n: int, test_fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    perm = rng.permutation(n)
    n_test = round(n * test_fraction)
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


class Generated(Population):
    """Clients generated one at a time: client ``k``'s samples (all of them, with the
    indices of those it keeps for training and those held out) come from its own random
    stream ``(seed, tag, k)``, so a cohort costs what its clients hold, whatever the
    population."""

    def __init__(self, counts: np.ndarray, seed: int, test_fraction: float,
                 input_shape: tuple[int, ...], num_classes: int) -> None:
        self.counts = np.asarray(counts, dtype=np.int64)  # all samples, held-out ones too
        self.sizes = self.counts - np.round(self.counts * test_fraction).astype(np.int64)
        self.seed, self.test_fraction = seed, test_fraction
        self.input_shape, self.num_classes = input_shape, num_classes
        # the clients of the last ``train`` call, kept for a ``test`` of the same ones
        self._last: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}

    @abstractmethod
    def client(self, k: int) -> tuple[np.ndarray, np.ndarray, np.random.Generator]:
        """Client ``k``'s samples ``(x float32, y)`` and its stream, drawn on from there
        for the hold-out."""

    def _split(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if k in self._last:  # train then test of the same clients: generated once
            return self._last.pop(k)
        x, y, rng = self.client(int(k))
        tr, te = holdout(len(y), self.test_fraction, rng)
        return x, y, tr, te

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_last": {}}

    def train(self, clients: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        splits = [self._split(int(k)) for k in clients]
        self._last = dict(zip(map(int, clients), splits, strict=True))  # for test(clients)
        return [(x[tr], y[tr]) for x, y, tr, _ in splits]

    def test(self, clients: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        out = [(x[te], y[te]) for x, y, _, te in map(self._split, map(int, clients))]
        self._last = {}
        return out


class Synthetic(PopulationDataset):
    """Synthetic(alpha, beta) of Li et al., "Federated Optimization in Heterogeneous Networks"
    (FedProx, MLSys 2020), following the authors' generator: client k has its own softmax
    regression model W_k ~ N(u_k, 1), b_k ~ N(u_k, 1), u_k ~ N(0, alpha), and its own input
    distribution x ~ N(v_k, Sigma), v_k ~ N(B_k, 1), B_k ~ N(0, beta), Sigma = diag(j^-1.2);
    y = argmax softmax(W_k x + b_k). Sample counts are lognormal(4, 2) + 50 as in the
    authors' code, capped at ``max_samples``. Each client is a natural client; ``test_fraction``
    of each client's samples are held out and pooled into the test set.

    Departure from the authors' code: client k draws from its own stream (seed, k), not
    from one stream in client order, so that a million-client population generates only
    the clients a round samples (``data.load: cohort``); the counts come first, from one
    stream, as theirs do.
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

    def _counts(self, seed: int, num_clients: int) -> np.ndarray:
        rng = np.random.default_rng([seed, 0x5F])
        return np.minimum(rng.lognormal(4, 2, num_clients).astype(np.int64) + 50, self.max_samples)

    def describe(self, num_clients: int, seed: int, test_fraction: float) -> DatasetInfo:
        counts = self._counts(seed, num_clients)
        train = int((counts - np.round(counts * test_fraction).astype(np.int64)).sum())
        return DatasetInfo(train, (self.dimension,), self.classes, natural_clients=num_clients)

    def population(self, num_clients: int, seed: int, test_fraction: float) -> Population:
        return SyntheticClients(self, self._counts(seed, num_clients), seed, test_fraction)


class SyntheticClients(Generated):
    """The clients of :class:`Synthetic`, generated from (seed, client)."""

    def __init__(self, ds: Synthetic, counts: np.ndarray, seed: int,
                 test_fraction: float) -> None:
        super().__init__(counts, seed, test_fraction, (ds.dimension,), ds.classes)
        self.alpha, self.beta = ds.alpha, ds.beta
        d = ds.dimension
        self.sd = np.power(np.arange(1, d + 1, dtype=np.float64), -1.2) ** 0.5

    def client(self, k: int) -> tuple[np.ndarray, np.ndarray, np.random.Generator]:
        rng = np.random.default_rng([self.seed, 0x5F, k])
        d, c = self.input_shape[0], self.num_classes
        u, big_b = rng.normal(0, self.alpha), rng.normal(0, self.beta)
        v = rng.normal(big_b, 1, d)
        w = rng.normal(u, 1, (d, c))
        b = rng.normal(u, 1, c)
        x = v + rng.standard_normal((int(self.counts[k]), d)) * self.sd
        return x.astype(np.float32), np.argmax(x @ w + b, axis=1).astype(np.int64), rng


class LinearRegression(PopulationDataset):
    """Heterogeneous linear regression, in the manner of FedProx's Synthetic(alpha, beta)
    (Li et al., MLSys 2020) with real-valued targets: a shared w ~ N(0, I/d); client k has
    w_k = w + N(0, heterogeneity^2 I/d) and inputs x ~ N(m_k, I), m_k ~ N(0, shift^2);
    y = x . w_k + N(0, noise^2), float32. ``samples`` per client, client k's from its own
    stream (seed, k); each client is a natural client and ``test_fraction`` of its samples
    are pooled into the test set. The task is ``regression`` (one output)."""

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

    def population(self, num_clients: int, seed: int, test_fraction: float) -> Population:
        return RegressionClients(self, num_clients, seed, test_fraction)


class RegressionClients(Generated):
    """The clients of :class:`LinearRegression`, generated from (seed, client)."""

    def __init__(self, ds: LinearRegression, num_clients: int, seed: int,
                 test_fraction: float) -> None:
        super().__init__(np.full(num_clients, ds.samples, np.int64), seed, test_fraction,
                         (ds.dimension,), 1)
        self.heterogeneity, self.shift, self.noise = ds.heterogeneity, ds.shift, ds.noise
        d = ds.dimension
        self.w = np.random.default_rng([seed, 0x2E]).normal(0, 1 / np.sqrt(d), d)

    def client(self, k: int) -> tuple[np.ndarray, np.ndarray, np.random.Generator]:
        rng = np.random.default_rng([self.seed, 0x2E, k])
        d, n = self.input_shape[0], int(self.counts[k])
        wk = self.w + rng.normal(0, self.heterogeneity / np.sqrt(d), d)
        x = rng.normal(rng.normal(0, self.shift, d), 1, (n, d))
        y = x @ wk + rng.normal(0, self.noise, n)
        return x.astype(np.float32), y.astype(np.float32), rng


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

    CHUNK = 65536  # rows drawn at a time

    def describe(self, num_clients: int, seed: int, test_fraction: float) -> DatasetInfo:
        return DatasetInfo(_n_train(self.samples, test_fraction), (self.dimension,), self.classes,
                           natural_clients=0)

    def load(self, num_clients: int, seed: int, test_fraction: float) -> DatasetSplit:
        rng = np.random.default_rng([seed, 0x6A])
        means = rng.normal(0, self.separation, (self.classes, self.dimension))
        y = rng.integers(0, self.classes, self.samples)
        # float32 rows written a chunk at a time: the draws (float64) are the same stream as
        # one call's, without a float64 copy of the whole data
        x = np.empty((self.samples, self.dimension), dtype=np.float32)
        for lo in range(0, self.samples, self.CHUNK):
            hi = min(lo + self.CHUNK, self.samples)
            x[lo:hi] = means[y[lo:hi]] + rng.standard_normal((hi - lo, self.dimension))
        tr, te = holdout(self.samples, test_fraction, rng)
        return DatasetSplit(x[tr], y[tr], x[te], y[te], (self.dimension,), self.classes)


@functools.cache
def _digits_table() -> np.ndarray:
    """The (1797, 65) table of scikit-learn's digits (64 pixels, then the label), read from the
    file scikit-learn ships without importing scikit-learn (0.7 s of imports, scipy's among
    them, for a 60 KB file); through ``load_digits`` where the file is not where it was.
    Read once per process (40 ms a read here: a sweep's seeds, a warm pool's runs), and
    read-only."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    roots = spec.submodule_search_locations if spec is not None else None
    path = Path(next(iter(roots or [""]))) / "datasets" / "data" / "digits.csv.gz"
    if roots and path.is_file():
        table = np.loadtxt(path, delimiter=",", dtype=np.float64)
    else:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        table = np.column_stack([bunch.data, bunch.target])
    table.flags.writeable = False
    return table


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


def parquet_data(path: str) -> Any:
    """A Parquet file, or a directory of Parquet files (read as one table, the files in
    name order), as a ``pyarrow.dataset.Dataset``."""
    import pyarrow.dataset as pads

    return pads.dataset(path, format="parquet")


def _one_schema(key: str, path: str) -> None:
    """A folder's Parquet files hold one schema (pyarrow reads a folder with its first
    file's): DataError naming the first file that differs, and the first column that does.
    Each file's footer only is read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not Path(path).is_dir():
        return
    files = parquet_data(path).files
    first = pq.read_schema(files[0]) if files else None
    for f in files[1:]:
        try:
            other = pq.read_schema(f)
        except (pa.ArrowInvalid, OSError):
            raise DataError(f"{key}: not a Parquet file: {f}") from None
        assert first is not None
        if [(c.name, c.type) for c in other] != [(c.name, c.type) for c in first]:
            raise DataError(f"{key}: the files of {path} must hold one schema; {f} "
                            f"{schema_difference(first, other)} ({files[0]} has the first)")


def schema_difference(first: Any, other: Any) -> str:
    """The first column where ``other`` differs from ``first``, in words."""
    for field in first:
        if field.name not in other.names:
            return f"lacks column {field.name!r}"
        theirs = other.field(field.name).type
        if theirs != field.type:
            return f"holds column {field.name!r} as {theirs}, not {field.type}"
    extra = [n for n in other.names if n not in first.names]
    if extra:
        return f"has column {extra[0]!r} besides"
    return "orders its columns otherwise"


_CHECKED: set[tuple[Any, ...]] = set()  # Parquet blocks checked, with their files' stamps


def _stamp(path: str | None, key: str) -> tuple[tuple[str, int, int], ...]:
    """(name, size, modification time) of the file at ``path``, or of every file under the
    folder: what a checked Parquet block's result stands on. The guard comes first: the
    path is a regular file or a folder."""
    if path is None:
        return ()
    try:
        guard(path, "either")
    except PathRefused as e:
        raise DataError(f"{key}: {e}") from None
    names = [path] if not Path(path).is_dir() else sorted(
        os.path.join(d, f) for d, _, files in os.walk(path) for f in files)
    out = []
    for name in names:
        try:
            st = os.stat(name)
        except OSError:
            continue  # gone since the listing: the check itself says what is wrong
        out.append((name, st.st_size, st.st_mtime_ns))
    return tuple(out)


class ParquetDataset(PopulationDataset):
    """A user's Parquet file, or a directory of Parquet files with one schema (read in file
    name order): numeric feature columns (or list columns: list, large_list or
    fixed_size_list, every row the same length), an integer label column and, optionally, a
    client column for the ``natural`` partitioner. ``shape`` gives one sample's shape (say
    ``[1, 28, 28]`` for images stored as 784 values), default the flat feature vector.
    ``test_path`` gives a separate test file; otherwise ``test_fraction`` is held out.
    ``classes`` gives the number of classes (a subset of a data set may lack its last
    ones), default the largest label + 1. Relative paths are relative to the scenario
    file's directory.

    With a client column and a ``test_path`` whose rows have the client column too, its
    clients can be read a cohort at a time (``data.load: cohort``: :class:`ParquetClients`,
    through pyarrow's dataset API with a filter on the client column, never the whole
    file): client ``k`` is the ``k``-th client id in order, its rows in file order, the
    same samples the ``natural`` partitioner gives it from ``load``. Files sorted by client
    (``fedray data convert`` writes them so) let the filter skip every row group but the
    cohort's."""

    traits = Traits(path_params=("path", "test_path"),
                    file_or_folder_params=("path", "test_path"))
    whole_is_gathered = False  # its own load: a hold-out drawn over the whole file

    def __init__(
        self,
        path: str,
        label: str = "label",
        features: list[str] | None = None,
        client: str | None = None,
        test_path: str | None = None,
        shape: list[Annotated[int, Ge(1)]] | None = None,
        classes: Annotated[int, Ge(2)] | None = None,
    ) -> None:
        self.path, self.label, self.features = path, label, features
        self.client, self.test_path = client, test_path
        self.shape, self.classes = shape, classes

    def _classes(self, top: int) -> int:
        """The number of classes: ``classes`` when given (above every label), else the
        largest label + 1."""
        if self.classes is None:
            return top + 1
        if top >= self.classes:
            raise DataError(f"classes: the labels of {self.path} go up to {top}; classes "
                            f"must be above it, got {self.classes}")
        return self.classes

    def _shape(self, width: int) -> tuple[int, ...]:
        """One sample's shape: ``shape`` when given (its product must be the width)."""
        if self.shape is None:
            return (width,)
        if int(np.prod(self.shape)) != width:
            raise DataError(f"shape: {list(self.shape)} holds {int(np.prod(self.shape))} values, "
                            f"the samples of {self.path} have {width}")
        return tuple(self.shape)

    def check(self, n: int) -> None:
        """Both paths exist and are Parquet files (or directories of them, of one schema),
        with the named columns; once while the files stay as they were (a sweep's points
        ask with the same block)."""
        stamp = (self.path, self.test_path, self.label, tuple(self.features or ()),
                 self.client, _stamp(self.path, "path"), _stamp(self.test_path, "test_path"))
        if stamp in _CHECKED:
            return
        self._check_files()
        if len(_CHECKED) >= 64:
            _CHECKED.clear()
        _CHECKED.add(stamp)

    def _check_files(self) -> None:
        import pyarrow as pa

        for key in ("path", "test_path"):
            p = getattr(self, key)
            if p is None:
                continue
            try:
                guard(p, "either")
                for f in parquet_data(p).files if Path(p).is_dir() else []:
                    guard(f, "file")  # a FIFO or a device among them is never opened
            except PathRefused as e:
                raise DataError(f"{key}: {e}") from None
            except (pa.ArrowInvalid, OSError):
                raise DataError(f"{key}: not a Parquet file: {p}") from None
            try:
                schema = parquet_data(p).schema
            except (pa.ArrowInvalid, OSError):
                raise DataError(f"{key}: not a Parquet file: {p}") from None
            names = schema.names
            if not names:
                raise DataError(f"{key}: no Parquet file in {p}")
            _one_schema(key, p)
            for what, col in [("label", self.label), ("client", self.client)] + \
                    [("features", c) for c in self.features or []]:
                if col is not None and col not in names:
                    raise DataError(f"{what}: column {col!r} not in {p}; columns: "
                                     f"{', '.join(names[:20])}")
            self._check_types(schema, p)

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
            if not (pt.is_integer(t) or pt.is_floating(t) or pt.is_fixed_size_binary(t)):
                raise DataError(f"features: column {name!r} of {path} must hold numbers (or "
                                f"lists of numbers, or fixed-size bytes), got "
                                f"{schema.field(name).type}")

    def describe(self, num_clients: int, seed: int, test_fraction: float) -> DatasetInfo:
        """Rows, feature width and classes, reading the label and feature columns in batches
        (labels must be integers >= 0, features finite); the file is never held whole."""
        self.check(num_clients)
        x_width, n, top, pixels = 0, 0, -1, True
        for path in [self.path] + ([self.test_path] if self.test_path else []):
            width, rows, hi, uint8 = self._scan(path)
            pixels = pixels and uint8
            if x_width and width != x_width:
                raise DataError(f"test_path: {width} features per sample, {self.path} has {x_width}")
            x_width, top = width, max(top, hi)
            n = n or rows
        train = n if self.test_path else _n_train(n, test_fraction)
        return DatasetInfo(train, self._shape(x_width), self._classes(top),
                           natural_clients=self._natural_clients(seed, test_fraction),
                           value_bytes=1 if pixels else 4)  # uint8 pixels stay uint8

    def _natural_clients(self, seed: int, test_fraction: float) -> int:
        """Distinct ids of the client column among the training rows (as ``load`` splits
        them), reading that column alone; 0 without a client column."""
        if self.client is None:
            return 0
        column = parquet_data(self.path).to_table(columns=[self.client]).column(self.client)
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

    def _scan(self, path: str) -> tuple[int, int, int, bool]:
        """(features per sample, rows, largest label, whether every feature is uint8) of one
        file, checked batch by batch."""
        import pyarrow as pa
        import pyarrow.compute as pc

        f = parquet_data(path)
        names = f.schema.names
        feats = self.features or [c for c in names if c not in (self.label, self.client)]
        width, rows, top, uint8 = 0, 0, -1, True
        for batch in f.to_batches(columns=[self.label, *feats], batch_size=65536):
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
                m = feature_matrix(col, name, path)
                w += m.shape[1] if len(col) else 0
                uint8 = uint8 and m.dtype == np.uint8
            width = width or w
            rows += batch.num_rows
        return width, rows, top, uint8

    def _read(self, path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        return self.arrays(parquet_data(path).to_table(), path)

    def arrays(self, table: Any, path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(x, y, clients)`` of a table read from ``path``: the feature block, int64
        labels and (with a client column) each row's client id."""
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
            x_te, y_te, c_te = self._read(self.test_path)
            tr = np.arange(len(y))
        else:
            tr, te = self._holdout(len(y), seed, test_fraction)
            x_te, y_te = x[te], y[te]
            c_te = None if clients is None else clients[te]
        num_classes = self._classes(int(max(y.max(), y_te.max() if len(y_te) else 0)))
        shape = self._shape(x.shape[1])
        return DatasetSplit(
            x[tr].reshape(-1, *shape), y[tr], x_te.reshape(-1, *shape), y_te, shape,
            num_classes, None if clients is None else clients[tr], c_te,
        )

    def population(self, num_clients: int, seed: int, test_fraction: float) -> Population:
        """Its clients, a cohort at a time: needs the client column, and a ``test_path``
        with the client column (each client's held-out rows: a held-out fraction of rows
        drawn over the whole file cannot be read per client)."""
        self.check(num_clients)
        if self.client is None:
            raise DataError("client: data.load cohort reads the file's clients; name its "
                            "client column")
        if self.test_path is None or \
                self.client not in parquet_data(self.test_path).schema.names:
            raise DataError(f"test_path: data.load cohort needs a test file with the client "
                            f"column {self.client!r} (each client's held-out rows)")
        ids, sizes = _client_counts(parquet_data(self.path), self.client)
        as_many_clients(len(ids), num_clients)
        first = parquet_data(self.path).head(1, columns=[*self._features(), self.label,
                                                           self.client])
        width = self.arrays(first, self.path)[0].shape[1] if first.num_rows else 1
        top = max(_label_max(self.path, self.label), _label_max(self.test_path, self.label))
        return ParquetClients(self, ids, sizes, self._shape(width), self._classes(top))

    def _features(self) -> list[str]:
        names = parquet_data(self.path).schema.names
        return self.features or [c for c in names if c not in (self.label, self.client)]


def _label_max(path: str, label: str) -> int:
    import pyarrow.compute as pc

    top = pc.max(parquet_data(path).to_table(columns=[label]).column(label)).as_py()
    return -1 if top is None else int(top)


def _client_counts(data: Any, client: str) -> tuple[np.ndarray, np.ndarray]:
    """The sorted distinct ids of the client column and each one's rows, reading that
    column a batch at a time (memory: the distinct ids, never the column whole)."""
    ids: list[np.ndarray] = []
    counts: list[np.ndarray] = []
    for batch in data.to_batches(columns=[client], batch_size=1 << 20):
        col = batch.column(0)
        if col.null_count:
            raise DataError(f"client: column {client!r} has {col.null_count} missing client ids")
        u, c = np.unique(col.to_numpy(zero_copy_only=False), return_counts=True)
        ids.append(u)
        counts.append(c)
    if not ids:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    u, where = np.unique(np.concatenate(ids), return_inverse=True)
    return u.astype(np.int64), np.bincount(where, weights=np.concatenate(counts),
                                           minlength=len(u)).astype(np.int64)


@dataclass(frozen=True)
class RowGroups:
    """One Parquet file's row groups by the client ids they hold (their min/max statistics;
    a group without statistics is read for every cohort)."""

    path: str
    low: np.ndarray  # float64: the smallest client id of each row group (-inf: unknown)
    high: np.ndarray  # the largest (+inf: unknown)

    @staticmethod
    def of(path: str, client: str) -> RowGroups:
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path).metadata
        col = meta.schema.to_arrow_schema().get_field_index(client)
        low, high = np.full(meta.num_row_groups, -np.inf), np.full(meta.num_row_groups, np.inf)
        for g in range(meta.num_row_groups):
            st = meta.row_group(g).column(col).statistics
            if st is not None and st.has_min_max:
                low[g], high[g] = st.min, st.max
        return RowGroups(path, low, high)

    def holding(self, keys: np.ndarray) -> list[int]:
        """The row groups whose client range holds one of the sorted ``keys`` at least."""
        first = np.searchsorted(keys, self.low, "left")
        return np.flatnonzero(first < np.searchsorted(keys, self.high, "right")).tolist()


class ParquetClients(Population):
    """The clients of a :class:`ParquetDataset` (its ``k``-th client id is client ``k``).
    A cohort reads only the row groups whose client range (the groups' statistics, taken
    once) holds one of its clients, through pyarrow's dataset API with a filter on the
    client column: in a file sorted by client, 100 clients of 20,000 read 100 groups where
    a filter alone scanned the whole file (71 ms against 1.9 s, 2 M rows, here)."""

    def __init__(self, ds: ParquetDataset, ids: np.ndarray, sizes: np.ndarray,
                 input_shape: tuple[int, ...], num_classes: int) -> None:
        self.ds, self.ids, self.sizes = ds, ids, sizes
        self.input_shape, self.num_classes = input_shape, num_classes
        self.columns = [*ds._features(), ds.label, ds.client]
        assert ds.client is not None and ds.test_path is not None
        self.groups = {p: [RowGroups.of(f, ds.client) for f in parquet_data(p).files]
                       for p in (ds.path, ds.test_path)}
        self._open: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_open": {}}  # files are opened in each process

    def _fragment(self, path: str) -> Any:
        if path not in self._open:
            self._open[path] = next(iter(parquet_data(path).get_fragments()))
        return self._open[path]

    def _rows(self, path: str, clients: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        import pyarrow as pa
        import pyarrow.compute as pc

        keys = self.ids[np.asarray(clients, dtype=np.int64)]
        wanted = pa.array(np.unique(keys))
        parts = [self._fragment(f.path).subset(row_group_ids=f.holding(np.unique(keys)))
                 .to_table(columns=self.columns, filter=pc.field(self.ds.client).isin(wanted))
                 for f in self.groups[path]]
        x, y, owner = self.ds.arrays(pa.concat_tables(parts), path)
        assert owner is not None
        order = np.argsort(owner, kind="stable")  # by client, file order within each
        owned = owner[order]
        lo, hi = np.searchsorted(owned, keys, "left"), np.searchsorted(owned, keys, "right")
        return [(x[order[a:b]].reshape(-1, *self.input_shape), y[order[a:b]])
                for a, b in zip(lo.tolist(), hi.tolist(), strict=True)]

    def train(self, clients: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        return self._rows(self.ds.path, clients)

    def test(self, clients: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        assert self.ds.test_path is not None
        return self._rows(self.ds.test_path, clients)
