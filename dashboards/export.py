"""The report's figures and tables as files to paste into a paper or a slide: every chart
and heat map as PDF and SVG (drawn again with matplotlib from the same numbers as the HTML's
inline SVG, with the same colours, dashes, log axes and colour range), every table as
Markdown and LaTeX (booktabs). ``fedray report`` writes them beside ``report.html``, in
``figures/`` and ``tables/``.

A figure keeps its plot at least about half of the page: the legend goes outside the plot
(beside or below it, where it takes less room) and the figure grows by it; a chart with more
curves than one plot reads is split into small multiples, one per condition of a robust-FL
sweep (no attack, each attack), a curve per setting in the same style in every panel. The
HTML's hints (which curves are faded, what a click does) stay out of the PDFs."""

from __future__ import annotations

import math
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dashboards.formats import latex, markdown
from dashboards.svg import PALETTE, wants_log


@dataclass
class Exports:
    """What a report shows, collected while it is rendered."""

    figures: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (kind, spec)
    tables: list[tuple[str, list[str], list[list[str]]]] = field(default_factory=list)


def slug(text: str, n: int = 60) -> str:
    """A file name from a title: ``test-accuracy``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:n] or "figure"


def _dash(pattern: str) -> Any:
    if not pattern:
        return "-"
    return (0, tuple(float(x) / 2 for x in pattern.split()))


def _draw(ax: Any, series: list[dict], log: bool) -> None:
    for i, s in enumerate(series):
        c = s.get("color") or PALETTE[i % len(PALETTE)]
        pts = [(x, y) for x, y in zip(s["x"], s["mean"]) if math.isfinite(y)
               and (y > 0 or not log)]
        if not pts:
            continue
        if s.get("scatter"):  # points, no line
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=c, linestyle="none",
                    marker="o", markersize=4, label=s["label"])
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=c,
                linestyle=_dash(s.get("dash", "")), linewidth=1.4, label=s["label"],
                marker="o" if s.get("markers") else None, markersize=3)
        lo, hi = s.get("lo"), s.get("hi")
        if lo and hi and any(a != b for a, b in zip(lo, hi)):
            ax.fill_between(s["x"], lo, hi, color=c, alpha=0.15, linewidth=0)
    if log:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)


MIN_SHARE = 0.6  # of the page the plots take, by the layout's estimate
LEGEND_FONT = 7.5  # pt
ROW = LEGEND_FONT * 1.45 / 72  # in: a legend row


def _legend_layout(entries: list[str], grid_w: float, grid_h: float
                   ) -> tuple[str, int, float, float]:
    """Where the legend goes so that the plot keeps its size: (``right`` or ``below``, its
    columns, the width and the height it adds to the figure, in inches), whichever leaves
    the plot the larger share of the page."""
    col_w = 0.45 + 0.56 * LEGEND_FONT / 72 * max((len(e) for e in entries), default=0)
    best = None
    per_col = max(1, int(grid_h / ROW))
    ncol = math.ceil(len(entries) / per_col)
    right = ("right", ncol, ncol * col_w + 0.1, 0.0)
    ncol = max(1, min(len(entries), int(grid_w / col_w)))
    below = ("below", ncol, 0.0, math.ceil(len(entries) / ncol) * ROW + 0.45)
    for layout in (right, below):
        share = grid_w * grid_h / ((grid_w + layout[2]) * (grid_h + layout[3]))
        if best is None or share > best[0]:
            best = (share, layout)
    assert best is not None
    return best[1]


def _figure_size(entries: list[str], ncols: int, nrows: int, pw: float, ph: float
                 ) -> tuple[str, int, float, float]:
    """(where the legend goes, its columns, the figure's width and height in inches) for
    ``nrows`` x ``ncols`` plots of ``pw`` x ``ph``: plots grown while the legend beside them
    would leave them less than MIN_SHARE of the page, never a thumbnail."""
    while True:
        where, legend_cols, add_w, add_h = _legend_layout(entries, ncols * pw, nrows * ph)
        # margins: ticks and axis labels, the title
        fig_w, fig_h = ncols * pw + 0.9 + add_w, nrows * ph + 0.9 + 0.35 * (nrows - 1) + add_h
        if ncols * pw * nrows * ph >= MIN_SHARE * fig_w * fig_h or pw > 16:
            return where, legend_cols, fig_w, fig_h
        pw, ph = pw * 1.15, ph * 1.1


def _lines_figure(spec: dict[str, Any]) -> Any:
    """A chart as a matplotlib figure: one plot, or small multiples (``spec["panels"]``, one
    per condition, on shared axes); the legend outside the plots, beside or below them,
    where it takes the less room, and the figure grown by it so the plots keep their size."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = spec.get("panels") or [("", spec["series"])]
    every = [s for _, series in panels for s in series]
    log = spec["log"] if spec.get("log") is not None else wants_log(every)
    n = len(panels)
    ncols = 1 if n == 1 else 2 if n <= 4 else 3
    nrows = math.ceil(n / ncols)
    pw, ph = (5.2, 3.0) if n == 1 else (3.2, 2.1)
    entries = list(dict.fromkeys(s["label"] for s in every))
    where, legend_cols, fig_w, fig_h = _figure_size(entries, ncols, nrows, pw, ph)
    fig, axes = plt.subplots(nrows, ncols, figsize=(fig_w, fig_h), sharex=True, sharey=True,
                             squeeze=False, layout="constrained")
    for k, ax in enumerate(axes.flat):
        if k >= n:
            ax.set_visible(False)
            continue
        title, series = panels[k]
        _draw(ax, series, log)
        if spec.get("log_x"):
            ax.set_xscale("log")
        if spec["x_label"] == "round" or spec["x_label"].startswith("evaluation"):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if n > 1:
            ax.set_title(title, fontsize=9)
        if k % ncols == 0:
            ax.set_ylabel(spec["y_label"])
        if k + ncols >= n:
            ax.set_xlabel(spec["x_label"])
            ax.xaxis.set_tick_params(labelbottom=True)
    handles: dict[str, Any] = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    order = [e for e in entries if e in handles]  # the settings' order, in every chart
    fig.legend([handles[e] for e in order], order, fontsize=LEGEND_FONT, frameon=False,
               ncols=legend_cols, loc="outside right center" if where == "right" else
               "outside lower center")
    fig.suptitle("\n".join(textwrap.wrap(spec["title"], 90)), fontsize=10)
    return fig


def _heat(fig: Any, ax: Any, spec: dict[str, Any]) -> None:
    import numpy as np
    from matplotlib.patches import Rectangle

    rows, cols, values = spec["rows"], spec["cols"], spec["values"]
    grid = np.full((len(rows), len(cols)), np.nan)
    diverged = np.zeros((len(rows), len(cols)), dtype=int)
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            v = values.get((r, c), (math.nan, math.nan, 0))
            grid[i, j] = v[0]
            diverged[i, j] = v[3] if len(v) > 3 else 0
    grid[diverged > 0] = np.nan  # marked, never a colour of the scale
    finite = grid[np.isfinite(grid)]
    lo = float(spec["lo"]) if spec.get("lo") is not None else \
        (float(finite.min()) if finite.size else 0.0)
    hi = float(spec["hi"]) if spec.get("hi") is not None else \
        (float(finite.max()) if finite.size else 1.0)
    im = ax.imshow(np.ma.masked_invalid(grid), cmap="viridis", vmin=lo,
                   vmax=hi if hi > lo else lo + 1e-9, aspect="auto")
    ax.set_facecolor("#cccccc")  # a missing cell
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    ax.set_xlabel(spec["col_label"])
    ax.set_ylabel(spec["row_label"])
    for i in range(len(rows)):
        for j in range(len(cols)):
            if diverged[i, j]:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="white",
                                       edgecolor="#d62728", hatch="///", linewidth=1.5))
                ax.text(j, i, "diverged", ha="center", va="center", fontsize=9, weight="bold",
                        color="#d62728", bbox={"facecolor": "white", "edgecolor": "none",
                                               "pad": 1})
            elif math.isfinite(grid[i, j]):
                light = hi > lo and (grid[i, j] - lo) > 0.6 * (hi - lo)
                ax.text(j, i, f"{grid[i, j]:.3g}", ha="center", va="center", fontsize=9,
                        color="black" if light else "white")
    bar = fig.colorbar(im, ax=ax)
    shared = spec.get("shared", 1)
    bar.set_label(f"one scale for all {shared} maps" if shared > 1 else
                  "the range of this map", fontsize=8)


