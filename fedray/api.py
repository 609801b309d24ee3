"""fedray from Python: load a scenario, run it, and read what its runs logged, as pandas
DataFrames and torch modules (docs/python.md).

The same code paths as the commands: :func:`load` is ``fedray validate``'s (the same one-line
problems, raised as one :class:`ScenarioError` carrying them all), :func:`run` is ``fedray
run``'s (``simulator.run.runner.run_loaded``), :func:`sweep` ``fedray sweep``'s,
:func:`resume` ``fedray resume``'s, :func:`tune` ``fedray tune``'s; :func:`results` reads any experiment in MLflow, finished
by a command or by a program, into the same :class:`Results` that :func:`run` returns.

A plugin defined in a script or a notebook registers with :func:`register` and is then
named in a scenario as an installed one is; it runs on the inline and the Ray backend alike
(the run's actors receive it with the run's plan).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from simulator import registry
from simulator.config.errors import ScenarioError
from simulator.config.load import LoadedScenario, load_text
from simulator.config.load import load as load_file
from simulator.errors import UsageError

if TYPE_CHECKING:
    import pandas as pd
    import torch

__all__ = ["Results", "RunRecord", "ScenarioError", "Search", "load", "register", "results",
           "resume", "run", "sweep", "tune"]

T = TypeVar("T", bound=type)
Source = str | Path | Mapping[str, Any] | LoadedScenario
Overrides = Mapping[str, Any] | Sequence[str] | None


def _override_items(overrides: Overrides) -> list[str]:
    """``--set`` items from a mapping of dotted paths to values (each written as YAML), or
    the items as given."""
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    if isinstance(overrides, str):
        return [overrides]
    return list(overrides)


def load(source: Source, overrides: Overrides = None, *, name: str | None = None
         ) -> LoadedScenario:
    """A validated scenario and its run points (every sweep point x seed).

    ``source``: a scenario file's path, a mapping (a scenario as a dict), or YAML text (a
    string that is not a file's path); a loaded scenario is returned as it is (with
    ``overrides``: loaded again with them). ``overrides``: dotted paths and values
    (``{"rounds": 5, "aggregator.name": "median"}``) or ``KEY=VALUE`` strings, as ``--set``
    takes them. ``name``: the experiment's name for a mapping or text without one (default
    ``scenario``). Relative paths in a file are relative to its folder; in a mapping or text,
    to the working directory.

    Raises :class:`ScenarioError` carrying every problem (``.lines``: one line each, as the
    commands print them, naming the file, ``<mapping>`` or ``<text>:LINE``) before anything
    runs.
    """
    items = _override_items(overrides)
    if isinstance(source, LoadedScenario):
        if not items:
            return source
        return load_text(source.text, source.path, items)
    if isinstance(source, Mapping):
        text = yaml.safe_dump(dict(source), sort_keys=False)
        return load_text(text, Path.cwd() / f"{name or 'scenario'}.yaml", items,
                         "<mapping>", lines=False)
    path = Path(source)
    if isinstance(source, Path) or ("\n" not in source and path.suffix in (".yaml", ".yml")):
        return load_file(path, items)
    if path.is_file():
        return load_file(path, items)
    return load_text(str(source), Path.cwd() / f"{name or 'scenario'}.yaml", items, "<text>")


@dataclass(frozen=True)
class RunRecord:
    """One point run: its MLflow ``run_id`` and ``name``, its sweep ``values`` (dotted path
    -> value; {} without a sweep), its ``seed`` and its MLflow ``status``."""

    run_id: str
    name: str
    values: dict[str, Any]
    seed: int
    status: str = "FINISHED"


@dataclass
class Results:
    """An experiment's point runs in MLflow, as DataFrames and models.

    ``experiment``: its name; ``tracking_uri``: where it is; ``parent_run_id``: the scenario
    run its points belong to; ``runs``: each point run (:class:`RunRecord`, in the order they
    were created). The data is read from MLflow when asked for (``metrics.parquet`` and
    ``model/model.pt`` of each run), so a :class:`Results` of a large experiment costs
    nothing until then."""

    experiment: str
    tracking_uri: str
    parent_run_id: str | None
    runs: list[RunRecord] = field(default_factory=list)
    _client: Any = field(default=None, repr=False, compare=False)

    @property
    def run_ids(self) -> list[str]:
        """The MLflow run id of each point run, in ``runs``' order."""
        return [r.run_id for r in self.runs]

    @property
    def client(self) -> Any:
        """The MLflow client of ``tracking_uri``."""
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(self.tracking_uri)
        return self._client

    def _keys(self) -> list[str]:
        """The sweep paths of the runs, in first appearance."""
        return list(dict.fromkeys(k for r in self.runs for k in r.values))

    def metrics(self) -> pd.DataFrame:
        """Every round's metrics of every run, in long form: one row per run, round and
        metric, columns the sweep paths, ``seed``, ``run_id``, ``round`` (0-based, MLflow's
        step) and ``metric`` (fedray's plain names: ``test_accuracy``, ``epsilon``), ``value``
        (NaN where a round did not measure a metric are left out)."""
        import pandas as pd
        import pyarrow.parquet as pq

        frames = []
        keys = self._keys()
        columns = [*keys, "seed", "run_id", "round", "metric", "value"]
        for r in self.runs:  # in the runs' order, each by round, then metric
            path = self.client.download_artifacts(r.run_id, "metrics.parquet")
            wide = pq.read_table(path).to_pandas()
            long = wide.melt(id_vars="round", var_name="metric", value_name="value")
            long = long[long["value"].notna()].sort_values(["round", "metric"], kind="stable")
            frames.append(long.assign(**{k: [r.values.get(k)] * len(long) for k in keys},
                                      seed=r.seed, run_id=r.run_id)[columns])
        if not frames:
            return pd.DataFrame(columns=columns)
        return pd.concat(frames, ignore_index=True)

    def final(self) -> pd.DataFrame:
        """Each run's final value of every metric (its last logged round's), one row per run:
        the sweep paths, ``seed``, ``run_id``, then a column per metric (plain names)."""
        import pandas as pd

        from simulator.metric_names import plain_name
        from simulator.run.reductions import from_mlflow

        rows = []
        for r in self.runs:
            logged = self.client.get_run(r.run_id).data.metrics
            rows.append({**r.values, "seed": r.seed, "run_id": r.run_id,
                         **{plain_name(k): from_mlflow(v) for k, v in sorted(logged.items())}})
        return pd.DataFrame(rows)

    def model(self, run: str | int | None = None) -> torch.nn.Module:
        """The final model of a run (its id, its index in ``runs``, or None for the only
        run), built from its scenario and ``model/model.pt``, in eval mode on the CPU."""
        import torch

        from simulator.models import build_model

        record = self._record(run)
        sc = _logged_scenario(self.client, record.run_id)
        info = _model_info(sc)
        model = build_model(sc.model, info[0], info[1], sc.seeds[0], info[2])
        state = torch.load(self.client.download_artifacts(record.run_id, "model/model.pt"),
                           map_location="cpu", weights_only=True)
        model.load_state_dict(state)
        return model.eval()

    def _record(self, run: str | int | None) -> RunRecord:
        if run is None:
            if len(self.runs) != 1:
                raise UsageError(f"{self.experiment}: {len(self.runs)} runs; name one (an "
                                 "index into runs, or a run id)")
            return self.runs[0]
        if isinstance(run, int):
            if not -len(self.runs) <= run < len(self.runs):
                raise UsageError(f"{self.experiment}: no run {run}; it has {len(self.runs)}")
            return self.runs[run]
        found = [r for r in self.runs if r.run_id == run]
        if not found:
            raise UsageError(f"{self.experiment}: no run {run!r} among its {len(self.runs)}")
        return found[0]

    def table(self, by: Sequence[str] = (), metrics: Sequence[str] = ("test_accuracy:final",)
              ) -> pd.DataFrame:
        """``fedray table``'s numbers as a DataFrame: one row per value of the ``by`` keys
        (params, as ``--by`` takes them), each ``metrics`` column (``METRIC:HOW``: final,
        lastK, mean, min, max, sum, time_toX) as its mean, standard deviation and the number
        of seeds (x runs) it is over."""
        import pandas as pd

        from dashboards.cells import column
        from dashboards.tables import collect_rows
        from simulator.run.reductions import parse_metrics

        try:
            wanted = parse_metrics(list(metrics))
        except ValueError as e:
            raise UsageError(str(e)) from None
        rows = collect_rows(self.experiment, list(by), wanted, self.tracking_uri,
                            self.parent_run_id)
        out = []
        for row in rows:
            cells: dict[str, Any] = dict(row.key)
            cells["n"] = len(row.by_seed)
            for m, how in wanted:
                s = row.summary(column(m, how))
                cells[f"{column(m, how)} mean"] = s.mean
                cells[f"{column(m, how)} std"] = s.std if s.n > 1 else math.nan
            out.append(cells)
        return pd.DataFrame(out)


    def figures(self) -> list[Any]:
        """The figures ``fedray report`` draws of these runs (accuracy and loss curves,
        robustness heat maps, privacy curves, ...) as matplotlib figures, each with its
        title, the very figures of the report's page and files: in a notebook
        ``display(fig)`` (or a cell ending in one) shows it inline."""
        from dashboards.export import Exports
        from dashboards.report import collect, render

        title, _, runs = collect(str(self.parent_run_id), self.tracking_uri)
        exports = Exports()
        render(title, runs, exports)
        _inline_display()
        return [drawing.figure for drawing in exports.figures]

    def report(self, out: str | Path | None = None) -> Path:
        """``fedray report`` of these runs: the HTML file (``out``, default
        ``./fedray-report/EXPERIMENT``), its figures as PDF/SVG and tables beside it."""
        from dashboards.report import build_report

        folder = Path(out) if out is not None else Path("fedray-report") / self.experiment
        return build_report(str(self.parent_run_id), folder, self.tracking_uri)


