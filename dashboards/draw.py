"""The report's figures, each drawn once, with matplotlib: a line chart (a curve and a spread
band per series, or small multiples: one panel per condition of a robust-FL sweep) and a heat
map (a cell per (row, column), its value written in it, a colour bar). The same ``Figure``
is inlined in the HTML report as SVG (``Drawing.svg``), saved as PDF and SVG beside it
(``dashboards.export.write_figures``) and returned by ``fedray.results(...).figures()``, so
the three cannot drift.

Every mark the report's script and its tests address is an artist with a ``gid``; the SVG
post-pass (``Drawing.svg``) turns each such group into the classes, ``data-*`` attributes and
native ``<title>`` hover texts of the page: ``g.curve``, ``g.band``, ``use.marker`` (a
``point`` each for a scatter), ``g.legend`` and its key ``g.legend-key`` (a click on
either shows or fades its series, in every panel), ``g.cell`` with
``data-row``/``data-col``/``data-value``/``data-diverged``, ``g.colorbar`` with ``data-lo``/``data-hi``/``data-shared``. The ids matplotlib gives are
prefixed per figure (several figures share one HTML page) or dropped where nothing refers
to them; text stays text (``svg.fonttype: none``), so a page is searchable and its labels
selectable.

Figures are ``matplotlib.figure.Figure`` objects made without pyplot: no backend is chosen and
no window can open (a report drawn from a desktop session or a thread draws the same).

A figure keeps its plot at least about half of the page: the legend goes outside the plot
(beside or below it, where it takes less room) and the figure grows by it; a chart with more
curves than one plot reads is split into small multiples, a curve per setting in the same
style in every panel. The HTML's hints (which curves are faded, what a click does) are page
text beside the figure, never in it.
"""

from __future__ import annotations

import html
import io
import math
import re
import textwrap
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf"]
MAX_SERIES = 10  # curves shown at once on a line chart; pick_series fades the others
SVG = "http://www.w3.org/2000/svg"
XLINK = "http://www.w3.org/1999/xlink"
# how matplotlib writes the SVG: text as text, ids that do not change from run to run
SVG_RC: Any = {"svg.fonttype": "none", "svg.hashsalt": "fedray", "font.sans-serif": ["DejaVu Sans"]}


def fmt(v: float) -> str:
    """A value as a label: three significant digits, exponent form outside [1e-3, 1e4)."""
    if not math.isfinite(v):
        return str(v)
    if v != 0 and (abs(v) >= 1e4 or abs(v) < 1e-3):
        return f"{v:.2e}"
    return f"{v:.3g}"


def spans_decades(values: Sequence[float], ratio: float = 1e3) -> bool:
    """Whether positive ``values`` span more than ``ratio`` (a log axis reads them)."""
    pos = [v for v in values if math.isfinite(v)]
    return bool(pos) and min(pos) > 0 and max(pos) / min(pos) > ratio


def wants_log(series: Sequence[dict]) -> bool:
    """Whether a chart of ``series`` reads on a log y axis: its non-zero values (curves and
    bands) are positive and span more than three decades."""
    return spans_decades([y for s in series for key in ("mean", "lo", "hi")
                          for y in s.get(key) or [] if math.isfinite(y) and y != 0])


def pick_series(series: list[dict]) -> tuple[list[dict], str]:
    """Every curve, the MAX_SERIES // 2 best and worst by final value shown and the others
    faded until their legend entry is clicked (``hidden``): each one is reachable. The note
    says so (page text for the HTML; the exported figure draws every curve)."""
    if len(series) <= MAX_SERIES:
        return series, ""
    ranked = sorted(range(len(series)), key=lambda i: -next(
        (v for v in reversed(series[i]["mean"]) if math.isfinite(v)), -math.inf))
    half = MAX_SERIES // 2
    shown = set(ranked[:half] + ranked[-half:])
    out = [{**s, "hidden": i not in shown} for i, s in enumerate(series)]
    return out, (f"{half} highest and {half} lowest final values of {len(series)} sweep "
                 "points shown; click a faded legend entry to show its curve.")


