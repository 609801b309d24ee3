"""Conformance suites (as scikit-learn's check_estimator): every registered aggregator,
pre-aggregator, meta-aggregator and attack passes the same checks."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from simulator import registry
from strategies.aggregators import CoordinateWiseMedian, Mean
from tests.strategies.conformance import D, F, N, build, call, names

NOT_PERMUTATION_INVARIANT = {"monna"}  # relative to its reference row 0
NOT_TRANSLATION_EQUIVARIANT = {"cc"}  # clips around its stored centre, not around the data


def matrix(seed: int = 0, n: int = N, d: int = D) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, d), generator=g) + torch.linspace(-1, 1, d)


# ---------------------------------------------------------------- aggregators


@pytest.fixture(params=names("aggregators"))
def aggregator_name(request):
    return request.param


def test_aggregator_shape_dtype_finite_and_no_mutation(aggregator_name):
    x = matrix()
    before = x.clone()
    out = call(build("aggregators", aggregator_name), x)
    assert out.shape == (D,) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert torch.equal(x, before), f"{aggregator_name} modified its input"


def test_aggregator_is_deterministic_and_picklable(aggregator_name):
    x = matrix(1)
    a = call(build("aggregators", aggregator_name), x)
    b = call(build("aggregators", aggregator_name), x)
    c = call(pickle.loads(pickle.dumps(build("aggregators", aggregator_name))), x)
    assert torch.equal(a, b) and torch.equal(a, c)


def test_aggregator_permutation_invariance(aggregator_name):
    x = matrix(2)
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(3))
    if aggregator_name in NOT_PERMUTATION_INVARIANT:
        perm = torch.cat([torch.tensor([0]), perm[perm != 0]])
    a = call(build("aggregators", aggregator_name), x)
    b = call(build("aggregators", aggregator_name), x[perm])
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_aggregator_identical_rows_give_that_row(aggregator_name):
    row = matrix(4, n=1)[0]
    out = call(build("aggregators", aggregator_name), row.expand(N, -1).clone())
    torch.testing.assert_close(out, row, rtol=1e-5, atol=1e-5)


def test_aggregator_translation_equivariance(aggregator_name):
    if aggregator_name in NOT_TRANSLATION_EQUIVARIANT:
        pytest.skip(f"{aggregator_name} is not translation equivariant by construction")
    x = matrix(5)
    shift = torch.full((D,), 7.5)
    a = call(build("aggregators", aggregator_name), x)
    b = call(build("aggregators", aggregator_name), x + shift)
    torch.testing.assert_close(b, a + shift, rtol=1e-4, atol=1e-4)


def test_aggregator_survives_f_nonfinite_rows(aggregator_name):
    """f rows of NaN or +/-inf never make a robust rule's output non-finite; mean does."""
    x = matrix(6)
    honest_mean = x[: N - F].mean(dim=0)
    for bad in (math.nan, math.inf, -math.inf):
        y = x.clone()
        y[N - F :] = bad
        out = call(build("aggregators", aggregator_name), y)
        if aggregator_name == "mean":
            assert not torch.isfinite(out).all()
        else:
            assert torch.isfinite(out).all(), f"{aggregator_name} output non-finite with {bad}"
            assert float((out - honest_mean).norm()) < 10.0


# ---------------------------------------------------------------- pre-aggregators


@pytest.fixture(params=names("preaggregators"))
def pre_name(request):
    return request.param


def test_preaggregator_contract(pre_name):
    x = matrix(7)
    before = x.clone()
    p = build("preaggregators", pre_name)
    out = call(p, x)
    assert out.shape == (p.output_rows(N), D) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert torch.equal(x, before), f"{pre_name} modified its input"
    assert torch.equal(out, call(build("preaggregators", pre_name), x))
    assert torch.equal(out, call(pickle.loads(pickle.dumps(p)), x))


def test_preaggregator_permutation_invariance_of_the_aggregate(pre_name):
    """Pre-aggregation then the mean does not depend on the order of the clients (bucketing:
    a permutation only relabels its random buckets, so compare the median of its row means
    over many seeds instead)."""
    x = matrix(8)
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(9))
    p = build("preaggregators", pre_name)
    if getattr(p, "RANDOM", False):
        a = torch.stack([call(p, x, s).mean(0) for s in range(50)]).mean(0)
        b = torch.stack([call(p, x[perm], s).mean(0) for s in range(50)]).mean(0)
        torch.testing.assert_close(a, b, rtol=0, atol=0.05)
    else:
        torch.testing.assert_close(Mean()(call(p, x)), Mean()(call(p, x[perm])), rtol=1e-5, atol=1e-5)


def test_preaggregator_identical_rows(pre_name):
    row = matrix(10, n=1)[0] * 0.1  # inside static clipping's radius
    out = call(build("preaggregators", pre_name), row.expand(N, -1).clone())
    torch.testing.assert_close(out, row.expand_as(out), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- meta-aggregators


@pytest.fixture(params=names("meta"))
def meta_name(request):
    return request.param


def _meta(m, x):
    med = CoordinateWiseMedian()
    if getattr(m, "RANDOM", False):
        return m(x, med, torch.Generator().manual_seed(0))
    return m(x, med)


def test_meta_contract(meta_name):
    x = matrix(11)
    before = x.clone()
    m = build("meta", meta_name)
    out = _meta(m, x)
    assert out.shape == (D,) and torch.isfinite(out).all()
    assert torch.equal(x, before)
    assert torch.equal(_meta(build("meta", meta_name), x), out)
    assert torch.equal(_meta(pickle.loads(pickle.dumps(m)), x), out)
    row = x[0]
    torch.testing.assert_close(_meta(m, row.expand(N, -1).clone()), row)
    if not getattr(m, "RANDOM", False):  # random buckets: a permutation relabels them
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(12))
        torch.testing.assert_close(_meta(m, x[perm]), out, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- attacks


@pytest.fixture(params=[n for n in names("attacks")
                        if not getattr(registry.get("attacks", n), "GOSSIP", False)])
def attack_name(request):
    return request.param


def _attack(name):
    return build("attacks", name, aggregate=CoordinateWiseMedian()) if name.startswith(
        "optimal") else build("attacks", name)


def test_attack_contract(attack_name):
    a = _attack(attack_name)
    # an omniscient attack sees the honest rows, any other its own f honestly computed rows
    honest = matrix(13, n=N - F if a.omniscient else F)
    before = honest.clone()
    rows = a(honest, F, torch.Generator().manual_seed(0))
    assert rows.shape == (F, D) and rows.dtype == torch.float32
    assert torch.equal(honest, before), f"{attack_name} modified the honest rows"
    again = _attack(attack_name)(honest, F, torch.Generator().manual_seed(0))
    assert torch.equal(rows, again) or (torch.isnan(rows).all() and torch.isnan(again).all())
    if attack_name not in ("optimal_ipm", "optimal_alie"):  # their aggregate is a context arg
        pickle.loads(pickle.dumps(a))
    if attack_name not in ("inf", "nan"):
        assert torch.isfinite(rows).all()
