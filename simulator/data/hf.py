"""HuggingFace data sets, offline, read with pyarrow alone (the ``datasets`` library is not
needed): a ``save_to_disk`` folder (``dataset_dict.json`` and one folder per split, each
with ``state.json`` and Arrow stream files), a folder of Parquet or Arrow files named by
split (``train-00000-of-00001.parquet``, ``data/test.arrow``, ``train/*.parquet``), or a
data set in the hub's local cache (``hub: owner/name``, the snapshot the ``main`` ref points
at; nothing is fetched).

Columns are mapped by name: an image column (HF's ``Image`` feature, a struct of encoded
``bytes``, decoded with Pillow; or a list column of pixel values), a text column, or numeric
feature columns; an integer label column; an optional client column for the ``natural``
partitioner. Text becomes token ids, one per UTF-8 byte (id = byte + 1, 0 pads on the left
to ``length``; longer texts keep their first ``length`` bytes): 257 ids, no tokenizer to
download, and a model that takes tokens (``char_lstm``) classifies it.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from annotated_types import Ge

from simulator.data.datasets import feature_block, feature_matrix, holdout, schema_difference
from simulator.data.formats import load_json
from simulator.errors import DataError
from strategies.paths import PathRefused, guard
from strategies.protocols import Dataset, DatasetInfo, DatasetSplit, Traits

TEXT_VOCABULARY = 257  # a UTF-8 byte + 1, and 0 for padding


def hub_cache() -> Path:
    """The hub's local cache folder (HF_HUB_CACHE, else HF_HOME/hub, else the default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")
    return Path(home) / "hub"


def _split_files(folder: Path, split: str) -> list[Path]:
    """The Parquet or Arrow files of ``split`` under ``folder`` (by file or folder name)."""
    pattern = re.compile(rf"^{re.escape(split)}([-.]|$)")
    out = [p for p in sorted(folder.rglob("*")) if p.suffix in (".parquet", ".arrow")
           and (pattern.match(p.name) or p.parent.name == split)]
    return out


