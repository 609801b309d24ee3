"""A run's figure for the MLflow UI (``figures/curves.svg`` on each point run): accuracy,
losses and the Byzantine error per round, and for a run with a simulated clock (a
``speeds:`` block) accuracy against simulated seconds, so a run reads without leaving MLflow.

A standalone SVG drawn by ``dashboards.svg`` (this figure's own drawing: the report's
figures are matplotlib's, ``dashboards.draw``), which MLflow's UI previews as it does PNGs: a
few milliseconds at the end of each run, where matplotlib cost 0.6 s to import and 0.1-0.2 s
a figure on the path to the end of ``fedray run``."""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

from dashboards.svg import line_chart
from simulator.metric_names import SIM_TIME
from simulator.run.callbacks import Callback, PointRun

PANELS = [
    ("accuracy", ["test_accuracy", "averaged_test_accuracy"]),
    ("loss", ["test_loss", "train_loss", "client_loss"]),
    ("error", ["aggregation_error", "consensus_distance"]),
]


def figure_panels(rows: list[dict[str, float]]
                  ) -> list[tuple[str, str, dict[str, list[tuple[float, float]]]]]:
    """What ``run_figure`` draws: (title, x label, {metric: finite (x, value) points}) per
    panel, x the round (1-based); with ``sim_time`` in the rows, a last panel of accuracy
    against it (a row is one step, so value and time are matched by step)."""
    out = []
    for name, keys in PANELS:
        out.append((name, "round", {k: [(float(i + 1), r[k]) for i, r in enumerate(rows)
                                        if k in r and math.isfinite(r[k])]
                                    for k in keys if any(k in r for r in rows)}))
    if any(SIM_TIME in r for r in rows):
        out.append(("accuracy against simulated time", "simulated time (s)",
                    {k: [(r[SIM_TIME], r[k]) for r in rows
                         if k in r and SIM_TIME in r and math.isfinite(r[k])]
                     for k in PANELS[0][1] if any(k in r for r in rows)}))
    return [(name, x, lines) for name, x, lines in out if lines]


# the report's chart style, inside the file: the MLflow UI shows it as an image (no page CSS)
STYLE = ("<style>text{font-family:sans-serif}.title{font-size:13px;font-weight:600}"
         ".tick{font-size:11px;fill:#444}.axis{font-size:12px}.frame{fill:none;stroke:#999}"
         ".grid{stroke:#eee}.curve{fill:none;stroke-width:2}"
         "</style>")
GAP = 10  # px between panels


def run_figure_svg(rows: list[dict[str, float]], title: str = "") -> str | None:
    """The per-round ``rows`` of a run as one SVG document: a line chart per panel of
    ``figure_panels``, side by side, under ``title`` (None when nothing to plot)."""
    panels = figure_panels(rows)
    if not panels:
        return None
    charts = [line_chart(name, [{"label": k, "x": [p[0] for p in pts],
                                 "mean": [p[1] for p in pts]}
                                for k, pts in lines.items() if pts],
                         x_label, name)
              for name, x_label, lines in panels]
    sizes = [(float(_attr(c, "width")), float(_attr(c, "height"))) for c in charts]
    top = 24.0 if title else 0.0
    width = sum(w for w, _ in sizes) + GAP * (len(charts) - 1)
    height = top + max(h for _, h in sizes)
    out = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
            f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}">'), STYLE,
           f'<rect width="{width:.0f}" height="{height:.0f}" fill="#fff"/>']
    if title:
        out.append(f'<text x="8" y="17" class="title">{html.escape(title)}</text>')
    x = 0.0
    for chart, (w, _) in zip(charts, sizes):
        out.append(chart.replace("<svg ", f'<svg x="{x:.0f}" y="{top:.0f}" ', 1))
        x += w + GAP
    out.append("</svg>")
    return "".join(out)


def _attr(svg: str, name: str) -> str:
    """The value of attribute ``name`` of the document's first element."""
    first = svg[:svg.index(">")]
    return first.split(f' {name}="', 1)[1].split('"', 1)[0]


def run_figure(rows: list[dict[str, float]], path: Path, title: str = "") -> Path | None:
    """Plot the per-round ``rows`` of a run into the SVG file ``path`` (None when nothing
    to plot)."""
    svg = run_figure_svg(rows, title)
    if svg is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(svg, encoding="utf-8")
    return path


class RunFigure(Callback):
    """A finished point run's curves as ``figures/curves.svg`` on its MLflow run."""

    def on_end(self, run: PointRun, result: Any, status: str) -> None:
        if status != "FINISHED" or result is None:
            return
        run.tmp.mkdir(parents=True, exist_ok=True)
        if run_figure(result.metrics, run.tmp / "curves.svg", run.point.label) is not None:
            run.tracker.log_artifact(run.run_id, run.tmp / "curves.svg", "figures")
