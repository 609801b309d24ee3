"""`fedray report` in a real browser: headless Chromium (Debian's package; .ci/run installs it)
loads the report from a local file with no console error, shows the expected number of
heat-map cells and curves, and leaves a screenshot in the test's tmp dir."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from dashboards.figures import PANELS, RunFigure
from dashboards.report import build_report
from simulator.config.load import load
from simulator.run.runner import run_loaded
from tests.stores import run_text

SWEEP = """\
name: report-test
description: 2 aggregators x 2 attacks x 2 seeds
rounds: 4
seeds: [0, 1]
data:
  dataset: {name: digits}
model: {name: logreg}
clients: {total: 10, per_round: 6, byzantine: 2}
local: {steps: 2, batch_size: 16, lr: 0.2}
attack: {name: sign_flip}
sweep:
  aggregator.name: [mean, median]
  attack.name: [sign_flip, alie]
runtime: {backend: inline}
"""

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--no-first-run", "--disable-dev-shm-usage"]


@pytest.fixture(scope="module")
def report(new_store):
    tmp, uri = new_store("report")
    out = run_text(tmp, uri, SWEEP, "sweep.yaml", callbacks=[RunFigure()])
    path = build_report("report-test", tmp / "out", uri)
    return {"path": path, "uri": uri, "parent": out.parent_run_id, "runs": out.runs, "tmp": tmp}


def test_report_content_and_mlflow_artifacts(report):
    text = report["path"].read_text()
    assert text.count('<g class="cell"') == 4  # aggregator x attack
    # 4 sweep points: a curve each in the accuracy, loss and aggregation-error charts
    assert text.count('<g class="curve"') == 12
    assert "<script>" in text and "http" not in text.replace("http://www.w3.org/2000/svg", "")
    client = MlflowClient(report["uri"])
    assert [a.path for a in client.list_artifacts(report["parent"], "report")] == ["report/report.html"]
    child = report["runs"][0]["run_id"]
    assert [a.path for a in client.list_artifacts(child, "figures")] == ["figures/curves.svg"]
    # the run's figure: a standalone SVG (MLflow previews it), a panel per kind of metric,
    # each curve titled with its final value
    svg = Path(client.download_artifacts(child, "figures/curves.svg", str(report["tmp"])))
    root = ET.parse(svg).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    assert root.tag == f"{ns}svg" and len(root.findall(f"{ns}svg")) == 3
    titles = [t.text for t in root.iter(f"{ns}title")]
    acc = report["runs"][0]["final_test_accuracy"]
    assert f"test_accuracy: final {acc:.3g}" in titles
    # a curve for each metric of a panel the run logged (metrics.parquet's columns)
    columns = pq.read_table(client.download_artifacts(child, "metrics.parquet",
                                                      str(report["tmp"]))).column_names
    drawn = sorted(t.split(": final")[0] for t in titles if ": final" in t)
    assert drawn == sorted(k for _, keys in PANELS for k in keys if k in columns)
    assert {"test_accuracy", "test_loss", "aggregation_error"} <= set(drawn)
    assert len(list(root.iter(f"{ns}polyline"))) == len(drawn)
    # every cell holds the mean over seeds of the runs' final accuracy
    cells = {(row, col): float(v) for row, col, v in re.findall(
        r'<g class="cell"[^>]*data-row="([^"]+)" data-col="([^"]+)" data-value="([^"]+)"', text)}
    by_point: dict = {}
    for r in report["runs"]:
        by_point.setdefault((r["values"]["aggregator.name"], r["values"]["attack.name"]), []).append(
            r["final_test_accuracy"])
    for key, accs in by_point.items():
        assert cells[key] == pytest.approx(sum(accs) / len(accs))


def _load(url: str) -> tuple[str, list[str]]:
    """(DOM after scripts ran, console messages) of ``url`` in headless Chromium."""
    r = subprocess.run([CHROMIUM, *FLAGS, "--enable-logging=stderr", "--v=0",
                        "--virtual-time-budget=3000", "--dump-dom", url],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout, [line for line in r.stderr.splitlines() if ":CONSOLE" in line]


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def test_report_in_headless_chromium(report):
    tmp = report["tmp"]
    url = report["path"].resolve().as_uri()
    dom, console = _load(url)
    # the DOM as the browser built it: cells, curves and the legend's script all there
    assert dom.count('class="cell"') == 4
    assert dom.count('class="curve"') == 12
    assert console == []  # no message at all: no error, no stray log
    # the console check sees a page's errors (so an empty list means something)
    bad = tmp / "bad.html"
    bad.write_text("<html><body><script>console.error('boom'); missing();</script></body></html>")
    _, bad_console = _load(bad.resolve().as_uri())
    assert any("Uncaught ReferenceError" in line for line in bad_console)
    shot = tmp / "report.png"
    s = subprocess.run([CHROMIUM, *FLAGS, "--window-size=1400,2000", f"--screenshot={shot}", url],
                       capture_output=True, text=True, timeout=120, check=False)
    assert s.returncode == 0 and shot.stat().st_size > 20_000, s.stderr[-2000:]


def test_report_shows_privacy_curves(tmp_path, _mlflow_template):
    db = tmp_path / "mlflow.db"
    shutil.copy(_mlflow_template, db)
    uri = f"sqlite:///{db}"
    p = tmp_path / "dp.yaml"
    p.write_text(SWEEP.replace("name: report-test", "name: dp-report")
                 .replace("clients: {total: 10, per_round: 6, byzantine: 2}",
                          "clients: {total: 10, per_round: 6}")
                 .replace("attack: {name: sign_flip}\n", "")
                 .replace("  aggregator.name: [mean, median]\n  attack.name: [sign_flip, alie]\n",
                          "  privacy.noise_multiplier: [0.0, 0.8, 2.0]\n")
                 .replace("runtime: {backend: inline}", "runtime: {backend: inline}\n"
                          "privacy: {name: dp_sgd, clip: 1.0, noise_multiplier: 1.0}"))
    run_loaded(load(p), tracking_uri=uri, quiet=True)
    text = build_report("dp-report", tmp_path / "out", uri).read_text()
    assert "<h2>Privacy</h2>" in text
    assert "privacy spent: epsilon" in text  # epsilon per round, one curve per noise level
    section = text.split("<h2>Privacy</h2>")[1]
    # noise 0: epsilon is inf, which MLflow stores as the largest float; it must read back as
    # inf (its curve is not drawn) rather than overflow the mean over seeds
    assert "noise_multiplier=0.0 (2 of 2 runs not finite)" in text
    # one trade-off curve per mechanism (noise 0: beta = 0 everywhere, a curve too)
    assert section.count('<g class="curve"') == 3
    # the Delta table: more noise is more private, so choosing 0.8 over 2.0 costs something,
    # Delta(2.0 || 0.8) > 0, and the other way round nothing
    table = section.split('<table class="mechanisms">')[1].split("</table>")[0]
    rows = [r.split("</td>") for r in table.split("<tr>")[2:]]
    names = [r[0].rsplit(">", 1)[1] for r in rows]
    assert names == ["noise_multiplier=0.0", "noise_multiplier=0.8", "noise_multiplier=2.0"]
    none, low, high = 0, 1, 2
    assert float(rows[none][1].rsplit(">", 1)[1]) == 1.0  # no noise: advantage 1
    value = lambda i, j: float(rows[i][2 + j].rsplit(">", 1)[1])
    assert value(high, low) > 0.05 and value(low, high) == 0.0
    assert value(low, low) == 0.0 == value(high, high)
    adv = [float(r[1].rsplit(">", 1)[1]) for r in rows]
    assert 0 < adv[high] < adv[low] < 1


def test_report_lists_each_mechanism_once():
    """Runs that differ only in the aggregator share one mechanism: one trade-off curve and one
    row of the Delta table each, named by the privacy param that varies."""
    import numpy as np

    from dashboards.report import RunData, render
    from strategies.privacy import gaussian_tradeoff

    alpha = np.linspace(0, 1, 1001)
    runs = []
    for sigma, mu in [("1.0", 2.0), ("2.0", 1.0)]:
        for agg in ("mean", "median"):
            params = {"privacy.noise_multiplier": sigma, "privacy.clip": "1.0",
                      "privacy.epsilon": str(mu), "aggregator.name": agg}
            runs.append(RunData(f"{sigma}{agg}", f"{sigma} {agg} seed=0", f"{sigma} {agg}", "0",
                                {}, params, {"test_accuracy": [(0, 0.5)]},
                                (alpha.tolist(), gaussian_tradeoff(alpha, mu).tolist())))
    section = render("t", runs).split("<h2>Privacy</h2>")[1]
    assert section.count('<g class="curve"') == 2
    table = section.split('<table class="mechanisms">')[1].split("</table>")[0]
    assert table.count("<tr>") == 3  # header + 2 mechanisms
    assert "noise_multiplier=1.0" in table and "aggregator" not in table
    # G_2 against G_1: Phi(1) - Phi(1/2), choosing sigma 1 (mu 2) over sigma 2 (mu 1)
    from scipy.stats import norm

    expect = f"{norm.cdf(1.0) - norm.cdf(0.5):.4f}"
    assert expect in table


# what a person sees, measured in the browser: every text inside its figure, the colour bar's
# range, one style per sweep point across panels
PROBE = """
<script>
window.addEventListener('load', function () {
  var out = {clipped: [], bars: [], strokes: {}};
  document.querySelectorAll('svg').forEach(function (svg, k) {
    var box = svg.viewBox.baseVal;
    var s = svg.getBoundingClientRect();  // on screen, transforms (rotated labels) applied
    svg.querySelectorAll('text').forEach(function (t) {
      var b = t.getBoundingClientRect();
      if (b.left < s.left - 0.5 || b.top < s.top - 0.5 || b.right > s.right + 0.5 ||
          b.bottom > s.bottom + 0.5) {
        out.clipped.push(k + ': ' + t.textContent);
      }
    });
  });
  document.querySelectorAll('g.colorbar').forEach(function (g) {
    var cells = Array.from(g.closest('svg').querySelectorAll('g.cell'))
      .map(function (c) { return parseFloat(c.getAttribute('data-value')); })
      .filter(function (v) { return isFinite(v); });
    out.bars.push([parseFloat(g.getAttribute('data-lo')), parseFloat(g.getAttribute('data-hi')),
                   Math.min.apply(null, cells), Math.max.apply(null, cells),
                   Array.from(g.querySelectorAll('text')).map(function (t) {
                     return t.textContent; })]);
  });
  // the stroke each label is drawn with: its legend key and its curve in every panel
  document.querySelectorAll('svg.chart').forEach(function (svg) {
    svg.querySelectorAll('.legend-key, .curve').forEach(function (g) {
      var i = g.getAttribute('data-series');
      var label = svg.querySelector('.legend-key[data-series="' + i + '"]')
        .getAttribute('data-label');
      var st = getComputedStyle(g.querySelector('path'));
      (out.strokes[label] = out.strokes[label] || []).push(
        st.stroke.replace(/ /g, '') + ' ' + st.strokeDasharray.replace(/ /g, ''));
    });
  });
  var pre = document.createElement('pre'); pre.id = 'probe';
  pre.textContent = JSON.stringify(out); document.body.appendChild(pre);
});
</script>
"""


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def test_what_a_person_sees_in_the_report(report):
    import json

    probe = report["tmp"] / "probe.html"
    control = ('<svg viewBox="0 0 60 20" width="60" height="20"><text x="2" y="15">'
               "a label much wider than its figure</text></svg>")  # the probe sees clipping
    probe.write_text(report["path"].read_text().replace("</body>", control + PROBE + "</body>"))
    dom, console = _load(probe.resolve().as_uri())
    assert console == []
    seen = json.loads(dom.split('<pre id="probe">')[1].split("</pre>")[0])
    # no title, tick, legend or label cut by its figure (but the control's)
    assert [c.split(": ", 1)[1] for c in seen["clipped"]] == ["a label much wider than its figure"]
    assert seen["bars"]
    for lo, hi, cell_lo, cell_hi, texts in seen["bars"]:
        # the colour scale is the data's range, and its bar says so at both ends
        assert (lo, hi) == (pytest.approx(cell_lo), pytest.approx(cell_hi)) and lo < hi
        shown = sorted(float(t) for t in texts if re.fullmatch(r"[-0-9.e+]+", t))
        assert shown == [pytest.approx(lo, rel=1e-2), pytest.approx(hi, rel=1e-2)]
        assert "the range of this map" in texts
    # one colour per aggregator, one dash per attack, the same in the legend and every chart
    # in each of the 3 charts: its legend key and its curve
    assert all(len(s) == 6 for s in seen["strokes"].values())
    styles = {label: set(s) for label, s in seen["strokes"].items()}
    assert len(styles) == 4 and all(len(s) == 1 for s in styles.values()), styles
    colour = {label: next(iter(s)).split()[0] for label, s in styles.items()}
    dash = {label: next(iter(s)).split()[1] for label, s in styles.items()}
    assert colour["mean sign_flip"] == colour["mean alie"] != colour["median alie"]
    assert dash["mean sign_flip"] == dash["median sign_flip"] != dash["mean alie"]
    shot = report["tmp"] / "seen.png"
    subprocess.run([CHROMIUM, *FLAGS, "--window-size=1400,2400", f"--screenshot={shot}",
                    report["path"].resolve().as_uri()], capture_output=True, timeout=120,
                   check=True)


def test_worst_case_over_attacks_and_the_context_header(report):
    text = report["path"].read_text()
    assert "<b>model</b> logreg" in text and "<b>Byzantine</b> 2" in text
    assert "<b>attack</b> swept (sign_flip, alie)" in text and "<b>seeds</b> 0, 1" in text
    table = text.split('<table class="worst-case">')[1].split("</table>")[0]
    rows = [[c.rsplit(">", 1)[1] for c in r.split("</td>")[:-1]] for r in table.split("<tr>")[2:]]
    by_point: dict = {}
    for r in report["runs"]:
        by_point.setdefault((r["values"]["aggregator.name"], r["values"]["attack.name"]),
                            []).append(r["final_test_accuracy"])
    for agg, sign_flip, alie, worst, attack in rows:
        means = {a: sum(v) / len(v) for (g, a), v in by_point.items() if g == agg}
        assert float(sign_flip) == pytest.approx(means["sign_flip"], rel=1e-3)
        assert float(alie) == pytest.approx(means["alie"], rel=1e-3)
        assert float(worst) == pytest.approx(min(means.values()), rel=1e-3)
        assert attack == min(means, key=means.get)


def test_log_axis_for_a_metric_that_spans_decades():
    from dashboards.draw import lines

    drawing = lines({"title": "consensus distance", "x_label": "round", "y_label": "",
                     "series": [{"label": "ring", "x": [0, 1, 2, 3],
                                 "mean": [0.2, 1e-3, 1e-9, 1e-13]}]})
    assert drawing.svg().startswith('<svg class="chart log"')
    (ax,) = drawing.figure.axes
    assert ax.get_yscale() == "log"
    lo, hi = ax.get_ylim()
    assert lo <= 1e-13 and hi >= 0.2
    assert ax.get_ylabel() == ""  # every value drawn
    zero = lines({"title": "error", "x_label": "round", "y_label": "error",
                  "series": [{"label": "a", "x": [0, 1, 2], "mean": [1.0, 0.0, 1e-9]}]})
    (ax,) = zero.figure.axes
    assert ax.get_yscale() == "log" and ax.get_ylabel() == "error (values ≤ 0 not drawn)"
    flat = lines({"title": "accuracy", "x_label": "round", "y_label": "",
                  "series": [{"label": "a", "x": [0, 1], "mean": [0.5, 0.9]}]})
    assert flat.svg().startswith('<svg class="chart"') and flat.figure.axes[0].get_yscale() == \
        "linear"


def test_every_figure_as_pdf_and_svg_and_every_table_as_markdown_and_latex(report):
    out = report["path"].parent
    text = report["path"].read_text()
    pdfs = sorted((out / "figures").glob("*.pdf"))
    svgs = sorted((out / "figures").glob("*.svg"))
    # 3 charts (accuracy, loss, aggregation error) and 1 aggregator x attack heat map
    figures = text.count('<svg class="chart') + text.count('<svg class="heatmap"')
    assert len(pdfs) == len(svgs) == figures == 4
    assert [p.stem for p in pdfs] == [p.stem for p in svgs]
    assert pdfs[0].read_bytes().startswith(b"%PDF") and b"<svg" in svgs[0].read_bytes()
    # the files are the page's figures: the same drawing, so the same texts and marks
    from dashboards.export import slug

    files = {p.stem.split("-", 1)[1]: p.read_text() for p in svgs}
    pages = {slug(html.unescape(m.group(1))): m.group(0) for m in re.finditer(
        r'<svg class="(?:chart|heatmap)[^"]*"[^>]*aria-label="([^"]*)".*?</svg>', text, re.DOTALL)}
    assert len(pages) == 4 and sorted(files) == sorted(pages)
    for name, written in files.items():
        assert _texts(written) == _texts(pages[name]) != [], name
        assert _paths(written) == _paths(pages[name]) > 0, name
    md = (out / "tables" / "worst-case.md").read_text().splitlines()
    assert md[0] == "| aggregator | sign_flip | alie | worst | worst attack |"
    html_rows = text.split('<table class="worst-case">')[1].split("</table>")[0]
    for line in md[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert "<td>" + "</td><td>".join(cells) + "</td>" in html_rows  # the same numbers
    tex = (out / "tables" / "worst-case.tex").read_text()
    assert tex.startswith("\\begin{tabular}{lrrrr}\n\\toprule\naggregator & sign\\_flip & alie")
    pdftoppm = shutil.which("pdftoppm")
    if pdftoppm is None:
        pytest.skip("pdftoppm is not installed (.ci/run installs poppler-utils)")
    for pdf in pdfs:  # each PDF opens and renders
        subprocess.run([pdftoppm, "-png", "-r", "40", str(pdf), str(report["tmp"] / pdf.stem)],
                       check=True, capture_output=True, timeout=60)
        assert (report["tmp"] / f"{pdf.stem}-1.png").stat().st_size > 1000


def _texts(svg: str) -> list[str]:
    return re.findall(r"<text[^>]*>([^<]*)</text>", svg)


def _paths(svg: str) -> int:
    return len(re.findall(r"<path ", svg))


def test_one_report_across_experiments(report):
    from fedray.cli import main

    p = report["tmp"] / "other.yaml"
    p.write_text(SWEEP.replace("name: report-test", "name: other-test").replace(
        "  attack.name: [sign_flip, alie]\n", "").replace("seeds: [0, 1]", "seeds: [0]"))
    run_loaded(load(p), tracking_uri=report["uri"], quiet=True)
    out = report["tmp"] / "both"
    assert main(["report", "report-test", "other-test", "--tracking-uri", report["uri"],
                 "--out", str(out)]) == 0
    text = (out / "report.html").read_text()
    assert "<h1>fedray report: report-test + other-test</h1>" in text
    summary = text.split('<table class="summary">')[1].split("</table>")[0]
    assert summary.count("<td>report-test: ") == 4 and summary.count("<td>other-test: ") == 2
    client = MlflowClient(report["uri"])
    for name in ("report-test", "other-test"):  # logged on each scenario's parent run
        exp = client.get_experiment_by_name(name)
        parent = client.search_runs([exp.experiment_id], "tags.`fedray.kind` = 'scenario'",
                                    order_by=["attributes.start_time DESC"])[0]
        assert [a.path for a in client.list_artifacts(parent.info.run_id, "report")] == \
            ["report/report.html"]


def test_a_latest_run_that_logged_no_round_names_the_one_that_did(report, tmp_path, capsys):
    """A last attempt that failed before its first round (a bad --set, a device it did not
    have) made `fedray report EXPERIMENT` write an empty report; now one line naming the
    latest scenario run with rounds, which a report of its id shows."""
    from fedray.cli import main

    db = tmp_path / "m.db"
    shutil.copy(report["uri"].removeprefix("sqlite:///"), db)
    uri = f"sqlite:///{db}"
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("report-test").experiment_id
    failed = client.create_run(exp, tags={"fedray.kind": "scenario"}).info.run_id
    child = client.create_run(exp, tags={"fedray.kind": "point",
                                         "mlflow.parentRunId": failed}).info.run_id
    client.set_terminated(child, "FAILED")
    client.set_terminated(failed, "FAILED")
    assert main(["report", "report-test", "--tracking-uri", uri, "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"fedray report: the latest scenario run of 'report-test', {failed} (FAILED), logged "
        f"no round; the latest that did: fedray report {report['parent']}")
    assert main(["report", report["parent"], "--tracking-uri", uri, "--out",
                 str(tmp_path)]) == 0
    page = Path(capsys.readouterr().out.strip().removeprefix("report: ")).read_text()
    assert page.count('<g class="cell"') == 4
