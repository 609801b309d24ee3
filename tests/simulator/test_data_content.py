"""Data whose content contradicts itself, in every published format and in the user's own
files, is refused in one line (exit 2) naming the file, the field and what was expected,
before any MLflow run exists: validation reads the files through, with the bounds the run
reads them with. Each case below ran to FINISHED (or failed after runs existed, or with a
traceback) before."""

from __future__ import annotations

import json
import pickle
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fedray.cli import main
from tests import formats
from tests.conftest import own_lines

MODELS = {"image": "{name: logreg}", "tokens": "{name: char_lstm, hidden: 8, layers: 1}"}


def refused(tmp_path: Path, mlflow_uri: str, capsys, dataset: str, partitioner: str = "iid",
            model: str = "image", clients: int = 4) -> str:
    """``fedray run`` of a scenario over ``dataset``: exit 2, one line on stderr (returned,
    with the scenario's path as SCENARIO), and no MLflow run anywhere in the store."""
    from mlflow.tracking import MlflowClient

    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(f"""\
        rounds: 2
        data: {{dataset: {dataset}, partitioner: {{name: {partitioner}}}}}
        model: {MODELS[model]}
        clients: {{total: {clients}}}
        local: {{steps: 2, batch_size: 4}}
    """))
    capsys.readouterr()
    rc = main(["run", str(p), "--backend", "inline", "--tracking-uri", mlflow_uri, "--quiet"])
    lines = own_lines(capsys.readouterr().err)
    assert rc == 2 and len(lines) == 1, (rc, lines)
    client = MlflowClient(mlflow_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    assert client.search_runs(experiments) == []
    return lines[0].replace(str(p), "SCENARIO").replace(str(tmp_path), "TMP")


# ---------------------------------------------------------------------------- LEAF


def _leaf(tmp_path: Path, edit, split: str = "train", file: int = 0) -> str:
    """FEMNIST's files, one of them edited (``edit(doc)``); the dataset block."""
    formats.write_leaf(tmp_path / "leaf", writers=4, per_writer=8, files=2)
    path = tmp_path / "leaf" / split / f"all_data_{file}_niid_0_keep_0_{split}_9.json"
    doc = json.loads(path.read_text())
    text = edit(doc)
    path.write_text(text if isinstance(text, str) else json.dumps(doc))
    return "{name: femnist, root: leaf}"


LEAF_FILE = "TMP/leaf/train/all_data_0_niid_0_keep_0_train_9.json"
PRE = "SCENARIO:2: data.dataset.root: "


def _first(doc: dict) -> dict:
    return doc["user_data"][doc["users"][0]]


@pytest.mark.parametrize("edit, message", [
    (lambda d: _first(d)["y"].pop(),
     ": user_data['f0000_00'] has 6 x and 5 y; expected one y per x"),
    (lambda d: d["num_samples"].__setitem__(0, 60),
     ": num_samples gives user 'f0000_00' 60 samples, its user_data holds 6"),
    (lambda d: d["users"].append("f0000_00") or d["num_samples"].append(6),
     ": user 'f0000_00' is listed twice in users; expected each user once"),
    (lambda d: json.dumps(d)[:-1] + ', "user_data": {}}',
     " has the key 'user_data' twice in one object; expected each key once"),
    (lambda d: d["users"].append("ghost") or d["num_samples"].append(0),
     ": user 'ghost' of users has no user_data"),
    (lambda d: d["user_data"].__setitem__("stray", {"x": [], "y": []}),
     ": user_data holds 'stray', which users does not list"),
], ids=["x_y_lengths", "lying_num_samples", "user_twice", "key_twice", "user_no_data",
        "data_no_user"])
def test_a_leaf_file_that_contradicts_itself(tmp_path, mlflow_uri, capsys, edit, message):
    block = _leaf(tmp_path, edit)
    assert refused(tmp_path, mlflow_uri, capsys, block, "natural") == \
        f"{PRE}{LEAF_FILE}{message}"


@pytest.mark.parametrize("value, shown", [(float("nan"), "nan"), (float("inf"), "inf"),
                                          (1e300, "1e+300"), (-0.5, "-0.5"), (3.0, "3")])
def test_leaf_pixels_must_be_finite_and_in_0_1(tmp_path, mlflow_uri, capsys, value, shown):
    block = _leaf(tmp_path, lambda d: _first(d)["x"][2].__setitem__(5, value))
    assert refused(tmp_path, mlflow_uri, capsys, block, "natural") == (
        f"{PRE}{LEAF_FILE}: user_data['f0000_00']: x[2] holds {shown}; expected pixel values "
        "in [0, 1]")


@pytest.mark.parametrize("edit, message", [
    (lambda d: _first(d)["x"][1].pop(),
     "x[1] holds 783 values; expected 784 pixel values in [0, 1] (28x28)"),
    (lambda d: _first(d)["x"].__setitem__(0, "pixels"),
     "x[0] holds str; expected 784 pixel values in [0, 1] (28x28)"),
    (lambda d: _first(d)["x"][3].__setitem__(0, "0.5"),
     "x holds values that are not numbers; expected pixel values in [0, 1]"),
    (lambda d: _first(d)["y"].__setitem__(0, "seven"),
     "y holds values that are not numbers; expected class ids 0..61"),
    (lambda d: _first(d)["y"].__setitem__(0, 62),
     "y: label 62 at row 0; expected 0..61 (FEMNIST's 62 classes)"),
    (lambda d: _first(d)["y"].__setitem__(0, 1.5),
     "y must hold integer class ids 0..61"),
], ids=["783_values", "row_string", "value_strings", "label_string", "label_62",
        "label_float"])
def test_a_leaf_sample_of_the_wrong_width_or_kind(tmp_path, mlflow_uri, capsys, edit, message):
    block = _leaf(tmp_path, edit)
    assert refused(tmp_path, mlflow_uri, capsys, block, "natural") == \
        f"{PRE}{LEAF_FILE}: user_data['f0000_00']: {message}"


def test_a_user_in_two_files_of_a_split(tmp_path, mlflow_uri, capsys):
    formats.write_leaf(tmp_path / "leaf", writers=4, per_writer=8, files=2)
    src = tmp_path / "leaf" / "test" / "all_data_0_niid_0_keep_0_test_9.json"
    (tmp_path / "leaf" / "test" / "copy.json").write_text(src.read_text())
    assert refused(tmp_path, mlflow_uri, capsys, "{name: femnist, root: leaf}", "natural") == (
        f"{PRE}user 'f0000_00' is listed in both TMP/leaf/test/all_data_0_niid_0_keep_0_test_9"
        ".json and TMP/leaf/test/copy.json; expected each user in one test file")


def test_a_leaf_file_nested_deeply_is_one_line(tmp_path, mlflow_uri, capsys):
    """5,000 nested lists: a RecursionError and ~3,000 lines of traceback before."""
    block = _leaf(tmp_path, lambda d: json.dumps(d)[:-1] + ', "extra": ' + "[" * 5000
                  + "]" * 5000 + "}")
    line = refused(tmp_path, mlflow_uri, capsys, block, "natural")
    assert line.startswith(f"{PRE}{LEAF_FILE} nests arrays and objects deeper than 32 levels "
                           "(at byte ")
    assert line.endswith("); expected the format's few levels")


def test_shakespeare_samples_are_80_characters_and_one(tmp_path, mlflow_uri, capsys):
    formats.write_shakespeare(tmp_path / "play", roles=4, per_role=12)
    path = tmp_path / "play" / "test" / "all_data_niid_0_keep_0_test_9.json"
    doc = json.loads(path.read_text())
    doc["user_data"]["THE_PLAY_ROLE1"]["y"][0] = "ab"
    path.write_text(json.dumps(doc))
    assert refused(tmp_path, mlflow_uri, capsys, "{name: shakespeare, root: play}", "natural",
                   "tokens") == (
        f"{PRE}TMP/play/test/all_data_niid_0_keep_0_test_9.json: user_data['THE_PLAY_ROLE1']: "
        "y[0] is not one character; expected the character after its x")
    doc["user_data"]["THE_PLAY_ROLE1"]["y"][0] = "a"
    doc["user_data"]["THE_PLAY_ROLE1"]["x"][1] = "too short"
    path.write_text(json.dumps(doc))
    assert refused(tmp_path, mlflow_uri, capsys, "{name: shakespeare, root: play}", "natural",
                   "tokens") == (
        f"{PRE}TMP/play/test/all_data_niid_0_keep_0_test_9.json: user_data['THE_PLAY_ROLE1']: "
        "x[1] is not a string of 80 characters (LEAF's sequence length)")


# ---------------------------------------------------------------------------- IDX


@pytest.mark.parametrize("label", [200, 255, 10])
def test_mnist_labels_outside_its_ten_classes(tmp_path, mlflow_uri, capsys, label):
    """Labels of 200 or 255 made a 201- or 256-class model, silently."""
    written = formats.write_mnist(tmp_path / "m")
    y = written["y_test"].astype(np.uint8)
    y[7] = label
    formats.write_idx(tmp_path / "m" / "t10k-labels-idx1-ubyte", y, gz=True)
    assert refused(tmp_path, mlflow_uri, capsys, "{name: mnist, root: m}") == (
        f"{PRE}TMP/m/t10k-labels-idx1-ubyte.gz: label {label} at row 7; expected 0..9 "
        "(MNIST's 10 classes)")


def test_emnist_labels_are_checked_against_its_split(tmp_path, mlflow_uri, capsys):
    formats.write_mnist(tmp_path / "e", prefix="emnist-digits-", classes=10)
    y = formats.images(60, 0, classes=10)[1].astype(np.uint8)
    y[3] = 46  # a balanced label, not a digit
    formats.write_idx(tmp_path / "e" / "emnist-digits-train-labels-idx1-ubyte", y, gz=True)
    assert refused(tmp_path, mlflow_uri, capsys, "{name: emnist, root: e, split: digits}") == (
        f"{PRE}TMP/e/emnist-digits-train-labels-idx1-ubyte.gz: label 46 at row 3; expected "
        "0..9 (EMNIST digits's 10 classes)")


def test_mnist_images_cut_short_or_not_as_published(tmp_path, mlflow_uri, capsys):
    """An images file shorter than its header says failed only when the run loaded it."""
    import gzip

    written = formats.write_mnist(tmp_path / "m")
    gz = tmp_path / "m" / "t10k-images-idx3-ubyte.gz"
    gz.write_bytes(gzip.compress(gzip.decompress(gz.read_bytes())[:-784]))
    assert refused(tmp_path, mlflow_uri, capsys, "{name: mnist, root: m}") == (
        f"{PRE}TMP/m/t10k-images-idx3-ubyte.gz holds 14896 bytes of data, its header says "
        "(20, 28, 28) x 1")
    formats.write_idx(gz.with_suffix(""), written["x_test"].astype(np.float32) / 255, gz=True)
    assert refused(tmp_path, mlflow_uri, capsys, "{name: mnist, root: m}") == (
        f"{PRE}TMP/m/t10k-images-idx3-ubyte.gz holds IDX values of type float32; expected "
        "unsigned bytes (type 0x08), as MNIST publishes them")
    formats.write_idx(gz.with_suffix(""), written["x_test"][:, :, :27].copy(), gz=True)
    assert refused(tmp_path, mlflow_uri, capsys, "{name: mnist, root: m}") == (
        f"{PRE}TMP/m/t10k-images-idx3-ubyte.gz holds (20, 28, 27), TMP/m/t10k-labels-idx1-ubyte.gz "
        "(20,): "
        "expected (N, 28, 28) images and (N,) labels")


# ---------------------------------------------------------------------------- CIFAR


def _cifar(tmp_path: Path, name: str, edit) -> str:
    formats.write_cifar10(tmp_path / "c")
    path = tmp_path / "c" / "cifar-10-batches-py" / name
    batch = pickle.loads(path.read_bytes(), encoding="bytes")
    edit(batch)
    path.write_bytes(pickle.dumps(batch, protocol=2))
    return "{name: cifar10, root: c}"


@pytest.mark.parametrize("name, edit, message", [
    ("data_batch_3", lambda b: b[b"labels"].pop(),
     "11 'labels' for 12 images; expected one label per image"),
    ("test_batch", lambda b: b[b"labels"].__setitem__(4, 10),
     "label 10 at row 4; expected 0..9 (CIFAR10's 10 classes)"),
    ("test_batch", lambda b: b[b"labels"].__setitem__(4, "cat"),
     "'labels' must be a list of integer class ids"),
    ("data_batch_1", lambda b: b.__setitem__(b"data", b[b"data"].astype(np.float64) * np.nan),
     "'data' must be an (N, 3072) uint8 array of 32x32 RGB images, got float64 (12, 3072)"),
], ids=["fewer_labels", "label_10", "label_string", "nan_images"])
def test_cifar_batches_that_contradict_themselves(tmp_path, mlflow_uri, capsys, name, edit,
                                                  message):
    block = _cifar(tmp_path, name, edit)
    assert refused(tmp_path, mlflow_uri, capsys, block) == \
        f"{PRE}TMP/c/cifar-10-batches-py/{name}: {message}"


# ---------------------------------------------------------------------------- Hugging Face


@pytest.mark.parametrize("text, message", [
    ('["train", "test"]', ("TMP/hf/dataset_dict.json holds a JSON list; expected an object "
                          "with 'splits', as save_to_disk writes it")),
    ('{"splits": "train"}', ("TMP/hf/dataset_dict.json: splits must be a list of split names "
                            "(strings)")),
    ('{"splits": [' * 40 + "]}" * 40, ("TMP/hf/dataset_dict.json nests arrays and objects "
                                      "deeper than 32 levels (at byte 192); expected the "
                                      "format's few levels")),
], ids=["list", "splits_text", "deep"])
def test_a_huggingface_dataset_dict_of_the_wrong_type(tmp_path, mlflow_uri, capsys, text,
                                                      message):
    formats.write_hf_save_to_disk(tmp_path / "hf")
    (tmp_path / "hf" / "dataset_dict.json").write_text(text)
    assert refused(tmp_path, mlflow_uri, capsys, "{name: huggingface, path: hf}",
                   clients=3) == f"SCENARIO:2: data.dataset.path: {message}"


def test_a_huggingface_state_file_naming_a_file_elsewhere(tmp_path, mlflow_uri, capsys):
    formats.write_hf_save_to_disk(tmp_path / "hf")
    (tmp_path / "hf" / "train" / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "../../../etc/passwd"}]}))
    assert refused(tmp_path, mlflow_uri, capsys, "{name: huggingface, path: hf}",
                   clients=3) == (
        'SCENARIO:2: data.dataset.path: TMP/hf/train/state.json: _data_files must be a list of '
        '{"filename": NAME}, each a file in its folder')