def _inline_display() -> None:
    """In a Jupyter kernel, a matplotlib figure shows as a PNG where it is displayed. The
    report's figures are made without pyplot, so no backend has set that up; a session that
    displays figures already (``%matplotlib inline``, a pyplot figure, its own formats) is
    left as it is."""
    from matplotlib.figure import Figure

    from simulator.run.progress import in_notebook

    if not in_notebook():
        return
    from IPython import get_ipython
    from IPython.core.pylabtools import select_figure_formats

    shell = get_ipython()
    formatters = shell.display_formatter.formatters
    if not any(Figure in formatters[m].type_printers for m in
               ("image/png", "image/svg+xml", "image/jpeg", "application/pdf")):
        select_figure_formats(shell, {"png"})


def _logged_scenario(client: Any, run_id: str) -> Any:
    """The resolved single-point scenario a run logged (``scenario.yaml``)."""
    from simulator.config.schema import Scenario

    text = Path(client.download_artifacts(run_id, "scenario.yaml")).read_text()
    return Scenario.model_validate(yaml.safe_load(text))


def _model_info(sc: Any) -> tuple[tuple[int, ...], int, int | None]:
    """(input shape, classes, vocabulary) of a scenario's model: from its data set's
    description, or, for one that cannot say before loading, from the loaded data."""
    from simulator.config.data_load import dataset_info

    info = dataset_info(sc)
    if info is not None:
        return tuple(info.input_shape), info.num_classes, info.vocabulary
    from simulator.sim.engine import load_data

    data = load_data(sc)
    return tuple(data.input_shape), data.num_classes, data.vocabulary


