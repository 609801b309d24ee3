"""Views of a search (``fedray tune``, simulator/run/tuning.py) from what MLflow holds: per
search (one per value of ``tune.per``, e.g. each aggregator) its best setting, its score,
its trials, and the metric of its best trial's points under each value of
``tune.worst_over`` (e.g. each attack), the worst one marked: "each aggregator at its best
setting under its worst attack". ``fedray table EXPERIMENT`` (without ``--by``) prints it,
``fedray report`` draws the search beside it (the score against each searched key, the ASHA
rungs).

The layout read: the search's parent run (``fedray.kind=tune``, ``fedray.best.<search>`` =
the run id of that search's best trial, the resolved scenario as ``scenario/resolved.yaml``),
a child run per trial (``fedray.kind=trial``, ``fedray.search``, ``fedray.trial_end``, the
searched values as params, ``score`` at each evaluation, ``round`` its round), and a
grandchild per point of a trial (its rounds, as ``fedray run`` logs them). A point's number
is reduced from its history by the code ``fedray table`` reduces a run with
(``dashboards.cells.run_value``: ``final``, ``lastK``, ``mean``, ``time_toX``), then
averaged per seed over the point's other sweep values, and shown as mean ± std over seeds.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dashboards.cells import column, histories, number, reach_cell, run_value
from dashboards.draw import PALETTE, pick_series
from dashboards.stats import Summary, summarize
from simulator.metric_names import SIM_TIME
from simulator.run.reductions import TimeTo, from_mlflow, lower_is_better, parse_how, parse_metrics

KIND = "fedray.kind"
OUTCOMES = ("finished", "stopped by ASHA", "failed", "interrupted", "running")


# ------------------------------------------------------------------ finding a search


def newest_parent(client: Any, experiment_id: str) -> Any | None:
    """The experiment's newest parent run: a sweep's (``fedray.kind=scenario``) or a
    search's (``fedray.kind=tune``); None without either."""
    found = [r for kind in ("scenario", "tune") for r in client.search_runs(
        [experiment_id], f"tags.`{KIND}` = '{kind}'", order_by=["attributes.start_time DESC"],
        max_results=1)]
    return max(found, key=lambda r: r.info.start_time, default=None)


def find_search(client: Any, experiment_id: str, parent_run_id: str | None) -> Any | None:
    """The search parent run to show: ``parent_run_id`` when it is a search's, else (no run
    given) the experiment's newest parent when it is a search's; None otherwise."""
    if parent_run_id is not None:
        try:
            run = client.get_run(parent_run_id)
        except Exception:  # noqa: BLE001 - MLflow raises its own types for a missing run
            return None
    else:
        run = newest_parent(client, experiment_id)
    return run if run is not None and run.data.tags.get(KIND) == "tune" else None


# ------------------------------------------------------------------ what a search holds


@dataclass
class TrialRecord:
    """A trial's child run: its searched values (params, as logged) and scores."""

    run_id: str
    name: str
    search: str
    status: str
    end: str  # fedray.trial_end
    values: dict[str, str]
    scores: list[tuple[int, float]]  # (evaluation, score)
    rounds: list[tuple[int, float]]  # (evaluation, its round)

    @property
    def outcome(self) -> str:
        """finished | stopped by ASHA | failed | interrupted | running."""
        if self.status in ("FINISHED", "FAILED"):
            return self.status.lower()
        if self.status == "KILLED":
            return "stopped by ASHA" if self.end.startswith("stopped by ASHA") else \
                "interrupted"
        return "running"

    @property
    def score(self) -> float:
        """The score at its last evaluation (nan: none)."""
        return self.scores[-1][1] if self.scores else math.nan


