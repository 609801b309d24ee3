"""Tables of a sweep from what MLflow holds: the child runs of an experiment's latest
scenario run, grouped by sweep values, each metric as mean and spread over seeds, and the
differences against a baseline paired by seed.

    fedray table EXPERIMENT --by aggregator.name attack [--metrics M:HOW ...]
                 [--paired aggregator.name=mean] [--pivot KEY] [--format markdown|latex|csv]
                 [--parent RUN_ID] [--tracking-uri URI]

    fedray table EXPERIMENT [--metrics M:HOW ...] [--format ...]   (a search: fedray tune)

(also ``python -m dashboards.tables ...``). On a search (``fedray tune``: the newest parent
run of EXPERIMENT, or ``--parent``, is a search's), without ``--by`` the table has one row
per search (per ``tune.per`` value) at its best setting: the searched values, the score,
the trials, and per ``tune.worst_over`` value the mean ± std over seeds of the metric at the
best trial's points, the worst marked (dashboards/search.py); with ``--by``, the rows are
made of the points of each search's best trial. ``--by`` names params (``clients.per_round``,
``aggregator.name``, ``spectral_gap``) or tags (``meta``, ``preaggregators``, ``attack``,
``topology``); the runs of one row must differ only in their seed (a swept key left out of
``--by`` is named, never merged). ``--metrics`` lists ``metric:how``, how one of ``final``
(the last value), ``lastK`` (the mean of the last K logged values: the last K
evaluations, as papers average them), ``mean`` (over rounds), ``sum``, ``param`` (a
numeric run param such as ``spectral_gap``) or ``time_toX`` (the simulated seconds, the
run's ``sim_time``, at the first step where the metric reaches X: >= X, or <= X for a
metric where lower is better, a name ending in loss, perplexity, error or distance; runs
need a ``speeds:`` block; ``time_to:X`` is short for ``test_accuracy:time_toX``); one metric
may appear with several hows, each its own column, never merged. A ``time_toX`` cell is the
mean ± std over the seeds that reached X and says how many did (``41.200 ± 3.100 (2 of
3 reached; 1 never)``, ``never (0 of 3 reached)``): a seed that never reached X is never
averaged in as a number. By default a run is summarised by its final
``test_accuracy``, the mean over rounds of ``relative_aggregation_error`` and its number of
rounds with ``byzantine_exceeded``.

``--paired KEY=VALUE`` adds, per metric, the difference of each row from the row with
``KEY=VALUE`` and the same other ``--by`` values, computed seed by seed (runs paired by
their seed) and summarised as mean ± std over the pairs; a row's unpaired seeds are left
out and counted, as are pairs with an infinite side (a seed that never reached a
``time_toX`` threshold, a diverged run), which have no finite difference. Pairing removes the variance the seeds share (data split, initial model),
which is why papers compare methods this way.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dashboards.cells import column, histories, number, reach_cell, run_value
from dashboards.formats import csv_text, latex, markdown
from dashboards.search import best_points, find_search, load_search, search_table
from dashboards.stats import Summary, summarize
from simulator.errors import FedrayError, UsageError
from simulator.log import logger, to_stderr
from simulator.metric_names import SIM_TIME, mlflow_name, plain_name
from simulator.run.reductions import TimeTo, parse_how, parse_metrics
from simulator.usage import OneLineParser

DEFAULT: list[tuple[str, str]] = [
    ("test_accuracy", "final"),
    ("relative_aggregation_error", "mean"),
    ("byzantine_exceeded", "sum"),
]


def _value(run: Any, key: str) -> str:
    """A tag (the short form: ``preaggregators`` -> ``nnm``), else a param, of ``run``."""
    if key in run.data.tags:
        return run.data.tags[key]
    return run.data.params.get(key, "?")


SHADOW_RUN = " run "  # a row's sample key: the seed, and a shadow-run attack's run


@dataclass
class Row:
    """A combination of ``--by`` values: its runs' numbers per column, by seed."""

    key: dict[str, str]
    by_seed: dict[str, dict[str, float]] = field(default_factory=dict)  # seed -> column -> value

    def summary(self, col: str) -> Summary:
        return summarize(v[col] for v in self.by_seed.values())


