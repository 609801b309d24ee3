"""``fedray table`` and ``fedray report`` on a search (``fedray tune``): the numbers of the
best-setting table checked against what MLflow holds, computed here by hand from the
points' histories; the report's search section drawn with one marker per trial."""

from __future__ import annotations

import csv
import io
import re
import shutil
import statistics

import pytest
from mlflow.tracking import MlflowClient

from dashboards.draw import lines
from dashboards.search import condition, find_search, load_search, search_table
from dashboards.tables import main as table_main

SCENARIO = """\
name: tune-views
rounds: 4
seeds: [0, 1]
data: {dataset: {name: digits}, partitioner: {name: iid}}
model: {name: logreg}
clients: {total: 6, byzantine: 1, b_hat: {rule: fixed, value: 1}}
local: {steps: 2, batch_size: 16, lr: 0.1}
aggregator: {name: cwtm}
attack: {name: sign_flip}
evaluation: {every: 2}
sweep:
  aggregator.name: [cwtm, median]
  attack: [{name: sign_flip}, {name: gaussian, sigma: 10.0}]
tune:
  space:
    local.lr: {log_uniform: [0.01, 0.5]}
    local.momentum: {uniform: [0.0, 0.9]}
  metric: test_accuracy:final
  trials: 3
  parallel: 2
  worst_over: [attack]
  per: [aggregator.name]
"""
ACC = "eval/test_accuracy"


@pytest.fixture(scope="module")
def searched(_mlflow_template, tmp_path_factory, ray_backend):
    """A real ``fedray tune`` of two searches (cwtm, median) x 3 trials x 2 attacks x 2
    seeds into a fresh store; its tracking URI."""
    from simulator.config.load import load
    from simulator.run.tuning import run_tune

    tmp = tmp_path_factory.mktemp("tune-views")
    shutil.copy(_mlflow_template, tmp / "mlflow.db")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    (tmp / "scenario.yaml").write_text(SCENARIO)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)  # Ray Tune's state goes to ./.fedray/tune
        result = run_tune(load(tmp / "scenario.yaml"), tracking_uri=uri)
    assert [b["search"] for b in result.best] == ["cwtm", "median"]
    return uri


def _by_hand(client: MlflowClient, trial_id: str) -> dict[str, dict[str, float]]:
    """attack -> seed -> the final test accuracy of the trial's point (its last step)."""
    exp = client.get_run(trial_id).info.experiment_id
    out: dict[str, dict[str, float]] = {}
    for run in client.search_runs([exp], f"tags.mlflow.parentRunId = '{trial_id}'"):
        assert run.info.status == "FINISHED" and run.data.tags["fedray.kind"] == "point"
        hist = sorted(client.get_metric_history(run.info.run_id, ACC), key=lambda m: m.step)
        attack = run.data.params["attack.name"]
        out.setdefault(attack, {})[run.data.tags["seed"]] = hist[-1].value
    return out


