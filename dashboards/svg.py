"""The run's own figure for the MLflow UI (``dashboards.figures``: ``figures/curves.svg``
on each point run), drawn as a few SVG elements without matplotlib: the figure is made at
the end of every ``fedray run``, where matplotlib would add 0.6 s (its import) and 0.1-0.2 s
a figure to a run of about 4 s here. This is its only drawing: the report's figures are
``dashboards.draw``'s (matplotlib), one drawing each. Line charts only: a curve per series,
native ``<title>`` hover values, a log y axis for values that span decades.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

from dashboards.draw import PALETTE, wants_log
from dashboards.draw import fmt as _fmt


def _esc(s: object) -> str:
    return html.escape(str(s), quote=True)


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step + 1e-9) + 1)]


def text_width(text: str, size: float = 11.0) -> float:
    """A generous estimate of a label's width in px (sans-serif: about 0.62 em a character),
    to size margins so that no label is cut."""
    return 0.62 * size * len(text) + 4


def wrap(text: str, width: float, size: float = 13.0) -> list[str]:
    """``text`` in lines that fit ``width`` px (words kept whole)."""
    per = max(8, int(width / (0.62 * size)))
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= per:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines or [""]


def _title(text: str, x: float, y: float, width: float) -> tuple[str, float]:
    """A wrapped title: (svg, height it takes)."""
    lines = wrap(text, width)
    spans = "".join(f'<tspan x="{x}" dy="{0 if i == 0 else 16}">{_esc(line)}</tspan>'
                    for i, line in enumerate(lines))
    return f'<text x="{x}" y="{y}" class="title">{spans}</text>', 16.0 * (len(lines) - 1)


def _log_ticks(lo: float, hi: float) -> list[float]:
    """Powers of ten between ``lo`` and ``hi`` (every k-th when there are many)."""
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    step = max(1, (b - a) // 6)
    return [10.0 ** e for e in reversed(range(b, a - 1, -step))]  # the top one always


def _series_svg(i: int, s: dict, sx: Any, sy: Any, legend_x: float, top: float) -> list[str]:
    """One series of a line chart: its curve (titled with its final value), its markers
    when it is sparse, and its legend entry."""
    c = PALETTE[i % len(PALETTE)]
    finite = [(x, y) for x, y in zip(s["x"], s["mean"]) if math.isfinite(y)]
    line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in finite)
    last = next((y for y in reversed(s["mean"]) if math.isfinite(y)), math.nan)
    out = [(f'<polyline class="curve" points="{line}" stroke="{c}">'
            f'<title>{_esc(s["label"])}: final {_fmt(last)}</title></polyline>')]
    if len(finite) <= 25:  # a sparse series (evaluated every k rounds) shows its points
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{c}"/>'
                for x, y in finite]
    ly = top + 12 + 16 * i
    out.append(f'<line x1="{legend_x + 8}" x2="{legend_x + 24}" y1="{ly - 4}" y2="{ly - 4}" '
               f'stroke="{c}" stroke-width="3"/><text x="{legend_x + 28}" y="{ly}" '
               f'class="tick">{_esc(s["label"])}</text>')
    return out


def _y_range(pts: Sequence[tuple[float, float]], log: bool) -> tuple[float, float]:
    """(y0, y1) of the points; a log axis from a power of ten to a power of ten."""
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if log:
        y0, y1 = 10 ** math.floor(math.log10(y0)), 10 ** math.ceil(math.log10(y1))
        y1 = y0 * 10 if y1 == y0 else y1
    elif y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    return y0, y1


def _scales(r: tuple[float, float, float, float], box: tuple[float, float, float, float],
            log: bool) -> tuple[Any, Any]:
    """Data -> pixel maps of the x and y axes (y on a log axis when ``log``)."""
    x0, x1, y0, y1 = r
    left, top, pw, ph = box
    if log:
        y0, y1 = math.log10(y0), math.log10(y1)

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        y = math.log10(max(y, 10 ** y0)) if log else y  # zeros on the bottom edge
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    return sx, sy


def line_chart(title: str, series: Sequence[dict], x_label: str = "round", y_label: str = "",
               height: int = 320) -> str:
    """``series``: dicts with ``label``, ``x``, ``mean``; one ``<polyline class="curve">``
    each. A log y axis when the positive values span more than three decades (the rule of
    the report's charts, ``draw.wants_log``). The legend's margin and the chart's height
    grow to hold every label whole; the title wraps."""
    pts = [(x, y) for s in series for x, y in zip(s["x"], s["mean"]) if math.isfinite(y)]
    if not pts:
        return f'<figure class="chart"><figcaption>{_esc(title)}: no data</figcaption></figure>'
    log = wants_log(series)
    zeros = log and any(p[1] <= 0 for p in pts)
    xs = [p[0] for p in pts]  # zeros on a log axis still span the x axis (the bottom edge)
    if log:
        pts = [p for p in pts if p[1] > 0] or [(xs[0], 1.0)]
    y0, y1 = _y_range(pts, log)
    x0, x1 = min(xs), max(xs)
    x1 = x0 + 1 if x1 == x0 else x1
    yticks = [(t, f"1e{round(math.log10(t))}" if log and not 1e-3 <= t < 1e4 else _fmt(t))
              for t in (_log_ticks(y0, y1) if log else _ticks(y0, y1))]
    legend_w = max((text_width(str(s["label"])) for s in series), default=0) + 40
    left = max(64.0, max(text_width(label) for _, label in yticks) + 30)
    right, bottom = max(120, legend_w), 45
    scale = " (log scale; zeros on the bottom edge)" if zeros else " (log scale)" if log else ""
    head, extra = _title(title + scale, left, 18,
                         left + 480 + right - left)
    top = 30 + extra
    h = max(float(height), top + 16 * len(series) + 20)
    pw, ph = 480, h - top - bottom
    w = left + pw + right
    sx, sy = _scales((x0, x1, y0, y1), (left, top, pw, ph), log)

    out = [(f'<svg class="chart{" log" if log else ""}" role="img" '
            f'width="{w:.0f}" '
            f'height="{h:.0f}" viewBox="0 0 {w:.0f} {h:.0f}" '
            'xmlns="http://www.w3.org/2000/svg">'), head,
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="frame"/>']
    for t, label in yticks:
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" class="grid"/>'
                   f'<text x="{left - 6}" y="{sy(t) + 4:.1f}" class="tick ytick" '
                   f'text-anchor="end">{label}</text>')
    for t in _ticks(x0, x1):
        out.append(f'<text x="{sx(t):.1f}" y="{top + ph + 16}" class="tick xtick" '
                   f'text-anchor="middle">{_fmt(t)}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{h - 8}" class="axis" text-anchor="middle">'
               f'{_esc(x_label)}</text>')
    out.append(f'<text x="14" y="{top + ph / 2}" class="axis" text-anchor="middle" '
               f'transform="rotate(-90 14 {top + ph / 2})">{_esc(y_label)}</text>')
    for i, s in enumerate(series):
        out += _series_svg(i, s, sx, sy, left + pw, top)
    out.append("</svg>")
    return "".join(out)
