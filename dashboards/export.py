"""The report's figures and tables as files to paste into a paper or a slide: every chart
and heat map as PDF and SVG (drawn again with matplotlib from the same numbers as the HTML's
inline SVG, with the same colours, dashes, log axes and colour range), every table as
Markdown and LaTeX (booktabs). ``fedray report`` writes them beside ``report.html``, in
``figures/`` and ``tables/``."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def _lines(ax: Any, spec: dict[str, Any]) -> None:
    series = spec["series"]
    log = wants_log(series)
    for i, s in enumerate(series):
        c = s.get("color") or PALETTE[i % len(PALETTE)]
        pts = [(x, y) for x, y in zip(s["x"], s["mean"]) if math.isfinite(y)
               and (y > 0 or not log)]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=c,
                linestyle=_dash(s.get("dash", "")), linewidth=1.6, label=s["label"])
        lo, hi = s.get("lo"), s.get("hi")
        if lo and hi and any(a != b for a, b in zip(lo, hi)):
            ax.fill_between(s["x"], lo, hi, color=c, alpha=0.15, linewidth=0)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel(spec["x_label"])
    ax.set_ylabel(spec["y_label"])
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8, frameon=False)


def _heat(fig: Any, ax: Any, spec: dict[str, Any]) -> None:
    import numpy as np

    rows, cols, values = spec["rows"], spec["cols"], spec["values"]
    grid = np.full((len(rows), len(cols)), np.nan)
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            grid[i, j] = values.get((r, c), (math.nan,))[0]
    finite = grid[np.isfinite(grid)]
    lo = float(finite.min()) if finite.size else 0.0
    hi = float(finite.max()) if finite.size else 1.0
    im = ax.imshow(grid, cmap="viridis", vmin=lo, vmax=hi if hi > lo else lo + 1e-9,
                   aspect="auto")
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    ax.set_xlabel(spec["col_label"])
    ax.set_ylabel(spec["row_label"])
    for i in range(len(rows)):
        for j in range(len(cols)):
            if math.isfinite(grid[i, j]):
                light = hi > lo and (grid[i, j] - lo) > 0.6 * (hi - lo)
                ax.text(j, i, f"{grid[i, j]:.3g}", ha="center", va="center", fontsize=9,
                        color="black" if light else "white")
    fig.colorbar(im, ax=ax)


def write_figures(exports: Exports, folder: Path) -> list[Path]:
    """Each figure as ``NN-title.pdf`` and ``.svg`` in ``folder``; the paths written."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i, (kind, spec) in enumerate(exports.figures):
        fig, ax = plt.subplots(figsize=(7.5, 3.8) if kind == "lines" else
                               (1.4 + 1.1 * len(spec["cols"]), 1.4 + 0.5 * len(spec["rows"])))
        _lines(ax, spec) if kind == "lines" else _heat(fig, ax, spec)
        ax.set_title("\n".join(textwrap.wrap(spec["title"], 70)), fontsize=10)
        fig.tight_layout()
        for ext in ("pdf", "svg"):
            path = folder / f"{i + 1:02d}-{slug(spec['title'])}.{ext}"
            fig.savefig(path, bbox_inches="tight")
            out.append(path)
        plt.close(fig)
    return out


def write_tables(exports: Exports, folder: Path) -> list[Path]:
    """Each table as ``NAME.md`` and ``NAME.tex`` (booktabs) in ``folder``."""
    from dashboards.tables import latex, markdown

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
