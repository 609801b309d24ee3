"""Simulated device speeds and availability (the scenario's ``speeds`` block: the asynchronous
modes' clock, and a synchronous run's simulated time), parametric or from FedScale's two trace
files.

A task of client ``c`` (``samples`` samples of local work, the model sent down and its update
sent up) takes ``samples * sample_seconds[c] * exp(jitter * e) + 2 * model_bits /
bandwidth[c]`` simulated seconds, ``e`` a standard normal drawn per (client, task) from the
seed. ``sample_seconds[c]`` is ``speeds.sample_seconds`` times a fixed factor per client drawn
once from ``speeds.distribution`` (one seeded draw vector in client-id order: NumPy's
generators fill a vector element after element, so client ``c``'s factor is the same whatever
``total`` is, whoever is Byzantine), or comes from a device-capacity trace. A client with an
availability trace starts a task only while active (``Availability.next_start``).

FedScale's formats and semantics (Lai et al., "FedScale: Benchmarking Model and System
Performance of Federated Learning at Scale", ICML 2022), as read in SymbioticLab/FedScale at
commit 7ec441c2afa99510535adebe155d89fa8bb2c637 (its shipped trace files are not in the
repository snapshot, only their format):

* Both files are pickled dicts keyed by client id (``benchmark/dataset/data/device_info/
  README.md``), loaded with a plain ``pickle.load`` (``fedscale/cloud/aggregation/
  aggregator.py:258-264``; ``fedscale/cloud/client_manager.py:33-36``).
* Device capacity, ``{client: {'computation': ms, 'communication': kbit/s}}``:
  ``fedscale/cloud/internal/client_metadata.py:56-63`` computes a task's time as
  ``3.0 * batch_size * local_steps * computation / 1000`` seconds (``computation`` is the
  *inference* latency in ms per sample; ``augmentation_factor = 3.0`` counts the backward pass
  as twice the forward) plus ``(upload + download) / communication``, the model's size being
  ``bytes / 1024 * 8`` "kbits" (``aggregator.py:423-425``): a kbit there is 1024 bits. So here
  ``sample_seconds = TRAINING_PASSES * computation / 1000`` (``TRAINING_PASSES = 3``) and
  ``bandwidth = communication * KBIT`` bits/s (``KBIT = 1024``): the same trace gives the
  same seconds as FedScale.
* Availability, ``{client: {'active': [s], 'inactive': [s], 'finish_time': s, 'duration': s,
  'model': str}}``: ``ClientMetadata.is_active`` (``client_metadata.py:35-54``) takes
  ``cur_time % finish_time`` and answers whether it lies in ``[active[i], inactive[i]]``,
  both ends included, ``i`` an index it keeps between calls and moves at most one window per
  call (so its answer depends on which times were asked before). ``duration`` is never read
  (it is the total active time: in the one shipped entry we could see, quoted in a derived
  project's source, it equals the sum of ``inactive[i] - active[i]``). FedScale's own test
  (``fedscale/tests/cloud/internal/test_client_metadata.py:9-13, 34-40``) uses windows
  ``[1, 1], [3, 4], [6, 7], [9, 10]`` with ``finish_time`` 10. Synchronous FedScale keeps a
  client only if it is active when its task would end (``aggregator.py:357-372``); its
  asynchronous aggregator picks the next client among those active at the start time
  (``fedscale/cloud/aggregation/async_aggregator.py:16-37``).
* Client ids onto entries: FedScale numbers clients from 1. The capacity of client ``k`` is
  the entry whose *key* is ``k % len(file)``, and ``{'computation': 1.0, 'communication':
  1.0}`` when no entry has that key (``aggregator.py:274-293``); its availability is the
  entry at *position* ``k % len(file)`` of the file's key order (``client_manager.py:50-54``).

Where fedray departs:

* Client ``c`` (numbered from 0) takes the entry at position ``c % len(file)`` in the file's
  order (insertion order of the pickle's or JSON's mapping, row order of Parquet), in both
  files. For a capacity file keyed 1..n in order this is FedScale's entry for every client but
  the one FedScale gives its silent 1.0/1.0 default; the availability entry is FedScale's
  shifted by one position, of no statistical consequence. Every client has a real entry.
* Activity is stateless: ``c`` is active at ``t`` when ``t mod finish_time`` lies in some
  ``[active[i], inactive[i])`` (half-open: at ``inactive[i]`` it has left). Windows are
  clipped to ``[0, finish_time]`` (FedScale never reaches a time beyond it either), and may
  overlap or come in any order (their union counts); an entry with no window is never active
  (FedScale divides by zero). FedScale's test case answers the same here.
* The engine asks ``next_start`` for the first time a client can start (FedScale's
  asynchronous rule); whether it must still be active when it ends is the engine's call.

Trace files are read without running anything they hold: pickles through a restricted
unpickler (builtin containers, numbers, text, and NumPy's scalar numbers, which tools that
write these files often leave in them; every other global is refused), at most
``MAX_TRACE_BYTES`` of a regular file (``strategies.paths``: never a FIFO or a device) and
``MAX_TRACE_ENTRIES`` entries; the same content is accepted as JSON (``.json``: parsed one
entry at a time, refused at the first entry past the cap, so memory follows the entries
read) and as Parquet (``.parquet``: one row per client, columns ``client, computation,
communication`` or ``client, active, inactive, finish_time, duration``; its row count read
from the footer first).
"""