def _children(client: Any, experiment: str, parent_run_id: str | None,
              uri: str) -> list[Any]:
    """The FINISHED children of the scenario run (default: the latest); none is an error
    naming the latest scenario run that has some (a failed last attempt printed an empty
    table)."""
    from simulator.run.tracking import child_runs, latest_scenario_run

    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise ValueError(f"no experiment {experiment!r} in {uri}")
    points = _search_points(client, exp.experiment_id, parent_run_id)
    if points is not None:
        return points
    if parent_run_id is not None:
        children = child_runs(client, exp.experiment_id, parent_run_id, finished=True)
        if not children:
            raise ValueError(f"--parent {parent_run_id}: no FINISHED point of experiment "
                             f"{experiment!r} has this parent run")
        return children
    found = latest_scenario_run(client, exp.experiment_id, True, bool)
    if found is None:
        raise ValueError(f"experiment {experiment!r} has no fedray scenario run")
    latest, children, good = found
    if good is latest:
        return children
    if good is None:
        raise ValueError(f"no scenario run of {experiment!r} has a FINISHED point")
    raise ValueError(f"the latest scenario run of {experiment!r}, {latest.info.run_id} "
                     f"({latest.info.status}), has no FINISHED point; the latest that has: "
                     f"--parent {good.info.run_id}")


def _search_points(client: Any, experiment_id: str, parent_run_id: str | None
                   ) -> list[Any] | None:
    """When the run to show (``parent_run_id``, default: the experiment's newest parent) is
    a search's (``fedray tune``): the FINISHED points of each search's best trial; None
    otherwise."""
    parent = find_search(client, experiment_id, parent_run_id)
    if parent is None:
        return None
    points = best_points(client, load_search(client, parent))
    if not points:
        raise ValueError(f"search run {parent.info.run_id}: no search has a best trial (none "
                         "ran every evaluation)")
    return points


def _check_columns(runs: list[Any], by: Sequence[str], metrics: Sequence[tuple[str, str]],
                   user_metrics: bool) -> None:
    """A ``--by`` key no run has as a tag or param, or a ``--metrics`` metric (param) no run
    logged, is refused naming what there is (they printed a column of ? or nan)."""
    for key in by:
        if not any(key in r.data.tags or key in r.data.params for r in runs):
            params = {k: {r.data.params.get(k) for r in runs}
                      for r in runs for k in r.data.params}
            differ = sorted(k for k, v in params.items() if len(v) > 1 and k not in ("seed", "seeds"))
            tags = sorted({k for r in runs for k in r.data.tags
                           if not k.startswith(("mlflow.", "fedray."))})
            raise ValueError(f"--by {key}: no run has this param or tag; the runs differ in: "
                             f"{', '.join(differ) or 'no param but the seed'} (tags: "
                             f"{', '.join(tags)})")
    if not user_metrics:
        return
    for metric, how in metrics:
        if how == "param":
            if not any(metric in r.data.params for r in runs):
                raise ValueError(f"--metrics {metric}:param: no run has the param {metric}")
        elif not any(mlflow_name(metric) in r.data.metrics for r in runs):
            logged = sorted({plain_name(k) for r in runs for k in r.data.metrics})
            raise ValueError(f"--metrics {metric}: no run logged it; logged: "
                             f"{', '.join(logged)}")
        if isinstance(parse_how(how), TimeTo):
            bare = next((r for r in runs if mlflow_name(SIM_TIME) not in r.data.metrics), None)
            if bare is not None:
                raise ValueError(f"--metrics {metric}:{how}: run {bare.info.run_name} "
                                 f"({bare.info.run_id}) logged no {SIM_TIME} (simulated "
                                 "time); add a speeds: block to its scenario")


