"""Small files in the published on-disk formats, written byte for byte as their documents say
(tests only): IDX (LeCun's MNIST page), CIFAR's python batches (Krizhevsky's page: a pickled
dict with ``data`` (N, 3072) uint8, row-major RGB planes, and ``labels``), LEAF's JSON."""

from __future__ import annotations

import gzip
import json
import pickle
import struct
from pathlib import Path

import numpy as np

IDX_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(np.int16): 0x0B,
             np.dtype(np.int32): 0x0C, np.dtype(np.float32): 0x0D, np.dtype(np.float64): 0x0E}


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> Path:
    """``array`` as an IDX file: 0x0000, the type code, the number of dimensions, each
    dimension as a big-endian int32, then the data big-endian."""
    head = struct.pack(">HBB", 0, IDX_CODES[array.dtype], array.ndim)
    head += struct.pack(f">{array.ndim}i", *array.shape)
    body = array.astype(array.dtype.newbyteorder(">")).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(head + body))
    else:
        path.write_bytes(head + body)
    return path


def images(n: int, seed: int, shape: tuple[int, ...] = (28, 28), classes: int = 10
           ) -> tuple[np.ndarray, np.ndarray]:
    """``n`` uint8 noise images in which class c lights its own band of pixels (learnable by
    a linear model), and their labels."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % classes
    width = int(np.prod(shape))
    flat = rng.integers(0, 60, (n, width))
    band = width // classes
    for c in range(classes):
        flat[y == c, c * band : (c + 1) * band] += 180
    return flat.reshape(n, *shape).astype(np.uint8), y


def write_mnist(root: Path, n_train: int = 60, n_test: int = 20, prefix: str = "",
                classes: int = 10, gz: bool = True) -> dict[str, np.ndarray]:
    """The four MNIST files (``prefix`` for EMNIST's ``emnist-SPLIT-``)."""
    root.mkdir(parents=True, exist_ok=True)
    x, y = images(n_train, 0, classes=classes)
    xt, yt = images(n_test, 1, classes=classes)
    names = (["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
              "t10k-labels-idx1-ubyte"] if not prefix else
             [f"{prefix}train-images-idx3-ubyte", f"{prefix}train-labels-idx1-ubyte",
              f"{prefix}test-images-idx3-ubyte", f"{prefix}test-labels-idx1-ubyte"])
    for name, arr in zip(names, (x, y.astype(np.uint8), xt, yt.astype(np.uint8))):
        write_idx(root / name, arr, gz=gz)
    return {"x": x, "y": y, "x_test": xt, "y_test": yt}


def write_cifar10(root: Path, per_batch: int = 12, n_test: int = 20) -> dict[str, np.ndarray]:
    """``cifar-10-batches-py/``: five training batches and ``test_batch``, pickled as the
    published files are (protocol 2, byte-string keys)."""
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True, exist_ok=True)
    xs, ys = [], []
    for i in range(1, 6):
        x, y = images(per_batch, i, (3, 32, 32))
        xs.append(x)
        ys.append(y)
        batch = {b"batch_label": b"training batch %d of 5" % i, b"labels": y.tolist(),
                 b"data": x.reshape(per_batch, 3072), b"filenames": [b"x.png"] * per_batch}
        (d / f"data_batch_{i}").write_bytes(pickle.dumps(batch, protocol=2))
    xt, yt = images(n_test, 9, (3, 32, 32))
    (d / "test_batch").write_bytes(pickle.dumps(
        {b"labels": yt.tolist(), b"data": xt.reshape(n_test, 3072)}, protocol=2))
    return {"x": np.concatenate(xs), "y": np.concatenate(ys), "x_test": xt, "y_test": yt}


