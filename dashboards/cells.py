"""A table's cells, for ``fedray table`` (``dashboards.tables``) and a search's tables
(``dashboards.search``): a column's name, a run's number for it (``METRIC:HOW``, reduced by
``simulator.run.reductions``) from its history in MLflow, and a number over seeds written as
``mean ± std``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from dashboards.stats import summarize
from simulator.metric_names import SIM_TIME, mlflow_name
from simulator.run.reductions import TimeTo, lower_is_better, parse_how, run_summary, time_to


def column(metric: str, how: str) -> str:
    """A column's name: ``test_accuracy (last 5)``, ``test_loss (simulated s to ≤ 0.3)``."""
    k = parse_how(how)
    if isinstance(k, TimeTo):
        sign = "≤" if lower_is_better(metric) else "≥"
        return f"{metric} (simulated s to {sign} {k.threshold:.12g})"
    return f"{metric} ({'last ' + str(k) if isinstance(k, int) else k})"


def histories(client: Any, run: Any, metrics: set[str]
               ) -> dict[str, list[tuple[int, float]]]:
    """Each metric's (step, value) pairs in step order (a step logged twice, by a resumed
    run: in the order logged)."""
    out = {}
    for m in metrics:
        hist = sorted(client.get_metric_history(run.info.run_id, mlflow_name(m)),
                      key=lambda x: (x.step, x.timestamp))
        out[m] = [(int(h.step), h.value) for h in hist]
    return out


def run_value(run: Any, metric: str, how: str,
               hist: dict[str, list[tuple[int, float]]]) -> float:
    """One run's number for the column (metric, how)."""
    k = parse_how(how)
    if isinstance(k, TimeTo):
        if not hist.get(metric):
            return math.nan  # this run did not log the metric: a missing value
        try:
            return time_to(hist[metric], hist.get(SIM_TIME, []), k.threshold,
                           lower_is_better(metric))
        except ValueError as e:
            raise ValueError(f"--metrics {metric}:{how}: run {run.info.run_name} "
                             f"({run.info.run_id}): {metric} {e}") from None
    return run_summary([v for _, v in hist.get(metric, [])], how,
                       float(run.data.metrics.get(mlflow_name(metric), math.nan)),
                       run.data.params.get(metric))


def number(mean: float, std: float, n: int) -> str:
    """``mean ± std`` over ``n`` values; one value has no spread, so none is shown (it read
    ``± 0.000``, as if the seeds agreed)."""
    if math.isnan(mean):
        return "-"
    wide = abs(mean) >= 1e4 or (0 < abs(mean) < 1e-3)
    text = f"{mean:.3g}" if wide else f"{mean:.3f}"
    if n < 2:
        return text
    return text + (f" ± {std:.2g}" if wide else f" ± {std:.3f}")


def reach_cell(values: Sequence[float]) -> str:
    """A ``time_toX`` cell: mean ± std over the seeds that reached X and how many of the
    seeds did (``41.200 ± 3.100 (2 of 3 reached; 1 never)``); ``never (0 of 3 reached)`` when
    none did. A seed that never reached X (inf) is counted, never averaged in as a number;
    a missing value (nan: the run did not log the metric) is left out."""
    logged = [v for v in values if not math.isnan(v)]
    if not logged:
        return "-"
    reached = [v for v in logged if math.isfinite(v)]
    n, k = len(logged), len(reached)
    if not reached:
        return f"never (0 of {n} reached)"
    s = summarize(reached)
    return number(s.mean, s.std, k) + f" ({k} of {n} reached" + \
        (f"; {n - k} never)" if k < n else ")")
