"""A run's figure for the MLflow UI (``figures/curves.png`` on each point run): accuracy,
losses and the Byzantine error per round, and for a run with a simulated clock (a
``speeds:`` block) accuracy against simulated seconds, so a run reads without leaving MLflow.
Static PNG via matplotlib (MLflow's UI previews images; it ships with MLflow)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dashboards.rundata import SIM_TIME
from simulator.callbacks import Callback, PointRun

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


def run_figure(rows: list[dict[str, float]], path: Path, title: str = "") -> Path | None:
    """Plot the per-round ``rows`` of a run into ``path`` (None when nothing to plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = figure_panels(rows)
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2), squeeze=False)
    for ax, (name, x_label, lines) in zip(axes[0], panels):
        for k, pts in lines.items():
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 30
                    else None, label=k)
        ax.set_xlabel(x_label)
        ax.set_title(name)
        if name == "error":
            ax.set_yscale("symlog", linthresh=1e-3)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


class RunFigure(Callback):
    """A finished point run's curves as ``figures/curves.png`` on its MLflow run."""

    def on_end(self, run: PointRun, result: Any, status: str) -> None:
        if status != "FINISHED" or result is None:
            return
        run.tmp.mkdir(parents=True, exist_ok=True)
        if run_figure(result.metrics, run.tmp / "curves.png", run.point.label) is not None:
            run.tracker.log_artifact(run.run_id, run.tmp / "curves.png", "figures")