@dataclass
class Mark:
    """What the SVG post-pass gives the group of one artist: its ``cls`` (with ``off`` for a
    series faded on the page), ``data-*`` attributes, a hover ``title``; ``points``: a hover
    title for each of its markers (a scatter's points), ``marker``: the markers' class."""

    cls: str
    data: dict[str, str] = field(default_factory=dict)
    title: str = ""
    marker: str = ""
    points: list[str] = field(default_factory=list)


@dataclass
class Drawing:
    """One figure of a report: its ``kind`` (``lines`` or ``heat``), the ``spec`` it was
    drawn from (the numbers), the matplotlib ``figure`` and the ``marks`` its SVG carries on
    the page (by artist gid)."""

    kind: str
    spec: dict[str, Any]
    figure: Figure
    marks: dict[str, Mark]
    css: str  # the page's class of its <svg>: chart (log, log-x) or heatmap

    @property
    def title(self) -> str:
        return str(self.spec["title"])

    def svg(self, prefix: str = "f") -> str:
        """The figure as an SVG element to inline in an HTML page: the marks applied, ids
        prefixed with ``prefix`` (unique on the page), no XML prolog or metadata."""
        import matplotlib

        buf = io.StringIO()
        with matplotlib.rc_context(SVG_RC):
            self.figure.savefig(buf, format="svg", metadata={"Date": None})
        return _post_pass(buf.getvalue(), self, prefix)


def _post_pass(text: str, drawing: Drawing, prefix: str) -> str:
    """matplotlib's SVG as the page's: each marked group classed, its data and title set;
    ids prefixed where referred to, dropped elsewhere."""
    ET.register_namespace("", SVG)
    ET.register_namespace("xlink", XLINK)
    root = ET.fromstring(text)
    for meta in root.findall(f"{{{SVG}}}metadata"):
        root.remove(meta)
    for defs in root.findall(f"{{{SVG}}}defs"):  # its style is the page's (report.CSS)
        for style in defs.findall(f"{{{SVG}}}style"):
            defs.remove(style)
        if not len(defs):
            root.remove(defs)
    refs = set(re.findall(r'url\(#([^)]+)\)|href="#([^"]+)"', text))
    referred = {a or b for a, b in refs}
    for el in list(root.iter()):  # titles are inserted on the way
        _ids(el, drawing.marks, referred, prefix)
        if el.text is not None and not el.text.strip():  # matplotlib's indentation:
            el.text = None                                   # a tenth of the bytes
        if el.tail is not None and not el.tail.strip():
            el.tail = None
    root.attrib.pop("version", None)
    head = (f'<svg class="{drawing.css}" role="img" '
            f'aria-label="{html.escape(drawing.title, quote=True)}" ')
    return head + ET.tostring(root, encoding="unicode").removeprefix("<svg ")


_DIGITS = re.compile(r"(\.\d\d)\d+")


def _ids(el: ET.Element, marks: dict[str, Mark], referred: set[str], prefix: str) -> None:
    """An element of matplotlib's SVG as the page's: marked (its id dropped), its id
    prefixed where something refers to it (dropped where nothing does), its references
    prefixed."""
    gid = el.get("id")
    if gid is not None:
        del el.attrib["id"]
        if gid in marks:
            _apply(el, marks[gid])
        elif gid in referred:
            el.set("id", f"{prefix}-{gid}")
    for attr in ("clip-path", "style", "fill", "mask"):
        v = el.get(attr)
        if v is not None and "url(#" in v:
            el.set(attr, v.replace("url(#", f"url(#{prefix}-"))
    for attr in ("d", "x", "y", "points"):  # 0.01 pt is finer than any screen: half the bytes
        v = el.get(attr)
        if v is not None:
            el.set(attr, _DIGITS.sub(r"\1", v))
    xlink = f"{{{XLINK}}}href"
    v = el.get(xlink)
    if v is not None:  # SVG 2's plain href: no second namespace on the page
        del el.attrib[xlink]
        el.set("href", f"#{prefix}-{v[1:]}" if v.startswith("#") else v)