@dataclass
class Search:
    """A search's parent run, its resolved scenario and its trials (oldest first)."""

    parent: Any
    scenario: dict[str, Any]
    trials: list[TrialRecord]

    @property
    def tune(self) -> dict[str, Any]:
        return self.scenario.get("tune") or {}

    @property
    def space(self) -> dict[str, dict[str, Any]]:
        return self.tune.get("space") or {}

    @property
    def worst_over(self) -> list[str]:
        return list(self.tune.get("worst_over") or [])

    @property
    def metric(self) -> tuple[str, str]:
        ((metric, how),) = parse_metrics([self.tune.get("metric") or "test_accuracy:final"])
        return metric, how

    @property
    def maximize(self) -> bool:
        mode = self.tune.get("mode")
        return mode == "max" if mode else not lower_is_better(self.metric[0])

    @property
    def labels(self) -> list[str]:
        """The searches, in the order their first trial started (those tagged best but
        without a trial run here last)."""
        tagged = [k.removeprefix("fedray.best.") for k in self.parent.data.tags
                  if k.startswith("fedray.best.")]
        return list(dict.fromkeys([t.search for t in self.trials] + sorted(tagged)))

    def best(self, label: str) -> TrialRecord | None:
        run_id = self.parent.data.tags.get(f"fedray.best.{label}")
        return next((t for t in self.trials if t.run_id == run_id), None)


def resolved_scenario(client: Any, parent: Any) -> dict[str, Any]:
    """The parent's resolved scenario (its ``scenario/resolved.yaml``); without that
    artifact, its ``sweep.*`` and ``tune.*`` params. A run with no ``tune`` block in either
    is refused, naming it."""
    import yaml

    key = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"  # no progress bar on the terminal
    before = os.environ.get(key)
    os.environ[key] = "false"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = client.download_artifacts(parent.info.run_id, "scenario/resolved.yaml", tmp)
            out = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except Exception:  # noqa: BLE001 - no artifact: read the params
        out = {}
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before
    params = parent.data.params
    out.setdefault("sweep", {k.removeprefix("sweep."): yaml.safe_load(v)
                             for k, v in params.items() if k.startswith("sweep.")})
    if not out.get("tune"):
        tune: dict[str, Any] = {}
        for k, v in params.items():
            if k.startswith("tune."):
                _set(tune, k.removeprefix("tune.").split("."), yaml.safe_load(v))
        out["tune"] = tune
    if not out["tune"].get("space"):
        raise ValueError(f"search run {parent.info.run_id}: no tune: block in its "
                         "scenario/resolved.yaml artifact or its params")
    return out