def test_table_is_each_search_at_its_best_setting_under_its_worst_attack(searched):
    client = MlflowClient(searched)
    exp = client.get_experiment_by_name("tune-views").experiment_id
    parent = find_search(client, exp, None)
    assert parent is not None and parent.data.tags["fedray.kind"] == "tune"
    found = search_table("tune-views", tracking_uri=searched)
    assert found is not None
    _, head, body = found
    assert head[:5] == ["search", "local.lr", "local.momentum",
                        "score (test_accuracy final; worst over attack of the mean over seeds)",
                        "trials"]
    assert head[5:] == ["test_accuracy (final) @ sign_flip",
                        "test_accuracy (final) @ gaussian(sigma=10.0)", "worst attack"]
    assert [row[0] for row in body] == ["cwtm", "median"]
    trials = [r for r in client.search_runs([exp], "tags.`fedray.kind` = 'trial'")]
    for row in body:
        label = row[0]
        mine = [t for t in trials if t.data.tags["fedray.search"] == label]
        finished = [t for t in mine if t.info.status == "FINISHED"]
        best_id = parent.data.tags[f"fedray.best.{label}"]
        best = client.get_run(best_id)
        # the best trial: the highest final score of those that ran every evaluation
        assert best_id == max(finished, key=lambda t: t.data.metrics["score"]).info.run_id
        assert row[1] == f"{float(best.data.params['local.lr']):.4g}"
        assert row[2] == f"{float(best.data.params['local.momentum']):.4g}"
        stopped = sum(1 for t in mine if t.info.status == "KILLED"
                      and t.data.tags["fedray.trial_end"].startswith("stopped by ASHA"))
        failed = sum(1 for t in mine if t.info.status == "FAILED")
        assert row[4] == f"3 ({len(finished)} finished, {stopped} stopped by ASHA, {failed} failed)"
        assert len(finished) + stopped + failed == 3
        # per attack: mean ± std over the seeds of the final accuracy, by hand
        hand = _by_hand(client, best_id)
        assert sorted(hand) == ["gaussian", "sign_flip"]
        assert all(sorted(seeds) == ["0", "1"] for seeds in hand.values())
        means = {a: statistics.fmean(v.values()) for a, v in hand.items()}
        worst = min(means, key=lambda a: means[a])
        for col, attack in ((5, "sign_flip"), (6, "gaussian")):
            text = f"{means[attack]:.3f} ± {statistics.stdev(hand[attack].values()):.3f}"
            assert row[col] == text + (" (worst)" if attack == worst else "")
        assert row[7] == ("sign_flip" if worst == "sign_flip" else "gaussian(sigma=10.0)")
        # the score the trial logged is the worst over attacks of the mean over seeds
        assert best.data.metrics["score"] == pytest.approx(means[worst], abs=1e-12)
        assert row[3] == f"{means[worst]:.4g}"


