"""A run's metric history reduced to one number, ``METRIC:HOW``: what ``fedray table``
(``dashboards.tables``) puts in a cell and ``fedray tune`` (``simulator.run.tuning``) scores a
trial's point by, so that the two always agree. ``HOW`` is ``final`` (the last value),
``lastK`` (the mean of the last K), ``mean`` (over rounds), ``sum``, ``param`` (a numeric run
param) or ``time_toX`` (the simulated seconds, ``sim_time``, at the first step where the
metric reaches X: >= X, or <= X for a metric where lower is better). Values read from MLflow
go through ``from_mlflow`` (MLflow keeps an infinity as the largest float)."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from simulator.metric_names import SIM_TIME, plain_name

HUGE = 1e300  # MLflow stores inf as the largest float: read any value this large as inf
LOWER_IS_BETTER = ("loss", "perplexity", "error", "distance")


def from_mlflow(value: float) -> float:
    """A metric value as logged: MLflow's stores keep +-inf as +-1.797e308, which would read as
    finite (and overflow any sum); this gives the infinity back."""
    return math.copysign(math.inf, value) if abs(value) >= HUGE else value


def lower_is_better(metric: str) -> bool:
    """Whether a smaller value of ``metric`` is the better one: its name ends in loss,
    perplexity, error or distance (``test_loss``, ``relative_aggregation_error``,
    ``consensus_distance``)."""
    return plain_name(metric).endswith(LOWER_IS_BETTER)


@dataclass(frozen=True)
class TimeTo:
    """``time_toX``: the simulated time at which a metric first reaches ``threshold``."""

    threshold: float

    @property
    def how(self) -> str:
        """The canonical spelling (``time_to0.90`` and ``time_to0.9`` are one column)."""
        return f"time_to{self.threshold:.12g}"


def parse_how(how: str) -> int | str | TimeTo:
    """``final`` | ``mean`` | ``sum`` | ``param`` | ``lastK`` (K >= 1, returned as int) |
    ``time_toX`` (X a finite number, also written ``time_to:X``; returned as TimeTo)."""
    m = re.fullmatch(r"last(\d+)", how)
    if m and int(m.group(1)) >= 1:
        return int(m.group(1))
    if how in ("final", "mean", "sum", "param"):
        return how
    if how.startswith("time_to"):
        text = how.removeprefix("time_to").removeprefix(":")
        try:
            x = float(text)
        except ValueError:
            x = math.nan
        if not math.isfinite(x):
            raise ValueError(f"time_toX needs a number X, the threshold (time_to0.9), got "
                             f"{how!r}")
        return TimeTo(x)
    raise ValueError(f"how must be one of final, mean, sum, param, lastK (K >= 1) or "
                     f"time_toX (X a number), got {how!r}")


def parse_metrics(items: Sequence[str]) -> list[tuple[str, str]]:
    """``["test_accuracy:last5", ...]`` -> ``[("test_accuracy", "last5"), ...]``; the same
    metric and how twice is refused (no silent merge). ``time_to:X`` (issue #30's spelling)
    is ``test_accuracy:time_toX``; a ``time_toX`` how is returned in its canonical form."""
    out: list[tuple[str, str]] = []
    for item in items:
        metric, _, how = item.partition(":")
        if metric == "time_to":  # time_to:0.9
            metric, how = "test_accuracy", "time_to" + how
        if not metric:
            raise ValueError(f"--metrics {item}: METRIC:HOW")
        try:
            k = parse_how(how or "final")
        except ValueError as e:
            raise ValueError(f"--metrics {item}: {e}") from None
        if isinstance(k, TimeTo):
            how = k.how
        pair = (plain_name(metric), how or "final")  # eval/test_accuracy or test_accuracy
        if pair in out:
            raise ValueError(f"--metrics {item}: given twice")
        out.append(pair)
    return out


def run_summary(history: Sequence[float], how: str, final: float = math.nan,
                param: str | None = None) -> float:
    """One run's number for ``how`` from its metric ``history`` (values in step order)."""
    k = parse_how(how)
    if k == "param":
        try:
            return float(param if param is not None else "nan")
        except ValueError:
            return math.nan
    if k == "final":
        return from_mlflow(final) if not math.isnan(final) else \
            (from_mlflow(history[-1]) if history else math.nan)
    values = [from_mlflow(v) for v in history]
    if not values:
        return math.nan
    if isinstance(k, TimeTo):
        raise TypeError("time_toX needs the steps of the history: see time_to")
    if isinstance(k, int):
        return statistics.fmean(values[-k:])
    return float(sum(values) if k == "sum" else statistics.fmean(values))


def time_to(history: Sequence[tuple[int, float]], sim_time: Sequence[tuple[int, float]],
            threshold: float, lower: bool = False) -> float:
    """The simulated time at which a metric first reaches ``threshold``: ``sim_time`` at the
    first step, in step order, whose value is >= ``threshold`` (<= when ``lower``: a loss);
    inf when no step's is. Both histories are (step, value) pairs in any order, matched by
    step, never by position (an evaluated metric may be logged every k steps, the clock
    every step); a reached step without a ``sim_time`` is an error naming the step."""
    clock = dict(sim_time)
    for step, raw in sorted(history, key=lambda p: p[0]):
        v = from_mlflow(raw)
        if v <= threshold if lower else v >= threshold:  # nan reaches nothing
            if step not in clock:
                raise ValueError(f"it reaches {threshold:.12g} at step {step}, where no "
                                 f"{SIM_TIME} was logged")
            return from_mlflow(clock[step])
    return math.inf
