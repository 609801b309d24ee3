"""Membership inference with shadow runs (#47, LiRA: Carlini et al., S&P 2022): the runs a
``privacy_attacks: [{name: lira, runs: R}]`` block adds to the sweep, the candidates each
run trains on, the scores it saves, and ``fedray privacy shadows`` combining them."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from simulator.config import ScenarioError
from simulator.config.load import load
from simulator.config.plan import ShadowRun, resolve, shadow_run
from simulator.runtime.privacy_attacks import shadow_candidates
from simulator.sim.engine import load_data
from tests.stores import run_text

SHADOWS = """\
name: shadows
rounds: 3
data:
  dataset: {name: digits}
  partitioner: {name: iid}
  test_fraction: 0.5
model: {name: logreg}
clients: {total: 4, per_round: 4}
local: {epochs: 3, batch_size: 16, lr: 0.2}
privacy_attacks:
  - {name: lira, runs: 4, candidates: 60}
evaluation: {every: 3}
runtime: {backend: inline}
"""


def loaded(tmp_path, text=SHADOWS, overrides=()):
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return load(p, list(overrides))


def test_the_runs_are_sweep_points_that_share_the_data_and_not_the_seeds(tmp_path):
    """runs: 4 adds privacy_attacks.0.run over 0..3 (one point a run, named run=K); each run
    trains from its own seed, all keep the point's data split and candidates; a given run or
    a sweep of the block adds nothing."""
    points = loaded(tmp_path).points
    assert [p.values for p in points] == [{"privacy_attacks.0.run": k} for k in range(4)]
    assert [p.run_name for p in points] == [f"run={k} seed=0" for k in range(4)]
    plans = [resolve(p.scenario) for p in points]
    assert len({p.seed for p in plans}) == 4 and all(p.seed < 2**32 for p in plans)
    assert shadow_run(points[2].scenario) == ShadowRun(0, 4, 2, 60)
    one = loaded(tmp_path, overrides=["privacy_attacks.0.run=1"]).points
    assert len(one) == 1 and resolve(one[0].scenario).seed == plans[1].seed
    datas = [load_data(p.scenario) for p in points]
    base = datas[0].candidates
    for d in datas[1:]:
        np.testing.assert_array_equal(d.candidates[0], base[0])
        np.testing.assert_array_equal(d.candidates[1], base[1])
    # each candidate is trained on in exactly half of the runs; a run loses those it is not
    included = np.stack([d.candidates[2] for d in datas])
    assert (included.sum(axis=0) == 2).all() and len(set(included.sum(axis=1))) > 1
    total = 899  # digits' training samples at test_fraction 0.5
    assert [int(d.client_sizes().sum()) for d in datas] == (total - (~included).sum(axis=1)
                                                            ).tolist()


def test_a_run_trains_on_its_included_candidates_only(tmp_path):
    """The clients' table of a run holds each included candidate once and no excluded one;
    no client loses its first sample."""
    sc = loaded(tmp_path).points[1].scenario
    data = load_data(sc)
    x, y, included = data.candidates
    rows = np.concatenate([data.source.train([k])[0][0].reshape(-1, 64)
                           for k in range(4)])
    present = [(rows == x[j].reshape(1, 64)).all(axis=1).sum() for j in range(len(y))]
    assert [bool(p) for p in present] == included.tolist()
    sizes = np.array([225, 225, 225, 224])  # digits' 899 over 4 iid clients
    rows_all, inc = shadow_candidates(sizes, 0, ShadowRun(0, 4, 1, 60))
    offsets = np.r_[0, np.cumsum(sizes)]
    assert not np.isin(offsets[:-1], rows_all).any() and len(set(rows_all.tolist())) == 60
    np.testing.assert_array_equal(inc, included)
    with pytest.raises(Exception, match="candidates: at most 895"):
        shadow_candidates(sizes, 0, ShadowRun(0, 4, 1, 896))


@pytest.mark.parametrize(("over", "where", "says"), [
    (["privacy_attacks.0.run=4"], "privacy_attacks[0].run", "at most runs - 1 (3)"),
    (["privacy_attacks.0.candidates=900"], "privacy_attacks[0].candidates", "at most 895"),
    (["privacy_attacks.0.runs=2"], "privacy_attacks[0].runs", ">= 4"),
    (["data.load=cohort", "data.dataset={name: synthetic}", "data.partitioner={name: natural}",
      "privacy_attacks.0.candidates=10"], "data.load", "use all"),
    (["task={name: regression}", "data.dataset={name: linear_regression}"],
     "privacy_attacks[0]", "has no classes"),
])
def test_shadow_keys_are_checked_before_anything_runs(tmp_path, over, where, says):
    with pytest.raises(ScenarioError) as e:
        loaded(tmp_path, overrides=over)
    assert any(where in ln and says in ln for ln in e.value.lines), e.value.lines


def test_a_sweep_of_the_block_must_give_each_point_its_run(tmp_path):
    text = SHADOWS + "sweep:\n  privacy_attacks: [[{name: lira, runs: 4}]]\n"
    with pytest.raises(ScenarioError, match="give each point its run, 0..3"):
        loaded(tmp_path, text)


@pytest.fixture(scope="module")
def shadow_runs(new_store):
    tmp, uri = new_store("shadows")
    result = run_text(tmp, uri, SHADOWS)
    return {"uri": uri, "runs": [r["run_id"] for r in result.runs]}


def test_each_run_saves_its_candidates_scores(shadow_runs):
    """privacy/attack_lira.parquet: one row a candidate, its label, whether the run trained on
    it and its logit-scaled confidence; lira_auc is that score's own AUC (no shadow)."""
    from strategies.privacy_attacks import membership_scores

    client = MlflowClient(shadow_runs["uri"])
    for run_id in shadow_runs["runs"]:
        t = pq.read_table(client.download_artifacts(run_id, "privacy/attack_lira.parquet"))
        assert t.column_names == ["candidate", "label", "included", "score"]
        assert t.num_rows == 60 and 0 < sum(t.column("included").to_pylist()) < 60
        auc = membership_scores(t.column("score").to_numpy(), t.column("included").to_numpy())[0]
        assert client.get_run(run_id).data.metrics["lira_auc"] == pytest.approx(auc, abs=1e-12)


