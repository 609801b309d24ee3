"""Tables of a sweep from what MLflow holds: the child runs of an experiment's latest
scenario run, grouped by sweep values, each metric as mean and spread over seeds.

    python -m dashboards.tables EXPERIMENT --by clients.per_round [--metrics M:HOW ...]
                                [--tracking-uri URI]

``--by`` names params (``clients.per_round``, ``aggregator.name``, ``spectral_gap``) or tags
(``meta``, ``preaggregators``, ``attack``, ``topology``). ``--metrics`` lists ``metric:how``
with how one of ``final`` (the last value), ``mean`` (over rounds), ``sum`` or ``param`` (a
numeric run param such as ``spectral_gap``); by default a
run is summarised by its final ``test_accuracy``, the mean over rounds of
``relative_aggregation_error`` and its number of rounds with ``byzantine_exceeded``.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from typing import Any

from dashboards.stats import from_mlflow, summarize

SUMMARIES: dict[str, str] = {
    "test_accuracy": "final",
    "relative_aggregation_error": "mean",
    "byzantine_exceeded": "sum",
}


def _value(run: Any, key: str) -> str:
    """A tag (the short form: ``preaggregators`` -> ``nnm``), else a param, of ``run``."""
    if key in run.data.tags:
        return run.data.tags[key]
    return run.data.params.get(key, "?")


def _summary(client: Any, run: Any, metric: str, how: str) -> float:
    if how == "param":
        try:
            return float(run.data.params.get(metric, "nan"))
        except ValueError:
            return math.nan
    if how == "final":
        return from_mlflow(float(run.data.metrics.get(metric, math.nan)))
    values = [from_mlflow(m.value) for m in client.get_metric_history(run.info.run_id, metric)]
    if not values:
        return math.nan
    return float(sum(values) if how == "sum" else statistics.fmean(values))


def sweep_table(experiment: str, by: Sequence[str], tracking_uri: str | None = None,
                parent_run_id: str | None = None,
                summaries: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One row per combination of ``by`` values: ``{key: value, ..., "seeds": k,
    metric: (mean, std), ...}`` over the FINISHED children of ``parent_run_id`` (default: the
    experiment's most recent scenario run), in the order the runs were created."""
    from mlflow.tracking import MlflowClient

    from simulator.tracking import default_uri

    client = MlflowClient(tracking_uri or default_uri())
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise SystemExit(f"no experiment {experiment!r} in {tracking_uri or default_uri()}")
    if parent_run_id is None:
        parents = client.search_runs([exp.experiment_id], "tags.`fedray.kind` = 'scenario'",
                                     order_by=["attributes.start_time DESC"], max_results=1)
        if not parents:
            raise SystemExit(f"experiment {experiment!r} has no fedray scenario run")
        parent_run_id = parents[0].info.run_id
    children = client.search_runs(
        [exp.experiment_id], f"tags.mlflow.parentRunId = '{parent_run_id}' and "
        "attributes.status = 'FINISHED'", order_by=["attributes.start_time ASC"],
        max_results=50_000)
    summaries = summaries or SUMMARIES
    groups: dict[tuple[str, ...], list[dict[str, float]]] = {}
    for run in children:
        key = tuple(_value(run, k) for k in by)
        groups.setdefault(key, []).append(
            {m: _summary(client, run, m, how) for m, how in summaries.items()})
    rows = []
    for key, runs in groups.items():
        row: dict[str, Any] = dict(zip(by, key))
        row["seeds"] = len(runs)
        for m in summaries:
            s = summarize(r[m] for r in runs)
            row[m] = (s.mean, s.std)
        rows.append(row)
    return rows


def _cell(mean: float, std: float) -> str:
    if abs(mean) >= 1e4 or (0 < abs(mean) < 1e-3):
        return f"{mean:.3g} ± {std:.2g}"
    return f"{mean:.3f} ± {std:.3f}"


def markdown(rows: list[dict[str, Any]], by: Sequence[str],
             summaries: dict[str, str] | None = None) -> str:
    """The rows as a Markdown table: a column per ``by`` key and per metric (mean ± std)."""
    metrics = list(summaries or SUMMARIES)
    head = [*by, "seeds", *(f"{m} ({(summaries or SUMMARIES)[m]})" for m in metrics)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(by) + "---:|" * (1 + len(metrics))]
    for r in rows:
        cells = [*(str(r[k]) for k in by), str(r["seeds"]), *(_cell(*r[m]) for m in metrics)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pivot_markdown(rows: list[dict[str, Any]], by: Sequence[str], column: str, metric: str) -> str:
    """One metric as a grid: a row per combination of the other ``by`` keys, a column per
    value of ``column`` (in order of appearance), cells mean ± std."""
    keys = [k for k in by if k != column]
    cols = list(dict.fromkeys(r[column] for r in rows))
    grid: dict[tuple, dict[str, str]] = {}
    for r in rows:
        grid.setdefault(tuple(r[k] for k in keys), {})[r[column]] = _cell(*r[metric])
    lines = ["| " + " | ".join([*keys, *(f"{column}={c}" for c in cols)]) + " |",
             "|" + "---|" * len(keys) + "---:|" * len(cols)]
    for key, cells in grid.items():
        lines.append("| " + " | ".join([*key, *(cells.get(c, "-") for c in cols)]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dashboards.tables", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment")
    p.add_argument("--by", nargs="+", required=True, help="params or tags to group runs by")
    p.add_argument("--tracking-uri", default=None)
    p.add_argument("--metrics", nargs="+", default=None, metavar="METRIC:HOW",
                   help="how: final | mean | sum | param (default: " +
                   " ".join(f"{m}:{h}" for m, h in SUMMARIES.items()) + ")")
    p.add_argument("--parent", default=None, help="a scenario run id (default: the latest)")
    p.add_argument("--pivot", default=None, metavar="KEY",
                   help="one of the --by keys to spread over columns (first metric only)")
    args = p.parse_args(argv)
    summaries = None
    if args.metrics:
        summaries = {}
        for item in args.metrics:
            metric, _, how = item.partition(":")
            if how not in ("final", "mean", "sum", "param"):
                p.error(f"--metrics {item}: how must be one of final, mean, sum, param")
            summaries[metric] = how
    rows = sweep_table(args.experiment, args.by, args.tracking_uri, args.parent, summaries)
    if args.pivot:
        if args.pivot not in args.by:
            p.error(f"--pivot: must be one of the --by keys ({', '.join(args.by)}), got {args.pivot!r}")
        print(pivot_markdown(rows, args.by, args.pivot, next(iter(summaries or SUMMARIES))))
    else:
        print(markdown(rows, args.by, summaries))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
