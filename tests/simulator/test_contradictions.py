"""Contradictions between a plugin and the data, found by asking the plugin with the data's
description (``DatasetInfo``) at validation: a trigger that does not fit the images, an
image attack on features or tokens, a sample count beyond what the data holds, a Parquet
folder whose files disagree on their schema. Each refused in one line before anything runs."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from simulator import registry
from simulator.config import ScenarioError
from simulator.config.load import load
from strategies.protocols import DatasetInfo

BASE = """\
name: t
rounds: 2
data:
  dataset: {name: digits}
model: {name: logreg}
clients: {total: 4, byzantine: 1}
attack: {name: sign_flip}
"""


def _lines(tmp_path, overrides: list[str]) -> list[str]:
    """The scenario's problems, without the file and line (``[]`` when it is valid)."""
    path = tmp_path / "s.yaml"
    path.write_text(BASE)
    try:
        load(path, overrides)
    except ScenarioError as e:
        return [line.split(": ", 1)[1] for line in e.lines]
    return []


def _images(tmp_path, h: int, w: int, c: int = 1, name: str = "img.parquet") -> str:
    """A Parquet file of 60 images of shape (c, h, w), stored flat, 3 classes."""
    rng = np.random.default_rng(h * 100 + w)
    x = rng.random((60, c * h * w), dtype=np.float32)
    path = tmp_path / name
    pq.write_table(pa.table({"x": list(x), "label": np.arange(60) % 3}), path)
    return f"data.dataset={{name: parquet, path: '{path}', shape: [{c}, {h}, {w}]}}"


@pytest.mark.parametrize(("h", "w", "c"), [(5, 7, 1), (6, 6, 3), (4, 11, 1), (9, 3, 2)])
def test_a_square_trigger_larger_than_the_images_is_refused(tmp_path, h, w, c):
    data = _images(tmp_path, h, w, c)
    side = min(h, w)
    for attack in ("backdoor_pixel", "model_replacement"):
        assert _lines(tmp_path, [data, f"attack={{name: {attack}, size: {side + 1}}}"]) == [
            (f"attack.size: a trigger of {side + 1} x {side + 1} pixels does not fit the "
            f"data's {h} x {w} images; size must be at most {side}, got {side + 1}")]
        assert _lines(tmp_path, [data, f"attack={{name: {attack}, size: {side}}}"]) == []


@pytest.mark.parametrize(("h", "w"), [(8, 8), (6, 5), (12, 4)])
def test_dba_bars_that_do_not_fit_are_refused(tmp_path, h, w):
    data = [] if (h, w) == (8, 8) else [_images(tmp_path, h, w)]
    assert _lines(tmp_path, [*data, f"attack={{name: backdoor_dba, size: {w + 1}, parts: 1}}"]) \
        == [(f"attack.size: a trigger of 1 x {w + 1} pixels does not fit the data's {h} x {w} "
            f"images; size must be at most {w}, got {w + 1}")]
    rows = h + 1  # parts bars with gap 0 need as many rows
    assert _lines(tmp_path, [*data, f"attack={{name: backdoor_dba, size: 1, parts: {rows}}}"]) \
        == [(f"attack.parts: {rows} bars with gap 0 need {rows} rows, the input's pixel grid "
            f"is {h} x {w}")]
    assert _lines(tmp_path, [*data, f"attack={{name: backdoor_dba, size: {w}, parts: {h}}}"]) \
        == []


FEATURES = [("data.dataset={name: gaussian-mixture, dimension: 64}", "features of shape (64,)"),
            ("data.dataset={name: gaussian-mixture, dimension: 10}", "features of shape (10,)"),
            ("data.dataset={name: synthetic}", "features of shape (60,)")]


@pytest.mark.parametrize(("data", "kind"), FEATURES)
@pytest.mark.parametrize("attack", ["backdoor_pixel", "backdoor_dba", "model_replacement"])
def test_an_image_attack_on_features_is_refused(tmp_path, data, kind, attack):
    """Whatever the width (64 is a square: a flat vector is still not an image)."""
    assert _lines(tmp_path, [data, f"attack={{name: {attack}}}"]) == [
        (f"attack.name: a pixel trigger needs images (samples of shape (C, H, W) or (H, W)); "
        f"the data's samples are {kind} (a Parquet data set of images says so with its shape "
        "key, [1, 28, 28])")]


def test_flat_parquet_features_are_not_images_and_token_ids_neither(tmp_path):
    path = tmp_path / "flat.parquet"
    pq.write_table(pa.table({"x": list(np.zeros((40, 16), np.float32)),
                             "label": np.arange(40) % 2}), path)
    assert _lines(tmp_path, [f"data.dataset={{name: parquet, path: '{path}'}}",
                             "attack={name: backdoor_pixel}"])[0].endswith(
        "the data's samples are features of shape (16,) (a Parquet data set of images says "
        "so with its shape key, [1, 28, 28])")
    tokens = DatasetInfo(100, (80,), 80, tokens=True, vocabulary=80)
    with pytest.raises(ValueError, match=r"^name: .* samples are token ids of shape \(80,\)"):
        registry.get("attacks", "backdoor_pixel")().check_data(tokens)


