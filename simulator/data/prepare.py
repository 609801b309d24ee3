"""``fetch``: every published file a scenario's data needs, fetched and checked
before any MLflow run exists (``fedray run``, ``sweep`` and ``resume`` call it first, and
``fedray fetch`` alone). A data set with ``download: true`` has its files fetched into its
``root`` (each checked by MD5, within its published size and the download deadline, http(s)
only: ``simulator.data.download``), then its content read through and checked as validation
checks files already on disk (``describe``), and the scenario is validated again now that
its data can describe itself (the model against the data's shape and classes)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

from simulator import registry
from simulator.errors import DataError
from strategies.protocols import FetchedFile

if TYPE_CHECKING:
    from simulator.config import Scenario
    from simulator.config.load import LoadedScenario

__all__ = ["FetchedFile", "fetch"]


def fetch(target: LoadedScenario | Iterable[Scenario]) -> list[FetchedFile]:
    """Fetch and check what ``target`` (a loaded scenario, or scenarios: a resumed run's)
    needs; returns the published files of its data sets with ``download: true``, each
    ``downloaded`` now or found in ``root`` with its published checksum (empty: the scenario
    downloads nothing). Raises DataError, one line naming the file, the field and what was
    expected: a download that fails or is refused, data that contradicts itself."""
    points = getattr(target, "points", None)  # a LoadedScenario, without importing config
    scenarios = [p.scenario for p in points] if points is not None else \
        list(cast("Iterable[Scenario]", target))
    out: list[FetchedFile] = []
    fetched: set[str] = set()
    described: set[tuple[str, int, int, float]] = set()
    for sc in scenarios:
        spec = dict(sc.data.dataset)
        if not spec.get("download"):
            continue
        key = json.dumps(spec, sort_keys=True)
        dataset = _instance(spec)
        if key not in fetched:
            fetched.add(key)
            out += dataset.fetch()
        seed = sc.seeds[0] if sc.seeds else 0
        point = (key, sc.clients.total, seed, sc.data.test_fraction)
        if point not in described:  # the files' content, now that they are there
            described.add(point)
            dataset.describe(sc.clients.total, seed, sc.data.test_fraction)
    if any(f.downloaded for f in out) and hasattr(target, "raw"):
        _validate_again(target)
    return out


def _instance(spec: dict[str, Any]) -> Any:
    params = {k: v for k, v in spec.items() if k != "name"}
    return registry.get("datasets", spec["name"])(**params)


def _validate_again(loaded: Any) -> None:
    """The scenario validated again, its data now on disk: the checks of the data and the
    model that validation skipped while the files were not fetched. Its problems in one
    line."""
    from simulator.config import ScenarioError
    from simulator.config.data_load import describe_dataset
    from simulator.config.sweep import expand

    describe_dataset.cache_clear()  # it remembers that the data could not describe itself yet
    try:
        expand(copy.deepcopy(loaded.raw))
    except ScenarioError as e:
        raise DataError(f"{loaded.path}: once its data was fetched: "
                        + "; ".join(e.lines)) from None
