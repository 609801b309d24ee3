"""The audit beside the accountant (#47 item 3): the trade-off curve (epsilon, delta)-DP implies
(dashboards/audit.py) at hand-computed points and against the Gaussian mechanism's, the report
of an audited run (its audited curves and numbers), and ``fedray privacy compare --runs``."""

from __future__ import annotations

import html
import math
import re

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from dashboards.audit import dp_curve, dp_kinks, dp_tradeoff
from simulator.run.privacy_compare import AuditFacts, audit_delta, audit_facts, audit_line
from tests.stores import run_text

E = math.e


# ------------------------------------------------------------ the (epsilon, delta)-DP curve

@pytest.mark.parametrize(("eps", "delta", "alpha", "beta"), [
    (1.0, 0.0, 0.0, 1.0),
    (1.0, 0.0, 0.1, 1 - E * 0.1),  # 0.72817...: the steep line, above e^-1 * 0.9 = 0.331
    (1.0, 0.0, 0.5, 0.5 / E),  # 0.18394...: the shallow line, 1 - e/2 < 0
    (1.0, 0.0, 1 / (1 + E), 1 / (1 + E)),  # the lines meet on the diagonal
    (1.0, 0.0, 1.0, 0.0),
    (math.log(3), 0.1, 0.05, 0.75),  # 0.9 - 3 * 0.05
    (math.log(3), 0.1, 0.225, 0.225),  # the kink, 0.9 / (1 + 3)
    (math.log(3), 0.1, 0.6, 0.1),  # (0.9 - 0.6) / 3
    (math.log(3), 0.1, 0.95, 0.0),  # past 1 - delta
    (0.0, 0.01, 0.3, 0.69),  # epsilon 0: 1 - delta - alpha
    (math.inf, 1e-5, 0.0, 1 - 1e-5),  # no privacy past alpha = 0
    (math.inf, 1e-5, 1e-9, 0.0),
])
def test_dp_tradeoff_at_hand_computed_points(eps, delta, alpha, beta):
    assert dp_tradeoff(alpha, eps, delta) == pytest.approx(beta, abs=1e-12)


def test_dp_tradeoff_is_symmetric_and_its_kinks_draw_it_exactly():
    # a trade-off curve of (eps, delta)-DP is its own inverse on [0, 1 - delta]
    for eps, delta in [(0.5, 1e-5), (2.0, 0.05), (5.0, 1e-3)]:
        a = np.linspace(0, 1 - delta, 501)
        assert dp_tradeoff(dp_tradeoff(a, eps, delta), eps, delta) == pytest.approx(a, abs=1e-9)
        meet, zero = dp_kinks(eps, delta)
        assert dp_tradeoff(meet, eps, delta) == pytest.approx(meet)  # on the diagonal
        assert dp_tradeoff(zero, eps, delta) == 0.0 < dp_tradeoff(zero - 1e-6, eps, delta)
        # a coarse grid with the kinks: straight lines between its points give the curve
        alpha, beta = dp_curve(eps, delta, [0.0, 0.5, 1.0])
        assert {meet, zero} <= set(alpha) and alpha == sorted(alpha)
        fine = np.linspace(0, 1, 10_001)
        assert np.interp(fine, alpha, beta) == pytest.approx(dp_tradeoff(fine, eps, delta),
                                                             abs=1e-12)
    assert dp_kinks(math.inf, 0.0) == [0.0, 1.0] and dp_kinks(800.0, 0.0)[0] == 0.0
    with pytest.raises(ValueError, match="epsilon: must be >= 0, got -1"):
        dp_tradeoff(0.5, -1.0, 1e-5)
    with pytest.raises(ValueError, match="epsilon: must be >= 0, got nan"):
        dp_tradeoff(0.5, math.nan, 1e-5)


def test_the_gaussian_mechanism_is_tight_against_its_own_epsilon_delta():
    """mu-GDP is (eps, delta(eps))-DP with delta(eps) = Phi(-eps/mu + mu/2) - e^eps
    Phi(-eps/mu - mu/2) (Dong, Roth, Su 2022, Cor. 2.13), and no smaller delta: G_mu lies
    above the (eps, delta(eps)) curve and touches it; at a smaller delta it dips below."""
    from scipy.stats import norm

    from strategies.privacy import gaussian_tradeoff

    alpha = np.linspace(0, 1, 200_001)
    for mu, eps in [(1.0, 1.0), (0.5, 0.3), (2.0, 3.0)]:
        delta = norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)
        gap = gaussian_tradeoff(alpha, mu) - dp_tradeoff(alpha, eps, delta)
        assert gap.min() >= -1e-12 and gap.min() <= 1e-6
        assert (gaussian_tradeoff(alpha, mu) - dp_tradeoff(alpha, eps, 0.9 * delta)).min() < -1e-4
    # mu = 1, eps = 1: delta = Phi(-0.5) - e Phi(-1.5) = 0.12693...
    assert norm.cdf(-0.5) - E * norm.cdf(-1.5) == pytest.approx(0.126936, abs=1e-6)