def collect_rows(experiment: str, by: Sequence[str], metrics: Sequence[tuple[str, str]],
                 tracking_uri: str | None = None,
                 parent_run_id: str | None = None, user_metrics: bool = True) -> list[Row]:
    """The FINISHED children of ``parent_run_id`` (default: the experiment's most recent
    scenario run) grouped by ``by``, in the order the runs were created; each run summarised
    per ``metrics`` column. ``user_metrics``: the metrics were asked for (each must have been
    logged by some run), not the defaults."""
    from mlflow.tracking import MlflowClient

    from simulator.run.tracking import default_uri, ensure_store

    uri = tracking_uri or default_uri()
    ensure_store(uri)  # a store that cannot be used: one line
    client = MlflowClient(uri)
    rows: dict[tuple[str, ...], Row] = {}
    seen: dict[tuple[tuple[str, ...], str], Any] = {}  # (row, seed) -> its run
    needs = {m for m, h in metrics if h not in ("final", "param")}
    if any(isinstance(parse_how(h), TimeTo) for _, h in metrics):
        needs.add(SIM_TIME)
    runs = _children(client, experiment, parent_run_id, uri)
    _check_columns(runs, by, metrics, user_metrics)
    for run in runs:
        key = tuple(_value(run, k) for k in by)
        row = rows.setdefault(key, Row(dict(zip(by, key))))
        seed = run.data.tags.get("seed") or run.data.params.get("seed") or run.info.run_id
        if "fedray.shadow_run" in run.data.tags:  # a shadow-run attack's runs: each a target
            seed = f"{seed}{SHADOW_RUN}{run.data.tags['fedray.shadow_run']}"
        other = seen.setdefault((key, seed), run)
        if other is not run:
            raise ValueError(_mixed(by, key, seed, other, run))
        hist = histories(client, run, needs)
        row.by_seed[seed] = {column(m, h): run_value(run, m, h, hist) for m, h in metrics}
    return list(rows.values())


def _mixed(by: Sequence[str], key: tuple[str, ...], seed: str, a: Any, b: Any) -> str:
    """Why two runs of one seed fall in one row: the params they differ in (a swept key
    left out of ``--by``), which would otherwise be silently merged."""
    pa, pb = a.data.params, b.data.params
    differ = sorted(k for k in pa.keys() | pb.keys() if pa.get(k) != pb.get(k))
    row = ", ".join(f"{k}={v}" for k, v in zip(by, key))
    if not differ:
        return (f"--by: runs {a.info.run_id} and {b.info.run_id} are the same point ({row}, "
                f"seed {seed}); pass --parent to choose one scenario run")
    shown = ", ".join(f"{k} ({pa.get(k, '-')}, {pb.get(k, '-')})" for k in differ[:3])
    return (f"--by: the row {row} holds two runs of seed {seed} that differ in {shown}"
            f"{' and more' if len(differ) > 3 else ''}; add {differ[0]} to --by")


@dataclass(frozen=True)
class Paired:
    mean: float
    std: float
    n: int  # pairs
    unpaired: int  # this row's seeds without a baseline run of the same seed
    infinite: int = 0  # pairs left out: a side is infinite (never reached X, diverged)


def paired_difference(row: Row, base: Row, col: str) -> Paired:
    """``row - base`` seed by seed for ``col``: mean and std over the pairs whose two values
    are finite. A pair with an infinite side (a ``time_toX`` seed that never reached X, a
    diverged run) has no finite difference: it is left out and counted; a missing value
    (nan) is left out."""
    seeds = [s for s in row.by_seed if s in base.by_seed]
    diffs, infinite = [], 0
    for s in seeds:
        a, b = row.by_seed[s][col], base.by_seed[s][col]
        if math.isnan(a) or math.isnan(b):
            continue
        if math.isinf(a) or math.isinf(b):
            infinite += 1
            continue
        diffs.append(a - b)
    if not diffs:
        return Paired(math.nan, math.nan, 0, len(row.by_seed) - len(seeds), infinite)
    std = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
    return Paired(statistics.fmean(diffs), std, len(diffs), len(row.by_seed) - len(seeds),
                  infinite)


