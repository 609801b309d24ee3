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
MAX_SERIES = 10  # curves shown at once on a line chart; pick_series fades the others


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


def spans_decades(values: Sequence[float], ratio: float = 1e3) -> bool:
    """Whether positive ``values`` span more than ``ratio`` (a log axis reads them)."""
    pos = [v for v in values if math.isfinite(v)]
    return bool(pos) and min(pos) > 0 and max(pos) / min(pos) > ratio


def wants_log(series: Sequence[dict]) -> bool:
    """Whether a chart of ``series`` reads on a log y axis: its non-zero values (curves and
    bands) are positive and span more than three decades. The HTML chart and its PDF/SVG
    export decide by this one rule."""
    return spans_decades([y for s in series for key in ("mean", "lo", "hi")
                          for y in s.get(key) or [] if math.isfinite(y) and y != 0])


def _log_ticks(lo: float, hi: float) -> list[float]:
    """Powers of ten between ``lo`` and ``hi`` (every k-th when there are many)."""
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    step = max(1, (b - a) // 6)
    return [10.0 ** e for e in reversed(range(b, a - 1, -step))]  # the top one always


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
    c = s.get("color") or PALETTE[i % len(PALETTE)]
    dash = f' stroke-dasharray="{s["dash"]}"' if s.get("dash") else ""
    off = " off" if s.get("hidden") else ""  # drawn, shown by a click on its legend entry
    out = []
    lo, hi = s.get("lo"), s.get("hi")
    if lo and hi and any(a != b for a, b in zip(lo, hi)):
        ring = [(x, y) for x, y in zip(s["x"], hi) if math.isfinite(y)]
        ring += [(x, y) for x, y in reversed(list(zip(s["x"], lo))) if math.isfinite(y)]
        poly = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in ring)
        out.append(f'<polygon class="band{off}" data-series="{i}" points="{poly}" fill="{c}"/>')
    finite = [(x, y) for x, y in zip(s["x"], s["mean"]) if math.isfinite(y)]
    if s.get("scatter"):  # points, no line: each a marker with its values
        out += [f'<circle class="marker point{off}" data-series="{i}" cx="{sx(x):.1f}" '
                f'cy="{sy(y):.1f}" r="4" fill="{c}"><title>{_esc(s["label"])}: '
                f'({_fmt(x)}, {_fmt(y)})</title></circle>' for x, y in finite]
        return out + [_legend_svg(i, s, c, "", off, legend_x, top)]
    line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in finite)
    last = next((y for y in reversed(s["mean"]) if math.isfinite(y)), math.nan)
    out.append(f'<polyline class="curve{off}" data-series="{i}" points="{line}" stroke="{c}"{dash}>'
               f'<title>{_esc(s["label"])}: final {_fmt(last)}</title></polyline>')
    if len(finite) <= 25:  # a sparse series (evaluated every k rounds) shows its points
        out += [f'<circle class="marker{off}" data-series="{i}" cx="{sx(x):.1f}" cy="{sy(y):.1f}" '
                f'r="3" fill="{c}"/>' for x, y in finite]
    return out + [_legend_svg(i, s, c, dash, off, legend_x, top)]


def _legend_svg(i: int, s: dict, c: str, dash: str, off: str, legend_x: float,
                top: float) -> str:
    """A series' legend entry (a click on it shows or fades the series)."""
    ly = top + 12 + 16 * i
    return (f'<g class="legend{off}" data-series="{i}"><line x1="{legend_x + 8}" '
            f'x2="{legend_x + 24}" y1="{ly - 4}" y2="{ly - 4}" stroke="{c}" '
            f'stroke-width="3"{dash}/><text x="{legend_x + 28}" y="{ly}" '
            f'class="tick">{_esc(s["label"])}<title>{_esc(s["label"])}</title>'
            '</text></g>')


def _ranges(pts: Sequence[tuple[float, float]], log: bool) -> tuple[float, float, float, float]:
    """(x0, x1, y0, y1) of the points; a log axis from a power of ten to a power of ten."""
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if log:
        y0, y1 = 10 ** math.floor(math.log10(y0)), 10 ** math.ceil(math.log10(y1))
        y1 = y0 * 10 if y1 == y0 else y1
    elif y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    return x0, (x0 + 1 if x1 == x0 else x1), y0, y1


def _x_range(xs: Sequence[float], log: bool) -> tuple[float, float]:
    """The x axis' ends: the data's, or on a log axis the powers of ten around them."""
    x0, x1 = min(xs), max(xs)
    if log:
        x0, x1 = 10 ** math.floor(math.log10(x0)), 10 ** math.ceil(math.log10(x1))
        return x0, (x0 * 10 if x1 == x0 else x1)
    return x0, (x0 + 1 if x1 == x0 else x1)


