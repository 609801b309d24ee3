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
import math
import pickle
import re
import zlib
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from simulator.errors import DataError, brief
from strategies.paths import PathRefused, open_file

# IDX type codes (LeCun's format description): the element type of the data
IDX_TYPES: dict[int, np.dtype] = {0x08: np.dtype(">u1"), 0x09: np.dtype(">i1"), 0x0B: np.dtype(">i2"),
             0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def _read(path: Path, size: int = -1) -> bytes:
    """The first ``size`` bytes (-1: all) of a file, gunzipped when it is gzip (by its magic
    bytes, whatever its name); a file that cannot be read, or a truncated or corrupt gzip,
    is a DataError naming it."""
    try:
        with open_file(path) as raw:
            gz = raw.read(2) == b"\x1f\x8b"
            raw.seek(0)
            with gzip.open(raw, "rb") if gz else raw as f:
                return f.read(size)
    except PathRefused as e:
        raise DataError(f"root: {e}") from None
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
    count = math.prod(dims) if dims else 0
    if len(data) != count * dtype.itemsize:
        raise DataError(f"root: {path} holds {len(data)} bytes of data, its header says "
                        f"{dims} x {dtype.itemsize}")
    return np.frombuffer(data, dtype).reshape(dims).astype(dtype.newbyteorder("="))


def idx_verify(path: Path) -> tuple[np.dtype, tuple[int, ...]]:
    """(element type, dimensions) of an IDX file whose data is all there: the whole file is
    read in 1 MiB blocks (gunzipped as it goes), never held, and its length checked against
    its header, as ``read_idx`` checks it when it loads."""
    dtype, dims = idx_header(path)
    expected = 4 + 4 * len(dims) + (math.prod(dims) if dims else 0) * dtype.itemsize
    total = 0
    try:
        with open_file(path) as raw:
            gz = raw.read(2) == b"\x1f\x8b"
            raw.seek(0)
            with gzip.open(raw, "rb") if gz else raw as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    total += len(block)
                    if total > expected:
                        break
    except (EOFError, OSError, zlib.error) as e:
        raise DataError(f"root: {path} cannot be read ({e}): a truncated or corrupt file? "
                        "fetch it again") from None
    if total != expected:
        raise DataError(f"root: {path} holds {'more than ' if total > expected else ''}"
                        f"{total - 4 - 4 * len(dims)} bytes of data, its header says {dims} x "
                        f"{dtype.itemsize}")
    return dtype, dims


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
    if not isinstance(data, np.ndarray) or data.ndim != 2 or data.shape[1] != 3072 or \
            data.dtype != np.uint8:
        got = (f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else
               type(data).__name__)
        raise DataError(f"root: {path}: 'data' must be an (N, 3072) uint8 array of 32x32 RGB "
                        f"images, got {got}")
    return out


# ---------------------------------------------------------------------------- JSON


JSON_DEPTH = 32  # arrays and objects inside each other: LEAF's files need 5, HF's a few
_CHUNK = 1 << 20


def json_depth_over(raw: bytes, limit: int = JSON_DEPTH) -> int | None:
    """The byte offset where arrays and objects (outside strings) first nest deeper than
    ``limit``, or None: read in 1 MiB blocks with NumPy, before any parser recurses."""
    data = np.frombuffer(raw, np.uint8)
    depth, in_string, backslashes = 0, 0, 0  # carried from block to block
    for start in range(0, len(data), _CHUNK):
        c = data[start : start + _CHUNK]
        idx = np.arange(len(c))
        slash = c == 0x5C
        last = np.maximum.accumulate(np.where(slash, -1, idx))  # last non-backslash so far
        before = np.empty(len(c), np.int64)  # backslashes right before each byte
        before[0] = backslashes
        run = idx[:-1] - last[:-1]
        before[1:] = np.where(last[:-1] < 0, run + backslashes, run)
        before[1:] = np.where(slash[:-1], before[1:], 0)
        quote = (c == 0x22) & (before % 2 == 0)
        inside = (np.cumsum(quote) + in_string) % 2 == 1
        step = (((c == 0x5B) | (c == 0x7B)) & ~inside).astype(np.int64) - \
            (((c == 0x5D) | (c == 0x7D)) & ~inside)
        level = depth + np.cumsum(step)
        over = np.flatnonzero(level > limit)
        if len(over):
            return start + int(over[0])
        depth = int(level[-1]) if len(level) else depth
        in_string = int(inside[-1]) if len(c) else in_string
        tail = len(c) - 1 - int(last[-1])
        backslashes = tail + (backslashes if last[-1] < 0 else 0)
    return None


def load_json(path: Path, key: str = "root", limit: int = JSON_DEPTH) -> Any:
    """A JSON file, parsed once its nesting is known to be at most ``limit`` deep; a key
    that appears twice in one object is refused (JSON parsers keep the last silently)."""
    try:
        with open_file(path) as f:
            raw = f.read()
    except PathRefused as e:
        raise DataError(f"{key}: {e}") from None
    except OSError as e:
        raise DataError(f"{key}: {path} cannot be read ({e.strerror})") from None
    at = json_depth_over(raw, limit)
    if at is not None:
        raise DataError(f"{key}: {path} nests arrays and objects deeper than {limit} levels "
                        f"(at byte {at}); expected the format's few levels")

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(items)
        if len(out) != len(items):
            seen: set[str] = set()
            twice = next(k for k, _ in items if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise DataError(f"{key}: {path} has the key {brief(twice)} twice in one object; "
                            "expected each key once")
        return out

    try:
        return json.loads(raw, object_pairs_hook=pairs)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{key}: {path} is not JSON ({e})") from None


# ---------------------------------------------------------------------------- LEAF


_ARRAY = r'"{key}"\s*:\s*\[(.*?)\]'


def leaf_index(path: Path) -> tuple[list[str], list[int]]:
    """(users, num_samples) of a LEAF JSON file, read from its beginning only when LEAF's
    key order holds (``users`` and ``num_samples`` before ``user_data``), else parsed whole."""
    head = b""
    try:
        f = open_file(path)
    except PathRefused as e:
        raise DataError(f"root: {e}") from None
    with f:
        while b'"user_data"' not in head:
            chunk = f.read(1 << 20)
            if not chunk:
                break
            head += chunk
    text = head.split(b'"user_data"', 1)[0].decode("utf-8", "replace")
    users_m = re.search(_ARRAY.format(key="users"), text, re.DOTALL)
    counts_m = re.search(_ARRAY.format(key="num_samples"), text, re.DOTALL)
    users: Any = None
    counts: Any = None
    if users_m and counts_m:
        try:
            users = json.loads(f"[{users_m.group(1)}]")
            counts = json.loads(f"[{counts_m.group(1)}]")
        except json.JSONDecodeError:
            users = None  # not LEAF's plain lists: the whole file says what it holds
    if users is None or not _plain(users, str) or not _plain(counts, int):
        doc = read_leaf(path)
        users, counts = doc["users"], doc["num_samples"]
    if len(users) != len(counts):
        raise DataError(f"root: {path}: {len(users)} users but {len(counts)} num_samples; "
                        "expected one count per user")
    return [str(u) for u in users], [int(c) for c in counts]


def _plain(values: Any, kind: type) -> bool:
    """A list of ``kind`` values (bool is not an int here)."""
    return isinstance(values, list) and all(
        isinstance(v, kind) and not isinstance(v, bool) for v in values)


def _leaf_user(path: Path, user: str, count: int, mine: Any) -> None:
    """One user's ``user_data`` entry agrees with its ``num_samples`` count."""
    if mine is None:
        raise DataError(f"root: {path}: user {brief(user)} of users has no user_data")
    if not isinstance(mine, dict) or not isinstance(mine.get("x"), list) or \
            not isinstance(mine.get("y"), list):
        raise DataError(f"root: {path}: user_data[{brief(user)}] must be an object with "
                        "lists x and y")
    nx, ny = len(mine["x"]), len(mine["y"])
    if nx != ny:
        raise DataError(f"root: {path}: user_data[{brief(user)}] has {nx} x and {ny} y; "
                        "expected one y per x")
    if count != ny:
        raise DataError(f"root: {path}: num_samples gives user {brief(user)} {count} "
                        f"samples, its user_data holds {ny}")


def read_leaf(path: Path) -> dict[str, Any]:
    """A LEAF JSON file: ``users``, ``num_samples`` and ``user_data`` (user -> ``x``, ``y``),
    checked to agree with itself: each user listed once and holding user_data, each count
    the user's number of samples, as many ``x`` as ``y``. The samples' own values are the
    data set's to check (``_Leaf._samples``)."""
    doc = load_json(path)
    if not isinstance(doc, dict):
        raise DataError(f"root: {path} holds a JSON {type(doc).__name__}; expected LEAF's "
                        "object of users, num_samples and user_data")
    missing = [k for k in ("users", "num_samples", "user_data") if k not in doc]
    if missing:
        raise DataError(f"root: {path} lacks LEAF's keys {missing} (users, num_samples, "
                        "user_data)")
    users, counts, data = doc["users"], doc["num_samples"], doc["user_data"]
    if not _plain(users, str):
        raise DataError(f"root: {path}: users must be a list of user names (strings)")
    if not _plain(counts, int) or any(c < 0 for c in counts):
        raise DataError(f"root: {path}: num_samples must be a list of counts (integers >= 0)")
    if not isinstance(data, dict):
        raise DataError(f"root: {path}: user_data must be an object of user -> {{x, y}}")
    if len(users) != len(counts):
        raise DataError(f"root: {path}: {len(users)} users but {len(counts)} num_samples; "
                        "expected one count per user")
    seen: set[str] = set()
    for user, count in zip(users, counts):
        if user in seen:
            raise DataError(f"root: {path}: user {brief(user)} is listed twice in users; "
                            "expected each user once")
        seen.add(user)
        _leaf_user(path, user, count, data.get(user))
    extra = next((u for u in data if u not in seen), None)
    if extra is not None:
        raise DataError(f"root: {path}: user_data holds {brief(extra)}, which users does not "
                        "list")
    return doc