def _apply(el: ET.Element, mark: Mark) -> None:
    el.set("class", mark.cls)
    for k, v in mark.data.items():
        el.set(f"data-{k}", v)
    if mark.title:
        title = ET.Element(f"{{{SVG}}}title")
        title.text = mark.title
        el.insert(0, title)
    if mark.marker:
        for n, use in enumerate(el.iter(f"{{{SVG}}}use")):
            use.set("class", mark.marker)  # its group carries the series and the fading
            if n < len(mark.points):
                t = ET.SubElement(use, f"{{{SVG}}}title")
                t.text = mark.points[n]


# ---------------------------------------------------------------------------- line charts

MIN_SHARE = 0.6  # of the page the plots take, by the layout's estimate
LEGEND_FONT = 7.5  # pt
ROW = LEGEND_FONT * 1.45 / 72  # in: a legend row
SPARSE = 25  # a series of at most this many points shows each as a marker


def _dash(pattern: str) -> Any:
    if not pattern:
        return "-"
    return (0, tuple(float(x) / 2 for x in pattern.split()))


def _draw(ax: Any, series: list[dict], log: bool, index: dict[str, int], panel: int,
          marks: dict[str, Mark]) -> None:
    """The ``series`` on ``ax``; each curve, band and marker marked with its series' index
    in the figure's legend (``index``, by label), so a click reaches it in every panel."""
    for s in series:
        i = index[s["label"]]
        c = s.get("color") or PALETTE[i % len(PALETTE)]
        off = " off" if s.get("hidden") else ""
        data = {"series": str(i)}
        pts = [(x, y) for x, y in zip(s["x"], s["mean"]) if math.isfinite(y)
               and (y > 0 or not log)]
        gid = f"fedray-{panel}-{i}"
        if not pts:  # nothing to draw, but named in the legend (its label says why)
            ax.plot([], [], color=c, linestyle=_dash(s.get("dash", "")), label=s["label"])
            continue
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        if s.get("scatter"):  # points, no line: a hover title each
            (line,) = ax.plot(xs, ys, color=c, linestyle="none", marker="o", markersize=4,
                              label=s["label"])
            line.set_gid(gid)
            marks[gid] = Mark(f"scatter{off}", data, marker="marker point",
                              points=[f"{s['label']}: ({fmt(x)}, {fmt(y)})" for x, y in pts])
            continue
        markers = bool(s.get("markers")) or len(pts) <= SPARSE
        (line,) = ax.plot(xs, ys, color=c, linestyle=_dash(s.get("dash", "")), linewidth=1.4,
                          label=s["label"], marker="o" if markers else None, markersize=3)
        line.set_gid(gid)
        last = next(y for y in reversed(s["mean"]) if math.isfinite(y))  # drawn or not (<= 0)
        marks[gid] = Mark(f"curve{off}", data, f"{s['label']}: final {fmt(last)}",
                          marker="marker" if markers else "")
        lo, hi = s.get("lo"), s.get("hi")
        if lo and hi and any(a != b for a, b in zip(lo, hi)):
            band = ax.fill_between(s["x"], lo, hi, color=c, alpha=0.15, linewidth=0)
            band.set_gid(f"{gid}-band")
            marks[f"{gid}-band"] = Mark(f"band{off}", data)
    if log:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)


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


