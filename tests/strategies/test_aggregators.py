"""Aggregators, pre-aggregators and CTMA on hand-computed cases, robustness bounds, state."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fedray.testing import _call as call
from simulator import registry
from simulator.registry import instantiate
from strategies import aggregators as A
from strategies import geometry as G
from strategies import preaggregators as P
from strategies.meta import CenteredTrimmedMetaAggregator


def col(*v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)[:, None]


def test_median_trimmed_mean_meamed_by_hand():
    assert A.CoordinateWiseMedian()(col(1, 2, 10)).item() == 2
    assert A.CoordinateWiseMedian()(col(1, 2, 3, 10)).item() == 2.5
    assert A.CoordinateWiseTrimmedMean(1)(col(1, 2, 3, 100)).item() == 2.5
    # median 2.5; the 3 values closest to it are 1, 2, 3
    assert A.MeaMed(1)(col(1, 2, 3, 100)).item() == 2.0


def test_krum_and_multikrum_by_hand():
    # n = 5, f = 1: each score sums the n - f - 2 = 2 smallest squared distances to others
    # scores: 0 -> 1+4 = 5, 1 -> 1+1 = 2, 2 -> 1+4 = 5, 10 -> 1+64 = 65, 11 -> 1+81 = 82
    x = col(0, 1, 2, 10, 11)
    assert A.Krum(1)(x).item() == 1
    assert A.MultiKrum(1, m=3)(x).item() == 1  # rows 1, 0, 2
    assert A.MultiKrum(1)(x).item() == pytest.approx(13 / 4)  # m = n - f = 4 adds row 10
    with pytest.raises(ValueError, match="f: Krum needs n > 2f"):
        A.Krum(2)(x)


def test_krum_scores_follow_the_paper_not_byzfl():
    """Blanchard et al. sum the n - f - 2 nearest squared distances; ByzFL averages n - f - 1.
    On this case (n = 6, f = 1) the paper's rule picks the row 4, ByzFL's the row 13."""
    x = col(4, 19, 13, 0, 3, 19)
    d2 = G.squared_distances(x)
    assert G.krum_scores(d2, 1).tolist() == [98, 261, 153, 194, 110, 261]
    assert A.Krum(1)(x).item() == 4
    byzfl = torch.sort(d2, dim=1).values[:, 1:5].mean(dim=1)
    assert int(torch.argmin(byzfl)) == 2


def test_mda_by_hand():
    # subsets of 3 of {0, 1, 2, 10}: {0, 1, 2} has the smallest diameter (2)
    assert A.MinimumDiameterAveraging(1)(col(0, 1, 2, 10)).item() == 1.0
    with pytest.raises(ValueError, match=r"f: MDA enumerates C\(n, f\) = C\(40, 10\) = 847660528"):
        A.MinimumDiameterAveraging(10).check(40)


def _slow_smea(x, f):
    n = x.shape[0]
    best, val = None, math.inf
    for s in itertools.combinations(range(n), n - f):
        sub = x[list(s)].double()
        cov = torch.cov(sub.T, correction=0)
        lam = float(torch.linalg.eigvalsh(cov)[-1])
        if lam < val:
            best, val = s, lam
    return x[list(best)].mean(0)


def test_smea_matches_brute_force_covariance_eigenvalues():
    g = torch.Generator().manual_seed(0)
    x = torch.randn((8, 5), generator=g)
    x[2] += 6
    torch.testing.assert_close(A.SmallestMaxEigenvalueAveraging(2)(x), _slow_smea(x, 2))


def _slow_caf(x, f):
    """CAF with the d x d covariance and an exact eigendecomposition."""
    n = x.shape[0]
    x = x.double()
    c = torch.ones(n, dtype=torch.float64)
    best, best_lam = None, math.inf
    while c.sum() > n - 2 * f:
        mu = (c[:, None] * x).sum(0) / c.sum()
        diff = x - mu
        cov = (c[:, None, None] * diff[:, :, None] * diff[:, None, :]).sum(0) / c.sum()
        lam, vec = torch.linalg.eigh(cov)
        if lam[-1] < best_lam:
            best, best_lam = mu, lam[-1]
        tau = (diff @ vec[:, -1]) ** 2
        tau = torch.where(c > 0, tau, 0.0)  # max over the points still weighted
        c = c * (1 - tau / tau.max())
    return best.float()


def test_caf_matches_the_covariance_form():
    g = torch.Generator().manual_seed(1)
    x = torch.randn((9, 6), generator=g)
    x[7:] += torch.tensor([8.0, -3, 0, 0, 5, 1])
    torch.testing.assert_close(A.CovarianceAgnosticFilter(2)(x), _slow_caf(x, 2), rtol=1e-5, atol=1e-5)


def test_geometric_median_of_an_equilateral_triangle_is_its_centre():
    x = torch.tensor([[0.0, 0.0], [2.0, 0.0], [1.0, math.sqrt(3)]])
    out = A.GeometricMedian(init="zero", iterations=200, tol=1e-9)(x)
    torch.testing.assert_close(out, torch.tensor([1.0, math.sqrt(3) / 3]), rtol=0, atol=1e-4)


def test_bulyan_selects_by_iterated_krum_then_trims_around_the_median():
    # n = 7, f = 1: theta = 5 rows chosen by iterated Krum (never 100), beta = 3 closest to the
    # selection's median averaged
    x = col(0, 1, 2, 3, 4, 5, 100)
    out = A.Bulyan(1)(x).item()
    assert 1.0 <= out <= 4.0
    with pytest.raises(ValueError, match=r"f: Bulyan needs n >= 4f \+ 3; n = 7 allows f <= 1, got 2"):
        A.Bulyan(2).check(7)


def test_monna_averages_the_neighbours_of_its_reference():
    x = col(0, 1, 3, 10)
    assert A.MoNNA(1, reference=0)(x).item() == pytest.approx(4 / 3)
    assert A.MoNNA(1, reference=3)(x).item() == pytest.approx(14 / 3)


def test_dnc_removes_the_outliers_along_the_top_direction():
    g = torch.Generator().manual_seed(2)
    x = torch.randn((12, 50), generator=g)
    x[-3:] += 20.0
    out = A.DivideAndConquer(f=3, subsample_dim=20)(x, torch.Generator().manual_seed(0))
    torch.testing.assert_close(out, x[:9].mean(0))


def test_nnm_arc_clipping_bucketing_by_hand():
    # NNM, f = 1: each row -> mean of its 3 nearest (itself included)
    out = P.NearestNeighborMixing(1)(col(0, 1, 3, 10)).squeeze(1)
    torch.testing.assert_close(out, torch.tensor([4 / 3, 4 / 3, 4 / 3, 14 / 3]))
    # ARC, f = 1, n = 4: floor(2 * 1/4 * 3) = 1 row clipped, to the second largest norm (2)
    x = torch.tensor([[3.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 2.0]])
    torch.testing.assert_close(P.AdaptiveRobustClipping(1)(x)[0], torch.tensor([2.0, 0.0]))
    torch.testing.assert_close(P.AdaptiveRobustClipping(1)(x)[1:], x[1:])
    torch.testing.assert_close(P.StaticClipping(1.0)(torch.tensor([[3.0, 4.0]])), torch.tensor([[0.6, 0.8]]))
    # bucketing, s = 2, n = 5: two buckets of 2 and the remainder bucket of 1, last
    b = P.Bucketing(2)(col(1, 2, 3, 4, 5), torch.Generator().manual_seed(0)).squeeze(1)
    assert b.shape == (3,) and 2 * b[0] + 2 * b[1] + b[2] == 15 and b[2] in (1, 2, 3, 4, 5)


def test_ctma_by_hand():
    # x0 = median = 2; distances 2, 1, 0, 1, 98: keep 0, 1, 2, 3; x0 + mean(x - x0) = 1.5
    out = CenteredTrimmedMetaAggregator(1)(col(0, 1, 2, 3, 100), A.CoordinateWiseMedian())
    assert out.item() == 1.5


def test_cc_state_is_explicit_and_checkpointed():
    g = torch.Generator().manual_seed(3)
    rounds = [torch.randn((6, 4), generator=g) + 5 for _ in range(4)]
    a = A.CenteredClipping(tau=1.0)
    for x in rounds[:2]:
        a(x)
    saved = a.state_dict()
    rest = [a(x) for x in rounds[2:]]
    b = A.CenteredClipping(tau=1.0)
    b.load_state_dict(saved)
    assert all(torch.equal(u, b(x)) for u, x in zip(rest, rounds[2:]))
    fresh = A.CenteredClipping(tau=1.0)
    assert not torch.equal(fresh(rounds[2]), rest[0])  # the centre matters
    # one iteration from centre 0 with nothing clipped is the mean
    x = torch.full((3, 2), 0.1)
    torch.testing.assert_close(A.CenteredClipping(tau=10.0)(x), x.mean(0))


# majority_vote returns the sign of the vote, not an estimate of the mean (its robustness,
# one client one vote, is tested in tests/strategies/test_codecs.py)
ROBUST = [n for n in registry.available("aggregators") if n not in ("mean", "majority_vote")]


@pytest.mark.parametrize("name", ROBUST)
def test_robust_aggregators_stay_near_the_honest_mean_under_huge_rows(name):
    """n = 15 with f = 3 rows of norm 4e6: every robust rule stays within the honest radius
    (max distance of an honest row to the honest mean) of the honest mean; the mean is off
    by about f/n * 4e6."""
    g = torch.Generator().manual_seed(4)
    honest = torch.randn((12, 16), generator=g) * 0.5
    x = torch.cat([honest, torch.full((3, 16), 1e6)])
    radius = float((honest - honest.mean(0)).norm(dim=1).max())
    params = {"cc": {"tau": 1.0, "iterations": 5}, "norm_bound": {"bound": 1.0}, "foolsgold": {},
              "flame": {}, "fltrust": {}}.get(name, {"f": 3})
    if name in ("geomed", "median"):
        params = {}
    rule = instantiate("aggregators", {"name": name, **params})
    # FLTrust: the server's own update, here an honest-like one (the honest rows' median)
    out = rule(x, reference=honest.median(0).values) if rule.traits.reference else call(rule, x)
    err = float((out - honest.mean(0)).norm())
    assert err <= radius, f"{name}: {err} > {radius}"
    assert float((A.Mean()(x) - honest.mean(0)).norm()) > 7e5


def test_mean_divergence_is_reported_by_the_server_metric(tmp_path):
    from simulator.config.load import load
    from simulator.runtime.backend import InlineBackend
    from simulator.sim.engine import Engine

    p = tmp_path / "s.yaml"
    p.write_text("name: inf\nrounds: 6\ndata: {dataset: {name: digits}}\nmodel: {name: logreg}\n"
                 "clients: {total: 8, per_round: 8, byzantine: 2}\nattack: {name: inf}\n"
                 "local: {steps: 5, batch_size: 16, lr: 0.3}\n")
    mean_run = Engine(load(p).points[0].scenario, InlineBackend()).run()
    assert [m["nonfinite_aggregate"] for m in mean_run.metrics] == [1.0] * 6
    assert all(math.isfinite(v) for v in mean_run.final_params)  # the step was skipped
    robust = Engine(load(p, ["aggregator={name: median}"]).points[0].scenario, InlineBackend()).run()
    assert [m["nonfinite_aggregate"] for m in robust.metrics] == [0.0] * 6
    assert robust.final("test_accuracy") > mean_run.final("test_accuracy") + 0.3


def test_trimmed_mean_fast_path_keeps_precision_next_to_huge_rows():
    g = torch.Generator().manual_seed(5)
    x = torch.cat([torch.randn((9, 40), generator=g), torch.full((2, 40), 3e7)])
    ref = torch.sort(x.double(), dim=0).values[2:9].mean(0).float()
    torch.testing.assert_close(A.CoordinateWiseTrimmedMean(2)(x), ref, rtol=0, atol=1e-6)
    y = x.clone()
    y[-1, 0] = math.nan  # the partition path
    torch.testing.assert_close(A.CoordinateWiseTrimmedMean(2)(y)[1:], ref[1:], rtol=0, atol=1e-6)


def test_empirical_kappa_separates_mean_from_robust_rules_and_nnm_helps_krum():
    from benchmarks.kappa import empirical_kappa

    n, f, d = 11, 2, 20
    mean_k, _ = empirical_kappa("mean", n, f, d, trials=2, with_nnm=False)
    assert mean_k > 1e6
    for name in ("median", "cwtm", "geomed", "multikrum", "meamed", "mda", "caf", "smea"):
        k, attack = empirical_kappa(name, n, f, d, trials=2, with_nnm=False)
        assert k < 2.0, (name, k, attack)
    krum, _ = empirical_kappa("krum", n, f, d, trials=2, with_nnm=False)
    krum_nnm, _ = empirical_kappa("krum", n, f, d, trials=2, with_nnm=True)
    assert krum_nnm < krum


def test_meta_equals_its_preaggregator_chain():
    from strategies.meta import BucketingMeta, NNMMeta

    g = torch.Generator().manual_seed(6)
    x = torch.randn((11, 8), generator=g)
    med = A.CoordinateWiseMedian()
    torch.testing.assert_close(NNMMeta(2)(x, med), med(P.NearestNeighborMixing(2)(x)))
    b = BucketingMeta(2)(x, med, torch.Generator().manual_seed(1))
    torch.testing.assert_close(b, med(P.Bucketing(2)(x, torch.Generator().manual_seed(1))))
    # input untouched, and a different generator gives other buckets
    assert not torch.equal(b, BucketingMeta(2)(x, med, torch.Generator().manual_seed(2)))
