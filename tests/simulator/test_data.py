from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from simulator import data as fdata
from simulator.data.datasets import DataError, Digits, GaussianMixture, ParquetDataset, Synthetic
from simulator.data.partitioners import IID, Dirichlet, Natural, Shards


def classes_per_client(y, parts):
    return [len(np.unique(y[p])) for p in parts]


def test_synthetic_is_heterogeneous_and_seeded():
    a = Synthetic(alpha=1.0, beta=1.0).load(30, seed=3, test_fraction=0.2)
    b = Synthetic(alpha=1.0, beta=1.0).load(30, seed=3, test_fraction=0.2)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    assert a.input_shape == (60,) and a.num_classes == 10
    counts = np.bincount(a.clients_train, minlength=30)
    assert counts.min() >= 40  # 50 minimum samples, 20% held out
    # clients' input means differ (v_k ~ N(B_k, 1)): far more than sampling noise
    means = np.stack([a.x_train[a.clients_train == k].mean(0) for k in range(30)])
    assert means.std(0).mean() > 0.5
    # iid-in-model case (alpha=beta=0) is less heterogeneous across clients than alpha=beta=1
    h = Synthetic(alpha=0.0, beta=0.0).load(30, seed=3, test_fraction=0.2)
    mh = np.stack([h.x_train[h.clients_train == k].mean(0) for k in range(30)])
    assert mh.std(0).mean() < means.std(0).mean()


def test_digits_and_gaussian_mixture_shapes():
    d = Digits().load(10, seed=0, test_fraction=0.25)
    assert d.x_train.shape[1:] == (1, 8, 8) and len(d.y_train) + len(d.y_test) == 1797
    assert abs(len(d.y_test) - 449) <= 1 and d.x_train.max() <= 1.0
    g = GaussianMixture(samples=1000, dimension=5, classes=3).load(10, seed=0, test_fraction=0.1)
    assert g.x_train.shape == (900, 5) and set(np.unique(g.y_train)) == {0, 1, 2}


def test_digits_are_scikit_learns_read_without_importing_it():
    """Digits reads scikit-learn's shipped file directly (0.7 s of imports saved): the same
    pixels and labels as ``load_digits``, in the same order."""
    from sklearn.datasets import load_digits

    from simulator.data.datasets import _digits_table

    table, bunch = _digits_table(), load_digits()
    assert table.shape == (1797, 65)
    assert _digits_table() is table and not table.flags.writeable  # read once, shared
    np.testing.assert_array_equal(table[:, :-1], bunch.data)
    np.testing.assert_array_equal(table[:, -1], bunch.target)
    d = Digits().load(10, seed=0, test_fraction=0.25)
    assert np.isin(d.x_train.reshape(len(d.x_train), -1) * 16.0, bunch.data).all()


def test_iid_sizes_differ_by_at_most_one():
    y = np.arange(103) % 10
    parts = IID()(y, 10, np.random.default_rng(0))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 103
    assert len(np.unique(np.concatenate(parts))) == 103


def test_dirichlet_small_alpha_skews_labels():
    y = np.repeat(np.arange(10), 200)
    skewed = Dirichlet(alpha=0.05)(y, 20, np.random.default_rng(0))
    flat = Dirichlet(alpha=100.0)(y, 20, np.random.default_rng(0))
    assert np.mean(classes_per_client(y, skewed)) < 5
    assert np.mean(classes_per_client(y, flat)) == 10
    assert sum(len(p) for p in skewed) == 2000


def test_shards_give_at_most_k_classes():
    y = np.repeat(np.arange(10), 100)
    parts = Shards(k=2)(y, 50, np.random.default_rng(1))
    assert max(classes_per_client(y, parts)) <= 2
    assert sorted(np.concatenate(parts).tolist()) == list(range(1000))


def test_natural_needs_a_client_column_and_matching_count():
    y = np.zeros(6, dtype=np.int64)
    parts = Natural()(y, 3, None, np.array([2, 0, 1, 0, 2, 2]))
    assert [p.tolist() for p in parts] == [[1, 3], [2], [0, 4, 5]]
    with pytest.raises(DataError, match="clients.total: must equal the dataset's 3 natural clients"):
        Natural()(y, 4, None, np.array([2, 0, 1, 0, 2, 2]))
    with pytest.raises(DataError, match="needs a dataset with a client column"):
        Natural()(y, 3, None, None)


def test_parquet_dataset_with_client_column(tmp_path):
    rng = np.random.default_rng(0)
    n = 300
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({
        "f0": rng.normal(size=n), "f1": rng.normal(size=n), "f2": rng.normal(size=n),
        "label": rng.integers(0, 3, n), "user": np.repeat(np.arange(6), 50),
    }), path)
    fd = fdata.build({"name": "parquet", "path": str(path), "client": "user", "label": "label",
                      "features": None, "test_path": None},
                     {"name": "natural"}, 6, seed=0, test_fraction=0.2)
    assert fd.input_shape == (3,) and fd.num_classes == 3
    assert fd.num_clients == 6 and fd.client_sizes().sum() + len(fd.y_test) == n
    x, _ = fdata.client_arrays(fd.source.table, fd.input_shape)
    assert x.shape == (240, 3)
    with pytest.raises(DataError, match="column 'nope' not in"):
        ParquetDataset(str(path), label="nope").load(6, 0, 0.2)


