"""A run's figure (``figures/curves.svg``): one standalone SVG, a chart per panel, drawn
without matplotlib."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from dashboards.figures import run_figure, run_figure_svg
from dashboards.svg import line_chart

NS = "{http://www.w3.org/2000/svg}"


def test_the_figure_is_a_standalone_svg_with_a_chart_per_panel(tmp_path):
    rows = [{"test_accuracy": 0.1 * i, "test_loss": 2.0 - 0.1 * i, "train_loss": 2.1 - 0.1 * i,
             "aggregation_error": 10.0 ** -i if i else 0.0} for i in range(10)]
    path = run_figure(rows, tmp_path / "f" / "curves.svg", "quickstart seed=0")
    assert path == tmp_path / "f" / "curves.svg"
    root = ET.parse(path).getroot()
    assert root.tag == f"{NS}svg"
    charts = root.findall(f"{NS}svg")
    assert [c.find(f"{NS}text").findtext(f"{NS}tspan").split(" (")[0] for c in charts] == [
        "accuracy", "loss", "error"]
    # side by side, under the title, inside the document's width
    xs = [float(c.get("x")) for c in charts]
    widths = [float(c.get("width")) for c in charts]
    assert xs == sorted(xs) and xs[0] == 0
    assert all(a + w < b for a, w, b in zip(xs, widths, xs[1:]))
    assert xs[-1] + widths[-1] == float(root.get("width"))
    assert {c.get("y") for c in charts} == {"24"}
    assert root.find(f"{NS}text").text == "quickstart seed=0"
    finals = sorted(t.text for t in root.iter(f"{NS}title") if ": final" in t.text)
    assert finals == ["aggregation_error: final 1.00e-09", "test_accuracy: final 0.9",
                      "test_loss: final 1.1", "train_loss: final 1.2"]
    # the curves are not filled: the style travels inside the file
    assert ".curve{fill:none" in root.find(f"{NS}style").text


def test_nothing_to_plot_gives_no_figure(tmp_path):
    assert run_figure_svg([{"sampled": 10.0}]) is None
    assert run_figure([], tmp_path / "curves.svg") is None
    assert not (tmp_path / "curves.svg").exists()


def test_zeros_on_a_log_axis_sit_inside_the_frame():
    """A metric that is 0 in round 1, then spans decades: its zero is drawn on the bottom
    edge at round 1, the frame's left edge (the x axis spans the zeros too)."""
    svg = line_chart("error", [{"label": "e", "x": [1, 2, 3, 4],
                                "mean": [0.0, 1e-1, 1e-5, 1e-9]}])
    frame = re.search(r'<rect x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" height="([\d.]+)" '
                      r'class="frame"', svg)
    assert frame is not None
    left, top, _, height = (float(v) for v in frame.groups())
    cx, cy = (float(v) for v in re.search(r'<circle [^>]*cx="([\d.]+)" cy="([\d.]+)"',
                                          svg).groups())
    assert (cx, cy) == (left, top + height)