def _read_arrow(path: Path) -> Any:
    """An Arrow file: the IPC stream format (what ``save_to_disk`` writes) or file format."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_file(source).read_all()


class HuggingFace(Dataset):
    """A HuggingFace data set from local files (see the module docstring): ``path`` (a
    folder) or ``hub`` (``owner/name`` in the local hub cache); ``image`` (an image or
    list column), ``text`` (a text column, ``length`` byte tokens) or ``features``
    (numeric columns); ``label``; ``client`` (optional); the ``train_split`` and
    ``test_split`` names (without a test split, ``test_fraction`` is held out); ``shape``
    for a list column's samples."""

    traits = Traits(path_params=("path",), folder_params=("path",))

    def __init__(
        self,
        path: str | None = None,
        hub: str | None = None,
        image: str | None = "image",
        features: list[str] | None = None,
        label: str = "label",
        client: str | None = None,
        train_split: str = "train",
        test_split: str = "test",
        shape: list[Annotated[int, Ge(1)]] | None = None,
        text: str | None = None,
        length: Annotated[int, Ge(1)] = 128,
    ) -> None:
        self.path, self.hub, self.image, self.features = path, hub, image, features
        self.text, self.length = text, length
        self.label, self.client, self.shape = label, client, shape
        self.train_split, self.test_split = train_split, test_split

    def _folder(self) -> Path:
        if (self.path is None) == (self.hub is None):
            raise DataError("path: give path (a folder) or hub (owner/name), one of them")
        if self.path is not None:
            try:
                return guard(self.path, "folder")
            except PathRefused as e:
                raise DataError(f"path: {e}") from None
        owner, _, name = str(self.hub).partition("/")
        repo = hub_cache() / f"datasets--{owner}--{name}"
        ref = repo / "refs" / "main"
        if not ref.is_file():
            raise DataError(f"hub: {self.hub} is not in the local hub cache ({repo}); nothing "
                            "is fetched: download it once where the network allows")
        return repo / "snapshots" / ref.read_text().strip()

    def _files(self, split: str) -> list[Path]:
        folder = self._folder()
        if (folder / "dataset_dict.json").is_file():  # DatasetDict.save_to_disk
            splits = _json_field(folder / "dataset_dict.json", "splits", [])
            if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
                raise DataError(f"path: {folder / 'dataset_dict.json'}: splits must be a list "
                                "of split names (strings)")
            if split not in splits:
                return []
            folder = folder / split
        if (folder / "state.json").is_file():  # Dataset.save_to_disk
            files = _json_field(folder / "state.json", "_data_files", [])
            names = [f.get("filename") if isinstance(f, dict) else None for f in files] \
                if isinstance(files, list) else [None]
            for name in names:
                if not isinstance(name, str) or not _plain_name(name):
                    raise DataError(f"path: {folder / 'state.json'}: _data_files must be a list "
                                    "of {\"filename\": NAME}, each a file in its folder")
            return [folder / str(name) for name in names]
        return _split_files(folder, split)

    def _table(self, split: str) -> Any:
        import pyarrow as pa
        import pyarrow.parquet as pq

        tables = []
        files = self._files(split)
        for f in files:
            try:
                guard(f, "file")  # a FIFO or a device among the files is never opened
            except PathRefused as e:
                raise DataError(f"path: {e}") from None
            try:
                tables.append(pq.read_table(f) if f.suffix == ".parquet" else _read_arrow(f))
            except (pa.ArrowInvalid, OSError) as e:
                raise DataError(f"path: {f} is not a readable {f.suffix[1:]} file ({e})") from None
        for f, t in zip(files[1:], tables[1:]):
            if [(c.name, c.type) for c in t.schema] != [(c.name, c.type) for c in tables[0].schema]:
                raise DataError(f"path: the files of split {split} must hold one schema; {f} "
                                f"{schema_difference(tables[0].schema, t.schema)} ({files[0]} "
                                "has the first)")
        return pa.concat_tables(tables) if tables else None

    def check(self, n: int) -> None:
        if not self._files(self.train_split):
            raise DataError(f"train_split: no {self.train_split!r} split in {self._folder()} "
                            "(a save_to_disk folder, or Parquet/Arrow files named by split)")

    def _columns(self, table: Any, where: str) -> None:
        names = table.column_names
        wanted = [self.label, *([self.client] if self.client else []),
                  *(self.features or ([self.text] if self.text else
                                      [self.image] if self.image else []))]
        for col in wanted:
            if col not in names:
                raise DataError(f"{where}: column {col!r} not in the data; columns: "
                                f"{', '.join(names)}")

    def _x(self, table: Any) -> np.ndarray:
        """The samples: decoded images (uint8, (C, H, W)), byte tokens, or a feature matrix."""
        import pyarrow.types as pt

        if self.text:
            kind = table.column(self.text).type
            if not (pt.is_string(kind) or pt.is_large_string(kind)):
                raise DataError(f"text: column {self.text!r} must hold text, got {kind}")
            return np.stack([byte_tokens(t or "", self.length)
                             for t in table.column(self.text).to_pylist()]) \
                if table.num_rows else np.zeros((0, self.length), np.int32)
        if self.features:
            return feature_block([feature_matrix(table.column(c).combine_chunks(), c,
                                                 "the data") for c in self.features])
        if self.image is None:
            raise DataError("image: give an image column or features (numeric columns)")
        col = table.column(self.image).combine_chunks()
        if pt.is_struct(col.type):  # HF Image: {bytes, path}
            if col.type.get_field_index("bytes") < 0:
                raise DataError(f"image: column {self.image!r} is a struct without 'bytes' "
                                f"({col.type}); expected HF's Image feature {{bytes, path}}")
            images = [_decode(v, self.image, i)
                      for i, v in enumerate(col.field("bytes").to_pylist())]
            odd = next((i for i, im in enumerate(images) if im.shape != images[0].shape), None)
            if odd is not None:
                raise DataError(f"image: row {odd} of column {self.image!r} is "
                                f"{_dims(images[odd])}, row 0 {_dims(images[0])}; every image "
                                "needs the same size and channels")
            return np.stack(images)
        return feature_block([feature_matrix(col, self.image, "the data")])

    def _split(self, table: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        import pyarrow.types as pt

        self._columns(table, "label")
        x = self._x(table)
        if self.shape is not None:
            if int(np.prod(self.shape)) != int(np.prod(x.shape[1:])):
                raise DataError(f"shape: {list(self.shape)} holds {int(np.prod(self.shape))} "
                                f"values, the samples have {int(np.prod(x.shape[1:]))}")
            x = x.reshape(len(x), *self.shape)
        label = table.column(self.label)
        if not pt.is_integer(label.type) or label.null_count:
            raise DataError(f"label: column {self.label!r} must hold class indices 0.., got "
                            f"{label.type}" + (f" with {label.null_count} missing" if
                                               label.null_count else ""))
        y = label.to_numpy()
        if len(y) and y.min() < 0:
            raise DataError(f"label: column {self.label!r} holds {int(y.min())}; labels are "
                            "class indices 0..")
        c = None
        if self.client:
            col = table.column(self.client)
            if not (pt.is_integer(col.type) or pt.is_string(col.type) or
                    pt.is_large_string(col.type)) or col.null_count:
                raise DataError(f"client: column {self.client!r} must hold client ids "
                                f"(integers or strings) in every row, got {col.type}"
                                + (f" with {col.null_count} missing" if col.null_count else ""))
            # any ids -> 0..k-1
            c = np.unique(col.to_numpy(zero_copy_only=False), return_inverse=True)[1]
            c = c.astype(np.int64)
        return x, y.astype(np.int64), c

    def describe(self, num_clients: int, seed: int, test_fraction: float) -> DatasetInfo:
        """What ``load`` gives, found by loading it: every row is read and checked (each
        image decoded, features finite, labels and client ids of their types), so that what
        the run would find wrong, validation finds first."""
        split = self.load(num_clients, seed, test_fraction)
        natural = 0 if split.clients_train is None else len(np.unique(split.clients_train))
        return DatasetInfo(len(split.y_train), tuple(split.input_shape), split.num_classes,
                           bool(self.text), TEXT_VOCABULARY if self.text else None,
                           natural_clients=natural, value_bytes=split.x_train.dtype.itemsize)

    def load(self, num_clients: int, seed: int, test_fraction: float) -> DatasetSplit:
        self.check(num_clients)
        table = self._table(self.train_split)
        if table is None or not table.num_rows:
            raise DataError(f"train_split: the {self.train_split!r} split of {self._folder()} "
                            "has no rows")
        x, y, c = self._split(table)
        test = self._table(self.test_split)
        if test is not None:
            x_te, y_te, _ = self._split(test)
        else:
            tr, te = holdout(len(y), test_fraction, _rng(seed))
            x_te, y_te = x[te], y[te]
            x, y, c = x[tr], y[tr], None if c is None else c[tr]
        classes = int(max(y.max(), y_te.max() if len(y_te) else 0)) + 1
        return DatasetSplit(x, y, x_te, y_te, tuple(x.shape[1:]), classes, c,
                            vocabulary=TEXT_VOCABULARY if self.text else None)


def _json_field(path: Path, key: str, default: Any) -> Any:
    """``key`` of the JSON object in ``path`` (``default`` where it is missing); DataError
    naming the file when it is no JSON object."""
    doc = load_json(path, "path")
    if not isinstance(doc, dict):
        raise DataError(f"path: {path} holds a JSON {type(doc).__name__}; expected an object "
                        f"with {key!r}, as save_to_disk writes it")
    return doc.get(key, default)


def _plain_name(name: str) -> bool:
    """A file name inside its folder: no folder part, not . or .."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name


def _rng(seed: int) -> np.random.Generator:
    """The generator of the held-out split without a test split (``load`` and ``describe``)."""
    return np.random.default_rng([seed, 0x4F])


def byte_tokens(text: str, length: int) -> np.ndarray:
    """A text's first ``length`` UTF-8 bytes as ids 1..256, left-padded with 0 (int32)."""
    ids = np.frombuffer(text.encode("utf-8")[:length], dtype=np.uint8).astype(np.int32) + 1
    out = np.zeros(length, dtype=np.int32)
    out[length - len(ids):] = ids
    return out


def _dims(image: np.ndarray) -> str:
    """An image's (C, H, W) shape as 'W x H, C channel(s)'."""
    return f"{image.shape[2]}x{image.shape[1]} with {image.shape[0]} channel(s)"


def _decode(data: bytes | None, column: str, row: int) -> np.ndarray:
    """An encoded image (PNG, JPEG, ...) as uint8 (C, H, W); DataError naming the row of a
    missing or undecodable one."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data or b"")) as img:
            arr = np.asarray(img, dtype=np.uint8)
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DataError(f"image: row {row} of column {column!r} is not an image Pillow can "
                        f"decode ({e.__class__.__name__})") from None
    return arr[None] if arr.ndim == 2 else np.ascontiguousarray(arr.transpose(2, 0, 1))