def test_partition_table_round_trips_and_reads_zero_copy():
    x = np.arange(24, dtype=np.float32).reshape(6, 1, 2, 2)
    y = np.arange(6)
    parts = [np.array([4, 1]), np.array([0]), np.array([5, 2, 3])]
    table, offsets = fdata.partition_table(x, y, parts)
    assert offsets.tolist() == [0, 2, 3, 6]
    xs, ys = fdata.client_arrays(table, (1, 2, 2))
    np.testing.assert_array_equal(ys, [4, 1, 0, 5, 2, 3])
    np.testing.assert_array_equal(xs[0], x[4])
    assert not xs.flags.writeable  # a view of the Arrow buffer, not a copy
    assert table.column("client").to_pylist() == [0, 0, 1, 2, 2, 2]


def test_empty_client_is_an_error():
    with pytest.raises(DataError, match="clients got no sample"):
        fdata.build({"name": "digits"}, {"name": "iid"}, 2000, seed=0, test_fraction=0.2)


@pytest.mark.parametrize("kind", ["list", "large_list", "fixed_size_list"])
def test_parquet_one_list_column_of_features(tmp_path, kind):
    """The documented "one list column" form: it failed on current pyarrow ("setting an array
    element with a sequence") for variable-size list types."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, 5)).astype(np.float32)
    values = pa.array(x.reshape(-1))
    col = {"list": lambda: pa.ListArray.from_arrays(pa.array(np.arange(0, 201, 5, dtype=np.int32)), values),
           "large_list": lambda: pa.LargeListArray.from_arrays(pa.array(np.arange(0, 201, 5)), values),
           "fixed_size_list": lambda: pa.FixedSizeListArray.from_arrays(values, 5)}[kind]()
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"pixels": col, "label": np.arange(40) % 3}), path)
    ds = ParquetDataset(str(path))
    split = ds.load(4, 0, 0.25)
    assert split.input_shape == (5,) and split.num_classes == 3
    got = np.concatenate([split.x_train, split.x_test])
    np.testing.assert_array_equal(np.sort(got, axis=0), np.sort(x, axis=0))
    info = ds.describe(4, 0, 0.25)
    assert (info.train_samples, info.input_shape, info.num_classes) == (30, (5,), 3)


def test_parquet_list_rows_of_different_lengths_are_one_error(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"pixels": [[1.0, 2.0], [3.0], [4.0, 5.0]], "label": [0, 1, 0]}), path)
    with pytest.raises(DataError, match="'pixels' .* have 1 to 2 values"):
        ParquetDataset(str(path)).load(1, 0, 0.3)
    with pytest.raises(DataError, match="have 1 to 2 values"):
        ParquetDataset(str(path)).describe(1, 0, 0.3)


def test_pathological_gives_each_client_k_classes_split_evenly():
    from simulator.data.partitioners import Pathological

    y = np.repeat(np.arange(10), 30)
    parts = Pathological(k=2)(y, 12, np.random.default_rng(0))
    assert len(parts) == 12 and all(len(p) for p in parts)
    assert all(len(np.unique(y[p])) <= 2 for p in parts)
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == len(flat)  # disjoint
    for c in np.unique(y[flat]):  # a class's samples split evenly between its holders
        sizes = [int((y[p] == c).sum()) for p in parts if (y[p] == c).any()]
        assert max(sizes) - min(sizes) <= 1
    again = Pathological(k=2)(y, 12, np.random.default_rng(0))
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    with pytest.raises(ValueError, match="data.partitioner.k: 11 classes per client, the data has 10"):
        Pathological(k=11)(y, 3, np.random.default_rng(0))


def test_sizes_skews_the_client_sizes_and_keeps_every_sample():
    from simulator.data.partitioners import Sizes

    y = np.zeros(1000, dtype=np.int64)
    even = Sizes(alpha=1000.0)(y, 10, np.random.default_rng(1))
    skew = Sizes(alpha=0.2, min_size=5)(y, 10, np.random.default_rng(1))
    for parts in (even, skew):
        flat = np.concatenate(parts)
        assert sorted(flat.tolist()) == list(range(1000))
    assert max(map(len, even)) - min(map(len, even)) < 30  # ~100 each
    assert min(map(len, skew)) >= 5 and max(map(len, skew)) > 300
    with pytest.raises(ValueError, match="data.partitioner.min_size: 10 clients x 200 needs 2000 training samples, the data set has 1000"):
        Sizes(min_size=200)(y, 10, np.random.default_rng(0))
