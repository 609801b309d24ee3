"""``data.load`` decided before anything runs: ``auto`` (the default) loads the data set whole
where its estimated size fits comfortably in this machine's memory and reads it a cohort at a
time otherwise; an explicit ``all`` whose data cannot fit is refused, as is an ``auto`` that
would need the cohort path where the data cannot be read a cohort at a time.

The size is estimated from the data set's ``describe()`` (``DatasetInfo``: its training
samples, one sample's shape and the bytes of one stored value), the held-out samples taken
in the same proportion (``test_fraction``). Loading it whole peaks near twice that (the
loaded split and its table in client order, docs/datasets.md) and Ray's object store holds
one more copy: ``auto`` therefore loads whole only data of at most :data:`COMFORT` of the
memory available (``MemAvailable`` of /proc/meminfo, or the free pages ``os.sysconf``
counts; :data:`MEMORY_ENV` overrides it, for tests).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simulator import registry
from simulator.config.errors import Problem, problem
from simulator.config.schema import Scenario
from simulator.errors import DataError, UsageError

COMFORT = 0.25  # auto loads whole data of at most this fraction of the memory available
MEMORY_ENV = "FEDRAY_MEMORY_AVAILABLE"  # bytes (or 512MiB, 2GiB): the memory to assume


def available_memory() -> int | None:
    """The memory available to a run on this machine in bytes: :data:`MEMORY_ENV` where set,
    else MemAvailable of /proc/meminfo, else the free pages ``os.sysconf`` counts (None
    where neither can be read); read at most once a second (a sweep's points ask one after
    another)."""
    given = os.environ.get(MEMORY_ENV)
    if given is not None:
        return _env_bytes(given)
    now = time.monotonic()
    if now - _MEMORY[0] > 1.0:
        _MEMORY[:] = [now, _read_available_memory()]
    return _MEMORY[1]


_MEMORY: list[Any] = [-math.inf, None]  # (when read, bytes available)
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _env_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]iB|B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise UsageError(f"{MEMORY_ENV}: the memory to assume, in bytes (or with KiB, MiB, "
                         f"GiB, TiB), got {text[:40]!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def _read_available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def data_bytes(info: Any, test_fraction: float) -> int:
    """The data set held whole (``load: all``), estimated from its ``DatasetInfo``: each
    training sample's values, label (8 bytes) and client id (4) in the table, and the
    held-out samples, ``test_fraction`` of all, with their labels."""
    values = math.prod(info.input_shape) * info.value_bytes
    held_out = round(info.train_samples * test_fraction / (1 - test_fraction))
    return info.train_samples * (values + 12) + held_out * (values + 8)


def gib(n: float) -> str:
    """Bytes in GiB, to a tenth (in MiB below a tenth of a GiB)."""
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:,.1f} MiB"


@dataclass(frozen=True)
class LoadChoice:
    """What ``data.load: auto`` resolved to, and why (one clause, shown by ``fedray show``,
    logged as the run param ``data.load_reason`` and at debug level)."""

    load: str
    reason: str


def cohort_problem(sc: Scenario, population: bool = True) -> Problem | None:
    """Why the scenario's data cannot be read a cohort at a time, or None: the data set must
    give one client at a time (a ``PopulationDataset``) under a partitioner that keeps its
    clients (``traits.natural``); with ``population`` its population is also built (a file
    without a client column, a count that differs)."""
    from strategies.protocols import PopulationDataset

    name = sc.data.dataset["name"]
    if not issubclass(registry.get("datasets", name), PopulationDataset):
        able = [d for d in registry.available("datasets")
                if issubclass(registry.get("datasets", d), PopulationDataset)]
        return Problem(("data", "load"), f"cohort reads one client at a time; {name} cannot "
                       f"(data sets that can: {', '.join(able)}); use load: all")
    if not registry.get("partitioners", sc.data.partitioner["name"]).traits.natural:
        natural = [p for p in registry.available("partitioners")
                   if registry.get("partitioners", p).traits.natural]
        return Problem(("data", "partitioner"), f"data.load: cohort reads the data set's own "
                       f"clients; use partitioner {' or '.join(natural)}, got "
                       f"{sc.data.partitioner['name']}")
    if population:
        try:
            registry.instantiate("datasets", sc.data.dataset).population(
                sc.clients.total, sc.seeds[0] if sc.seeds else 0, sc.data.test_fraction)
        except ValueError as e:  # DataError is a ValueError
            return problem(("data", "dataset"), e)
    return None


@functools.lru_cache(maxsize=16)
def describe_dataset(dataset: str, total: int, seed: int, test_fraction: float) -> Any:
    """The dataset's DatasetInfo (cached: every sweep point of a file asks for the same)."""
    return registry.instantiate("datasets", json.loads(dataset)).describe(total, seed,
                                                                        test_fraction)


def dataset_info(sc: Scenario) -> Any:
    """The data set's DatasetInfo (None where it cannot say before loading, or fails: the
    data checks report that)."""
    try:
        return describe_dataset(json.dumps(sc.data.dataset, sort_keys=True), sc.clients.total,
                                sc.seeds[0] if sc.seeds else 0, sc.data.test_fraction)
    except (DataError, ValueError):
        return None


def choose_load(sc: Scenario) -> LoadChoice | Problem | None:
    """``data.load`` decided: for ``auto`` the choice, for an explicit ``all`` whose data
    cannot fit a problem, for ``cohort`` the problem of its data (None where it can)."""
    if sc.data.load == "cohort":
        return cohort_problem(sc)
    info = dataset_info(sc)
    if info is None:
        return LoadChoice("all", "the data set says its size only once loaded: loaded whole") \
            if sc.data.load == "auto" else None
    size, have = data_bytes(info, sc.data.test_fraction), available_memory()
    what = (f"the data set held whole is about {gib(size)} ({info.train_samples:,} training "
            f"samples of {math.prod(info.input_shape):,} values)")
    if have is None:
        return LoadChoice("all", f"{what}; this machine's available memory is unknown") \
            if sc.data.load == "auto" else None
    if sc.data.load == "all":
        return None if size <= have else _too_large(sc, what, have)
    if size <= COMFORT * have:
        return LoadChoice("all", f"{what}, within a quarter of the {gib(have)} available")
    why = f"{what}, more than a quarter of the {gib(have)} available"
    cannot = cohort_problem(sc)
    if cannot is None:
        return LoadChoice("cohort", why)
    hint = "set data.load: all to load it whole anyway, or " if size <= have else ""
    return Problem(("data", "load"), f"auto: {why}, and it cannot be read a cohort at a time "
                   f"({'.'.join(map(str, cannot.loc))}: {cannot.message}); {hint}use fewer "
                   "clients or a smaller data set")


def _too_large(sc: Scenario, what: str, have: int) -> Problem:
    """An explicit ``load: all`` whose data cannot fit, with the way out."""
    way = ("use load: cohort (or auto, the default), which reads a cohort at a time"
           if cohort_problem(sc, population=False) is None else
           "use fewer clients or a smaller data set")
    return Problem(("data", "load"), f"all: {what}, more than the {gib(have)} available "
                   f"here; {way}")


def with_load(sc: Scenario, choice: LoadChoice) -> Scenario:
    """``sc`` with ``data.load: auto`` resolved to ``choice`` (its reason kept beside)."""
    return sc.model_copy(update={"data": sc.data.chosen(choice.load, f"auto: {choice.reason}")})
