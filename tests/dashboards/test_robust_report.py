"""The report of a robust-FL sweep as a reviewer reads it: a 36-point aggregator x attack x
Byzantine-count sweep (inline, the digits data, a few rounds). The Byzantine count and the
attack are the condition, the rule and its hyperparameters the setting; "no attack" sits
beside the attacks and is never a worst case; the exported PDFs keep their plots at least half
of the page (measured on the rendered page); heat maps share one colour range, name only what
varies and mark diverged cells."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from dashboards.report import RunData, build_report, render
from tests.stores import run_text

AGGREGATORS = ["mean", "median", "cwtm", "krum", "geomed", "cc"]
ATTACKS = ["sign_flip", "alie", "gaussian"]
SWEEP = """\
name: robust-report
description: 6 aggregators x 3 attacks x 2 Byzantine counts
rounds: 4
seeds: [0]
data:
  dataset: {name: digits}
model: {name: logreg}
clients: {total: 10, per_round: 10, byzantine: 3}
local: {steps: 2, batch_size: 16, lr: 0.2}
attack: {name: sign_flip}
sweep:
  aggregator.name: [mean, median, cwtm, krum, geomed, cc]
  attack: [{name: sign_flip}, {name: alie}, {name: gaussian, sigma: 10.0}]
  clients.byzantine: [0, 3]
runtime: {backend: inline}
"""
PDFTOPPM = shutil.which("pdftoppm")
PDFTOTEXT = shutil.which("pdftotext")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def sweep(new_store):
    tmp, uri = new_store("robust")
    out = run_text(tmp, uri, SWEEP, "sweep.yaml")
    assert len(out.runs) == 36
    path = build_report("robust-report", tmp / "out", uri, log=False)
    acc = {(r["values"]["aggregator.name"], r["values"]["attack"]["name"],
            r["values"]["clients.byzantine"]): r["final_test_accuracy"] for r in out.runs}
    return {"path": path, "text": path.read_text(), "acc": acc, "tmp": tmp}


def _table(text: str, cls: str) -> tuple[list[str], list[list[str]]]:
    body = text.split(f'<table class="{cls}">')[1].split("</table>")[0]
    head = re.findall(r"<th>([^<]*)</th>", body)
    rows = [re.findall(r"<td>([^<]*)</td>", r) for r in body.split("<tr>")[2:]]
    return head, rows


def test_worst_case_puts_no_attack_beside_the_attacks(sweep):
    head, rows = _table(sweep["text"], "worst-case")
    # one row per rule (the Byzantine count is no setting), "no attack" a column
    assert head == ["aggregator", "no attack", *ATTACKS, "worst", "worst attack"]
    assert [r[0] for r in rows] == AGGREGATORS
    acc = sweep["acc"]
    for agg, clean, *under, worst, attack in rows:
        # the f = 0 runs of every attack name are the no-attack condition
        assert float(clean) == pytest.approx(
            np.mean([acc[agg, a, 0] for a in ATTACKS]), rel=1e-3)
        attacked = {a: acc[agg, a, 3] for a in ATTACKS}
        assert [float(v) for v in under] == pytest.approx(list(attacked.values()), rel=1e-3)
        assert float(worst) == pytest.approx(min(attacked.values()), rel=1e-3)
        assert attack == min(attacked, key=attacked.__getitem__)


def test_best_under_worst_never_picks_no_attack(sweep):
    head, rows = _table(sweep["text"], "best-under-worst")
    assert head == ["aggregator", "worst-case accuracy", "worst attack", "no attack"]
    acc = sweep["acc"]
    worst = {agg: min(acc[agg, a, 3] for a in ATTACKS) for agg in AGGREGATORS}
    # every rule once, ranked by its worst case under an attack (never its no-attack accuracy)
    assert [r[0] for r in rows] == sorted(AGGREGATORS, key=lambda a: -worst[a])
    for agg, value, attack, clean in rows:
        assert attack in ATTACKS
        assert float(value) == pytest.approx(worst[agg], rel=1e-3)
        assert float(value) == pytest.approx(acc[agg, attack, 3], rel=1e-3)
        assert float(clean) == pytest.approx(acc[agg, "sign_flip", 0], rel=1e-3)
    # the sweep is one where the old reading failed: no attack is some rule's best "worst case"
    assert any(acc[agg, "sign_flip", 0] > worst[agg] + 0.05 for agg in AGGREGATORS)


def _plot_boxes(png: Path, min_side: int = 12) -> tuple[list[tuple[int, int, int, int]], int]:
    """The plots of a rendered page: rectangles framed by dark lines on all four sides (the
    axes' spines), the outermost of each nest, at least 6% of the page wide (a colour bar is
    narrower); and the page's area in pixels."""
    from PIL import Image

    dark = np.asarray(Image.open(png).convert("RGB")).max(axis=2) < 90

    def runs(line: np.ndarray) -> list[tuple[int, int]]:
        d = np.diff(np.concatenate([[0], line.astype(np.int8), [0]]))
        return [(int(s), int(e)) for s, e in zip(np.flatnonzero(d == 1), np.flatnonzero(d == -1))
                if e - s >= min_side]

    vertical = [(x, s, e) for x in range(dark.shape[1]) for s, e in runs(dark[:, x])]
    boxes = []
    for x0, s0, e0 in vertical:
        for x1, s1, e1 in vertical:
            if x1 - x0 >= max(min_side, 0.06 * dark.shape[1]) and abs(s1 - s0) <= 3 and abs(e1 - e0) <= 3 and \
                    dark[s0:s0 + 3, x0:x1 + 1].any(axis=0).all() and \
                    dark[e0 - 3:e0, x0:x1 + 1].any(axis=0).all():
                boxes.append((x0, s0, x1, e0))
    keep: list[tuple[int, int, int, int]] = []
    for b in sorted(boxes, key=lambda b: -(b[2] - b[0]) * (b[3] - b[1])):
        if not any(k[0] - 4 <= b[0] and b[2] <= k[2] + 4 and k[1] - 4 <= b[1] and
                   b[3] <= k[3] + 4 for k in keep):
            keep.append(b)
    return keep, dark.size


