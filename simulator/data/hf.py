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
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from annotated_types import Ge

from simulator.data.datasets import feature_block, feature_matrix, holdout
from simulator.errors import DataError
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

    traits = Traits(path_params=("path",))

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
            folder = Path(self.path)
            if not folder.is_dir():
                raise DataError(f"path: {'not a folder' if folder.exists() else 'no such folder'}"
                                f": {self.path}")
            return folder
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
            splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
            if split not in splits:
                return []
            folder = folder / split
        if (folder / "state.json").is_file():  # Dataset.save_to_disk
            state = json.loads((folder / "state.json").read_text())
            return [folder / f["filename"] for f in state.get("_data_files", [])]
        return _split_files(folder, split)

    def _table(self, split: str) -> Any:
        import pyarrow as pa
        import pyarrow.parquet as pq

        tables = []
        for f in self._files(split):
            try:
                tables.append(pq.read_table(f) if f.suffix == ".parquet" else _read_arrow(f))
            except (pa.ArrowInvalid, OSError) as e:
                raise DataError(f"path: {f} is not a readable {f.suffix[1:]} file ({e})") from None
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
        if self.text:
            return np.stack([byte_tokens(t or "", self.length)
                             for t in table.column(self.text).to_pylist()]) \
                if table.num_rows else np.zeros((0, self.length), np.int32)
        if self.features:
            return feature_block([feature_matrix(table.column(c).combine_chunks(), c,
                                                 "the data") for c in self.features])
        if self.image is None:
            raise DataError("image: give an image column or features (numeric columns)")
        col = table.column(self.image).combine_chunks()
        import pyarrow.types as pt

        if pt.is_struct(col.type):  # HF Image: {bytes, path}
            return np.stack([_decode(v, self.image, i)
                             for i, v in enumerate(col.field("bytes").to_pylist())])
        return feature_block([feature_matrix(col, self.image, "the data")])

    def _split(self, table: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        self._columns(table, "label")
        x = self._x(table)
        if self.shape is not None:
            if int(np.prod(self.shape)) != int(np.prod(x.shape[1:])):
                raise DataError(f"shape: {list(self.shape)} holds {int(np.prod(self.shape))} "
                                f"values, the samples have {int(np.prod(x.shape[1:]))}")
            x = x.reshape(len(x), *self.shape)
        y = table.column(self.label).to_numpy()
        if not np.issubdtype(y.dtype, np.integer) or (len(y) and y.min() < 0):
            raise DataError(f"label: column {self.label!r} must hold class indices 0.., got "
                            f"{y.dtype}")
        c = table.column(self.client).to_numpy() if self.client else None
        if c is not None:
            c = np.unique(c, return_inverse=True)[1].astype(np.int64)  # any ids -> 0..k-1
        return x, y.astype(np.int64), c

    def describe(self, num_clients: int, seed: int, test_fraction: float) -> DatasetInfo:
        """Rows and classes from the label columns, the shape from the first sample alone
        (no image but one is decoded)."""
        self.check(num_clients)
        table = self._table(self.train_split)
        self._columns(table, "label")
        first = self._x(table.slice(0, 1))
        shape = tuple(self.shape) if self.shape is not None else tuple(first.shape[1:])
        if int(np.prod(shape)) != int(np.prod(first.shape[1:])):
            raise DataError(f"shape: {list(shape)} holds {int(np.prod(shape))} values, the "
                            f"samples have {int(np.prod(first.shape[1:]))}")
        y = table.column(self.label).to_numpy()
        test = self._table(self.test_split)
        top = int(y.max()) if len(y) else -1
        if test is not None:
            top = max(top, int(test.column(self.label).to_numpy().max()))
        n = len(y) if test is not None else len(y) - round(len(y) * test_fraction)
        natural = 0
        if self.client:
            ids = table.column(self.client).to_numpy()
            natural = len(np.unique(ids if test is not None else
                                    ids[holdout(len(ids), test_fraction, _rng(seed))[0]]))
        return DatasetInfo(n, shape, top + 1, bool(self.text),
                           TEXT_VOCABULARY if self.text else None, natural_clients=natural)

    def load(self, num_clients: int, seed: int, test_fraction: float) -> DatasetSplit:
        self.check(num_clients)
        x, y, c = self._split(self._table(self.train_split))
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


def _rng(seed: int) -> np.random.Generator:
    """The generator of the held-out split without a test split (``load`` and ``describe``)."""
    return np.random.default_rng([seed, 0x4F])


def byte_tokens(text: str, length: int) -> np.ndarray:
    """A text's first ``length`` UTF-8 bytes as ids 1..256, left-padded with 0 (int32)."""
    ids = np.frombuffer(text.encode("utf-8")[:length], dtype=np.uint8).astype(np.int32) + 1
    out = np.zeros(length, dtype=np.int32)
    out[length - len(ids):] = ids
    return out


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
