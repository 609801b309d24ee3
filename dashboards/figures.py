"""A run's figure for the MLflow UI (``figures/curves.png`` on each point run): accuracy,
losses and the Byzantine error per round, so a run reads without leaving MLflow. Static PNG
via matplotlib (MLflow's UI previews images; it ships with MLflow)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from simulator.callbacks import Callback, PointRun

PANELS = [
    ("accuracy", ["test_accuracy", "averaged_test_accuracy"]),
    ("loss", ["test_loss", "train_loss", "client_loss"]),
    ("error", ["aggregation_error", "consensus_distance"]),
]


def run_figure(rows: list[dict[str, float]], path: Path, title: str = "") -> Path | None:
    """Plot the per-round ``rows`` of a run into ``path`` (None when nothing to plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(name, [k for k in keys if any(k in r for r in rows)]) for name, keys in PANELS]
    panels = [(name, keys) for name, keys in panels if keys]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2), squeeze=False)
    for ax, (name, keys) in zip(axes[0], panels):
        for k in keys:
            pts = [(i, r[k]) for i, r in enumerate(rows) if k in r and math.isfinite(r[k])]
            if pts:
                ax.plot([p[0] + 1 for p in pts], [p[1] for p in pts], marker="." if len(pts) < 30
                        else None, label=k)
        ax.set_xlabel("round")
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