def _of(out: Any, loaded: LoadedScenario | None) -> Results:
    """The Results of a command's ExperimentResult (its finished and skipped runs: those
    of its parent)."""
    uri = out.tracking_uri
    if out.parent_run_id is None:
        raise UsageError("the command ran nothing")
    name = loaded.scenario.name if loaded is not None else None
    return results(name, uri, out.parent_run_id)


def run(scenario: Source, overrides: Overrides = None, *, backend: str | None = None,
        workers: int | None = None, address: str | None = None,
        tracking_uri: str | None = None, progress: bool = False) -> Results:
    """Run every point of a scenario (``fedray run``: one after another, on the inline or the
    Ray backend, ``backend`` ``inline``, ``ray`` or None: the scenario's ``runtime.backend``),
    tracked in MLflow at ``tracking_uri`` (default: ``$MLFLOW_TRACKING_URI`` or
    ``sqlite:///./mlflow.db``); ``address``: a Ray cluster's. ``progress``: a bar per
    point (tqdm: a widget in a notebook, a bar on a terminal, plain lines elsewhere).
    Returns the runs' :class:`Results`."""
    from simulator.run.runner import run_loaded
    from simulator.run.store_uri import check_command_uri

    loaded = load(scenario, overrides)
    check_command_uri(tracking_uri)
    out = run_loaded(loaded, backend, address, tracking_uri, False, workers,
                     progress=progress)
    return _of(out, loaded)


