"""``fedray table``: metrics over seeds from MLflow (final, the mean of the last K
evaluations), several summaries of one metric side by side, differences paired by seed, and
the table as Markdown, LaTeX and CSV. Every number is recomputed here from the runs' metric
histories."""

from __future__ import annotations

import statistics

import pytest
from mlflow.tracking import MlflowClient

from dashboards.tables import collect_rows, paired_difference, table
from fedray.cli import main
from simulator.config.load import load
from simulator.metric_names import mlflow_name
from simulator.run.reductions import parse_metrics
from simulator.run.runner import run_loaded
from tests.conftest import own_lines

SWEEP = """\
name: table-test
rounds: 5
seeds: [0, 1, 2]
data: {dataset: {name: digits}}
model: {name: logreg}
clients: {total: 10, per_round: 5, byzantine: 2}
attack: {name: sign_flip}
local: {steps: 2, batch_size: 16, lr: 0.2}
sweep:
  aggregator.name: [mean, median]
runtime: {backend: inline}
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, _mlflow_template):
    import shutil

    tmp = tmp_path_factory.mktemp("tables")
    shutil.copy(_mlflow_template, tmp / "mlflow.db")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    p = tmp / "s.yaml"
    p.write_text(SWEEP)
    run_loaded(load(p), tracking_uri=uri, quiet=True)
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("table-test")
    hist = {}
    for r in client.search_runs([exp.experiment_id], "tags.`fedray.kind` = 'point'"):
        values = [m.value for m in sorted(client.get_metric_history(r.info.run_id,
                                                                    mlflow_name("test_accuracy")),
                                          key=lambda m: m.step)]
        hist[(r.data.params["aggregator.name"], r.data.params["seed"])] = values
    # a 3-seed sweep's parent holds no swept value: a filter on one finds the 3 children only
    mean = client.search_runs([exp.experiment_id], "params.`aggregator.name` = 'mean'")
    assert sorted(r.info.run_name for r in mean) == ["mean seed=0", "mean seed=1", "mean seed=2"]
    assert all(r.data.tags["fedray.kind"] == "point" for r in mean)
    return uri, hist


def test_last_k_final_and_paired_differences_are_the_runs_numbers(runs):
    uri, hist = runs
    metrics = parse_metrics(["test_accuracy:final", "test_accuracy:last3"])
    rows = collect_rows("table-test", ["aggregator.name"], metrics, uri)
    assert [r.key for r in rows] == [{"aggregator.name": "mean"}, {"aggregator.name": "median"}]
    for r in rows:
        agg = r.key["aggregator.name"]
        assert sorted(r.by_seed) == ["0", "1", "2"]
        for seed, cols in r.by_seed.items():
            h = hist[(agg, seed)]
            assert len(h) == 5
            assert cols["test_accuracy (final)"] == pytest.approx(h[-1])
            assert cols["test_accuracy (last 3)"] == pytest.approx(statistics.fmean(h[-3:]))
        s = r.summary("test_accuracy (last 3)")
        per_seed = [statistics.fmean(hist[(agg, seed)][-3:]) for seed in "012"]
        assert (s.mean, s.std) == (pytest.approx(statistics.fmean(per_seed)),
                                   pytest.approx(statistics.stdev(per_seed)))
    mean, median = rows
    d = paired_difference(median, mean, "test_accuracy (final)")
    diffs = [hist[("median", s)][-1] - hist[("mean", s)][-1] for s in "012"]
    assert (d.n, d.unpaired) == (3, 0)
    assert d.mean == pytest.approx(statistics.fmean(diffs))
    assert d.std == pytest.approx(statistics.stdev(diffs))
    head, body = table(rows, ["aggregator.name"], metrics, ("aggregator.name", "mean"))
    assert head == ["aggregator.name", "seeds", "test_accuracy (final)",
                    "test_accuracy (last 3)", "Δ test_accuracy (final) vs aggregator.name=mean",
                    "Δ test_accuracy (last 3) vs aggregator.name=mean"]
    assert body[0][4] == "baseline"
    assert body[1][4] == f"{d.mean:.3f} ± {d.std:.3f} (3 pairs)"


def test_one_metric_twice_is_refused_and_two_summaries_stay_apart():
    with pytest.raises(ValueError, match="test_accuracy:final: given twice"):
        parse_metrics(["test_accuracy:final", "test_accuracy:final"])
    with pytest.raises(ValueError, match="lastK"):
        parse_metrics(["test_accuracy:last0"])
    assert parse_metrics(["test_accuracy", "test_accuracy:mean"]) == [
        ("test_accuracy", "final"), ("test_accuracy", "mean")]


def test_fedray_table_prints_markdown_latex_and_csv(runs, capsys):
    uri, hist = runs
    args = ["table", "table-test", "--by", "aggregator.name", "--tracking-uri", uri,
            "--metrics", "test_accuracy:last2", "--paired", "aggregator.name=mean"]
    assert main(args) == 0
    md = capsys.readouterr().out.splitlines()
    assert md[0] == ("| aggregator.name | seeds | test_accuracy (last 2) | Δ test_accuracy "
                     "(last 2) vs aggregator.name=mean |")
    mean_cell = statistics.fmean(statistics.fmean(hist[("mean", s)][-2:]) for s in "012")
    assert md[2].startswith(f"| mean | 3 | {mean_cell:.3f} ± ")
    assert main([*args, "--format", "latex"]) == 0
    tex = capsys.readouterr().out
    assert tex.startswith("\\begin{tabular}{lrrr}\n\\toprule\naggregator.name & seeds & "
                          "test\\_accuracy (last 2) & $\\Delta$ test\\_accuracy")
    assert "\\bottomrule\n\\end{tabular}" in tex and "$\\pm$" in tex
    assert main([*args, "--format", "csv"]) == 0
    csv = capsys.readouterr().out.splitlines()
    assert csv[0].startswith("aggregator.name,seeds,test_accuracy (last 2),") and len(csv) == 3
    with pytest.raises(SystemExit):
        main([*args[:-2], "--paired", "aggregator.name=krum"])
    assert "no run has aggregator.name=krum; values: mean, median" in capsys.readouterr().err


def test_a_swept_key_left_out_of_by_is_named_instead_of_merging_runs(runs, capsys):
    """--by attack: every row would hold a mean run and a median run of each seed; the
    table refuses in one line naming the swept key to add, rather than keep one of them."""
    uri, _ = runs
    assert main(["table", "table-test", "--by", "attack", "--tracking-uri", uri]) == 2
    err = "\n".join(own_lines(capsys.readouterr().err))
    assert err.startswith("fedray table: --by: the row attack=sign_flip holds two runs of seed ")
    assert "differ in aggregator.name (mean, median)" in err and \
        err.endswith("add aggregator.name to --by")
    assert len(err.splitlines()) == 1
    with pytest.raises(ValueError, match="add aggregator.name to --by"):
        collect_rows("table-test", ["attack"], parse_metrics(["test_accuracy"]), uri)


def test_what_no_run_has_is_named_instead_of_an_empty_table(runs, tmp_path, capsys):
    """A latest scenario run without a FINISHED point (a failed last attempt), a --by key no
    run has and a metric no run logged printed a table of no rows, or of ? and nan, exit 0;
    each is now one line naming what there is, exit 2."""
    import shutil

    uri, _ = runs
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("table-test")
    (done,) = client.search_runs([exp.experiment_id], "tags.`fedray.kind` = 'scenario'")
    copy = tmp_path / "m.db"
    shutil.copy(uri.removeprefix("sqlite:///"), copy)
    later = f"sqlite:///{copy}"
    failed = MlflowClient(later).create_run(exp.experiment_id,
                                            tags={"fedray.kind": "scenario"}).info.run_id
    MlflowClient(later).set_terminated(failed, "FAILED")
    assert main(["table", "table-test", "--by", "aggregator.name", "--tracking-uri", later]) == 2
    assert "\n".join(own_lines(capsys.readouterr().err)) == (
        f"fedray table: the latest scenario run of 'table-test', {failed} (FAILED), has no "
        f"FINISHED point; the latest that has: --parent {done.info.run_id}")
    assert main(["table", "table-test", "--by", "aggregator.name", "--tracking-uri", later,
                 "--parent", done.info.run_id]) == 0
    assert "| mean | 3 |" in capsys.readouterr().out

    assert main(["table", "table-test", "--by", "aggregator.nme", "--tracking-uri", uri]) == 2
    err = "\n".join(own_lines(capsys.readouterr().err))
    assert err.startswith("fedray table: --by aggregator.nme: no run has this param or tag; "
                          "the runs differ in: aggregator.name (tags: aggregator, attack, ")
    assert main(["table", "table-test", "--by", "aggregator.name", "--tracking-uri", uri,
                 "--metrics", "test_acc:final"]) == 2
    err = "\n".join(own_lines(capsys.readouterr().err))
    assert err.startswith("fedray table: --metrics test_acc: no run logged it; logged: ")
    assert "test_accuracy" in err and len(err.splitlines()) == 1
    assert main(["table", "table-test", "--by", "aggregator.name", "--tracking-uri", uri,
                 "--metrics", "rounds:param", "nosuch:param"]) == 2
    assert "\n".join(own_lines(capsys.readouterr().err)) == (
        "fedray table: --metrics nosuch:param: no run has the param nosuch")


def test_one_seed_has_no_spread():
    """A row of one seed shows its number alone (it read ``± 0.000``, as if seeds agreed);
    two seeds show mean ± sample std; a paired difference of one pair likewise."""
    from dashboards.tables import Row

    col = "test_accuracy (final)"
    one = Row({"aggregator.name": "mean"}, {"0": {col: 0.5}})
    two = Row({"aggregator.name": "median"}, {"0": {col: 0.25}, "1": {col: 0.75}})
    metrics = [("test_accuracy", "final")]
    head, body = table([one, two], ["aggregator.name"], metrics, ("aggregator.name", "mean"))
    assert head[:3] == ["aggregator.name", "seeds", col]
    assert body[0][:3] == ["mean", "1", "0.500"]
    assert body[1][:3] == ["median", "2", f"0.500 ± {statistics.stdev([0.25, 0.75]):.3f}"]
    assert body[1][3] == "-0.250 (1 pairs, 1 unpaired)"
    from dashboards.report import _cell
    from dashboards.stats import Summary

    assert (_cell(Summary(0.5, 0.0, 1, 0)), _cell(Summary(0.5, 0.25, 2, 0))) == ("0.5", "0.5 ± 0.25")
