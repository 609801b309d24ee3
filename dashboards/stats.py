"""One summary of a metric over seeds for every dashboard (tables and the HTML report)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import NamedTuple

HUGE = 1e300  # MLflow stores inf as the largest float: read any value this large as inf


def from_mlflow(value: float) -> float:
    """A metric value as logged: MLflow's stores keep +-inf as +-1.797e308, which would read as
    finite (and overflow any sum); this gives the infinity back."""
    return math.copysign(math.inf, value) if abs(value) >= HUGE else value


class Summary(NamedTuple):
    """mean and standard deviation over the runs that logged the metric (``n``). A run whose
    value is infinite (``diverged``; MLflow's huge stand-in counts) is not dropped: it makes
    the mean infinite and the spread nan, so a sweep point where one seed blew up never reads
    as a finite number."""

    mean: float
    std: float
    n: int
    diverged: int


def summarize(values: Iterable[float]) -> Summary:
    """NaN is a missing value (the run did not log the metric) and is left out; see
    ``Summary`` for diverged runs."""
    vals = [float(v) for v in values if not math.isnan(v)]
    if not vals:
        return Summary(math.nan, math.nan, 0, 0)
    vals = [from_mlflow(v) for v in vals]
    diverged = sum(1 for v in vals if not math.isfinite(v))
    if diverged:
        return Summary(sum(vals) / len(vals), math.nan, len(vals), diverged)
    return Summary(statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0,
                   len(vals), 0)