def sweep(scenario: Source, overrides: Overrides = None, *, parallel: int | None = None,
          address: str | None = None, tracking_uri: str | None = None,
          fresh: bool = False) -> Results:
    """Run a scenario's points several at a time (``fedray sweep``: each point a Ray task,
    at most ``parallel`` at once); a sweep of the same scenario run before goes on where it
    stopped unless ``fresh``. Returns the sweep's :class:`Results` (its finished points,
    those of an earlier call included)."""
    from simulator.run.runner import run_sweep
    from simulator.run.store_uri import check_command_uri

    loaded = load(scenario, overrides)
    check_command_uri(tracking_uri)
    out = run_sweep(loaded, address, tracking_uri, parallel, fresh)
    return _of(out, loaded)


@dataclass
class Search:
    """A finished search (``fedray tune``): its experiment, ``tracking_uri``, the search's
    MLflow run (``parent_run_id``: its trials are its children, each trial's point runs
    theirs) and ``best``, each search's best trial (``search``, ``score``, ``values``: the
    searched keys' values as MLflow holds them, text; ``run_id``: the trial's run,
    ``trials``: how many ran every round)."""

    experiment: str
    tracking_uri: str
    parent_run_id: str
    best: list[dict[str, Any]] = field(default_factory=list)

    def table(self) -> pd.DataFrame:
        """``best`` as a DataFrame: a row per search, the searched keys as columns."""
        import pandas as pd

        return pd.DataFrame([{"search": b["search"], "score": b["score"],
                              **{k: _param_value(v) for k, v in b["values"].items()},
                              "trials": b["trials"], "run_id": b["run_id"]}
                             for b in self.best])

    def trial(self, run_id: str | None = None) -> Results:
        """A trial's point runs as :class:`Results` (default: the first search's best)."""
        if run_id is None:
            if not self.best:
                raise UsageError(f"{self.experiment}: no trial ran every round")
            run_id = str(self.best[0]["run_id"])
        return results(self.experiment, self.tracking_uri, parent_run_id=run_id)


def tune(scenario: Source, overrides: Overrides = None, *, address: str | None = None,
         tracking_uri: str | None = None, fresh: bool = False) -> Search:
    """Search the scenario's ``tune:`` space on Ray Tune (``fedray tune``: each trial runs
    the scenario's points with one setting of the searched keys, scored by ``tune.metric``);
    the last search of the same scenario goes on where it stopped unless ``fresh``."""
    from simulator.run.store_uri import check_command_uri
    from simulator.run.tuning import run_tune

    loaded = load(scenario, overrides)
    if loaded.scenario.tune is None:
        raise UsageError(f"{loaded.scenario.name}: tune: this scenario has no tune block (the "
                         "keys to search and how to score a trial; docs/tuning.md)")
    check_command_uri(tracking_uri)
    out = run_tune(loaded, address, tracking_uri, fresh)
    return Search(loaded.scenario.name, out.tracking_uri, str(out.parent_run_id), out.best)