from __future__ import annotations

import bisect
import io
import json
import math
import pickle
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from simulator.errors import brief, brief_text
from simulator.seeding import numpy_rng
from strategies.paths import PathRefused, guard, read_bytes

if TYPE_CHECKING:
    from simulator.config.schema import Speeds

MAX_TRACE_BYTES = 256 << 20  # FedScale's files are tens of MB; a pickle's objects take ~10x
# entries of one trace: client c follows entry c mod len, so more describe no more clients
# (FedScale's device-capacity file has about 500,000); bounds a parse's memory (~0.6 GB)
MAX_TRACE_ENTRIES = 1_000_000
TRAINING_PASSES = 3.0  # FedScale's augmentation_factor: a training sample costs 3 inferences
KBIT = 1024.0  # FedScale's kbit (its model size is bytes / 1024 * 8)
CAPACITY_KEYS = ("computation", "communication")
AVAILABILITY_KEYS = ("active", "inactive", "finish_time", "duration")
Problems = list[tuple[tuple[str, ...], str]]
KEY = ("speeds",)  # where the block sits in a scenario: every message's location starts here
_AT = ".".join(KEY)


class TraceError(ValueError):
    """A trace file that is missing, unreadable or not of FedScale's format (one line)."""


class Availability:
    """When each client is active, from a FedScale availability trace: client ``c`` follows
    entry ``c % len(self)``, active while ``t mod finish_time`` lies in one of its windows
    ``[start, end)``."""

    def __init__(self, windows: Sequence[tuple[Sequence[float] | np.ndarray,
                                               Sequence[float] | np.ndarray]],
                 finish_time: Sequence[float]) -> None:
        """``windows[k]``: entry ``k``'s (active, inactive) times, ``finish_time[k]`` its
        period (> 0). Windows are clipped to ``[0, finish_time]``, empty ones dropped, the
        rest merged into disjoint sorted ones."""
        if len(windows) != len(finish_time) or not windows:
            raise ValueError("Availability needs one finish_time per entry, and an entry")
        self._finish = tuple(float(f) for f in finish_time)
        merged = [_merge(a, b, f) for (a, b), f in zip(windows, self._finish, strict=True)]
        self._starts = tuple(s for s, _ in merged)
        self._ends = tuple(e for _, e in merged)

    def __len__(self) -> int:
        return len(self._finish)

    def windows(self, client: int) -> tuple[tuple[float, ...], tuple[float, ...], float]:
        """(starts, ends, finish_time) of ``client``'s entry, merged and sorted."""
        k = int(client) % len(self._finish)
        return self._starts[k], self._ends[k], self._finish[k]

    def next_start(self, client: int, t: float) -> float:
        """The earliest time >= t at which ``client`` is active (t itself when active at t);
        inf when never again."""
        starts, ends, period = self.windows(client)
        t = float(t)
        if math.isnan(t):
            raise ValueError(f"next_start: time must be a number, got {t}")
        if not starts or t == math.inf:
            return math.inf
        cycle = math.floor(t / period)
        into = t - cycle * period
        if not 0.0 <= into < period:  # t / period rounded across a cycle's edge
            cycle += -1 if into < 0 else 1
            into = t - cycle * period
        i = bisect.bisect_right(ends, into)  # the first window that ends after ``into``
        if i < len(starts):
            return t if starts[i] <= into else max(t, cycle * period + starts[i])
        return max(t, (cycle + 1) * period + starts[0])

    def active(self, client: int, t: float) -> bool:
        """Whether ``client`` is active at time ``t``."""
        return self.next_start(client, t) == t

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Availability):
            return NotImplemented
        return (self._finish, self._starts, self._ends) == \
            (other._finish, other._starts, other._ends)

    __hash__ = None  # type: ignore[assignment]