def lines(spec: dict[str, Any]) -> Drawing:
    """A line chart: ``spec`` has ``title``, ``series`` (dicts with ``label``, ``x``,
    ``mean``, optional ``lo``/``hi`` (the spread band), ``color``, ``dash`` (an SVG dash
    pattern), ``hidden`` (faded on the page until its legend entry is clicked), ``scatter``
    (points only), ``markers``), ``x_label``, ``y_label``, optional ``panels`` ((title,
    series) small multiples on shared axes, drawn instead of ``series``), ``log`` (a log y
    axis; default: ``wants_log``) and ``log_x``. The legend is outside the plots, beside or
    below them, where it takes the less room, and the figure grows by it."""
    from matplotlib.figure import Figure

    panels = spec.get("panels") or [("", spec["series"])]
    every = [s for _, series in panels for s in series]
    log = spec["log"] if spec.get("log") is not None else wants_log(every)
    y_label = spec["y_label"]
    if log and any(y <= 0 for s in every for y in s["mean"] if math.isfinite(y)):
        y_label += " (values ≤ 0 not drawn)"  # a log axis has no place for them
    n = len(panels)
    ncols = 1 if n == 1 else 2 if n <= 4 else 3
    nrows = math.ceil(n / ncols)
    pw, ph = (5.2, 3.0) if n == 1 else (3.2, 2.1)
    entries = list(dict.fromkeys(s["label"] for s in every))
    index = {e: i for i, e in enumerate(entries)}
    marks: dict[str, Mark] = {}
    where, legend_cols, fig_w, fig_h = _figure_size(entries, ncols, nrows, pw, ph)
    fig = Figure(figsize=(fig_w, fig_h), layout="constrained")
    axes = fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False)
    for k, ax in enumerate(axes.flat):
        if k >= n:
            ax.set_visible(False)
            continue
        title, series = panels[k]
        _draw(ax, series, log, index, k, marks)
        _axes(ax, spec, y_label if k % ncols == 0 else "", title if n > 1 else "",
              bottom=k + ncols >= n)
    handles: dict[str, Any] = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    order = [e for e in entries if e in handles]  # the settings' order, in every chart
    legend = fig.legend([handles[e] for e in order], order, fontsize=LEGEND_FONT,
                        frameon=False, ncols=legend_cols,
                        loc="outside right center" if where == "right" else
                        "outside lower center")
    _mark_legend(legend, order, index, {s["label"] for s in every if s.get("hidden")}, marks)
    fig.suptitle("\n".join(textwrap.wrap(spec["title"], 90)), fontsize=10)
    css = "chart" + (" log" if log else "") + (" log-x" if spec.get("log_x") else "")
    return Drawing("lines", spec, fig, marks, css)


def _axes(ax: Any, spec: dict[str, Any], y_label: str, title: str, bottom: bool) -> None:
    """A panel's scales, title and axis labels (``y_label`` given to the left column's; the
    x label and its ticks on the bottom row)."""
    from matplotlib.ticker import MaxNLocator

    if spec.get("log_x"):
        ax.set_xscale("log")
    if spec["x_label"] == "round" or spec["x_label"].startswith("evaluation"):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if title:
        ax.set_title(title, fontsize=9)
    if y_label:
        ax.set_ylabel(y_label)
    if bottom:
        ax.set_xlabel(spec["x_label"])
        ax.xaxis.set_tick_params(labelbottom=True)


def _mark_legend(legend: Any, order: list[str], index: dict[str, int], hidden: set[str],
                 marks: dict[str, Mark]) -> None:
    """Each legend entry's handle and text marked ``legend`` with its series (a click on
    either shows or fades the series); faded with it when it starts faded."""
    for label, handle, text in zip(order, legend.legend_handles, legend.get_texts()):
        off = " off" if label in hidden else ""
        for part, artist in (("handle", handle), ("text", text)):
            if artist is None:  # a handle matplotlib could not draw: nothing to mark
                continue
            gid = f"fedray-legend-{index[label]}-{part}"
            artist.set_gid(gid)
            marks[gid] = Mark(f"legend{off}" if part == "text" else f"legend-key{off}",
                              {"series": str(index[label]), "label": label},
                              label if part == "text" else "")


# ---------------------------------------------------------------------------- heat maps

