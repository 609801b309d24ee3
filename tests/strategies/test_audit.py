from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy.integrate import quad
from scipy.optimize import brentq
from scipy.stats import norm

from strategies.audit import (
    gaussian_pair_delta,
    gaussian_pair_epsilon,
    one_run_epsilon,
    one_run_p_value,
    one_shot_epsilon,
    unit_directions,
)


def _gdp_epsilon(mu: float, delta: float) -> float:
    """mu-GDP's epsilon at delta from Balle and Wang's (ICML 2018) profile
    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)."""
    def excess(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    return brentq(excess, 0.0, 200.0, xtol=1e-14)


@pytest.mark.parametrize("mu", [0.5, 1.0, 2.0, 4.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-3])
def test_equal_stds_is_gdp(mu, delta):
    expect = _gdp_epsilon(mu, delta)
    assert gaussian_pair_epsilon(0.0, 1.0, mu, 1.0, delta) == pytest.approx(expect, rel=1e-6)
    # shift both means, scale both stds: the same pair of experiments
    shift, scale = -3.7, 0.02
    got = gaussian_pair_epsilon(shift, scale, shift + scale * mu, scale, delta)
    assert got == pytest.approx(expect, rel=1e-6)
    # and with the roles swapped (DP is symmetric)
    assert gaussian_pair_epsilon(mu, 1.0, 0.0, 1.0, delta) == pytest.approx(expect, rel=1e-6)


def _delta_by_quadrature(eps: float, mu0: float, s0: float, mu1: float, s1: float) -> float:
    """int max(0, p1 - e^eps p0) dx numerically, with breakpoints where the privacy loss
    log p1 - log p0 crosses eps (numpy's roots of the quadratic, written out here)."""
    a = 1 / (2 * s0**2) - 1 / (2 * s1**2)
    b = mu1 / s1**2 - mu0 / s0**2
    c = mu0**2 / (2 * s0**2) - mu1**2 / (2 * s1**2) + math.log(s0 / s1) - eps
    roots = [float(x.real) for x in np.roots([a, b, c]) if abs(x.imag) < 1e-12]
    lo = min(mu0 - 40 * s0, mu1 - 40 * s1)
    hi = max(mu0 + 40 * s0, mu1 + 40 * s1)

    def f(x: float) -> float:
        return max(0.0, norm.pdf(x, mu1, s1) - math.exp(eps) * norm.pdf(x, mu0, s0))

    cuts = [lo, *sorted(r for r in roots if lo < r < hi), hi]
    return sum(quad(f, u, w, epsabs=0, epsrel=1e-12, limit=500)[0]
               for u, w in itertools.pairwise(cuts))


@pytest.mark.parametrize("case", [
    (1.0, 0.0, 1.0, 0.5, 2.0),   # s1 > s0: the loss set is the two tails
    (0.5, 0.0, 1.0, 1.0, 0.7),   # s1 < s0: the loss set is an interval
    (9.0, 0.0, 1.0, 1.0, 1.05),  # far tail: delta 4.5e-11
    (20.0, 0.0, 1.0, 1.0, 1.05),  # farther: 2.8e-33, far below double-precision cancellation
    (0.2, 2.0, 0.5, -1.0, 0.45),
])
def test_unequal_stds_against_quadrature(case):
    got = gaussian_pair_delta(*case)
    expect = _delta_by_quadrature(*case)
    assert expect > 0
    assert got == pytest.approx(expect, rel=1e-6)


def test_far_tail_deltas_are_tiny():
    # the far-tail cases above really are the tiny deltas the accuracy is for
    assert 4e-11 < gaussian_pair_delta(9.0, 0.0, 1.0, 1.0, 1.05) < 5e-11
    assert 0 < gaussian_pair_delta(20.0, 0.0, 1.0, 1.0, 1.05) < 1e-32


def test_gaussian_pair_degenerate_cases():
    assert gaussian_pair_epsilon(0.0, 1.0, 0.0, 1.0, 1e-5) == 0.0  # identical
    assert gaussian_pair_epsilon(0.0, 1.0, 1.0, 0.0, 1e-5) == math.inf  # point mass
    assert gaussian_pair_epsilon(0.0, 1.0, 1.0, 1.0, 0.0) == math.inf  # pure DP: none
    assert math.isnan(gaussian_pair_epsilon(0.0, 1.0, math.nan, 1.0, 1e-5))
    # a delta above the total variation needs no epsilon: TV(N(0,1), N(0.1,1)) = 0.0399
    assert gaussian_pair_epsilon(0.0, 1.0, 0.1, 1.0, 0.05) == 0.0


def test_one_shot_on_a_hand_built_sample():
    # cosines with mean exactly 0.1 and sample std exactly 0.1 against N(0, 1/100): the
    # pair N(0, 0.1^2), N(0.1, 0.1^2) is 1-GDP
    z = np.random.default_rng(3).normal(size=200)
    z = (z - z.mean()) / z.std(ddof=1)
    cosines = 0.1 + 0.1 * z
    assert one_shot_epsilon(cosines, 100, 1e-5) == pytest.approx(_gdp_epsilon(1.0, 1e-5),
                                                                 rel=1e-6)


def test_one_shot_on_noise_is_small():
    # canaries that left no trace: cosines distributed as the null itself. The sample's mean
    # and std are off the null's by sampling error only; with this seed the estimate is
    # 0.4557 (an estimate, not a bound: it is not 0)
    d = 1000
    cosines = np.random.default_rng(0).normal(0.0, d**-0.5, size=1000)
    got = one_shot_epsilon(cosines, d, 1e-5)
    assert got == pytest.approx(0.455667, abs=1e-5)
    assert got < 0.5


def test_one_shot_edge_cases():
    assert math.isnan(one_shot_epsilon(np.array([0.3]), 100, 1e-5))
    assert one_shot_epsilon(np.full(5, 0.2), 100, 1e-5) == math.inf
    assert math.isnan(one_shot_epsilon(np.zeros(5), 100, 1e-5))


def test_one_run_pure_dp_hand_example():
    # 20 guesses all correct, delta = 0: p(eps) = q^20, rejected while q^20 <= 0.05
    q = 0.05 ** (1 / 20)
    expect = math.log(q / (1 - q))  # 1.82272
    m = 100
    scores = np.arange(m, dtype=np.float64)
    inserted = scores >= m // 2  # perfectly separated: every inserted canary scores higher
    eps, r, v = one_run_epsilon(scores, inserted, 20, 0.0, 0.95)
    assert (r, v) == (20, 20)
    assert eps == pytest.approx(expect, abs=1e-6)
    assert one_run_p_value(m, 20, 20, expect, 0.0) == pytest.approx(0.05, rel=1e-12)


def test_one_run_half_right_bounds_nothing():
    m = 100
    inserted = np.arange(m) % 2 == 0
    # the 10 highest scores (indices 0..9) and the 10 lowest (10..19) are each half inserted
    scores = np.zeros(m)
    scores[:10] = 1.0
    scores[10:20] = -1.0
    eps, r, v = one_run_epsilon(scores, inserted, 20, 0.0, 0.95)
    assert (r, v) == (20, 10) and eps == 0.0
    # and the p-value at r = 20, v = 10 is well above 0.05 already at eps = 0
    assert one_run_p_value(m, 20, 10, 0.0, 0.0) == pytest.approx(
        sum(math.comb(20, k) for k in range(10, 21)) / 2**20, rel=1e-12)


def test_one_run_delta_term():
    m, r, v, eps, delta = 1000, 10, 10, 1.0, 1e-6
    q = math.exp(eps) / (1 + math.exp(eps))
    pmf = [math.comb(r, k) * q**k * (1 - q) ** (r - k) for k in range(r + 1)]
    best = 0.0
    for i in range(1, v + 1):
        best = max(best, sum(pmf[v - i:v]) / i)
    expect = q**10 + 2 * m * delta * best
    assert one_run_p_value(m, r, v, eps, delta) == pytest.approx(expect, rel=1e-10)
    assert one_run_p_value(m, r, v, eps, delta) > q**10


def test_one_run_guess_count_is_validated():
    with pytest.raises(ValueError):
        one_run_epsilon(np.zeros(5), np.ones(5, dtype=bool), 6, 0.0, 0.95)
    with pytest.raises(ValueError):
        one_run_epsilon(np.zeros(5), np.ones(5, dtype=bool), 0, 0.0, 0.95)


def test_unit_directions():
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    rows = unit_directions(gens, 257)
    assert rows.shape == (3, 257) and rows.dtype == torch.float32
    torch.testing.assert_close(torch.linalg.vector_norm(rows, dim=1), torch.ones(3))
    again = unit_directions([torch.Generator().manual_seed(s) for s in (1, 2, 3)], 257)
    assert torch.equal(rows, again)
    assert not torch.equal(rows[0], rows[1])
    # the row of a seed is the seed's own draw, normalised
    raw = torch.randn(257, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(rows[1], raw / raw.norm())


def test_dp_sgd_adds_its_canary_examples_by_hand():
    """One DP-SGD step with q = 1 (batch_size >= n), no noise: each canary example is
    sampled (rate 1) and its per-example gradient -clip * direction joins the clipped sum,
    which is divided by q n: the update moves by lr * clip * sum(directions) / n."""
    from types import SimpleNamespace

    from torch import nn

    from strategies.trainers import dp_sgd

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(6, 3))
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    x, y = torch.rand(4, 6), torch.tensor([0, 1, 2, 1])
    local = SimpleNamespace(epochs=None, steps=1, batch_size=8, lr=0.3, momentum=0.0,
                            weight_decay=0.0)
    dirs = unit_directions([torch.Generator().manual_seed(i) for i in range(2)],
                           start.numel())
    plain, _ = dp_sgd(model, start, x, y, torch.Generator().manual_seed(5), local, 0.5, 0.0)
    with_canaries, _ = dp_sgd(model, start, x, y, torch.Generator().manual_seed(5), local, 0.5,
                              0.0, canaries=dirs, canary_generator=torch.Generator())
    torch.testing.assert_close(with_canaries - plain, 0.3 * 0.5 * dirs.sum(0) / 4)