def plot_share(pdf: Path, tmp: Path) -> tuple[float, int]:
    """(the share of the page the plots take, how many plots) of a PDF as pdftoppm renders it."""
    stem = tmp / pdf.stem
    subprocess.run([PDFTOPPM, "-png", "-r", "144", "-singlefile", str(pdf), str(stem)],
                   check=True, capture_output=True, timeout=60)
    boxes, page = _plot_boxes(stem.with_suffix(".png"))
    return sum((b[2] - b[0]) * (b[3] - b[1]) for b in boxes) / page, len(boxes)


@pytest.mark.skipif(PDFTOPPM is None, reason="pdftoppm is not installed (.ci/run installs it)")
def test_every_pdf_keeps_its_plot_at_least_half_the_page(sweep, tmp_path):
    pdfs = sorted((sweep["path"].parent / "figures").glob("*.pdf"))
    shares = {p.stem: plot_share(p, tmp_path) for p in pdfs}
    # 3 charts (accuracy, loss, aggregation error) and 1 + 3 heat maps
    assert len(pdfs) == 7, shares
    for stem, (share, n) in shares.items():
        assert share >= 0.5, (stem, share)  # measured 0.59-0.61 (a 36-curve legend: 0.01)
    # the charts are small multiples, one plot per condition: no attack and each attack
    assert shares["01-test-accuracy"][1] == 4
    # the measurement sees a thumbnail: a plot squeezed by a 36-entry legend beside it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    for i in range(36):
        ax.plot([0, 1], [0, i], label=f"a sweep point with a long label number {i}")
    ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8, frameon=False)
    fig.savefig(tmp_path / "squeezed.pdf", bbox_inches="tight")
    plt.close(fig)
    share, n = plot_share(tmp_path / "squeezed.pdf", tmp_path)
    assert n == 1 and share < 0.35


@pytest.mark.skipif(PDFTOTEXT is None, reason="pdftotext is not installed (poppler-utils)")
def test_no_html_hint_in_the_pdfs(sweep):
    # the page draws the small multiples the PDFs hold: every curve shown, no hint needed
    # (a chart that fades curves says so under it: test_stats)
    assert 'class="curve off"' not in sweep["text"]
    assert "click a faded legend entry" not in sweep["text"]
    for pdf in (sweep["path"].parent / "figures").glob("*.pdf"):
        text = subprocess.run([PDFTOTEXT, str(pdf), "-"], capture_output=True, text=True,
                              check=True).stdout
        assert "click" not in text and "faded" not in text and "highest" not in text, pdf