def test_huggingface_rows_are_checked_before_the_run(tmp_path, mlflow_uri, capsys):
    """An image of another size, non-finite features, a client column of floats: each broke
    the run after it started (np.stack's traceback) or passed."""
    table, _, _ = formats.hf_table(12, 0)
    rows = table.to_pylist()
    rows[5]["image"] = {"bytes": formats.png(np.zeros((9, 8), np.uint8)), "path": None}
    (tmp_path / "a").mkdir()
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), tmp_path / "a" / "train.parquet")
    assert refused(tmp_path, mlflow_uri, capsys, "{name: huggingface, path: a}", clients=3) == (
        "SCENARIO:2: data.dataset.image: row 5 of column 'image' is 8x9 with 1 channel(s), row 0 "
        "8x8 with 1 channel(s); every image needs the same size and channels")
    (tmp_path / "b").mkdir()
    f0 = np.arange(12, dtype=np.float64)
    f0[9] = 1e300
    pq.write_table(pa.table({"f0": f0, "label": np.arange(12) % 3,
                             "user": np.arange(12) % 3 + 0.5}), tmp_path / "b" / "train.parquet")
    assert refused(tmp_path, mlflow_uri, capsys,
                   "{name: huggingface, path: b, image: null, features: [f0]}", clients=3) == (
        "SCENARIO:2: data.dataset.features: column 'f0' of the data holds 1e+300 in row 9; "
        "expected finite numbers within float32's range (|x| <= 3.4e+38)")
    assert refused(tmp_path, mlflow_uri, capsys, "{name: huggingface, path: b, image: null, "
                   "features: [label], client: user}", "natural", clients=3) == (
        "SCENARIO:2: data.dataset.client: column 'user' must hold client ids (integers or "
        "strings) in every row, got double")
    (tmp_path / "c").mkdir()
    pq.write_table(pa.table({"sentence": np.arange(12), "label": np.arange(12) % 3,
                             "image": pa.array([{"x": 1}] * 12)}), tmp_path / "c" / "train.parquet")
    assert refused(tmp_path, mlflow_uri, capsys, "{name: huggingface, path: c, image: null, "
                   "text: sentence}", model="tokens", clients=3) == (
        "SCENARIO:2: data.dataset.text: column 'sentence' must hold text, got int64")
    assert refused(tmp_path, mlflow_uri, capsys, "{name: huggingface, path: c}", clients=3) == (
        "SCENARIO:2: data.dataset.image: column 'image' is a struct without 'bytes' "
        "(struct<x: int64>); expected HF's Image feature {bytes, path}")


