"""Agreement with ByzFL 0.0.11 (EPFL's Byzantine-robust library), the reference implementation,
on the rules both define the same way; and ByzFL's known in-place mutation, which ours avoid.

ByzFL is installed by the Makefile with --no-deps (its torchvision requirement does not load
beside the CPU build of torch used here); its aggregators and attacks need only numpy, torch
and scipy. Its package __init__ also imports its training framework (torchvision), so the
modules are loaded under a bare package object instead.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import pytest
import torch

from strategies import aggregators as A
from strategies import attacks as K
from strategies import preaggregators as P


@pytest.fixture(scope="module")
def byzfl():
    spec = importlib.util.find_spec("byzfl")
    assert spec is not None, "byzfl missing: run `make install` (the Makefile installs it)"
    saved = {k: v for k, v in sys.modules.items() if k == "byzfl" or k.startswith("byzfl.")}
    pkg = types.ModuleType("byzfl")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["byzfl"] = pkg
    try:
        agg = importlib.import_module("byzfl.aggregators")
        att = importlib.import_module("byzfl.attacks")
        names = {k: getattr(m, k) for m in (agg, att) for k in dir(m) if k[0].isupper()}
        yield types.SimpleNamespace(**names)
    finally:
        for k in [k for k in sys.modules if k == "byzfl" or k.startswith("byzfl.")]:
            del sys.modules[k]
        sys.modules.update(saved)


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
        (K.ALittleIsEnough(z=-1.5), byzfl.ALittleIsEnough(tau=1.5)),
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