# ------------------------------------------------------------ a run's audit from its params

PARAMS = {"privacy.name": "dp_fedavg", "privacy.delta": "0.001", "privacy.epsilon": "4.5",
          "audit.canaries": "12", "audit.inserted": "0.5", "audit.delta": "null"}


def test_audit_facts_read_as_the_server_resolves_them():
    f = audit_facts(PARAMS, {"epsilon": 4.0, "audit_epsilon": 2.5, "audit_epsilon_lower": 0.7,
                             "audit_canaries_inserted": 7.0})
    # the audit's delta: the privacy plugin's when audit.delta is null
    assert (f.epsilon, f.delta, f.audit_delta) == (4.0, 0.001, 0.001)
    assert (f.estimate, f.lower, f.inserted, f.canaries) == (2.5, 0.7, 7.0, 12)
    assert f.audited and f.measured and f.lower_expected and not f.exceeded
    assert audit_delta({**PARAMS, "audit.delta": "0.01"}) == 0.01
    assert audit_delta({"privacy": "null", "audit.canaries": "4", "audit.delta": "null"}) == 1e-5
    # no epsilon logged yet: the whole run's, from its param
    assert audit_facts(PARAMS, {}).epsilon == 4.5 and not audit_facts(PARAMS, {}).measured
    # the bound is only computed at inserted 0.5; above the accountant's: a leak
    assert not audit_facts({**PARAMS, "audit.inserted": "0.3"}, {}).lower_expected
    assert audit_facts(PARAMS, {"epsilon": 1.0, "audit_epsilon_lower": 1.2}).exceeded
    assert not audit_facts({**PARAMS, "audit.delta": "1e-5"},
                           {"epsilon": 1.0, "audit_epsilon_lower": 1.2}).exceeded  # other delta
    plain = audit_facts({"privacy": "null", "audit": "null"}, {})
    assert not plain.private and not plain.audited and math.isnan(plain.epsilon)


def test_audit_line_says_what_a_run_has():
    f = audit_facts(PARAMS, {"epsilon": 4.0, "audit_epsilon": 2.5, "audit_epsilon_lower": 4.25,
                             "audit_canaries_inserted": 7.0})
    line = audit_line("p seed=0", "abc", f)
    assert line == ("p seed=0 (abc): accountant epsilon 4 at delta 0.001; audited at delta "
                    "0.001 (7 of 12 canaries inserted): estimate 2.5, lower bound 4.25  (the "
                    "lower bound is above the accountant's epsilon: the run leaks more than "
                    "its guarantee)")
    plain = audit_facts({"privacy.name": "dp_sgd", "privacy.delta": "1e-05",
                         "privacy.epsilon": "3", "audit": "null"}, {"epsilon": 3.0})
    assert audit_line("q", "d", plain) == ("q (d): accountant epsilon 3 at delta 1e-05; not "
                                           "audited (no audit: block)")
    other = audit_facts({**PARAMS, "audit.inserted": "0.3"},
                        {"epsilon": 4.0, "audit_epsilon": 2.5, "audit_canaries_inserted": 3.0})
    assert audit_line("r", "e", other).endswith("estimate 2.5, lower bound none (only at "
                                                "audit.inserted 0.5)")
    assert isinstance(other, AuditFacts)


# ------------------------------------------------------------ the report, synthetic runs

def _run(seed: str, sigma: str, estimate: float, lower: float, eps: float, agg: str = "mean"):
    from dashboards.rundata import RunData
    from strategies.privacy import gaussian_tradeoff

    alpha = np.linspace(0, 1, 1001)
    params = {**PARAMS, "privacy.noise_multiplier": sigma, "privacy.epsilon": str(eps),
              "aggregator.name": agg}
    return RunData(f"{sigma}{agg}{seed}", f"{sigma} {agg} seed={seed}", f"{sigma} {agg}", seed,
                   {}, params, {"test_accuracy": [(1, 0.5)], "epsilon": [(1, eps)],
                                "audit_epsilon": [(1, estimate)],
                                "audit_epsilon_lower": [(1, lower)],
                                "audit_canaries_inserted": [(1, 6.0)]},
                   (alpha.tolist(), gaussian_tradeoff(alpha, 1.0).tolist())
                   if seed == "0" else None)