def test_privacy_shadows_combines_the_runs_and_logs_each_targets_measures(shadow_runs, capsys):
    """Each run the target of the three others: the command's AUC is that of lira_scores on
    the tables (recomputed here), logged on the run at its last round (step 2 of rounds 0..2,
    as the run's own metrics)."""
    from fedray.cli import main
    from strategies.privacy_attacks import lira_scores, membership_scores

    uri = shadow_runs["uri"]
    assert main(["privacy", "shadows", "shadows", "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "seed=0: lira, 4 runs, each the target of the others:"
    assert out[-1].startswith("  mean ± std: AUC ") and "DP allows at most 1.0000" in out[-1]
    client = MlflowClient(uri)
    runs = sorted((client.get_run(r) for r in shadow_runs["runs"]),
                  key=lambda r: r.info.run_name)
    tables = [pq.read_table(client.download_artifacts(r.info.run_id,
                                                      "privacy/attack_lira.parquet"))
              for r in runs]
    scores = np.stack([t.column("score").to_numpy() for t in tables])
    included = np.stack([t.column("included").to_numpy() for t in tables])
    for t, run in enumerate(runs):
        others = np.arange(4) != t
        s = lira_scores(scores[t], scores[others], included[others])
        auc = membership_scores(s, included[t])[0]
        history = client.get_metric_history(run.info.run_id, "lira_shadows_auc")
        assert [(h.step, h.value) for h in history] == [(2, pytest.approx(auc, abs=1e-12))]
        assert f"AUC {auc:.4f}" in out[1 + t]


def test_privacy_shadows_without_shadow_runs_is_one_line(mlflow_uri, capsys):
    from fedray.cli import main

    assert main(["privacy", "shadows", "nothing", "--tracking-uri", mlflow_uri]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'nothing': neither an experiment nor a run" in err[0]


def test_the_report_takes_a_points_runs_as_its_samples(shadow_runs):
    """After ``fedray privacy shadows``, the report's attack table has one row for the point
    (its four runs, ``seeds x runs``), the combined measures as mean ± std over the runs."""
    import html

    from dashboards.report import _cell, collect, render
    from dashboards.stats import summarize
    from simulator.run.privacy_shadows import shadow_groups

    (group,) = shadow_groups(["shadows"], shadow_runs["uri"])
    _, _, runs = collect("shadows", shadow_runs["uri"])
    assert {r.group for r in runs} == {"shadow runs"}
    section = render("t", runs).split("<h2>Privacy attacks</h2>")[1]
    assert "<h3>lira (shadow runs)</h3>" in section
    table = section.split('<table class="attack_lira">')[1].split("</table>")[0]
    assert "<th>seeds x runs</th>" in table
    cells = [html.unescape(c.rsplit(">", 1)[1]) for c in table.split("<tbody>")[1]
             .split("</td>")[:-1]]
    measures = [m for _, _, m in group.runs]
    assert cells[:2] == ["shadow runs", "4"]
    assert cells[2] == _cell(summarize(m["advantage"] for m in measures))
    assert cells[3] == "1 ± 0"  # no DP: the bound is 1
    assert cells[4] == _cell(summarize(m["auc"] for m in measures))
