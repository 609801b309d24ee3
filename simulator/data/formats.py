"""Readers of the published on-disk formats of the field's data sets: IDX (MNIST,
Fashion-MNIST, EMNIST), the CIFAR python pickle batches, and LEAF's JSON (FEMNIST).

Every reader checks the layout it is given and raises DataError naming the file and what it
expected. Nothing read here can execute code: CIFAR's pickles go through an unpickler that
only rebuilds NumPy arrays, lists, dicts, bytes and numbers.
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
import re
import zlib
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from simulator.errors import DataError

# IDX type codes (LeCun's format description): the element type of the data
IDX_TYPES: dict[int, np.dtype] = {0x08: np.dtype(">u1"), 0x09: np.dtype(">i1"), 0x0B: np.dtype(">i2"),
             0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def _read(path: Path, size: int = -1) -> bytes:
    """The first ``size`` bytes (-1: all) of a file, gunzipped when it is gzip (by its magic
    bytes, whatever its name); a file that cannot be read, or a truncated or corrupt gzip,
    is a DataError naming it."""
    try:
        with path.open("rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
        with gzip.open(path, "rb") if gz else path.open("rb") as f:
            return f.read(size)
    except (EOFError, OSError, zlib.error) as e:
        raise DataError(f"root: {path} cannot be read ({e}): a truncated or corrupt file? "
                        "fetch it again") from None


def find(root: Path, names: list[str], layout: str) -> Path:
    """The first of ``names`` (each also tried with ``.gz``) that exists under ``root``;
    DataError naming what was looked for and the layout expected otherwise."""
    for name in names:
        for candidate in (root / name, root / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    raise DataError(f"root: {names[0]} (or {names[0]}.gz) not found in {root}; expected "
                    f"{layout}")


def idx_header(path: Path) -> tuple[np.dtype, tuple[int, ...]]:
    """(element type, dimensions) of an IDX file, reading its header only."""
    return _idx_header(path, _read(path, 4 + 4 * 255))  # at most 255 dimensions


def _idx_header(path: Path, raw: bytes) -> tuple[np.dtype, tuple[int, ...]]:
    """(element type, dimensions) from the first bytes of an IDX file."""
    head = raw[:4]
    if len(head) < 4 or head[:2] != b"\x00\x00" or head[2] not in IDX_TYPES:
        raise DataError(f"root: {path} is not an IDX file (magic 0x0000, a type code, "
                        "the number of dimensions)")
    ndim = head[3]
    dims = raw[4 : 4 + 4 * ndim]
    if len(dims) < 4 * ndim:
        raise DataError(f"root: {path} ends inside its IDX header")
    return IDX_TYPES[head[2]], tuple(int(d) for d in np.frombuffer(dims, ">i4"))


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (gzipped or not) as a NumPy array in native byte order."""
    raw = _read(path)  # one read, gunzipped once
    dtype, dims = _idx_header(path, raw)
    data = raw[4 + 4 * len(dims) :]
    count = int(np.prod(dims)) if dims else 0
    if len(data) != count * dtype.itemsize:
        raise DataError(f"root: {path} holds {len(data)} bytes of data, its header says "
                        f"{dims} x {dtype.itemsize}")
    return np.frombuffer(data, dtype).reshape(dims).astype(dtype.newbyteorder("="))


# ---------------------------------------------------------------------------- CIFAR


class _ArraysOnly(pickle.Unpickler):
    """Rebuilds NumPy arrays and plain containers, and refuses every other class: a pickle
    file cannot run code through it."""

    ALLOWED: ClassVar[frozenset[tuple[str, str]]] = frozenset({
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"), ("builtins", "bytes"), ("_codecs", "encode")})

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a data batch")


def read_cifar_batch(path: Path) -> dict[str, Any]:
    """One CIFAR python batch (``data``: (N, 3072) uint8; ``labels``, or ``fine_labels`` and
    ``coarse_labels`` for CIFAR-100), with its keys as text."""
    content = _read(path)
    try:
        raw = _ArraysOnly(io.BytesIO(content), encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as e:
        raise DataError(f"root: {path} is not a CIFAR python batch ({e})") from None
    if not isinstance(raw, dict):
        raise DataError(f"root: {path} is not a CIFAR python batch (a dict of data and labels)")
    out = {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in raw.items()}
    data = out.get("data")
    if not isinstance(data, np.ndarray) or data.ndim != 2 or data.shape[1] != 3072:
        raise DataError(f"root: {path}: 'data' must be an (N, 3072) uint8 array of 32x32 RGB "
                        "images")
    return out


# ---------------------------------------------------------------------------- LEAF


_ARRAY = r'"{key}"\s*:\s*\[(.*?)\]'


def leaf_index(path: Path) -> tuple[list[str], list[int]]:
    """(users, num_samples) of a LEAF JSON file, read from its beginning only when LEAF's
    key order holds (``users`` and ``num_samples`` before ``user_data``), else parsed whole."""
    head = b""
    with path.open("rb") as f:
        while b'"user_data"' not in head:
            chunk = f.read(1 << 20)
            if not chunk:
                break
            head += chunk
    text = head.split(b'"user_data"', 1)[0].decode("utf-8", "replace")
    users_m = re.search(_ARRAY.format(key="users"), text, re.DOTALL)
    counts_m = re.search(_ARRAY.format(key="num_samples"), text, re.DOTALL)
    if users_m and counts_m:
        users = json.loads(f"[{users_m.group(1)}]")
        counts = json.loads(f"[{counts_m.group(1)}]")
    else:
        doc = read_leaf(path)
        users, counts = doc["users"], doc["num_samples"]
    if len(users) != len(counts):
        raise DataError(f"root: {path}: {len(users)} users but {len(counts)} num_samples")
    return [str(u) for u in users], [int(c) for c in counts]


def read_leaf(path: Path) -> dict[str, Any]:
    """A LEAF JSON file: ``users``, ``num_samples`` and ``user_data`` (user -> ``x``, ``y``)."""
    try:
        doc = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"root: {path} is not JSON ({e})") from None
    missing = [k for k in ("users", "num_samples", "user_data") if k not in doc]
    if missing:
        raise DataError(f"root: {path} lacks LEAF's keys {missing} (users, num_samples, "
                        "user_data)")
    return doc