def write_cifar100(root: Path, n: int = 40, n_test: int = 20) -> dict[str, np.ndarray]:
    """``cifar-100-python/train`` and ``test`` with fine (100) and coarse (20) labels."""
    d = root / "cifar-100-python"
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, count, seed in (("train", n, 3), ("test", n_test, 4)):
        x, _ = images(count, seed, (3, 32, 32))
        fine = np.arange(count) % 100
        (d / name).write_bytes(pickle.dumps({b"data": x.reshape(count, 3072),
                                             b"fine_labels": fine.tolist(),
                                             b"coarse_labels": (fine // 5).tolist()}, protocol=2))
        out[name] = fine
    return out


def write_leaf(root: Path, writers: int = 6, per_writer: int = 12, files: int = 2
               ) -> dict[str, dict]:
    """LEAF FEMNIST's layout: ``train/*.json`` and ``test/*.json``, writers spread over
    ``files`` files, each writer's samples split 75/25 between train and test as LEAF's
    ``--tf 0.75`` does; pixels as floats in [0, 1]."""
    users = [f"f{i:04d}_{i % 10:02d}" for i in range(writers)]
    data: dict[str, dict] = {"train": {}, "test": {}}
    for i, u in enumerate(users):
        x, y = images(per_writer, 100 + i, (784,), classes=62)
        y = (y + i) % 62
        cut = per_writer * 3 // 4
        data["train"][u] = {"x": (x[:cut] / 255.0).tolist(), "y": y[:cut].tolist()}
        data["test"][u] = {"x": (x[cut:] / 255.0).tolist(), "y": y[cut:].tolist()}
    for split in ("train", "test"):
        (root / split).mkdir(parents=True, exist_ok=True)
        for k in range(files):
            mine = users[k::files]
            doc = {"users": mine, "num_samples": [len(data[split][u]["y"]) for u in mine],
                   "user_data": {u: data[split][u] for u in mine}}
            (root / split / f"all_data_{k}_niid_0_keep_0_{split}_9.json").write_text(json.dumps(doc))
    return data


def png(image: np.ndarray) -> bytes:
    """A uint8 (H, W) or (H, W, 3) image as PNG bytes (HF's Image feature stores these)."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()


def hf_table(n: int, seed: int, rgb: bool = False) -> tuple[object, np.ndarray, np.ndarray]:
    """An Arrow table as HF writes an image data set: ``image`` struct<bytes, path>,
    ``label`` int64, ``writer`` string; and the pixels (C, H, W) and labels."""
    import pyarrow as pa

    x, y = images(n, seed, (8, 8, 3) if rgb else (8, 8), classes=4)
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    col = pa.array([{"bytes": png(im), "path": None} for im in x], type=image_type)
    table = pa.table({"image": col, "label": pa.array(y, pa.int64()),
                      "writer": pa.array([f"w{i % 3}" for i in range(n)])})
    chw = x.transpose(0, 3, 1, 2) if rgb else x[:, None]
    return table, chw, y


def write_hf_save_to_disk(root: Path, n_train: int = 24, n_test: int = 8, rgb: bool = False
                          ) -> dict[str, np.ndarray]:
    """``DatasetDict.save_to_disk``'s layout: ``dataset_dict.json`` ({"splits": [...]}) and a
    folder per split with ``state.json`` (``_data_files``), ``dataset_info.json`` and the
    rows as an Arrow IPC stream ``data-00000-of-00001.arrow``."""
    import pyarrow as pa

    root.mkdir(parents=True, exist_ok=True)
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    out = {}
    for split, n, seed in (("train", n_train, 0), ("test", n_test, 1)):
        d = root / split
        d.mkdir()
        table, x, y = hf_table(n, seed, rgb)
        with pa.OSFile(str(d / "data-00000-of-00001.arrow"), "wb") as sink, \
                pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        (d / "state.json").write_text(json.dumps({
            "_data_files": [{"filename": "data-00000-of-00001.arrow"}],
            "_fingerprint": "f" * 16, "_format_columns": None, "_format_kwargs": {},
            "_format_type": None, "_output_all_columns": False, "_split": split}))
        (d / "dataset_info.json").write_text(json.dumps({"features": {
            "image": {"_type": "Image"}, "label": {"_type": "ClassLabel"}}}))
        out[f"x_{split}"], out[f"y_{split}"] = x, y
    return out



LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"


# Sonnet 18 (public domain): text with the structure of English, for models to learn from
SONNET = (
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate: "
    "Rough winds do shake the darling buds of May, And summer's lease hath all too short a "
    "date: Sometime too hot the eye of heaven shines, And often is his gold complexion "
    "dimm'd; And every fair from fair sometime declines, By chance or nature's changing "
    "course untrimm'd; But thy eternal summer shall not fade, Nor lose possession of that "
    "fair thou ow'st; Nor shall Death brag thou wander'st in his shade, When in eternal "
    "lines to time thou grow'st: So long as men can breathe or eyes can see, So long lives "
    "this, and this gives life to thee. ")


def write_shakespeare(root: Path, roles: int = 4, per_role: int = 12,
                      text: str | None = None) -> dict[str, dict]:
    """LEAF Shakespeare's layout: ``train/*.json`` and ``test/*.json``, each role's ``x``
    the 80 characters before its ``y``, one character (LEAF's ``-sl 80``). The characters
    are random, or (``text``) windows of ``text`` repeated, each role from its own offset."""
    rng = np.random.default_rng(5)
    data: dict[str, dict] = {"train": {}, "test": {}}
    for r in range(roles):
        if text is None:
            text_r = "".join(rng.choice(list(LETTERS), 80 + per_role))
        else:
            start = int(rng.integers(len(text)))
            reps = (start + 80 + per_role) // len(text) + 1
            text_r = (text * reps)[start : start + 80 + per_role]
        xs = [text_r[i : i + 80] for i in range(per_role)]
        ys = [text_r[i + 80] for i in range(per_role)]
        cut = per_role * 3 // 4
        role = f"THE_PLAY_ROLE{r}"
        data["train"][role] = {"x": xs[:cut], "y": ys[:cut]}
        data["test"][role] = {"x": xs[cut:], "y": ys[cut:]}
    for split in ("train", "test"):
        (root / split).mkdir(parents=True, exist_ok=True)
        users = sorted(data[split])
        doc = {"users": users, "num_samples": [len(data[split][u]["y"]) for u in users],
               "user_data": data[split]}
        (root / split / f"all_data_niid_0_keep_0_{split}_9.json").write_text(json.dumps(doc))
    return data

# The writer of each file-backed data set, for tests that need one on disk.
WRITERS = {
    "mnist": lambda root: write_mnist(root),
    "fashion-mnist": lambda root: write_mnist(root),
    "emnist": lambda root: write_mnist(root, prefix="emnist-balanced-", classes=47),
    "cifar10": lambda root: write_cifar10(root),
    "cifar100": lambda root: write_cifar100(root),
    "femnist": lambda root: write_leaf(root),
    "huggingface": lambda root: write_hf_save_to_disk(root),
    "shakespeare": lambda root: write_shakespeare(root),
}
FOLDER_KEY = {"huggingface": "path"}  # the key naming the folder (``root`` for the others)