def test_report_draws_each_audit_beside_its_mechanism():
    from dashboards.export import Exports
    from dashboards.report import render

    runs = [_run("0", "1.0", 2.0, 0.5, 3.0), _run("1", "1.0", 3.0, 4.0, 3.0),
            _run("0", "2.0", 1.0, 0.0, 1.0)]
    exports = Exports()
    text = render("t", runs, exports)
    section = text.split("<h2>Privacy</h2>")[1]
    # 2 mechanisms, each with its audit's estimate and lower bound
    assert section.count('<g class="curve"') == 6
    assert '<svg class="chart" ' in section  # a trade-off curve on linear axes
    spec = next(d.spec for d in exports.figures if d.spec["x_label"] == "alpha")
    assert spec["log"] is False
    labels = [s["label"] for s in spec["series"]]
    assert labels[2:] == ["1.0 mean: audit estimate, epsilon 2.5 at delta 0.001, mean of 2 seeds",
                          ("1.0 mean: audit lower bound, epsilon 2.25 at delta 0.001, mean of 2 "
                          "seeds"),
                          "2.0 mean: audit estimate, epsilon 1 at delta 0.001",
                          "2.0 mean: audit lower bound, epsilon 0 at delta 0.001"]
    est = spec["series"][2]
    # the mean over seeds' estimate, 2.5, at the audit's delta, on the mechanism's grid + kinks
    meet, zero = dp_kinks(2.5, 0.001)
    assert est["x"] == sorted({*np.linspace(0, 1, 1001).tolist(), meet, zero})
    assert est["mean"] == pytest.approx(dp_tradeoff(est["x"], 2.5, 0.001).tolist(), abs=1e-15)
    at = dict(zip(est["x"], est["mean"]))
    assert at[0.05] == pytest.approx(0.999 - math.exp(2.5) * 0.05)  # 0.38988: the steep line
    assert at[0.1] == pytest.approx(math.exp(-2.5) * 0.899)  # 0.07379: the shallow one
    # each audit in its mechanism's colour and a dash of its kind
    colours = [s.get("color") for s in spec["series"][2:]]
    from dashboards.draw import PALETTE

    assert colours == [PALETTE[0], PALETTE[0], PALETTE[1], PALETTE[1]]
    assert [s["dash"] for s in spec["series"][2:]] == ["7 4", "2 3", "7 4", "2 3"]
    table = section.split('<table class="audit">')[1].split("</table>")[0]
    rows = [[html.unescape(c.rsplit(">", 1)[1]) for c in r.split("</td>")[:-1]]
            for r in table.split("<tr>")[2:]]
    # seed 1 of noise 1.0: its bound 4.0 is above its accountant's 3.0 (at the same delta)
    assert rows == [["1.0 mean", "2 of 2", "3 ± 0", "2.5 ± 0.71", ("2.25 ± 2.5 (above the "
                     "accountant's in 1 of 2 runs)"), "6 ± 0 of 12", "0.001", "0.001"],
                    ["2.0 mean", "1 of 1", "1", "1", "0", "6 of 12", "0.001", "0.001"]]


def test_report_audits_sharing_a_mechanism_take_their_own_colours():
    from dashboards.draw import PALETTE
    from dashboards.export import Exports
    from dashboards.report import render

    runs = [_run("0", "1.0", 2.0, 0.5, 3.0, "mean"), _run("0", "1.0", 1.0, 0.2, 3.0, "median")]
    exports = Exports()
    render("t", runs, exports)
    spec = next(d.spec for d in exports.figures if d.spec["x_label"] == "alpha")
    assert len(spec["series"]) == 1 + 4  # one mechanism (the aggregator is post-processing)
    assert [s.get("color") for s in spec["series"][1:]] == [PALETTE[1]] * 2 + [PALETTE[2]] * 2


def test_report_without_an_audit_has_no_audit_table():
    from dashboards.report import render

    runs = [_run("0", "1.0", 2.0, 0.5, 3.0)]
    for r in runs:
        r.params = {k: v for k, v in r.params.items() if not k.startswith("audit.")}
        r.params["audit"] = "null"
    section = render("t", runs).split("<h2>Privacy</h2>")[1]
    assert section.count('<g class="curve"') == 1 and 'class="audit"' not in section


# ------------------------------------------------------------ a real audited run

AUDITED = """\
name: audited
rounds: 2
data:
  dataset: {name: digits}
model: {name: logreg}
clients: {total: 12, per_round: 6}
local: {steps: 2, batch_size: 16, lr: 0.2}
privacy: {name: dp_fedavg, clip: 1.0, noise_multiplier: 1.0}
audit: {canaries: 12}
runtime: {backend: inline}
"""