# ---------------------------------------------------------------------------- Parquet


def test_parquet_columns_of_the_wrong_type_or_non_finite(tmp_path, mlflow_uri, capsys):
    rng = np.random.default_rng(0)
    base = {"f0": rng.normal(size=40), "f1": rng.normal(size=40),
            "label": rng.integers(0, 3, 40), "user": np.arange(40) % 4}
    cases = [
        ({"user": [f"u{i % 4}" for i in range(40)]}, "client: user",
         ("SCENARIO:2: data.dataset.client: column 'user' of TMP/d.parquet must hold integer "
         "client ids, got string")),
        ({"label": rng.integers(0, 3, 40).astype(np.float64)}, "",
         ("SCENARIO:2: data.dataset.label: column 'label' must hold integers, got double "
          "(class ids, in TMP/d.parquet)")),
        ({"f1": [str(v) for v in range(40)]}, "",
         ("SCENARIO:2: data.dataset.features: column 'f1' of TMP/d.parquet must hold numbers "
         "(or lists of numbers, or fixed-size bytes), got string")),
        ({"f1": np.where(np.arange(40) == 17, np.nan, 1.0)}, "",
         ("SCENARIO:2: data.dataset.features: column 'f1' of TMP/d.parquet holds nan in row 17; "
         "expected finite numbers within float32's range (|x| <= 3.4e+38)")),
        ({"f1": np.where(np.arange(40) == 3, 1e300, 1.0)}, "",
         ("SCENARIO:2: data.dataset.features: column 'f1' of TMP/d.parquet holds 1e+300 in row "
         "3; expected finite numbers within float32's range (|x| <= 3.4e+38)")),
    ]
    for change, client, line in cases:
        columns = {**base, **change}
        if not client:
            columns.pop("user")
        pq.write_table(pa.table(columns), tmp_path / "d.parquet")
        block = "{name: parquet, path: d.parquet" + (f", {client}" if client else "") + "}"
        assert refused(tmp_path, mlflow_uri, capsys, block,
                       "natural" if client else "iid") == line


def test_a_sweep_reads_the_files_through_once(tmp_path, monkeypatch):
    """Points of a sweep (other seeds, other client counts) describe the same files: they are
    read through once while they keep their size and modification time, again once changed."""
    from simulator import registry
    from simulator.data import published

    formats.write_leaf(tmp_path / "leaf", writers=6, per_writer=8, files=2)
    reads: list[str] = []
    real = published.read_leaf
    monkeypatch.setattr(published, "read_leaf", lambda p: reads.append(p.name) or real(p))
    femnist = registry.get("datasets", "femnist")(root=str(tmp_path / "leaf"))
    for seed, clients in ((0, 4), (1, 4), (2, 5), (0, 6)):
        assert femnist.describe(clients, seed, 0.2).train_samples == clients * 6
    assert len(reads) == 4  # two train and two test files, once
    path = tmp_path / "leaf" / "test" / "all_data_1_niid_0_keep_0_test_9.json"
    doc = json.loads(path.read_text())
    doc["user_data"][doc["users"][0]]["y"][0] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"y: label 99 at row 0; expected 0..61"):
        femnist.describe(4, 0, 0.2)
    assert len(reads) == 8