def _heat_figure(spec: dict[str, Any]) -> Any:
    """A heat map as a matplotlib figure: cells at least 0.95 x 0.42 in and the map at least
    5 x 3.4 in, so its labels, title and colour bar take less of the page than the map."""
    import matplotlib.pyplot as plt

    rows, cols = spec["rows"], spec["cols"]
    w, h = max(0.95 * len(cols), 5.0), max(0.42 * len(rows), 3.4)
    label = max((len(str(r)) for r in rows), default=0) * 0.075 + 0.5
    fig, ax = plt.subplots(figsize=(w + label + 1.1, h + 1.2), layout="constrained")
    _heat(fig, ax, spec)
    ax.set_title("\n".join(textwrap.wrap(spec["title"], 80)), fontsize=10)
    return fig


def figure(kind: str, spec: dict[str, Any]) -> Any:
    """One of a report's figures (``Exports.figures``' ``(kind, spec)``) as a matplotlib
    figure, closed in pyplot (a notebook shows it where it is displayed, once)."""
    import matplotlib.pyplot as plt

    fig = _lines_figure(spec) if kind == "lines" else _heat_figure(spec)
    plt.close(fig)
    return fig


def write_figures(exports: Exports, folder: Path) -> list[Path]:
    """Each figure as ``NN-title.pdf`` and ``.svg`` in ``folder``; the paths written."""
    import matplotlib

    matplotlib.use("Agg")

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i, (kind, spec) in enumerate(exports.figures):
        fig = figure(kind, spec)
        for ext in ("pdf", "svg"):
            path = folder / f"{i + 1:02d}-{slug(spec['title'])}.{ext}"
            fig.savefig(path, bbox_inches="tight")
            out.append(path)
    return out


def write_tables(exports: Exports, folder: Path) -> list[Path]:
    """Each table as ``NAME.md`` and ``NAME.tex`` (booktabs) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    seen: dict[str, int] = {}
    for name, head, rows in exports.tables:
        seen[name] = seen.get(name, 0) + 1
        stem = name if seen[name] == 1 else f"{name}-{seen[name]}"
        for ext, text in (("md", markdown(head, rows, 1)), ("tex", latex(head, rows, 1))):
            path = folder / f"{stem}.{ext}"
            path.write_text(text + "\n", encoding="utf-8")
            out.append(path)
    return out