def _merge(active: Sequence[float] | np.ndarray, inactive: Sequence[float] | np.ndarray,
           period: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Windows ``[active[i], inactive[i])`` clipped to ``[0, period]``, the empty ones
    dropped, sorted, overlapping or touching ones joined."""
    a = np.clip(np.asarray(active, np.float64), 0.0, period)
    b = np.clip(np.asarray(inactive, np.float64), 0.0, period)
    keep = a < b
    order = np.argsort(a[keep], kind="stable")
    starts: list[float] = []
    ends: list[float] = []
    for s, e in zip(a[keep][order].tolist(), b[keep][order].tolist(), strict=True):
        if ends and s <= ends[-1]:
            ends[-1] = max(ends[-1], e)
        else:
            starts.append(s)
            ends.append(e)
    return tuple(starts), tuple(ends)


@dataclass(frozen=True, eq=False)
class Profiles:
    """Each client's simulated device: compute seconds per sample and bandwidth (bits/s)."""

    sample_seconds: np.ndarray  # (total,) float64, > 0
    bandwidth: np.ndarray  # (total,) float64, > 0, inf allowed (no communication time)
    jitter: float
    seed: int
    availability: Availability | None

    def task_seconds(self, client: int, samples: int, model_bits: float, task: int,
                     up_bits: float | None = None) -> float:
        """samples * sample_seconds[c] * exp(jitter * e) + (model_bits + up_bits) /
        bandwidth[c]: ``model_bits`` down (what the client receives), ``up_bits`` up (what it
        sends: the message's payload after the codecs; ``model_bits`` when None, the
        symmetric ``2 * model_bits``); e a standard normal drawn from (seed, "speed-jitter",
        client, task), no draw at all when jitter == 0."""
        compute = samples * float(self.sample_seconds[client])
        if self.jitter:
            e = numpy_rng(self.seed, "speed-jitter", int(client), int(task)).standard_normal()
            with np.errstate(over="ignore"):
                compute *= float(np.exp(self.jitter * e))
        if up_bits is None:
            return compute + 2.0 * float(model_bits) / float(self.bandwidth[client])
        return compute + (float(model_bits) + float(up_bits)) / float(self.bandwidth[client])


# ------------------------------------------------------------------ parametric factors


def factors(speeds: Speeds, total: int, seed: int) -> np.ndarray:
    """Each client's speed factor (``total``,) float64 > 0, drawn from ``speeds.distribution``
    as one vector in client-id order from (seed, "speed-factor"): client c's factor does not
    depend on ``total``."""
    dist, a = speeds.distribution, float(speeds.a)
    if dist == "constant":
        return np.ones(total)
    if dist == "zipf" and a <= 1:
        raise ValueError(f"{_AT}.a: {_ZIPF_A} got {a:g}")
    rng = numpy_rng(seed, "speed-factor")
    if dist == "exponential":
        f = rng.exponential(1.0, total)
    elif dist == "lognormal":
        with np.errstate(over="ignore"):
            f = np.exp(float(speeds.sigma) * rng.standard_normal(total))
    elif dist == "zipf":
        f = rng.zipf(a, total).astype(np.float64)
    elif dist == "pareto":
        f = rng.pareto(a, total) + 1.0
    else:
        raise ValueError(f"{_AT}.distribution: unknown distribution {dist!r}")
    fmax = np.finfo(np.float64)
    # > 0 and finite, however far the tail reaches; at most max_factor (Plato's cap)
    return np.clip(f, fmax.tiny, fmax.max if speeds.max_factor is None else speeds.max_factor)


_ZIPF_A = "zipf needs a > 1 (its normalising sum diverges at a <= 1),"


def profiles(speeds: Speeds, total: int, seed: int, byzantine: np.ndarray) -> Profiles:
    """The devices of ``total`` clients from the scenario's ``speeds``:
    ``sample_seconds = speeds.sample_seconds * factor`` and ``bandwidth = speeds.bandwidth``,
    or, with ``speeds.trace``, the trace's (see the module's docstring for its units and how
    clients map onto entries); the Byzantine clients' (``byzantine``: their ids)
    sample_seconds multiplied by ``byzantine_factor`` and bandwidth divided by it; with
    ``speeds.availability``, its Availability. ValueError naming the scenario key and the file
    when a file is missing or not of the format."""
    if speeds.trace:
        computation, communication = _at(("trace",), read_capacity, speeds.trace)
        entry = np.arange(total) % len(computation)
        sample_seconds = TRAINING_PASSES * computation[entry] / 1000.0
        bandwidth = communication[entry] * KBIT
    else:
        sample_seconds = float(speeds.sample_seconds) * factors(speeds, total, seed)
        bandwidth = np.full(total, float(speeds.bandwidth))
    byz = _byzantine_ids(byzantine, total)
    sample_seconds[byz] *= speeds.byzantine_factor
    bandwidth[byz] /= speeds.byzantine_factor
    availability = (_at(("availability",), read_availability, speeds.availability)
                    if speeds.availability else None)
    sample_seconds.setflags(write=False)
    bandwidth.setflags(write=False)
    return Profiles(sample_seconds, bandwidth, float(speeds.jitter), int(seed), availability)


def _byzantine_ids(byzantine: np.ndarray, total: int) -> np.ndarray:
    """The Byzantine clients' ids, from ids or a boolean mask of length ``total``."""
    b = np.asarray(byzantine)
    if b.dtype == np.bool_:
        if b.shape != (total,):
            raise ValueError(f"byzantine: a mask must have {total} entries, got {b.shape}")
        return np.flatnonzero(b)
    ids = b.astype(np.int64).ravel()
    if ids.size and (ids.min() < 0 or ids.max() >= total):
        raise ValueError(f"byzantine: client ids must be in [0, {total}), got {brief(ids)}")
    return np.unique(ids)


def _at(field: tuple[str, ...], read: Any, path: str) -> Any:
    """``read(path)``, its TraceError prefixed with the scenario key it came from."""
    try:
        return read(path)
    except TraceError as e:
        raise ValueError(f"{_AT}.{'.'.join(field)}: {e}") from None


def check_speeds(speeds: Speeds, total: int) -> Problems:
    """Problems (location under the scenario, one-line message) before anything runs: zipf
    with a <= 1, a trace or availability file that is missing, unreadable or not of its format
    (the file, the client and what is wrong), and an availability trace in which none of the
    ``total`` clients is ever active. (The schema bounds the other keys.)"""
    loc = KEY
    problems: Problems = []
    if speeds.distribution == "zipf" and speeds.a <= 1 and not speeds.trace:
        problems.append((loc + ("a",), f"{_ZIPF_A} got {speeds.a:g}"))
    if speeds.trace:
        try:
            read_capacity(speeds.trace)
        except TraceError as e:
            problems.append((loc + ("trace",), str(e)))
    if speeds.availability:
        try:
            avail = read_availability(speeds.availability)
        except TraceError as e:
            problems.append((loc + ("availability",), str(e)))
        else:
            used = range(min(total, len(avail)))  # client c follows entry c % len
            if total > 0 and not any(avail.windows(c)[0] for c in used):
                never = (f"{_name(speeds.availability)}: none of the {total} clients is ever "
                         f"active (entries 0..{len(used) - 1} have no window of positive length)")
                problems.append((loc + ("availability",), never))
    return problems


# ------------------------------------------------------------------ reading the files


class _TraceUnpickler(pickle.Unpickler):
    """Rebuilds dicts, lists, tuples, numbers and text, and NumPy's scalar numbers, and
    refuses every other global: a trace file cannot run code through it (the pattern of
    ``simulator.data.formats._ArraysOnly``, whose package imports torch)."""

    ALLOWED: ClassVar[frozenset[tuple[str, str]]] = frozenset({
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("numpy", "dtype"), ("_codecs", "encode")})

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a trace file (only "
                                     "mappings, lists, numbers and text)")


def _name(path: str | Path) -> str:
    return brief_text(str(path))


def _stat(path: Path) -> None:
    """TraceError naming the file unless it is a regular file of at most MAX_TRACE_BYTES
    (``strategies.paths.guard``: no FIFO, device or link loop)."""
    try:
        guard(path, "file", MAX_TRACE_BYTES)
    except PathRefused as e:
        raise TraceError(str(e)) from None


def _read_bytes(path: Path) -> bytes:
    try:
        return read_bytes(path, MAX_TRACE_BYTES)
    except PathRefused as e:
        raise TraceError(str(e)) from None


class _TooMany(TraceError):
    """A trace of more than MAX_TRACE_ENTRIES entries."""


def _too_many(path: Path, count: int | None = None) -> TraceError:
    held = f"{count:,} entries, more than the" if count is not None else "more than the"
    return _TooMany(f"{_name(path)} holds {held} {MAX_TRACE_ENTRIES:,} entries a trace may "
                    "hold (client c follows entry c mod the entries: a longer trace "
                    "describes no more clients)")


def _load(path: Path, suffix: str) -> Any:
    """A pickle's or a JSON file's content (a JSON object parsed entry by entry, at most
    MAX_TRACE_ENTRIES of them: the memory follows the entries read, not the file)."""
    raw: bytes | None = _read_bytes(path)
    try:
        if suffix == ".json":
            text, raw = raw.decode("utf-8"), None  # type: ignore[union-attr]  # the bytes go
            return _json_entries(text, path)
        out = _TraceUnpickler(io.BytesIO(raw)).load()  # type: ignore[arg-type]
    except (RecursionError, MemoryError):
        raise TraceError(f"{_name(path)} nests too deep for a trace file") from None
    except _TooMany:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a malformed pickle or JSON raises
        kind = "JSON" if suffix == ".json" else "a pickle"
        raise TraceError(f"{_name(path)} is not {kind} this reader accepts "
                         f"({brief_text(str(e), 160)})") from None
    if isinstance(out, dict) and len(out) > MAX_TRACE_ENTRIES:
        raise _too_many(path, len(out))
    return out


_SPACE = re.compile(r"[ \t\n\r]*")


def _skip(text: str, i: int, char: str = "") -> int:
    """The index after ``char`` (when given, it must be at ``i``) and the blanks after it."""
    if char:
        if text[i:i + 1] != char:
            raise ValueError(f"expected {char!r} at character {i}")
        i += 1
    return _SPACE.match(text, i).end()  # type: ignore[union-attr]


def _json_entries(text: str, path: Path) -> Any:
    """A JSON trace: its top-level object read one entry at a time (``raw_decode``), so
    that a trace of more than MAX_TRACE_ENTRIES entries is refused after reading that
    many, never built whole; any other top-level value (or an empty object) is parsed as
    it is."""
    decoder = json.JSONDecoder(object_pairs_hook=_unique_keys)
    i = _skip(text, 0)
    if text[i:i + 1] != "{" or text[_skip(text, i, "{"):][:1] == "}":
        return decoder.decode(text)
    out: dict[str, Any] = {}
    i = _skip(text, i, "{")
    while True:
        if text[i:i + 1] != '"':
            raise ValueError(f"expected a key (text) at character {i}")
        key, i = decoder.raw_decode(text, i)
        value, i = decoder.raw_decode(text, _skip(text, _skip(text, i), ":"))
        if key in out:
            raise TraceError(f"the key {brief(key)} appears twice in one object")
        out[key] = value
        if len(out) > MAX_TRACE_ENTRIES:
            raise _too_many(path)
        i = _skip(text, i)
        if text[i:i + 1] == "}":
            if _skip(text, i, "}") != len(text):
                raise ValueError(f"extra data after character {i}")
            return out
        i = _skip(text, i, ",")


def _unique_keys(items: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(items)
    if len(out) != len(items):
        seen: set[str] = set()
        twice = next(k for k, _ in items if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise TraceError(f"the key {brief(twice)} appears twice in one object")
    return out


def _parquet_rows(path: Path) -> None:
    """A Parquet trace of more than MAX_TRACE_ENTRIES rows refused from its footer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowException, OSError):
        return  # _read_parquet names what is wrong with the file
    if rows > MAX_TRACE_ENTRIES:
        raise _too_many(path, rows)


def _read_parquet(path: Path) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise TraceError(f"{_name(path)} is not a readable Parquet file "
                         f"({brief_text(str(e), 120)})") from None
    if "client" not in table.column_names:
        raise TraceError(f"{_name(path)}: a Parquet trace has one row per client and a "
                         f"'client' column; got columns {', '.join(table.column_names)}")
    out: dict = {}
    for row in table.to_pylist():
        key = row.pop("client")
        if key in out:
            raise TraceError(f"{_name(path)}: client {brief(key)} has more than one row")
        out[key] = row
    return out


def read_trace(path: str | Path) -> dict:
    """The raw mapping ``{client: entry}`` of either FedScale file: a pickle (read with a
    restricted unpickler), ``.json`` or ``.parquet`` (one row per client). ValueError naming
    the file when it is missing, unreadable, too large or not a mapping."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        _stat(path)
        _parquet_rows(path)
        out = _read_parquet(path)
    else:
        out = _load(path, suffix)
    if not isinstance(out, dict):
        raise TraceError(f"{_name(path)} is not a FedScale trace: expected a mapping of "
                         f"client ids to entries, got {type(out).__name__}")
    if not out:
        raise TraceError(f"{_name(path)} holds no clients")
    return out


def read_capacity(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(computation in ms per sample, communication in kbit/s), one entry each in the file's
    order, from a FedScale device-capacity file; ValueError naming the file and the client
    when an entry is not ``{computation: > 0 finite, communication: > 0}``."""
    mapping = read_trace(path)
    computation = np.empty(len(mapping))
    communication = np.empty(len(mapping))
    try:
        for i, (key, entry) in enumerate(mapping.items()):
            who = _who(key)
            _entry(entry, CAPACITY_KEYS[:2], who, "a device-capacity entry")
            computation[i] = _positive(entry, "computation", who)
            communication[i] = _positive(entry, "communication", who, finite=False)
    except TraceError as e:
        raise TraceError(f"{_name(path)}: {e}") from None
    return computation, communication


def read_availability(path: str | Path) -> Availability:
    """The Availability of a FedScale availability file, entries in the file's order;
    ValueError naming the file and the client when an entry is not ``{active: [...],
    inactive: [...] as long, finish_time: > 0, duration: >= 0 (optional)}`` with
    ``active[i] <= inactive[i]``."""
    mapping = read_trace(path)
    windows: list[tuple[np.ndarray, np.ndarray]] = []
    finish: list[float] = []
    seen: dict[int, np.ndarray] = {}  # lists shared between entries are checked once
    try:
        for key, entry in mapping.items():
            who = _who(key)
            _entry(entry, AVAILABILITY_KEYS[:3], who, "an availability entry")
            finish.append(_positive(entry, "finish_time", who))
            if entry.get("duration") is not None:  # optional (FedScale never reads it)
                _number(entry, "duration", who, lambda v: v >= 0 and math.isfinite(v),
                        "a number >= 0")
            windows.append(_windows(entry, who, seen))
    except TraceError as e:
        raise TraceError(f"{_name(path)}: {e}") from None
    return Availability(windows, finish)


def _who(key: Any) -> str:
    if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, str, np.integer)):
        raise TraceError(f"keys must be client ids (integers or text), got {brief(key)}")
    return f"client {brief_text(str(key), 60)}"


def _entry(entry: Any, required: tuple[str, ...], who: str, what: str) -> None:
    if not isinstance(entry, dict):
        raise TraceError(f"{who}: {what} must be a mapping with {', '.join(required)}, got "
                         f"{brief(entry)}")
    missing = [k for k in required if k not in entry]
    if missing:
        raise TraceError(f"{who}: {missing[0]} is missing ({what} has {', '.join(required)}; "
                         f"got keys {brief_text(', '.join(map(str, entry)), 120)})")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and \
        not isinstance(value, (bool, np.bool_))


def _number(entry: dict, name: str, who: str, ok: Any, what: str) -> float:
    value = entry[name]
    try:
        x = float(value) if _is_number(value) else math.nan
    except OverflowError:  # an int beyond float's range
        x = math.nan
    if not ok(x):
        raise TraceError(f"{who}: {name} must be {what}, got {brief(value)}")
    return x


def _positive(entry: dict, name: str, who: str, finite: bool = True) -> float:
    x = _number(entry, name, who, lambda v: v > 0, "a positive number")
    if finite and math.isinf(x):
        raise TraceError(f"{who}: {name} must be finite, got {brief(entry[name])}")
    return x


def _times(value: Any, name: str, who: str, seen: dict[int, np.ndarray]) -> np.ndarray:
    """A list of finite numbers as float64."""
    if id(value) in seen:
        return seen[id(value)]
    if not isinstance(value, (list, tuple)):
        raise TraceError(f"{who}: {name} must be a list of times (s), got {brief(value)}")
    for i, x in enumerate(value):
        if not _is_number(x) or not math.isfinite(float(x)):
            raise TraceError(f"{who}: {name}[{i}] must be a finite number of seconds, got "
                             f"{brief(x)}")
    out = np.asarray([float(x) for x in value], np.float64)
    seen[id(value)] = out
    return out


def _windows(entry: dict, who: str, seen: dict[int, np.ndarray]
             ) -> tuple[np.ndarray, np.ndarray]:
    active = _times(entry["active"], "active", who, seen)
    inactive = _times(entry["inactive"], "inactive", who, seen)
    if len(active) != len(inactive):
        raise TraceError(f"{who}: active has {len(active)} times and inactive "
                         f"{len(inactive)}; they pair up as windows [active[i], inactive[i])")
    bad = np.flatnonzero(active > inactive)
    if len(bad):
        i = int(bad[0])
        raise TraceError(f"{who}: window {i} ends before it starts (active[{i}] = "
                         f"{active[i]:g}, inactive[{i}] = {inactive[i]:g})")
    return active, inactive