def resume(run_id: str, *, tracking_uri: str | None = None, backend: str | None = None,
           workers: int | None = None, address: str | None = None,
           progress: bool = False) -> Results:
    """Continue an interrupted run from its last checkpoint, in the same MLflow runs, then
    the unfinished points of its scenario run (``fedray resume``)."""
    from simulator.run.resume import resume_run
    from simulator.run.store_uri import check_command_uri

    check_command_uri(tracking_uri)
    out = resume_run(run_id, tracking_uri, backend, address, False, workers,
                     progress=progress)
    return _of(out, None)


def results(experiment: str | None, tracking_uri: str | None = None,
            parent_run_id: str | None = None) -> Results:
    """An experiment's point runs from MLflow: those of its latest scenario run (or of the
    scenario run ``parent_run_id``), FINISHED or not, in the order they were created."""
    from mlflow.tracking import MlflowClient

    from simulator.run.tracking import (
        child_runs,
        default_uri,
        ensure_store,
        latest_scenario_run,
        require_store,
    )

    uri = tracking_uri or default_uri()
    require_store(uri, f"experiment {experiment!r}")
    ensure_store(uri)
    client = MlflowClient(uri)
    if parent_run_id is not None:
        parent = client.get_run(parent_run_id)
        children = child_runs(client, parent.info.experiment_id, parent_run_id)
        experiment = experiment or client.get_experiment(parent.info.experiment_id).name
    else:
        exp = client.get_experiment_by_name(str(experiment))
        found = None if exp is None else latest_scenario_run(client, exp.experiment_id, False,
                                                             lambda runs: True)
        if found is None:
            raise UsageError(f"experiment {experiment!r}: no fedray scenario run in {uri}")
        parent, children, _ = found
        parent_run_id = str(parent.info.run_id)
    paths = [part for k in client.get_run(parent_run_id).data.params
             if k.startswith("sweep.") for part in k.removeprefix("sweep.").split(" / ")]
    records = [RunRecord(c.info.run_id, c.info.run_name, _values(c, paths), int(c.data.tags.get(
        "seed", c.data.params.get("seed", 0))), c.info.status) for c in children]
    return Results(str(experiment), uri, parent_run_id, records, client)


def _values(run: Any, paths: Sequence[str]) -> dict[str, Any]:
    """A point run's values of the sweep ``paths``, read back from its params (the resolved
    scenario, flattened: a block's keys under its path, lists as JSON)."""
    params = run.data.params
    out: dict[str, Any] = {}
    for path in paths:
        if path in params:
            out[path] = _param_value(params[path])
            continue
        block: dict[str, Any] = {}
        for k, v in params.items():
            if k.startswith(path + "."):
                cur = block
                *head, last = k[len(path) + 1:].split(".")
                for part in head:
                    cur = cur.setdefault(part, {})
                cur[last] = _param_value(v)
        out[path] = block or None
    return out


def _param_value(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def register(kind: str, name: str | None = None) -> Callable[[T], T]:
    """A class decorator: ``@fedray.register("aggregators", "my_rule")`` registers the class
    as plugin ``my_rule`` of its kind for this session (default name: the class's, in
    snake case), checked against the kind's contract as an installed plugin is
    (``strategies.protocols``); a scenario then names it. Runs on Ray receive it with their
    plan (a class defined in ``__main__``, a script or a notebook, travels by value)."""
    def decorate(cls: T) -> T:
        registry.register(kind, name or _snake(cls.__name__), cls)
        return cls
    return decorate


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower()
                   for i, c in enumerate(name))