def test_heat_maps_share_one_range_and_name_only_what_varies(sweep):
    text = sweep["text"]
    titles = re.findall(r'<svg class="heatmap" role="img" aria-label="([^"]*)"', text)
    assert titles == ["final test accuracy: aggregator x attack"] + [
        f"final test accuracy: aggregator x f (Byzantine clients) (attack={a})"
        for a in ATTACKS]
    assert "attack.mu" not in text and "=null" not in text and "attack.epsilon" not in text
    values = [float(v) for v in re.findall(r'<g class="cell"[^>]*data-value="([^"]+)"', text)]
    assert len(values) == 6 * 4 + 3 * 6 * 2  # conditions beside each other; f = 0 and f = 3
    bars = re.findall(r'<g class="colorbar" data-lo="([^"]+)" data-hi="([^"]+)" '
                      r'data-shared="(\d+)"', text)
    # one range for the 4 maps: the lowest and highest cell of all of them, said under the bar
    assert {(float(lo), float(hi), int(n)) for lo, hi, n in bars} == {
        (min(values), max(values), 4)}
    assert text.count(">one scale for all 4 maps</text>") == 4
    acc = sweep["acc"]
    assert min(values) == pytest.approx(min(acc.values()))


def _runs(points: list[tuple[dict, dict, list[float], bool]]) -> list[RunData]:
    """RunData of (tags, params, final accuracy per seed, diverged)."""
    out = []
    for k, (tags, params, accs, diverged) in enumerate(points):
        label = " ".join(f"{key}={v}" for key, v in params.items())
        for seed, acc in enumerate(accs):
            hist = {"test_accuracy": [(0, 0.1), (1, acc)], "test_loss": [(0, 2.3), (1, 1.0)],
                    "nonfinite_aggregate": [(0, 0.0), (1, 1.0 if diverged else 0.0)]}
            out.append(RunData(f"{k}-{seed}", f"{label} seed={seed}", label, str(seed),
                               {**tags}, {**params}, hist))
    return out


def _point(agg: str, attack: str, f: int, accs: list[float], diverged: bool = False,
           **params: str) -> tuple[dict, dict, list[float], bool]:
    return ({"aggregator": agg, "attack": attack, "f": str(f)},
            {"aggregator.name": agg, "attack.name": attack, "clients.byzantine": str(f),
             **params}, accs, diverged)


def test_the_setting_best_under_its_worst_attack_and_hyperparameters():
    """cwtm's f and the learning rate are the setting; each rule's best setting is the one
    whose worst attack is highest, whatever it scores with no attack."""
    points = []
    table = {  # (rule, its f, lr): (no attack, sign_flip, alie)
        ("cwtm", "1", "0.1"): (0.95, 0.60, 0.70),
        ("cwtm", "1", "0.01"): (0.90, 0.75, 0.72),
        ("cwtm", "3", "0.1"): (0.93, 0.81, 0.80),  # the best worst case: 0.80 under alie
        ("cwtm", "3", "0.01"): (0.99, 0.50, 0.90),  # the best without attack
        ("median", "", "0.1"): (0.97, 0.55, 0.65),
        ("median", "", "0.01"): (0.92, 0.70, 0.66),  # 0.66 under alie
    }
    for (agg, f, lr), (clean, sf, alie) in table.items():
        extra = {"aggregator.f": f} if f else {}
        points += [_point(agg, "sign_flip", 0, [clean], **extra, **{"local.lr": lr}),
                   _point(agg, "sign_flip", 2, [sf], **extra, **{"local.lr": lr}),
                   _point(agg, "alie", 2, [alie], **extra, **{"local.lr": lr})]
    page = render("t", _runs(points))
    head, rows = _table(page, "best-under-worst")
    assert head == ["aggregator", "hyperparameters", "local.lr", "worst-case accuracy",
                    "worst attack", "no attack"]
    assert rows == [["cwtm", "cwtm(f=3)", "0.1", "0.8", "alie", "0.93"],
                    ["median", "median", "0.01", "0.66", "alie", "0.92"]]
    head, rows = _table(page, "worst-case")
    assert head == ["aggregator", "local.lr", "no attack", "sign_flip", "alie", "worst",
                    "worst attack"]
    assert ["cwtm(f=3)", "0.01", "0.99", "0.5", "0.9", "0.5", "sign_flip"] in rows


def test_a_value_that_follows_the_byzantine_count_is_no_setting():
    """An aggregator's f zipped with the Byzantine count (f = 0 with none, f = 2 with two):
    one setting per rule, under two conditions, not two settings under one each."""
    points = [_point("cwtm", "alie", f, [acc], **{"aggregator.f": str(f)})
              for f, acc in ((0, 0.9), (2, 0.7))]
    points += [_point("median", "alie", f, [acc]) for f, acc in ((0, 0.88), (2, 0.75))]
    head, rows = _table(render("t", _runs(points)), "worst-case")
    assert head == ["aggregator", "no attack", "alie", "worst", "worst attack"]
    assert rows == [["cwtm", "0.9", "0.7", "0.7", "alie"],
                    ["median", "0.88", "0.75", "0.75", "alie"]]