@pytest.fixture(scope="module")
def audited(new_store):
    tmp, uri = new_store("audit-report")
    run_id = run_text(tmp, uri, AUDITED, "a.yaml").runs[0]["run_id"]
    plain = run_text(tmp, uri, AUDITED.replace("name: audited", "name: unaudited")
                     .replace("audit: {canaries: 12}\n", ""), "b.yaml").runs[0]["run_id"]
    metrics = MlflowClient(uri).get_run(run_id).data.metrics
    return {"uri": uri, "tmp": tmp, "run": run_id, "plain": plain,
            "final": {k.removeprefix("privacy/"): v for k, v in metrics.items()
                      if k.startswith("privacy/")}}


def test_report_of_an_audited_run(audited):
    from dashboards.export import Exports
    from dashboards.report import build_report, collect, render

    final = audited["final"]
    assert final["audit_canaries_inserted"] >= 2 and math.isfinite(final["audit_epsilon"])
    text = build_report("audited", audited["tmp"] / "out", audited["uri"]).read_text()
    section = text.split("<h2>Privacy</h2>")[1]
    assert section.count('<g class="curve"') == 3  # the mechanism, estimate, bound
    titles = re.findall(r"<title>([^<]+)</title>", section)
    assert f"audited: audit estimate, epsilon {final['audit_epsilon']:.3g} at delta 1e-05" \
        in titles
    assert (f"audited: audit lower bound, epsilon {final['audit_epsilon_lower']:.3g} at delta "
            "1e-05") in titles
    table = section.split('<table class="audit">')[1].split("</table>")[0]
    (row,) = [[c.rsplit(">", 1)[1] for c in r.split("</td>")[:-1]]
              for r in table.split("<tr>")[2:]]
    assert row == ["audited", "1 of 1", f"{final['epsilon']:.4g}", f"{final['audit_epsilon']:.4g}",
                   f"{final['audit_epsilon_lower']:.4g}",
                   f"{final['audit_canaries_inserted']:.4g} of 12", "1e-05", "1e-05"]
    assert (audited["tmp"] / "out" / "tables" / "audit.md").is_file()
    # the drawn curve is (eps, delta)-DP's for the logged estimate, at the privacy plugin's delta
    exports = Exports()
    title, _, runs = collect("audited", audited["uri"])
    render(title, runs, exports)
    spec = next(d.spec for d in exports.figures if d.spec["x_label"] == "alpha")
    est = spec["series"][1]
    assert est["mean"] == pytest.approx(
        dp_tradeoff(est["x"], final["audit_epsilon"], 1e-5).tolist(), abs=1e-15)


def test_privacy_compare_runs(audited, capsys):
    from fedray.cli import main

    final, uri = audited["final"], audited["uri"]
    # the experiment and its run name the same run: listed once
    assert main(["privacy", "compare", "--runs", "audited", audited["run"], audited["plain"],
                 "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        (f"audited seed=0 ({audited['run']}): accountant epsilon {final['epsilon']:.4g} at delta "
        f"1e-05; audited at delta 1e-05 ({final['audit_canaries_inserted']:.0f} of 12 canaries "
        f"inserted): estimate {final['audit_epsilon']:.4g}, lower bound "
        f"{final['audit_epsilon_lower']:.4g}"),
        (f"unaudited seed=0 ({audited['plain']}): accountant epsilon {final['epsilon']:.4g} at "
        "delta 1e-05; not audited (no audit: block)")]
    # a scenario file and runs: the mechanism's line first, as before
    assert main(["privacy", "compare", str(audited["tmp"] / "a.yaml"), "--runs", audited["run"],
                 "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{audited['tmp'] / 'a.yaml'}: epsilon {final['epsilon']:.4g} at "
                             "delta 1e-05, attacker advantage")
    assert out[1].startswith(f"audited seed=0 ({audited['run']}): accountant epsilon")
    # a name that is no run: one line, exit 2
    assert main(["privacy", "compare", "--runs", "nosuch", "--tracking-uri", uri]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"fedray privacy: --runs 'nosuch': neither an experiment nor a run in {uri}"


@pytest.mark.parametrize(("argv", "message"), [
    ([], "give scenario files, or finished runs with --runs"),
    (["--runs", "x", "--delta", "0.1"], ("--delta applies to scenario files; a run's epsilons "
     "are those it logged, at its deltas")),
    (["--runs", "x", "--set", "rounds=3"], "--set applies to scenario files"),
])
def test_privacy_compare_usage(argv, message, capsys):
    from fedray.cli import main

    with pytest.raises(SystemExit) as e:
        main(["privacy", "compare", *argv])
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"fedray privacy compare: error: {message}")
