"""Inline SVG charts for the HTML report: line charts with a spread band per series and heat
maps whose every cell is one ``<rect class="cell">``. No plotting library: the report stays a
few tens of kB, opens offline, and every mark is a DOM element (tests count them in a real
browser); native ``<title>`` elements give the hover values without any script.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf"]
# viridis at 5 stops, interpolated linearly
VIRIDIS = [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)]


def _esc(s: object) -> str:
    return html.escape(str(s), quote=True)


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    if v != 0 and (abs(v) >= 1e4 or abs(v) < 1e-3):
        return f"{v:.2e}"
    return f"{v:.3g}"


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step + 1e-9) + 1)]


def color(value: float, lo: float, hi: float) -> str:
    """Viridis colour of ``value`` on [lo, hi] (grey for a missing value)."""
    if not math.isfinite(value):
        return "#cccccc"
    t = 0.0 if hi <= lo else min(max((value - lo) / (hi - lo), 0.0), 1.0)
    pos = t * (len(VIRIDIS) - 1)
    i = min(int(pos), len(VIRIDIS) - 2)
    f = pos - i
    r, g, b = (round(a + (c - a) * f) for a, c in zip(VIRIDIS[i], VIRIDIS[i + 1]))
    return f"#{r:02x}{g:02x}{b:02x}"


def _series_svg(i: int, s: dict, sx: Any, sy: Any, legend_x: float, top: float) -> list[str]:
    """One series of a line chart: its band (when not flat), curve, markers and legend."""
    c = PALETTE[i % len(PALETTE)]
    out = []
    lo, hi = s.get("lo"), s.get("hi")
    if lo and hi and any(a != b for a, b in zip(lo, hi)):
        ring = [(x, y) for x, y in zip(s["x"], hi) if math.isfinite(y)]
        ring += [(x, y) for x, y in reversed(list(zip(s["x"], lo))) if math.isfinite(y)]
        poly = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in ring)
        out.append(f'<polygon class="band" data-series="{i}" points="{poly}" fill="{c}"/>')
    line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(s["x"], s["mean"])
                    if math.isfinite(y))
    last = next((y for y in reversed(s["mean"]) if math.isfinite(y)), math.nan)
    out.append(f'<polyline class="curve" data-series="{i}" points="{line}" stroke="{c}">'
               f'<title>{_esc(s["label"])}: final {_fmt(last)}</title></polyline>')
    finite = [(x, y) for x, y in zip(s["x"], s["mean"]) if math.isfinite(y)]
    if len(finite) <= 25:  # a sparse series (evaluated every k rounds) shows its points
        out += [f'<circle class="marker" data-series="{i}" cx="{sx(x):.1f}" cy="{sy(y):.1f}" '
                f'r="3" fill="{c}"/>' for x, y in finite]
    ly = top + 12 + 16 * i
    out.append(f'<g class="legend" data-series="{i}"><rect x="{legend_x + 10}" y="{ly - 9}" '
               f'width="10" height="10" fill="{c}"/><text x="{legend_x + 25}" y="{ly}" '
               f'class="tick">{_esc(s["label"][:40])}<title>{_esc(s["label"])}</title>'
               '</text></g>')
    return out


def line_chart(title: str, series: Sequence[dict], x_label: str = "round", y_label: str = "",
               width: int = 640, height: int = 320) -> str:
    """``series``: dicts with ``label``, ``x``, ``mean``, and optional ``lo``/``hi`` (the spread
    band). One ``<polyline class="curve">`` per series, ``<polygon class="band">`` when the
    band is not flat."""
    left, right, top, bottom = 60, 250, 30, 45
    pts = [(x, y) for s in series for x, y in zip(s["x"], s["mean"]) if math.isfinite(y)]
    pts += [(x, y) for s in series for key in ("lo", "hi") for x, y in zip(s["x"], s.get(key, []))
            if math.isfinite(y)]
    if not pts:
        return f'<figure class="chart"><figcaption>{_esc(title)}: no data</figcaption></figure>'
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    if x1 == x0:
        x1 = x0 + 1
    pw, ph = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    out = [(f'<svg class="chart" role="img" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">'),
           f'<text x="{left}" y="18" class="title">{_esc(title)}</text>',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="frame"/>']
    for t in _ticks(y0, y1):
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" class="grid"/>'
                   f'<text x="{left - 6}" y="{sy(t) + 4:.1f}" class="tick" text-anchor="end">{_fmt(t)}</text>')
    for t in _ticks(x0, x1):
        out.append(f'<text x="{sx(t):.1f}" y="{top + ph + 16}" class="tick" '
                   f'text-anchor="middle">{_fmt(t)}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 8}" class="axis" text-anchor="middle">'
               f'{_esc(x_label)}</text>')
    out.append(f'<text x="14" y="{top + ph / 2}" class="axis" text-anchor="middle" '
               f'transform="rotate(-90 14 {top + ph / 2})">{_esc(y_label)}</text>')
    for i, s in enumerate(series):
        out += _series_svg(i, s, sx, sy, left + pw, top)
    out.append("</svg>")
    return "".join(out)


def heat_map(title: str, rows: Sequence[str], cols: Sequence[str], values: dict, row_label: str,
             col_label: str, lo: float | None = None, hi: float | None = None) -> str:
    """``values[(row, col)] = (mean, std, count)``; one ``<rect class="cell">`` per
    (row, col), its value written in it (missing combinations grey and empty)."""
    cw, ch, left, top = 84, 30, 130, 60
    width, height = left + cw * len(cols) + 20, top + ch * len(rows) + 20
    finite = [v[0] for v in values.values() if math.isfinite(v[0])]
    lo = min(finite, default=0.0) if lo is None else lo
    hi = max(finite, default=1.0) if hi is None else hi
    out = [(f'<svg class="heatmap" role="img" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">'),
           f'<text x="4" y="18" class="title">{_esc(title)}</text>',
           f'<text x="{left}" y="38" class="axis">{_esc(col_label)} →</text>',
           f'<text x="4" y="{top - 6}" class="axis">{_esc(row_label)} ↓</text>']
    for j, c in enumerate(cols):
        out.append(f'<text x="{left + cw * j + cw / 2}" y="{top - 6}" class="tick" '
                   f'text-anchor="middle">{_esc(str(c)[:12])}</text>')
    for i, r in enumerate(rows):
        y = top + ch * i
        out.append(f'<text x="{left - 6}" y="{y + ch / 2 + 4}" class="tick" '
                   f'text-anchor="end">{_esc(str(r)[:18])}</text>')
        for j, c in enumerate(cols):
            mean, std, n = values.get((r, c), (math.nan, math.nan, 0))
            x = left + cw * j
            fill = color(mean, lo, hi)
            ink = "#000" if math.isfinite(mean) and (mean - lo) > 0.6 * (hi - lo) else "#fff"
            out.append(f'<rect class="cell" x="{x}" y="{y}" width="{cw - 2}" height="{ch - 2}" '
                       f'fill="{fill}" data-row="{_esc(r)}" data-col="{_esc(c)}" '
                       f'data-value="{mean}"><title>{_esc(r)} × {_esc(c)}: {_fmt(mean)} ± '
                       f'{_fmt(std)} ({n} run{"s" if n != 1 else ""})</title></rect>')
            if math.isfinite(mean):
                out.append(f'<text x="{x + cw / 2 - 1}" y="{y + ch / 2 + 4}" class="cellv" '
                           f'text-anchor="middle" fill="{ink}">{_fmt(mean)}</text>')
    out.append("</svg>")
    return "".join(out)