def baseline_of(rows: Sequence[Row], row: Row, key: str, value: str) -> Row | None:
    """The row with ``key = value`` and ``row``'s other keys."""
    want = {**row.key, key: value}
    return next((r for r in rows if r.key == want), None)


def table(rows: Sequence[Row], by: Sequence[str], metrics: Sequence[tuple[str, str]],
          paired: tuple[str, str] | None = None) -> tuple[list[str], list[list[str]]]:
    """(header, cells): the ``by`` keys, seeds, each column as mean ± std, and with
    ``paired`` each column's paired difference from the baseline row. The runs of a
    shadow-run attack (LiRA) are each a sample of their row, as seeds are (``seeds x
    runs``), paired by seed and run."""
    cols = [column(m, h) for m, h in metrics]
    reach = {column(m, h): isinstance(parse_how(h), TimeTo) for m, h in metrics}
    runs = any(SHADOW_RUN in s for r in rows for s in r.by_seed)
    head = [*by, "seeds x runs" if runs else "seeds", *cols]
    if paired:
        head += [f"Δ {c} vs {paired[0]}={paired[1]}" for c in cols]
    body = []
    for r in rows:
        cells = [*(r.key[k] for k in by), str(len(r.by_seed))]
        cells += [_cell(r, c, reach[c]) for c in cols]
        if paired:
            base = baseline_of(rows, r, *paired)
            for c in cols:
                if base is None:
                    cells.append("no baseline")
                elif base is r:
                    cells.append("baseline")
                else:
                    d = paired_difference(r, base, c)
                    why = "never reached" if reach[c] else "not finite"
                    cells.append(number(d.mean, d.std, d.n) + f" ({d.n} pairs"
                                 + (f", {d.unpaired} unpaired" if d.unpaired else "")
                                 + (f"; {d.infinite} left out: {why}" if d.infinite else "")
                                 + ")")
        body.append(cells)
    return head, body


def _cell(row: Row, col: str, reach: bool) -> str:
    """A row's cell: mean ± std over seeds, or for a ``time_toX`` column ``reach_cell``."""
    if reach:
        return reach_cell([v.get(col, math.nan) for v in row.by_seed.values()])
    return number(*row.summary(col)[:3])