def _scales(r: tuple[float, float, float, float], box: tuple[float, float, float, float],
            log: bool, log_x: bool = False) -> tuple[Any, Any]:
    """Data -> pixel maps of the x and y axes (y on a log axis when ``log``, x when
    ``log_x``)."""
    x0, x1, y0, y1 = r
    left, top, pw, ph = box
    if log:
        y0, y1 = math.log10(y0), math.log10(y1)
    if log_x:
        x0, x1 = math.log10(x0), math.log10(x1)

    def sx(x: float) -> float:
        x = math.log10(max(x, 10 ** x0)) if log_x else x
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        y = math.log10(max(y, 10 ** y0)) if log else y  # zeros on the bottom edge
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    return sx, sy


def pick_series(series: list[dict]) -> tuple[list[dict], str]:
    """Every curve, the MAX_SERIES // 2 best and worst by final value shown and the others
    faded until their legend entry is clicked: each one is reachable."""
    if len(series) <= MAX_SERIES:
        return series, ""
    ranked = sorted(range(len(series)), key=lambda i: -next(
        (v for v in reversed(series[i]["mean"]) if math.isfinite(v)), -math.inf))
    half = MAX_SERIES // 2
    shown = set(ranked[:half] + ranked[-half:])
    out = [{**s, "hidden": i not in shown} for i, s in enumerate(series)]
    return out, (f" ({half} highest and {half} lowest final values of {len(series)} sweep "
                 "points shown; click a faded legend entry to show its curve)")


def line_chart(title: str, series: Sequence[dict], x_label: str = "round", y_label: str = "",
               width: int = 640, height: int = 320, log: bool | None = None,
               log_x: bool = False) -> str:
    """``series``: dicts with ``label``, ``x``, ``mean``, optional ``lo``/``hi`` (the spread
    band), ``color``, ``dash``, ``hidden`` (drawn faded until its legend entry is
    clicked) and ``scatter`` (points only: a ``<circle class="marker point">`` each, no
    line). One ``<polyline class="curve">`` per other series,
    ``<polygon class="band">`` when the band is not flat. ``log``: a log y axis (default:
    when the positive values span more than three decades); ``log_x``: a log x axis (its
    positive x values; from a power of ten to a power of ten). The legend's margin and the
    chart's height grow to hold every label whole; the title wraps."""
    pts = [(x, y) for s in series for x, y in zip(s["x"], s["mean"]) if math.isfinite(y)]
    pts += [(x, y) for s in series for key in ("lo", "hi") for x, y in zip(s["x"], s.get(key, []))
            if math.isfinite(y)]
    if log_x:
        pts = [p for p in pts if p[0] > 0]
    if not pts:
        return f'<figure class="chart"><figcaption>{_esc(title)}: no data</figcaption></figure>'
    log = wants_log(series) if log is None else log
    zeros = log and any(p[1] <= 0 for p in pts)
    xs = [p[0] for p in pts]  # zeros on a log axis still span the x axis (the bottom edge)
    if log:
        pts = [p for p in pts if p[1] > 0] or [(xs[0], 1.0)]
    _, _, y0, y1 = _ranges(pts, log)
    x0, x1 = _x_range(xs, log_x)
    yticks = [(t, f"1e{round(math.log10(t))}" if log and not 1e-3 <= t < 1e4 else _fmt(t))
              for t in (_log_ticks(y0, y1) if log else _ticks(y0, y1))]
    legend_w = max((text_width(str(s["label"])) for s in series), default=0) + 40
    left = max(64.0, max(text_width(label) for _, label in yticks) + 30)
    right, bottom = max(120, legend_w), 45
    scale = " (log scale; zeros on the bottom edge)" if zeros else " (log scale)" if log else ""
    scale += " (x on a log scale)" if log_x else ""
    head, extra = _title(title + scale, left, 18,
                         left + 480 + right - left)
    top = 30 + extra
    h = max(float(height), top + 16 * len(series) + 20)
    pw, ph = 480, h - top - bottom
    w = left + pw + right
    sx, sy = _scales((x0, x1, y0, y1), (left, top, pw, ph), log, log_x)

    out = [(f'<svg class="chart{" log" if log else ""}{" log-x" if log_x else ""}" role="img" '
            f'width="{w:.0f}" '
            f'height="{h:.0f}" viewBox="0 0 {w:.0f} {h:.0f}" '
            'xmlns="http://www.w3.org/2000/svg">'), head,
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="frame"/>']
    for t, label in yticks:
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" class="grid"/>'
                   f'<text x="{left - 6}" y="{sy(t) + 4:.1f}" class="tick ytick" '
                   f'text-anchor="end">{label}</text>')
    for t in _log_ticks(x0, x1) if log_x else _ticks(x0, x1):
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


