"""The layout of a scenario's runs in MLflow: a parent run per scenario, a child run per
point (sweep point x seed), the tags and params each carries, the identity of a point and of a
sweep (how a later command finds them again), and ``Opening``, which opens them on a
background thread while the engine starts. ``simulator.run.experiment`` owns their lifecycle."""

from __future__ import annotations

import hashlib
import inspect
import json
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

import simulator
from simulator.config import RunPoint
from simulator.config.blocks import plugin_class
from simulator.config.load import LoadedScenario
from simulator.config.plan import shadow_run
from simulator.config.schema import Tracking
from simulator.run.removed import working_directory
from simulator.run.tracking import Tracker, check_uri, flatten, git_commit


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _identity(sc: Any) -> dict[str, Any]:
    """The resolved scenario a digest is taken of. A ``tracking`` block at its defaults is
    left out: the keys of the runs made before the block existed stay the same (a sweep
    continued across it finds its parent); one that asks for more (``log_model: true``) is
    another point, so a sweep run again with it logs the models it asks for."""
    dump = sc.model_dump(mode="json")
    if dump.get("tracking") == Tracking().model_dump(mode="json"):
        del dump["tracking"]
    return dump


def point_key(point: RunPoint) -> str:
    """Identity of a run point: a digest of its resolved single-seed scenario."""
    return _digest(_identity(point.scenario))


def sweep_key(loaded: LoadedScenario) -> str:
    """Identity of a sweep: a digest of the resolved scenario with its sweep and seeds."""
    return _digest(_identity(loaded.scenario))


_COMMIT: list[str] = []


def _commit() -> str:
    if not _COMMIT:
        _COMMIT.append(git_commit())
    return _COMMIT[0]


def run_tags(backend: Any) -> dict[str, str]:
    """The tags of where a run ran: fedray's version, the commit, the backend, its nodes.
    Read on the thread that drives the backend, while it runs: the MLflow runs open on a
    thread of their own (``Opening``), which may get to them only after the last point's end
    has shut Ray down (a one-round run beside a slow new store)."""
    return {"fedray.version": simulator.__version__, "mlflow.source.git.commit": _commit(),
            "backend": backend.name, "ray_nodes": str(backend.num_nodes())}


def run_params(backend: Any) -> dict[str, str]:
    """The params of where a run ran: why its backend was chosen (``backend.reason``:
    ``runtime.backend: auto``'s estimate, or what asked for it), where it says."""
    return {"backend.reason": backend.reason} if backend.reason else {}


def plugin_label(kind: str, spec: dict[str, Any]) -> str:
    """A plugin block as a tag: its name, and in parentheses the arguments that differ from
    its constructor's defaults (``top_k(fraction=0.01, error_feedback=true)``,
    ``dp_sgd(noise_multiplier=4.0)``), so that ``fedray table --by codecs`` (or ``--by
    privacy``) tells two blocks of the same plugin apart."""
    cls = plugin_class(kind, spec)
    defaults: dict[str, Any] = {}
    if cls is not None:
        defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
                    if p.default is not inspect.Parameter.empty}
    args = [f"{k}={json.dumps(v)}" for k, v in spec.items()
            if k != "name" and (k not in defaults or defaults[k] != v)]
    return f"{spec['name']}({', '.join(args)})" if args else str(spec["name"])


def scenario_tags(sc: Any) -> dict[str, str]:
    """The tags a scenario point decides (aggregator, attack, n, f, data set, model, ...)."""
    return {
        "aggregator": sc.aggregator["name"],
        "preaggregators": ",".join(p["name"] for p in sc.preaggregators) or "none",
        "meta": sc.meta["name"] if sc.meta else "none",
        "attack": sc.attack["name"] if sc.attack else "none",
        "topology": sc.topology["name"] if sc.topology else "none",
        "codecs": ",".join(plugin_label("codecs", c) for c in sc.codecs) or "none",
        "downlink": ",".join(plugin_label("codecs", c) for c in sc.downlink) or "none",
        "privacy": plugin_label("privacy", sc.privacy) if sc.privacy else "none",
        "n": str(sc.clients.total),
        "f": str(sc.clients.byzantine),
        "dataset": sc.data.dataset["name"],
        "model": sc.model["name"],
    }


def sweep_param(key: str) -> str:
    """The MLflow param name of a sweep key (names cannot hold commas: the paths of a zipped
    key are joined with ' / ')."""
    return "sweep." + " / ".join(part.strip() for part in key.split(","))


