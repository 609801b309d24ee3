"""One summary of a metric over seeds for every dashboard (tables and the HTML report)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import NamedTuple

from simulator.run.reductions import from_mlflow


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
