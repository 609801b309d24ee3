"""Agreement with ByzFL 0.0.11 (EPFL's Byzantine-robust library), the reference implementation,
on the rules both define the same way; and ByzFL's known in-place mutation, which ours avoid.

ByzFL is installed by the Makefile with --no-deps; ``benchmarks/peers.py`` says why and how it
is loaded.
"""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import peers
from strategies import aggregators as A
from strategies import attacks as K
from strategies import preaggregators as P


@pytest.fixture(scope="module")
def byzfl():
    with peers.byzfl() as lib:
        yield lib


def data(seed=0, n=11, d=30):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, d), generator=g)
    x[-2:] = x[-2:] * 10 + 3  # two outlying rows
    return x


CASES = [
    ("mean", lambda b: b.Average(), lambda: A.Mean()),
    ("median", lambda b: b.Median(), lambda: A.CoordinateWiseMedian()),
    ("trmean", lambda b: b.TrMean(f=2), lambda: A.CoordinateWiseTrimmedMean(2)),
    ("meamed", lambda b: b.Meamed(f=2), lambda: A.MeaMed(2)),
    ("geomed", lambda b: b.GeometricMedian(nu=0.1, T=3),
     lambda: A.GeometricMedian(nu=0.1, iterations=3, tol=0.0, init="zero")),
    ("mda", lambda b: b.MDA(f=2), lambda: A.MinimumDiameterAveraging(2)),
    ("monna", lambda b: b.MoNNA(f=2, idx=0), lambda: A.MoNNA(2, reference=0)),
    ("cc", lambda b: b.CenteredClipping(L=3, tau=2.0),
     lambda: A.CenteredClipping(tau=2.0, iterations=3)),
]


@pytest.mark.parametrize("name,theirs,ours", CASES, ids=[c[0] for c in CASES])
def test_aggregators_agree_with_byzfl(byzfl, name, theirs, ours):
    mine, peer = ours(), theirs(byzfl)  # one instance each: stateful rules carry their state
    for seed in range(3):
        x = data(seed)
        torch.testing.assert_close(mine(x), peer(x.clone()), rtol=1e-5, atol=1e-5)


def test_preaggregators_agree_with_byzfl(byzfl):
    x = data(4)
    torch.testing.assert_close(P.NearestNeighborMixing(2)(x), byzfl.NNM(f=2)(x.clone()),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(P.StaticClipping(2.0)(x), byzfl.Clipping(c=2.0)(x.clone()))
    torch.testing.assert_close(P.AdaptiveRobustClipping(2)(x), byzfl.ARC(f=2)(x.clone()))


def test_byzfl_clipping_and_arc_mutate_their_input_ours_do_not(byzfl):
    for theirs, ours in ((byzfl.Clipping(c=2.0), P.StaticClipping(2.0)),
                         (byzfl.ARC(f=2), P.AdaptiveRobustClipping(2))):
        x = data(5)
        before = x.clone()
        theirs(x)
        assert not torch.equal(x, before)  # the peer's bug
        x = before.clone()
        ours(x)
        assert torch.equal(x, before)


def test_attacks_agree_with_byzfl(byzfl):
    honest = data(6, n=9)
    g = torch.Generator().manual_seed(0)
    pairs = [
        (K.SignFlip(), byzfl.SignFlipping()),
        (K.InnerProductManipulation(2.0), byzfl.InnerProductManipulation(tau=2.0)),
        # ALIE: ByzFL sends mu + tau * std(ddof=1); the paper mu - z * std(1/n)
        (K.ALittleIsEnough(z=-1.5 * math.sqrt(9 / 8)), byzfl.ALittleIsEnough(tau=1.5)),
        (K.Mimic(3), byzfl.Mimic(epsilon=3)),
    ]
    for ours, theirs in pairs:
        rows = ours(honest, 2, g)
        torch.testing.assert_close(rows, theirs(honest.clone()).expand(2, -1), rtol=1e-5, atol=1e-5)
    assert torch.isinf(K.Infinity()(honest, 2, g)).all() and torch.isinf(byzfl.Inf()(honest)).all()


def test_optimal_ipm_agrees_with_byzfl(byzfl):
    """The same line search against the same pipeline (static clipping then median) finds the
    same scale."""
    honest = data(7, n=9) + 1.0
    pipeline = lambda x: A.CoordinateWiseMedian()(P.StaticClipping(2.0)(x))
    ours = K.OptimalIPM(pipeline)(honest, 3, torch.Generator())
    theirs = byzfl.Optimal_InnerProductManipulation(
        agg=byzfl.Median(), pre_agg_list=[byzfl.Clipping(c=2.0)], f=3)(honest.clone())
    torch.testing.assert_close(ours[0], theirs, rtol=1e-5, atol=1e-5)


def test_alie_differs_from_byzfl_by_the_papers_sign_and_std(byzfl):
    honest = data(8, n=9)
    ours = K.ALittleIsEnough(z=1.5)(honest, 1, torch.Generator())[0]
    theirs = byzfl.ALittleIsEnough(tau=1.5)(honest.clone())
    mu = honest.mean(0)
    # opposite side of the mean, and closer to it by the factor sqrt((n - 1) / n)
    torch.testing.assert_close(mu - ours, (theirs - mu) * math.sqrt(8 / 9), rtol=1e-5, atol=1e-5)


def test_robust_selections_agree_with_byzfl_when_the_outliers_are_clear(byzfl):
    """Multi-Krum and SMEA agree with ByzFL where their definitions select the same rows (ByzFL
    scores Krum over n - f - 1 neighbours and estimates SMEA's eigenvalues by one random power
    iteration; ours follow the paper and are exact): two far outliers among eleven rows."""
    for seed in range(3):
        x = data(seed)
        x[-2:] += 100.0
        torch.testing.assert_close(A.MultiKrum(2)(x), byzfl.MultiKrum(f=2)(x.clone()),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(A.SmallestMaxEigenvalueAveraging(2)(x),
                                   byzfl.SMEA(f=2)(x.clone()), rtol=1e-5, atol=1e-5)