def pivot_markdown(rows: Sequence[Row], by: Sequence[str], column_key: str, col: str,
                   reach: bool = False) -> str:
    """One column as a grid: a row per combination of the other ``by`` keys, a column per
    value of ``column_key`` (in order of appearance), cells mean ± std (``reach``: a
    ``time_toX`` column's cells, see ``reach_cell``)."""
    keys = [k for k in by if k != column_key]
    cols = list(dict.fromkeys(r.key[column_key] for r in rows))
    grid: dict[tuple, dict[str, str]] = {}
    for r in rows:
        grid.setdefault(tuple(r.key[k] for k in keys), {})[r.key[column_key]] = \
            _cell(r, col, reach)
    lines = ["| " + " | ".join([*keys, *(f"{column_key}={c}" for c in cols)]) + " |",
             "|" + "---|" * len(keys) + "---:|" * len(cols)]
    for key, cells in grid.items():
        lines.append("| " + " | ".join([*key, *(cells.get(c, "-") for c in cols)]) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="fedray table", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment")
    p.add_argument("--by", nargs="+", default=None,
                   help="params or tags to group runs by (a search's points: those of each "
                   "search's best trial); without it, a search (fedray tune) shows each "
                   "search at its best setting, under each worst_over value")
    p.add_argument("--tracking-uri", default=None)
    p.add_argument("--metrics", nargs="+", default=None, metavar="METRIC:HOW",
                   help="how: final | lastK | mean | sum | param | time_toX: the simulated "
                   "seconds (sim_time; runs need a speeds: block) at the first step where "
                   "METRIC >= X, or <= X for a metric whose name ends in loss, perplexity, "
                   "error or distance; per seed, a seed that never reaches X is counted "
                   "(never), not averaged; time_to:X is test_accuracy:time_toX (default: " +
                   " ".join(f"{m}:{h}" for m, h in DEFAULT) + ")")
    p.add_argument("--paired", default=None, metavar="KEY=VALUE",
                   help="differences from the row with KEY=VALUE, paired by seed")
    p.add_argument("--parent", default=None, help="a scenario run id (default: the latest)")
    p.add_argument("--pivot", default=None, metavar="KEY",
                   help="one of the --by keys to spread over columns (first metric only)")
    p.add_argument("--format", choices=["markdown", "latex", "csv"], default="markdown")
    return p


def _print(head: Sequence[str], body: Sequence[Sequence[str]], keys: int, fmt: str) -> None:
    if fmt == "latex":
        print(latex(head, body, keys))
    elif fmt == "csv":
        print(csv_text(head, body))
    else:
        print(markdown(head, body, keys))


def search_main(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``fedray table`` without ``--by``: the search's best settings (dashboards/search.py);
    a sweep needs ``--by``."""
    if args.paired or args.pivot:
        p.error("--paired and --pivot need --by")
    try:
        metrics = parse_metrics(args.metrics) if args.metrics else None
        found = search_table(args.experiment, metrics, args.tracking_uri, args.parent)
    except (ValueError, FedrayError) as e:
        logger.error("fedray table: %s", e)
        return 2 if isinstance(e, (ValueError, UsageError)) else 1
    if found is None:
        p.error("the following arguments are required for a sweep: --by (only a search, "
                "fedray tune, has a table without it)")
    _, head, body = found
    _print(head, body, 1, args.format)
    return 0


def main(argv: list[str] | None = None) -> int:
    from simulator.run.store_uri import check_command_uri

    p = build_parser()
    args = p.parse_args(argv)
    try:  # the check every command that takes --tracking-uri makes first
        check_command_uri(args.tracking_uri)
    except UsageError as e:
        logger.error("fedray table: %s", e)
        return 2
    if args.by is None:
        return search_main(p, args)
    try:
        metrics = parse_metrics(args.metrics) if args.metrics else list(DEFAULT)
    except ValueError as e:
        p.error(str(e))
    paired = None
    if args.paired:
        key, sep, value = args.paired.partition("=")
        if not sep or key not in args.by:
            p.error(f"--paired: KEY=VALUE with KEY one of the --by keys ({', '.join(args.by)}), "
                    f"got {args.paired!r}")
        paired = (key, value)
    if args.pivot and args.pivot not in args.by:
        p.error(f"--pivot: must be one of the --by keys ({', '.join(args.by)}), got {args.pivot!r}")
    try:
        rows = collect_rows(args.experiment, args.by, metrics, args.tracking_uri, args.parent,
                            user_metrics=bool(args.metrics))
    except (ValueError, FedrayError) as e:  # a store that cannot be used: FedrayError
        logger.error("fedray table: %s", e)
        return 2 if isinstance(e, (ValueError, UsageError)) else 1
    if paired and not any(r.key[paired[0]] == paired[1] for r in rows):
        values = sorted({r.key[paired[0]] for r in rows})
        p.error(f"--paired: no run has {paired[0]}={paired[1]}; values: {', '.join(values)}")
    if args.pivot:
        print(pivot_markdown(rows, args.by, args.pivot, column(*metrics[0]),
                             isinstance(parse_how(metrics[0][1]), TimeTo)))
        return 0
    head, body = table(rows, args.by, metrics, paired)
    _print(head, body, len(args.by), args.format)
    return 0


if __name__ == "__main__":
    with to_stderr():
        raise SystemExit(main())