def test_diverged_cells_are_marked_not_averaged():
    """mean under inf: one of two seeds' aggregate was not finite. Its cell says so, takes no
    colour of the scale and is the rule's worst case; the scale spans the other cells."""
    points = [_point("mean", "inf", 2, [0.4, 0.1], diverged=False),
              _point("mean", "alie", 2, [0.7, 0.72]),
              _point("median", "inf", 2, [0.8, 0.82]), _point("median", "alie", 2, [0.75, 0.77])]
    runs = _runs(points)
    runs[1].history["nonfinite_aggregate"][1] = (1, 1.0)  # mean under inf, seed 1
    page = render("t", runs)
    head, rows = _table(page, "worst-case")
    assert head == ["aggregator", "inf", "alie", "worst", "worst attack"]
    assert rows[0] == ["mean", "diverged (1 of 2 runs)", "0.71", "diverged (1 of 2 runs)", "inf"]
    assert rows[1] == ["median", "0.81", "0.76", "0.76", "alie"]
    cells = re.findall(r'<g class="cell"[^>]*data-row="([^"]+)" data-col="([^"]+)" '
                       r'data-value="([^"]+)" data-diverged="(\d+)"', page)
    assert ("mean", "inf", "nan", "1") in cells
    finite = [float(v) for _, _, v, d in cells if d == "0"]
    lo, hi = re.findall(r'data-lo="([^"]+)" data-hi="([^"]+)"', page)[0]
    assert (float(lo), float(hi)) == (pytest.approx(min(finite)), pytest.approx(max(finite)))
    assert (float(lo), float(hi)) == (pytest.approx(0.71), pytest.approx(0.81))
    assert ">diverged</text>" in page
    assert ">the range of this map</text>" in page  # its own range: said


def test_the_pdf_heat_map_marks_a_diverged_cell(tmp_path):
    from dashboards.export import Exports, write_figures

    points = [_point("mean", "inf", 2, [0.4], diverged=True), _point("mean", "alie", 2, [0.7]),
              _point("median", "inf", 2, [0.8]), _point("median", "alie", 2, [0.75])]
    exports = Exports()
    render("t", _runs(points), exports)
    heat = [d.spec for d in exports.figures if d.kind == "heat"]
    assert len(heat) == 1 and heat[0]["values"][("mean", "inf")][3] == 1
    assert (heat[0]["lo"], heat[0]["hi"]) == (0.7, 0.8)
    paths = write_figures(exports, tmp_path)
    if PDFTOTEXT is not None:
        pdf = next(p for p in paths if p.suffix == ".pdf" and "attack" in p.stem)
        text = subprocess.run([PDFTOTEXT, str(pdf), "-"], capture_output=True, text=True,
                              check=True).stdout
        assert "diverged" in text and "0.4" not in text


FADE_PROBE = """
<script>
window.addEventListener('load', function () {
  var o = function (sel) {
    return Array.from(document.querySelectorAll(sel)).map(function (e) {
      return parseFloat(getComputedStyle(e).opacity); });
  };
  var pre = document.createElement('pre'); pre.id = 'probe';
  pre.textContent = JSON.stringify({curve: o('g.curve:not(.off)'),
    faded_curve: o('g.curve.off'), band: o('g.band:not(.off)'),
    faded_band: o('g.band.off')});
  document.body.appendChild(pre);
});
</script>
"""


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def test_faded_curves_are_faded_with_their_bands(tmp_path):
    """30 sweep points of two seeds each: the 20 faded curves' min-max bands are faded as
    much as their curves (in the browser, by computed opacity)."""
    runs = [RunData(f"{i}-{s}", f"p{i} seed={s}", f"p{i}", str(s), {}, {},
                    {"test_accuracy": [(0, 0.1), (1, i / 30 + 0.01 * s)]})
            for i in range(30) for s in (0, 1)]
    page = tmp_path / "faded.html"
    page.write_text(render("faded", runs).replace("</body>", FADE_PROBE + "</body>"))
    r = subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
                        "--virtual-time-budget=3000", "--dump-dom", page.resolve().as_uri()],
                       capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(r.stdout.split('<pre id="probe">')[1].split("</pre>")[0])
    # the accuracy chart (and none other here): 10 shown and 20 faded, each with its band
    assert (len(seen["curve"]), len(seen["faded_curve"])) == (10, 20)
    assert (len(seen["band"]), len(seen["faded_band"])) == (10, 20)
    curve, faded_curve = seen["curve"][0], seen["faded_curve"][0]
    band, faded_band = seen["band"][0], seen["faded_band"][0]
    assert faded_curve / curve == pytest.approx(0.15)
    assert faded_band / band <= faded_curve / curve  # faded as much as its curve, or more
    assert not math.isclose(faded_band, band)