def _set(d: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        d = d.setdefault(part, {})
    d[path[-1]] = value


def _history(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    hist = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
    return [(int(m.step), from_mlflow(m.value)) for m in hist]


def load_search(client: Any, parent: Any) -> Search:
    """The search of ``parent`` (a ``fedray.kind=tune`` run) and its trials."""
    from simulator.run.tracking import child_runs

    scenario = resolved_scenario(client, parent)
    trials = []
    for r in child_runs(client, parent.info.experiment_id, parent.info.run_id):
        if r.data.tags.get(KIND) != "trial":
            continue
        trials.append(TrialRecord(
            r.info.run_id, r.info.run_name, r.data.tags.get("fedray.search", "search"),
            r.info.status, r.data.tags.get("fedray.trial_end", ""),
            {k: v for k, v in r.data.params.items() if not k.startswith("search.")},
            _history(client, r.info.run_id, "score"), _history(client, r.info.run_id, "round")))
    return Search(parent, scenario, trials)


def best_points(client: Any, search: Search) -> list[Any]:
    """The FINISHED points (grandchild runs) of each search's best trial, search by search."""
    from simulator.run.tracking import child_runs

    out = []
    for label in search.labels:
        trial = search.best(label)
        if trial is not None:
            out += child_runs(client, search.parent.info.experiment_id, trial.run_id,
                              finished=True)
    return out


# ------------------------------------------------------------------ conditions (worst_over)


def _same(a: str | None, b: str) -> bool:
    """Two param strings that are one value (``10`` and ``10.0``)."""
    if a == b:
        return True
    try:
        return a is not None and float(a) == float(b)
    except ValueError:
        return False


def _flat(key: str, value: Any) -> dict[str, str]:
    """A sweep key's value as the params a point logs it as (a zipped key ``"a.b, c.d"``:
    each path with its value)."""
    from simulator.run.tracking import flatten

    paths = [p.strip() for p in key.split(",")]
    values = value if len(paths) > 1 and isinstance(value, list) else [value]
    out: dict[str, str] = {}
    for p, v in zip(paths, values):
        out.update(flatten({p: v}))
    return out


def condition(params: dict[str, str], keys: Sequence[str], sweep: dict[str, list]) -> str:
    """The ``worst_over`` values of a point (``sign_flip``, ``gaussian(sigma=10.0)``): of a
    key's sweep values, the one whose params the point logged (the most specific that
    matches); ``""`` without ``worst_over``."""
    from simulator.config.schema import short

    parts = []
    for key in keys:
        best: tuple[int, str] | None = None
        for v in sweep.get(key) or []:
            flat = _flat(key, v)
            if all(_same(params.get(p), x) for p, x in flat.items()) and \
                    (best is None or len(flat) > best[0]):
                best = (len(flat), short(v))
        if best is None:  # not a sweep value (an edited scenario): the params themselves
            own = sorted((p, x) for p, x in params.items() if p == key or p.startswith(key + "."))
            best = (0, ",".join(f"{p}={x}" for p, x in own) or "?")
        parts.append(best[1])
    return ", ".join(parts)


# ------------------------------------------------------------------ the best-setting table


@dataclass
class BestRow:
    """A search at its best trial: per condition (``worst_over`` value), seed and column,
    the number of its points of that seed (mean over the point's other sweep values)."""

    search: str
    trial: TrialRecord | None
    counts: dict[str, int]
    by_cond: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)

    def summary(self, cond: str, col: str) -> Summary:
        return summarize(v[col] for v in self.by_cond.get(cond, {}).values())

    def values(self, cond: str, col: str) -> list[float]:
        return [v[col] for v in self.by_cond.get(cond, {}).values()]


def _cells(client: Any, search: Search, trial: TrialRecord, metrics: Sequence[tuple[str, str]]
           ) -> dict[str, dict[str, dict[str, float]]]:
    """Condition -> seed -> column -> the mean over the points of that seed and condition."""
    from simulator.run.tracking import child_runs

    needs = {m for m, h in metrics if h not in ("final", "param")}
    if any(isinstance(parse_how(h), TimeTo) for _, h in metrics):
        needs.add(SIM_TIME)
    acc: dict[str, dict[str, dict[str, list[float]]]] = {}
    for run in child_runs(client, search.parent.info.experiment_id, trial.run_id,
                          finished=True):
        cond = condition(run.data.params, search.worst_over, search.scenario.get("sweep") or {})
        seed = run.data.tags.get("seed") or run.data.params.get("seed") or run.info.run_id
        hist = histories(client, run, needs)
        cell = acc.setdefault(cond, {}).setdefault(seed, {})
        for m, h in metrics:
            cell.setdefault(column(m, h), []).append(run_value(run, m, h, hist))
    return {c: {s: {col: statistics.fmean(v) for col, v in cols.items()}
                for s, cols in seeds.items()} for c, seeds in acc.items()}


def best_rows(client: Any, search: Search, metrics: Sequence[tuple[str, str]] | None = None
              ) -> list[BestRow]:
    """Per search, its best trial's numbers (``metrics``: the search's metric first, then
    these), and how its trials ended."""
    cols = [search.metric, *(m for m in metrics or [] if m != search.metric)]
    out = []
    for label in search.labels:
        counts = {o: 0 for o in OUTCOMES}
        for t in search.trials:
            if t.search == label:
                counts[t.outcome] += 1
        trial = search.best(label)
        row = BestRow(label, trial, counts)
        if trial is not None:
            row.by_cond = _cells(client, search, trial, cols)
        out.append(row)
    return out


def conditions(rows: Sequence[BestRow]) -> list[str]:
    return list(dict.fromkeys(c for r in rows for c in r.by_cond))


def worst(row: BestRow, search: Search) -> str | None:
    """The condition whose mean (of the search's metric) is the worst at this row's best
    setting (a condition with no number, or a diverged one, is the worst there is)."""
    col = column(*search.metric)
    if not row.by_cond:
        return None

    def badness(cond: str) -> float:
        m = row.summary(cond, col).mean
        if math.isnan(m):
            return math.inf
        return -m if search.maximize else m

    return max(row.by_cond, key=badness)


def _searched(value: str | None) -> str:
    """A searched value as a cell: floats to 4 significant digits (the params keep all)."""
    if value is None:
        return "-"
    try:
        f = float(value)
    except ValueError:
        return value
    return f"{f:.4g}" if any(c in value for c in ".eE") else value


def _trials_cell(counts: dict[str, int]) -> str:
    n = sum(counts.values())
    parts = [f"{counts[o]} {o}" for o in OUTCOMES[:3]]
    parts += [f"{counts[o]} {o}" for o in OUTCOMES[3:] if counts[o]]
    return f"{n} ({', '.join(parts)})"


def score_head(search: Search) -> str:
    metric, how = search.metric
    over = (f"worst over {', '.join(search.worst_over)} of the mean over seeds"
            if search.worst_over else "mean over points")
    return f"score ({metric} {how}; {over})"


def best_table(search: Search, rows: Sequence[BestRow],
               metrics: Sequence[tuple[str, str]] | None = None
               ) -> tuple[list[str], list[list[str]]]:
    """(header, cells): per search its best values, score, trials, and per condition the
    mean ± std over seeds of each metric (the worst condition marked ``(worst)``)."""
    cols = [column(*search.metric)] + [column(*m) for m in metrics or []
                                        if m != search.metric]
    conds = conditions(rows)
    keys = list(search.space)
    head = ["search", *keys, score_head(search), "trials"]
    head += [f"{c} @ {cond}" if cond else c for c in cols for cond in conds]
    if search.worst_over:
        head.append(f"worst {', '.join(search.worst_over)}")
    body = [_best_cells(search, r, keys, cols, conds) for r in rows]
    return head, body


def _best_cells(search: Search, row: BestRow, keys: list[str], cols: list[str],
                conds: list[str]) -> list[str]:
    t = row.trial
    if t is None:
        return [row.search, *("-" for _ in keys), "no trial ran every evaluation",
                _trials_cell(row.counts), *("-" for _ in cols for _ in conds),
                *(["-"] if search.worst_over else [])]
    bad = worst(row, search)
    cells = [row.search, *(_searched(t.values.get(k)) for k in keys), f"{t.score:.4g}",
             _trials_cell(row.counts)]
    for i, col in enumerate(cols):
        for cond in conds:
            if "simulated s to" in col:
                text = reach_cell(row.values(cond, col))
            else:
                s = row.summary(cond, col)
                text = number(s.mean, s.std, s.n)
            mark = i == 0 and cond == bad and len(conds) > 1
            cells.append(text + (" (worst)" if mark else ""))
    if search.worst_over:
        cells.append(bad or "-")
    return cells


def search_table(experiment: str, metrics: Sequence[tuple[str, str]] | None = None,
                 tracking_uri: str | None = None, parent_run_id: str | None = None
                 ) -> tuple[Search, list[str], list[list[str]]] | None:
    """The best-setting table of the search to show (``find_search``); None when the run
    to show is not a search's."""
    from mlflow.tracking import MlflowClient

    from simulator.run.tracking import default_uri, ensure_store

    uri = tracking_uri or default_uri()
    ensure_store(uri)
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise ValueError(f"no experiment {experiment!r} in {uri}")
    parent = find_search(client, exp.experiment_id, parent_run_id)
    if parent is None:
        return None
    search = load_search(client, parent)
    head, body = best_table(search, best_rows(client, search, metrics), metrics)
    return search, head, body


# ------------------------------------------------------------------ the report's section


def _numeric(values: Sequence[str | None]) -> list[float] | None:
    try:
        return [float(v) if v is not None else math.nan for v in values]
    except ValueError:
        return None


def _scatter(search: Search, label: str, key: str) -> tuple[list[dict], str] | None:
    """The score of each trial of a search against ``key``: a series per outcome (markers
    only), and the x label (a choice key's values by index)."""
    trials = [t for t in search.trials if t.search == label and math.isfinite(t.score)]
    raw = [t.values.get(key) for t in trials]
    xs = _numeric(raw)
    x_label = key
    if xs is None:  # a choice of names: by index
        names = list(dict.fromkeys(str(v) for v in raw))
        xs = [float(names.index(str(v))) for v in raw]
        x_label = f"{key} ({', '.join(f'{i} = {n}' for i, n in enumerate(names))})"
    series = []
    for i, outcome in enumerate(OUTCOMES):
        pts = [(x, t.score) for x, t in zip(xs, trials) if t.outcome == outcome]
        if pts:
            series.append({"label": f"{outcome} ({len(pts)})", "x": [p[0] for p in pts],
                           "mean": [p[1] for p in pts], "scatter": True,
                           "color": PALETTE[i % len(PALETTE)]})
    return (series, x_label) if series else None


def _rungs(search: Search, label: str) -> list[dict]:
    """Each trial's score at each evaluation: a line that ends where ASHA stopped it."""
    best = search.best(label)
    out = []
    for t in search.trials:
        if t.search == label and t.scores:
            mark = ", best" if t is best else ""
            out.append({"label": f"{t.name} ({t.outcome}{mark})", "markers": True,
                        "x": [s for s, _ in t.scores], "mean": [v for _, v in t.scores]})
    return out


def _evaluation_rounds(search: Search) -> str:
    rounds = sorted({int(r) for t in search.trials for _, r in t.rounds})
    return f"evaluation (at rounds {', '.join(map(str, rounds))})" if rounds else "evaluation"


def search_section(page: Any, search: Search, head: list[str], body: list[list[str]]
                   ) -> list[str]:
    """The report's section of a search: the best-setting table, and per search (``per``
    value) the score of each trial against each searched key (a log axis for a key
    searched log-uniformly) and the ASHA rungs (score against evaluation)."""
    import html

    metric, how = search.metric
    out = ["<h2>Search</h2>",
           ('<p class="note">' + html.escape(
               f"fedray tune: {len(search.trials)} trial(s) over "
               f"{', '.join(search.space)}; the score is {metric} ({how}) of each point, "
               + (f"the worst over {', '.join(search.worst_over)} of the mean over the rest"
                  if search.worst_over else "the mean over the points")
               + f", to {'maximize' if search.maximize else 'minimize'}. The best setting of "
               "each search is its best trial among those that ran every evaluation; a "
               "trial ASHA stopped early shows its score at its last evaluation.") + "</p>"),
           "<h3>Best setting of each search</h3>", page.table(head, body, "search-best")]
    for label in search.labels:
        charts = []
        for key, dist in search.space.items():
            found = _scatter(search, label, key)
            if found is not None:
                charts.append(page.chart(f"{label}: score against {key}", found[0], found[1],
                                         "score", log_x="log_uniform" in dist))
        series, note = pick_series(_rungs(search, label))
        if series:
            charts.append(page.chart(f"{label}: ASHA rungs, each trial's score at each "
                                     "evaluation (a line ends where its trial stopped)",
                                     series, _evaluation_rounds(search), "score", note))
        if charts:
            out += [f"<h3>{html.escape(label)}</h3>", *charts]
    return out