def test_table_command_formats_and_by(searched, capsys):
    assert table_main(["tune-views", "--tracking-uri", searched, "--format", "csv"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert len(rows) == 3 and rows[0][0] == "search" and [r[0] for r in rows[1:]] == [
        "cwtm", "median"]
    assert table_main(["tune-views", "--tracking-uri", searched, "--format", "latex"]) == 0
    tex = capsys.readouterr().out
    assert tex.count(r"\\") == 3 and r"$\pm$" in tex and "(worst)" in tex
    # --by: the rows are the best trials' points, as a sweep's
    assert table_main(["tune-views", "--tracking-uri", searched, "--by", "aggregator.name",
                       "attack", "--metrics", "test_accuracy:final", "--format", "csv"]) == 0
    by = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert [r[:3] for r in by[1:]] == [["cwtm", "sign_flip", "2"], ["cwtm", "gaussian", "2"],
                                       ["median", "sign_flip", "2"], ["median", "gaussian", "2"]]
    client = MlflowClient(searched)
    parent = find_search(client, client.get_experiment_by_name("tune-views").experiment_id,
                         None)
    assert parent is not None
    hand = _by_hand(client, parent.data.tags["fedray.best.median"])
    m = statistics.fmean(hand["gaussian"].values())
    assert by[4][3] == f"{m:.3f} ± {statistics.stdev(hand['gaussian'].values()):.3f}"


def test_a_sweep_still_needs_by(mlflow_uri, capsys):
    client = MlflowClient(mlflow_uri)
    exp = client.create_experiment("a-sweep")
    client.create_run(exp, tags={"fedray.kind": "scenario"})
    with pytest.raises(SystemExit) as e:
        table_main(["a-sweep", "--tracking-uri", mlflow_uri])
    assert e.value.code == 2 and "--by" in capsys.readouterr().err


def _svg(page: str, title: str) -> str:
    found = [s for s in page.split("<svg")[1:] if title in s.split("</text>")[0]]
    assert len(found) == 1, title
    return found[0].split("</svg>")[0]


def test_report_draws_the_search(searched, tmp_path):
    from dashboards.report import build_report

    path = build_report("tune-views", tmp_path / "rep", searched, log=False)
    page = path.read_text()
    search = load_search(MlflowClient(searched), find_search(
        MlflowClient(searched), MlflowClient(searched).get_experiment_by_name(
            "tune-views").experiment_id, None))
    assert "<h2>Search</h2>" in page and "<h3>Best setting of each search</h3>" in page
    assert page.count('class="search-best"') == 1
    for label in ("cwtm", "median"):
        trials = [t for t in search.trials if t.search == label]
        assert len(trials) == 3
        lr = _svg(page, f"{label}: score against local.lr")
        assert 'class="chart log-x"' in lr  # searched log-uniformly
        momentum = _svg(page, f"{label}: score against local.momentum")
        assert "log-x" not in momentum.split(">")[0]
        for chart in (lr, momentum):  # one marker per trial, no line
            assert chart.count('class="marker point') == 3 and 'class="curve' not in chart
        rungs = _svg(page, f"{label}: ASHA rungs")
        assert rungs.count('<g class="curve') == 3
        # a line per trial with a point per evaluation it reported: ASHA's stop shows
        for t in trials:
            n = len(t.scores)
            assert n == (2 if t.outcome == "finished" else 1)
        markers = rungs.count('class="marker')
        assert markers == sum(len(t.scores) for t in trials)
    md = (tmp_path / "rep" / "tables" / "search-best.md").read_text().splitlines()
    assert len(md) == 4 and md[2].startswith("| cwtm |") and md[3].startswith("| median |")
    pdfs = sorted(p.name for p in (tmp_path / "rep" / "figures").glob("*.pdf"))
    search_figures = [n for n in pdfs if n.startswith(("01-", "02-", "03-", "04-", "05-", "06-"))]
    assert [n[3:].split("-")[0] for n in search_figures] == ["cwtm"] * 3 + ["median"] * 3
    assert sum("score-against-local-lr" in n for n in search_figures) == 2
    assert sum("asha-rungs" in n for n in search_figures) == 2


def test_condition_matches_the_most_specific_sweep_value():
    sweep = {"attack": [{"name": "gaussian"}, {"name": "gaussian", "sigma": 10}],
             "a.b, c.d": [[1, "x"], [2, "y"]]}
    params = {"attack.name": "gaussian", "attack.sigma": "10.0", "a.b": "2", "c.d": "y"}
    assert condition(params, ["attack"], sweep) == "gaussian(sigma=10)"
    assert condition({**params, "attack.sigma": "1.0"}, ["attack"], sweep) == "gaussian"
    assert condition(params, ["attack", "a.b, c.d"], sweep) == "gaussian(sigma=10), [2, \"y\"]"
    assert condition(params, [], sweep) == ""


def test_log_x_axis_places_decades_evenly():
    drawing = lines({"title": "t", "series": [{"label": "s", "x": [0.01, 0.1, 1.0],
                                               "mean": [1.0, 2.0, 3.0], "scatter": True}],
                     "x_label": "lr", "y_label": "score", "log_x": True})
    svg = drawing.svg()
    assert svg.startswith('<svg class="chart log-x"')
    # one marker a trial, no line; decades evenly apart on the page
    xs = [float(x) for x in re.findall(r'<use x="([0-9.]+)"[^>]*class="marker point"', svg)]
    assert len(xs) == 3 and 'class="curve' not in svg
    assert xs[1] - xs[0] == pytest.approx(xs[2] - xs[1], abs=0.02)  # written to 0.01 pt
    (ax,) = drawing.figure.axes
    assert ax.get_xscale() == "log"
    lo, hi = ax.get_xlim()
    assert [t for t in ax.get_xticks() if lo <= t <= hi] == pytest.approx([0.01, 0.1, 1.0])
    titles = re.findall(r"<title>([^<]+)</title>", svg)
    assert titles == ["s: (0.01, 1)", "s: (0.1, 2)", "s: (1, 3)", "s"]
