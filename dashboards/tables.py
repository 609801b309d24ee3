"""Tables of a sweep from what MLflow holds: the child runs of an experiment's latest
scenario run, grouped by sweep values, each metric as mean and spread over seeds.

    python -m dashboards.tables EXPERIMENT --by clients.per_round [--tracking-uri URI]

``--by`` names params (``clients.per_round``, ``aggregator.name``) or tags (``meta``,
``preaggregators``, ``attack``); a run is summarised by its final ``test_accuracy``, the mean
over rounds of ``relative_aggregation_error`` and its number of rounds with
``byzantine_exceeded``.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from typing import Any

SUMMARIES: dict[str, str] = {
    "test_accuracy": "final",
    "relative_aggregation_error": "mean",
    "byzantine_exceeded": "sum",
}


def _value(run: Any, key: str) -> str:
    if key in run.data.params:
        return run.data.params[key]
    return run.data.tags.get(key, "?")


def _summary(client: Any, run: Any, metric: str, how: str) -> float:
    if how == "final":
        return float(run.data.metrics.get(metric, math.nan))
    values = [m.value for m in client.get_metric_history(run.info.run_id, metric)]
    if not values:
        return math.nan
    return float(sum(values) if how == "sum" else statistics.fmean(values))


def sweep_table(experiment: str, by: Sequence[str], tracking_uri: str | None = None,
                parent_run_id: str | None = None) -> list[dict[str, Any]]:
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
    groups: dict[tuple[str, ...], list[dict[str, float]]] = {}
    for run in children:
        key = tuple(_value(run, k) for k in by)
        groups.setdefault(key, []).append(
            {m: _summary(client, run, m, how) for m, how in SUMMARIES.items()})
    rows = []
    for key, runs in groups.items():
        row: dict[str, Any] = dict(zip(by, key))
        row["seeds"] = len(runs)
        for m in SUMMARIES:
            vals = [r[m] for r in runs if not math.isnan(r[m])]
            row[m] = (statistics.fmean(vals) if vals else math.nan,
                      statistics.stdev(vals) if len(vals) > 1 else 0.0)
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], by: Sequence[str]) -> str:
    head = [*by, "seeds", "test accuracy", "rel. aggregation error", "rounds exceeded"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(by) + "---:|" * 4]
    for r in rows:
        acc, err, exc = r["test_accuracy"], r["relative_aggregation_error"], r["byzantine_exceeded"]
        lines.append("| " + " | ".join([*(str(r[k]) for k in by), str(r["seeds"]),
                                        f"{acc[0]:.3f} ± {acc[1]:.3f}", f"{err[0]:.3f} ± {err[1]:.3f}",
                                        f"{exc[0]:.1f}"]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dashboards.tables", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment")
    p.add_argument("--by", nargs="+", required=True, help="params or tags to group runs by")
    p.add_argument("--tracking-uri", default=None)
    p.add_argument("--parent", default=None, help="a scenario run id (default: the latest)")
    args = p.parse_args(argv)
    print(markdown(sweep_table(args.experiment, args.by, args.tracking_uri, args.parent), args.by))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