def heat(spec: dict[str, Any]) -> Drawing:
    """A heat map: ``spec`` has ``title``, ``rows``, ``cols``, ``values[(row, col)] =
    (mean, std, count[, diverged])``, ``row_label``, ``col_label``, optional ``lo``/``hi``
    (the colour range; default the data's) and ``shared`` (how many maps take that range).
    A cell per (row, col), its value written in it; a missing combination grey and empty; a
    cell with diverged runs white with a red hatched frame and "diverged" written in it,
    never a colour of the scale. Viridis (colour-blind safe, readable in grey); the colour
    bar is labelled at both ends of its range and says whether the range is this map's or
    shared. Cells at least 0.95 x 0.42 in and the map at least 5 x 3.4 in, so its labels,
    title and colour bar take less of the page than the map."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    rows, cols, values = spec["rows"], spec["cols"], spec["values"]
    cells = {(r, c): values.get((r, c), (math.nan, math.nan, 0)) for r in rows for c in cols}
    scored = [v[0] for v in cells.values() if math.isfinite(v[0]) and not _diverged(v)]
    lo = float(spec["lo"]) if spec.get("lo") is not None else min(scored, default=0.0)
    hi = float(spec["hi"]) if spec.get("hi") is not None else max(scored, default=1.0)
    norm = Normalize(vmin=lo, vmax=hi if hi > lo else lo + 1e-9)
    cmap = colormaps["viridis"]
    w, h = max(0.95 * len(cols), 5.0), max(0.42 * len(rows), 3.4)
    label_w = max((len(str(r)) for r in rows), default=0) * 0.075 + 0.5
    fig = Figure(figsize=(w + label_w + 1.1, h + 1.2), layout="constrained")
    ax = fig.subplots()
    marks: dict[str, Mark] = {}
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            mean, std, n, *rest = cells[(r, c)]
            diverged = rest[0] if rest else 0
            gid = f"fedray-cell-{i}-{j}"
            if diverged:
                patch = Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="white",
                                  edgecolor="#d62728", hatch="///", linewidth=1.5)
                what = f"diverged ({diverged} of {n} runs)"
            else:
                fill = cmap(norm(mean)) if math.isfinite(mean) else "#cccccc"
                patch = Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=fill, edgecolor="white",
                                  linewidth=1)
                what = f'{fmt(mean)} ± {fmt(std)} ({n} run{"s" if n != 1 else ""})'
            patch.set_gid(gid)
            ax.add_patch(patch)
            marks[gid] = Mark("cell", {"row": str(r), "col": str(c),
                                       "value": str(math.nan if diverged else mean),
                                       "diverged": str(diverged)}, f"{r} × {c}: {what}")
            if diverged:
                ax.text(j, i, "diverged", ha="center", va="center", fontsize=9, weight="bold",
                        color="#d62728", bbox={"facecolor": "white", "edgecolor": "none",
                                               "pad": 1})
            elif math.isfinite(mean):
                light = hi > lo and (mean - lo) > 0.6 * (hi - lo)
                ax.text(j, i, fmt(mean), ha="center", va="center", fontsize=9,
                        color="black" if light else "white")
    ax.set_xlim(-0.5, len(cols) - 0.5)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # the first row on top
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    ax.tick_params(length=0)
    ax.set_xlabel(spec["col_label"])
    ax.set_ylabel(spec["row_label"])
    bar = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax)
    ticks = [lo, hi] if hi > lo else [lo]
    bar.set_ticks(ticks, labels=[fmt(t) for t in ticks])
    shared = int(spec.get("shared", 1))
    bar.set_label(f"one scale for all {shared} maps" if shared > 1 else
                  "the range of this map", fontsize=8)
    bar.ax.set_gid("fedray-colorbar")
    marks["fedray-colorbar"] = Mark("colorbar", {"lo": str(lo), "hi": str(hi),
                                                 "shared": str(shared)})
    ax.set_title("\n".join(textwrap.wrap(spec["title"], 80)), fontsize=10)
    return Drawing("heat", spec, fig, marks, "heatmap")


def _diverged(v: Sequence[Any]) -> bool:
    return len(v) > 3 and bool(v[3])