def test_class_keys_beyond_the_classes_are_refused_by_check_data():
    for classes in (2, 3, 7):
        info = DatasetInfo(100, (1, 8, 8), classes)
        with pytest.raises(ValueError, match=f"^source: must be < num_classes = {classes}, "
                                             f"got {classes}$"):
            registry.get("attacks", "edge_case")(target=0, source=classes).check_data(info)
        with pytest.raises(ValueError, match=f"^target: must be < num_classes = {classes}"):
            registry.get("attacks", "backdoor_dba")(target=classes).check_data(info)


def test_every_attack_accepts_the_images_it_is_made_for():
    """No attack refuses 28x28 images of 10 classes with its default keys (those built
    with the engine's context are checked when built)."""
    info = DatasetInfo(1000, (1, 28, 28), 10)
    for name in registry.available("attacks"):
        try:
            cls = registry.get("attacks", name)
        except ImportError:  # an entry point of another checkout's installed metadata
            continue
        if not cls.traits.context:
            cls().check_data(info)


@pytest.mark.parametrize(("data", "train"), [
    ("data.test_fraction=0.2", 1438), ("data.test_fraction=0.5", 899),
    ("data.test_fraction=0.9", 180),
    ("data.dataset={name: gaussian-mixture, samples: 300}", 240),
])
def test_a_root_set_larger_than_the_training_data_is_refused(tmp_path, data, train):
    fltrust = "aggregator={name: fltrust}"
    assert _lines(tmp_path, [data, fltrust, f"server.root_samples={train + 1}"]) == [
        (f"server.root_samples: 'fltrust' draws its root set from the {train:,} training "
        f"samples the data holds; at most {train:,}, got {train + 1:,}")]
    assert _lines(tmp_path, [data, fltrust, f"server.root_samples={train}"]) == []
    # an aggregator without a root set ignores the key
    assert _lines(tmp_path, [data, f"server.root_samples={train + 1}"]) == []


def _write(folder, name: str, table: pa.Table) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / name)


N = 30
GOOD = {"x": pa.array(np.zeros(N, np.float32)), "label": pa.array(np.arange(N) % 3)}
SCHEMAS = [
    ({"x": pa.array(np.zeros(N, np.float64)), "label": GOOD["label"]},
     "holds column 'x' as double, not float"),
    ({"x": GOOD["x"], "label": pa.array((np.arange(N) % 3).astype(np.int32))},
     "holds column 'label' as int32, not int64"),
    ({"label": GOOD["label"]}, "lacks column 'x'"),
    ({**GOOD, "extra": pa.array(np.ones(N))}, "has column 'extra' besides"),
    ({"label": GOOD["label"], "x": GOOD["x"]}, "orders its columns otherwise"),
]


@pytest.mark.parametrize(("other", "difference"), SCHEMAS)
@pytest.mark.parametrize("position", [1, 2])
def test_a_parquet_folder_whose_files_disagree_is_refused(tmp_path, other, difference,
                                                          position):
    folder = tmp_path / "parts"
    for i in range(3):
        _write(folder, f"part-{i}.parquet", pa.table(other if i == position else GOOD))
    bad = folder / f"part-{position}.parquet"
    assert _lines(tmp_path, [f"data.dataset={{name: parquet, path: '{folder}'}}"]) == [
        (f"data.dataset.path: the files of {folder} must hold one schema; {bad} {difference} "
        f"({folder / 'part-0.parquet'} has the first)")]


def test_a_parquet_folder_of_one_schema_is_accepted(tmp_path):
    folder = tmp_path / "parts"
    for i in range(3):
        _write(folder, f"part-{i}.parquet", pa.table(GOOD))
    assert _lines(tmp_path, [f"data.dataset={{name: parquet, path: '{folder}'}}"]) == []


@pytest.mark.parametrize(("other", "difference"), SCHEMAS[:3])
def test_a_huggingface_split_whose_files_disagree_is_refused(tmp_path, other, difference):
    folder = tmp_path / "hf" / "train"
    _write(folder, "train-0.parquet", pa.table(GOOD))
    _write(folder, "train-1.parquet", pa.table(other))
    assert _lines(tmp_path, [(f"data.dataset={{name: huggingface, path: '{tmp_path / 'hf'}', "
                             "image: null, features: [x]}")]) == [
        (f"data.dataset.path: the files of split train must hold one schema; "
        f"{folder / 'train-1.parquet'} {difference} ({folder / 'train-0.parquet'} has the first)")]