def heat_map(title: str, rows: Sequence[str], cols: Sequence[str], values: dict, row_label: str,
             col_label: str, lo: float | None = None, hi: float | None = None,
             shared: int = 1) -> str:
    """``values[(row, col)] = (mean, std, count[, diverged])``; one ``<rect class="cell">``
    per (row, col), its value written in it (missing combinations grey and empty; a cell
    with ``diverged`` runs white with a red frame, "diverged" written in it and no value:
    never a colour of the scale). The colour scale (viridis: colour-blind safe and readable
    in grey) spans the data's range unless ``lo``/``hi`` are given, and a colour bar
    (``<g class="colorbar" data-lo data-hi data-shared>``) says so; ``shared``: the number of
    maps that take this one range (said under the bar, as is a map's own range). Labels are never
    cut: cells and margins are as wide as they need."""
    finite = [v[0] for v in values.values() if math.isfinite(v[0])]
    lo = min(finite, default=0.0) if lo is None else lo
    hi = max(finite, default=1.0) if hi is None else hi
    cw = max(72.0, max((text_width(str(c)) for c in cols), default=0) + 12)
    ch = 30
    left = max(110.0, max((text_width(str(r)) for r in rows), default=0) + 14,
               text_width(row_label + " ↓", 12) + 8)
    bar_w = 110
    grid_w = left + cw * len(cols)
    width = grid_w + bar_w
    head, extra = _title(title, 4, 18, width - 8)
    top = 60 + extra
    height = max(top + ch * len(rows) + 20, top + 150)
    out = [(f'<svg class="heatmap" role="img" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}" xmlns="http://www.w3.org/2000/svg">'), head,
           f'<text x="{left}" y="{top - 22}" class="axis">{_esc(col_label)} →</text>',
           f'<text x="4" y="{top - 6}" class="axis">{_esc(row_label)} ↓</text>']
    for j, c in enumerate(cols):
        out.append(f'<text x="{left + cw * j + cw / 2}" y="{top - 6}" class="tick" '
                   f'text-anchor="middle">{_esc(c)}</text>')
    for i, r in enumerate(rows):
        y = top + ch * i
        out.append(f'<text x="{left - 6}" y="{y + ch / 2 + 4}" class="tick" '
                   f'text-anchor="end">{_esc(r)}</text>')
        for j, c in enumerate(cols):
            mean, std, n, *rest = values.get((r, c), (math.nan, math.nan, 0))
            diverged = rest[0] if rest else 0
            x = left + cw * j
            fill = "#ffffff" if diverged else color(mean, lo, hi)
            frame = ' stroke="#d62728" stroke-width="2"' if diverged else ""
            ink = "#000" if math.isfinite(mean) and (mean - lo) > 0.6 * (hi - lo) else "#fff"
            what = (f"diverged ({diverged} of {n} runs)" if diverged else
                    f'{_fmt(mean)} ± {_fmt(std)} ({n} run{"s" if n != 1 else ""})')
            out.append(f'<rect class="cell" x="{x}" y="{y}" width="{cw - 2}" height="{ch - 2}" '
                       f'fill="{fill}"{frame} data-row="{_esc(r)}" data-col="{_esc(c)}" '
                       f'data-value="{math.nan if diverged else mean}" '
                       f'data-diverged="{diverged}"><title>{_esc(r)} × {_esc(c)}: {what}'
                       '</title></rect>')
            if diverged:
                out.append(f'<text x="{x + cw / 2 - 1}" y="{y + ch / 2 + 4}" class="cellv" '
                           'text-anchor="middle" fill="#d62728">diverged</text>')
            elif math.isfinite(mean):
                out.append(f'<text x="{x + cw / 2 - 1}" y="{y + ch / 2 + 4}" class="cellv" '
                           f'text-anchor="middle" fill="{ink}">{_fmt(mean)}</text>')
    out.append(colorbar(grid_w + 24, top, 110, lo, hi, shared))
    out.append("</svg>")
    return "".join(out)


def colorbar(x: float, y: float, h: float, lo: float, hi: float, shared: int = 1) -> str:
    """A vertical viridis bar from ``lo`` (bottom) to ``hi`` (top) with both ends labelled;
    under it, whether ``shared`` maps take this range or it is this map's own."""
    steps = 20
    parts = [f'<g class="colorbar" data-lo="{lo}" data-hi="{hi}" data-shared="{shared}">']
    for k in range(steps):
        v = hi - (hi - lo) * (k + 0.5) / steps
        parts.append(f'<rect x="{x}" y="{y + h * k / steps:.1f}" width="14" '
                     f'height="{h / steps + 0.5:.1f}" fill="{color(v, lo, hi)}"/>')
    parts += [f'<rect x="{x}" y="{y}" width="14" height="{h}" class="frame"/>',
              f'<text x="{x + 18}" y="{y + 9}" class="tick cbmax">{_fmt(hi)}</text>',
              f'<text x="{x + 18}" y="{y + h}" class="tick cbmin">{_fmt(lo)}</text>']
    first, second = ("one scale,", f"all {shared} maps") if shared > 1 else \
        ("the range of", "this map")
    parts += [f'<text x="{x - 16}" y="{y + h + 16}" class="tick cbshared">{first}</text>',
              f'<text x="{x - 16}" y="{y + h + 30}" class="tick cbshared">{second}</text>']
    parts.append("</g>")
    return "".join(parts)