def common_params(loaded: LoadedScenario) -> dict[str, str]:
    """The params every point of the scenario shares: the parent holds only these, so a
    search on a swept param (``params.`aggregator.name` = 'mean'``) finds children alone."""
    flats = [flatten(p.scenario.model_dump(mode="json", exclude={"sweep"}))
             for p in loaded.points]
    return {k: v for k, v in flats[0].items() if all(f.get(k) == v for f in flats[1:])}


def common_tags(loaded: LoadedScenario, where: dict[str, str]) -> dict[str, str]:
    """The tags every point of the scenario shares (a swept aggregator is no parent tag), and
    ``where`` it runs (``run_tags``)."""
    per = [scenario_tags(p.scenario) for p in loaded.points]
    shared = {k: v for k, v in per[0].items() if all(t.get(k) == v for t in per[1:])}
    return {**shared, **where}


def shadow_tags(sc: Any) -> dict[str, str]:
    """A run of a shadow-run membership attack: ``fedray.shadow_group``, the identity of its
    runs (the scenario with the attack's run unset: the point and seed the runs share),
    ``fedray.shadow_attack``, the attack's name (``fedray privacy shadows`` reads both), and
    ``fedray.shadow_run``, the run's index (``fedray table`` takes each run as a sample of
    its row); none for another run."""
    shadow = shadow_run(sc)
    if shadow is None:
        return {}
    attacks = [dict(a) for a in sc.privacy_attacks]
    attacks[shadow.attack]["run"] = None
    return {"fedray.shadow_group": _digest(_identity(sc.model_copy(
                update={"privacy_attacks": attacks}))),
            "fedray.shadow_attack": str(attacks[shadow.attack]["name"]),
            "fedray.shadow_run": str(shadow.run)}


def run_name(point: RunPoint) -> str:
    """A child run's name: the values that differ between points and the seed; a scenario
    without a sweep adds its name (``quickstart seed=0``), not a bare ``seed=0``."""
    return point.run_name


def open_parent(loaded: LoadedScenario, where: dict[str, str], tracker: Tracker, tmp: Path,
                final_tags: dict[str, str] | None = None,
                backend: dict[str, str] | None = None) -> str:
    """The parent run of a scenario: tags, the resolved scenario as params (and the
    ``backend`` params, ``run_params``), the scenario file as given and resolved as
    artifacts; ``final_tags`` are set last, once all that is logged (a sweep finds its
    parent by them). A failure marks the run FAILED and is raised."""
    sc = loaded.scenario
    parent = tracker.create_run(sc.name, {**common_tags(loaded, where),
                                          "fedray.kind": "scenario",
                                          "sweep": ",".join(sc.sweep) or "none"},
                                description=sc.description)
    try:
        tracker.log_params(parent, common_params(loaded) |
                           {"seeds": yaml.safe_dump(sc.seeds, default_flow_style=True).strip()} |
                           {sweep_param(k): yaml.safe_dump(v, default_flow_style=True).strip()
                            for k, v in sc.sweep.items()} | (backend or {}))
        given = tmp / "given" / loaded.path.name
        given.parent.mkdir(parents=True, exist_ok=True)
        given.write_text(loaded.text)
        tracker.log_artifact(parent, given, "scenario")
        resolved = tmp / "resolved.yaml"
        resolved.write_text(yaml.safe_dump(sc.model_dump(mode="json"), sort_keys=False))
        tracker.log_artifact(parent, resolved, "scenario")
        for k, v in (final_tags or {}).items():
            tracker.client.set_tag(parent, k, v)
    except BaseException:
        tracker.end(parent, "FAILED")
        raise
    return parent


def open_child(point: RunPoint, key: str, where: dict[str, str], tracker: Tracker, parent: str,
               tmp: Path, backend: dict[str, str] | None = None) -> str:
    """A point's child run: tags, params (the ``backend`` params, ``run_params``, too) and,
    from the start, the resolved scenario as the ``scenario.yaml`` artifact (what ``fedray
    resume`` rebuilds the run from); ``key`` is the point's identity (``point_key``)."""
    sc = point.scenario
    desc = sc.description + (f"\n\nSweep point: {point.values}" if point.values else "") + \
        f"\nSeed: {point.seed}"
    run_id = tracker.create_run(run_name(point), {**scenario_tags(sc), **where, "seed": str(point.seed),
                                              "fedray.kind": "point",
                                              "fedray.point_key": key, **shadow_tags(sc)},
                                parent_id=parent, description=desc.strip())
    tracker.log_params(run_id, flatten(sc.model_dump(mode="json", exclude={"sweep"})) |
                       {"seed": str(point.seed)} | load_param(sc) | (backend or {}))
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "scenario.yaml").write_text(yaml.safe_dump(sc.model_dump(mode="json"), sort_keys=False))
    tracker.log_artifact(run_id, tmp / "scenario.yaml")
    log_dataset(tracker, run_id, sc)
    return run_id


