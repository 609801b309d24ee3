from __future__ import annotations

import math
import re

import pytest

from dashboards.report import RunData, render
from dashboards.stats import summarize
from simulator.run.reductions import from_mlflow


def test_summarize_mean_std_missing_and_diverged():
    s = summarize([0.8, 0.9, math.nan])  # nan: a run that did not log the metric
    assert (s.n, s.diverged) == (2, 0)
    assert s.mean == pytest.approx(0.85) and s.std == pytest.approx(0.0707107, rel=1e-5)
    assert summarize([0.5]) == (0.5, 0.0, 1, 0)
    d = summarize([0.1, math.inf, 0.3])
    assert d.mean == math.inf and math.isnan(d.std) and (d.n, d.diverged) == (3, 1)
    # MLflow stores inf as the largest float: it reads back as inf, and sums do not overflow
    big = 1.7976931348623157e308
    assert from_mlflow(big) == math.inf and from_mlflow(-big) == -math.inf
    assert from_mlflow(3.5) == 3.5
    s = summarize([big, big, 0.5])
    assert s.mean == math.inf and (s.n, s.diverged) == (3, 2)
    empty = summarize([math.nan])
    assert empty.n == 0 and math.isnan(empty.mean)


def _run(seed: str, err: list[float]) -> RunData:
    return RunData(run_id=seed, name=f"mean seed={seed}", group="mean", seed=seed, tags={},
                   params={}, history={"test_accuracy": [(0, 0.5), (1, 0.6)],
                                       "aggregation_error": list(enumerate(err))})


def test_report_does_not_hide_a_diverged_seed():
    page = render("t", [_run("0", [1.0, 2.0]), _run("1", [1.0, math.inf])])
    assert "diverged (1 of 2 runs)" in page  # summary cell of the aggregation error
    assert "mean (1 of 2 runs not finite)" in page  # its curve's legend
    assert "0.6 ± 0" in page  # the finite column is unaffected
    page = render("t", [_run("0", [1.0, 2.0]), _run("1", [1.0, 4.0])])
    assert "diverged" not in page and "3 ± 1.4" in page


def test_every_curve_is_reachable_when_there_are_many():
    """30 sweep points: 10 curves shown (the 5 best and 5 worst), the other 20 drawn faded,
    each shown by a click on its legend entry (the report's script toggles ``off``)."""
    runs = [RunData(run_id=str(i), name=f"p{i} seed=0", group=f"p{i}", seed="0", tags={},
                    params={}, history={"test_accuracy": [(0, 0.1), (1, i / 30)]})
            for i in range(30)]
    page = render("many", runs)
    chart = page.split("<h2>Curves</h2>")[1].split("</svg>")[0]
    assert chart.count('<g class="curve') == 30
    assert chart.count('<g class="curve off"') == 20
    assert chart.count('<g class="legend off"') == 20
    shown = re.findall(r'<g class="curve" data-series="(\d+)"', chart)
    assert sorted(int(i) for i in shown) == [0, 1, 2, 3, 4, 25, 26, 27, 28, 29]
    after = page.split("<h2>Curves</h2>")[1].split("</svg>", 1)[1]  # said beside, not in it
    assert after.startswith('<p class="note">5 highest and 5 lowest final values of 30 sweep '
                            "points shown; click a faded legend entry to show its curve.</p>")