def load_param(sc: Any) -> dict[str, str]:
    """``data.load_reason``: why ``data.load: auto`` chose how the data loads (all or
    cohort), where it chose (a scenario that gives ``load`` has none)."""
    return {"data.load_reason": sc.data.load_reason} if sc.data.load_reason else {}


def dataset_input(sc: Any) -> Any:
    """The run's data as an MLflow dataset input: the data set's name, a digest of what
    decides the clients' samples (data block, clients, seed), the data block as its source
    and the partition as its profile; runs on the same clients share the digest."""
    import hashlib
    import json

    from mlflow.entities import Dataset, DatasetInput, InputTag

    data = sc.data.model_dump(mode="json")
    what = {"data": data, "clients": sc.clients.total, "seed": sc.seeds[0]}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    profile = {"clients": sc.clients.total, "partitioner": data["partitioner"],
               "test_fraction": data["test_fraction"], "seed": sc.seeds[0]}
    ds = Dataset(name=sc.data.dataset["name"], digest=digest, source_type="fedray",
                 source=json.dumps(data["dataset"], sort_keys=True),
                 profile=json.dumps(profile, sort_keys=True))
    return DatasetInput(ds, [InputTag("mlflow.data.context", "train")])


def log_dataset(tracker: Tracker, run_id: str, sc: Any) -> None:
    """``log_input`` of the run's data (see :func:`dataset_input`)."""
    tracker.client.log_inputs(run_id, datasets=[dataset_input(sc)])


class Opening:
    """The MLflow side of a command, opened on one background thread while the engine
    starts: MLflow's import and store set-up (about 2 s here, 3.7 s for a new store) go on
    while Ray starts, the data loads and the first rounds run, not before them. The tracker,
    the parent run and each point's child run are opened in that order; a store that cannot
    be used fails each of them with its one-line error. The tracker is the store's first
    answer: a point waits for it before its first round (``Experiment.store_answered``), so
    nothing trains for a store that cannot take it; the parent and child runs may still be
    opening while the first rounds run (their rounds wait in ``PointRun.backlog``)."""

    def __init__(self, uri: str, experiment: str) -> None:
        check_uri(uri)  # what can be refused without opening the store, before anything runs
        # the command's working directory, read before the opening thread runs (a folder
        # removed while the store opens is then named in its line: Experiment.needs)
        self.start = working_directory()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedray-opening")
        self.tracker = self._pool.submit(Tracker, uri, experiment)
        self.parent: Future[str] | None = None

    @classmethod
    def existing(cls, tracker: Tracker, parent: str | None = None) -> Opening:
        """An opening whose tracker (and parent run, when given) exist already."""
        opening = cls.__new__(cls)
        opening.start = working_directory()
        opening._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedray-opening")
        opening.tracker, opening.parent = Future(), None
        opening.tracker.set_result(tracker)
        if parent is not None:
            opening.adopt(parent)
        return opening

    def adopt(self, parent: str) -> None:
        """The parent run is ``parent``, which exists already (a sweep or run continued)."""
        self.parent = Future()
        self.parent.set_result(parent)

    def open_parent(self, loaded: LoadedScenario, backend: Any, tmp: Path,
                    final_tags: dict[str, str] | None = None) -> None:
        where = run_tags(backend)  # here, while the backend runs (see run_tags)
        params = run_params(backend)
        self.parent = self._pool.submit(
            lambda: open_parent(loaded, where, self.tracker.result(), tmp, final_tags, params))

    def open_child(self, point: RunPoint, key: str, backend: Any, tmp: Path
                   ) -> Future[tuple[Tracker, str]]:
        parent = self.parent
        assert parent is not None, "open_parent first"
        where, params = run_tags(backend), run_params(backend)

        def child() -> tuple[Tracker, str]:
            tracker = self.tracker.result()
            return tracker, open_child(point, key, where, tracker, parent.result(), tmp,
                                       params)

        return self._pool.submit(child)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
