from __future__ import annotations

import math

import pytest

from strategies.subsampling import (
    b_hat,
    bernoulli_kl,
    hypergeometric_pmf,
    hypergeometric_tail,
    kl_tail_bound,
)


def test_hypergeometric_hand_computed():
    # n = 10 clients, f = 2 Byzantine, s = 3 sampled: C(10, 3) = 120 samples
    assert hypergeometric_pmf(10, 2, 3, 0) == pytest.approx(56 / 120)  # C(8, 3)
    assert hypergeometric_pmf(10, 2, 3, 1) == pytest.approx(56 / 120)  # 2 * C(8, 2)
    assert hypergeometric_pmf(10, 2, 3, 2) == pytest.approx(8 / 120)
    assert hypergeometric_pmf(10, 2, 3, 3) == 0.0
    assert hypergeometric_tail(10, 2, 3, 0) == pytest.approx(64 / 120)
    assert hypergeometric_tail(10, 2, 3, 1) == pytest.approx(8 / 120)
    assert hypergeometric_tail(10, 2, 3, 2) == 0.0


@pytest.mark.parametrize("n,f,s", [(30, 6, 10), (150, 30, 40), (17, 8, 17), (100, 1, 7)])
def test_pmf_sums_to_one_and_tail_is_its_sum(n, f, s):
    pmf = [hypergeometric_pmf(n, f, s, k) for k in range(s + 1)]
    assert sum(pmf) == pytest.approx(1.0, abs=1e-12)
    for b in range(s + 1):
        assert hypergeometric_tail(n, f, s, b) == pytest.approx(sum(pmf[b + 1:]), abs=1e-12)


@pytest.mark.parametrize("n,f,s", [(30, 6, 10), (150, 30, 40), (60, 12, 25)])
def test_kl_bound_is_a_valid_upper_bound(n, f, s):
    for b in range(s):
        assert kl_tail_bound(n, f, s, b) >= hypergeometric_tail(n, f, s, b) - 1e-15


def test_bernoulli_kl():
    assert bernoulli_kl(0.3, 0.3) == 0.0
    assert bernoulli_kl(0.5, 0.2) == pytest.approx(0.5 * math.log(2.5) + 0.5 * math.log(0.625))
    assert bernoulli_kl(1.0, 0.2) == pytest.approx(math.log(5))


def test_b_hat_rules():
    # exact: P(B > 1) = 8/120 = 0.067 <= 0.1, and b must be >= ceil(f s / n) = 1
    assert b_hat(10, 2, 3, "hypergeometric", 0.1) == 1
    with pytest.raises(ValueError, match="^level: no b_hat < s/2 = 1.5"):
        b_hat(10, 2, 3, "hypergeometric", 0.05)
    assert b_hat(10, 0, 3, "kl", 0.01) == 0
    # the paper's setting n = 150, f = 30: the KL bound is looser, so never a smaller b_hat
    for s in (20, 40, 75):
        exact, kl = b_hat(150, 30, s, "hypergeometric", 0.05), b_hat(150, 30, s, "kl", 0.05)
        assert math.ceil(30 * s / 150) <= exact <= kl < s / 2
        assert hypergeometric_tail(150, 30, s, exact) <= 0.05 < hypergeometric_tail(150, 30, s, exact - 1)
    assert (b_hat(150, 30, 40, "hypergeometric", 0.05), b_hat(150, 30, 40, "kl", 0.05)) == (12, 14)
    # no sample holds more than f Byzantine clients: b_hat never exceeds f
    assert b_hat(150, 30, 150, "kl", 0.01) == b_hat(150, 30, 150, "hypergeometric", 0.01) == 30
    assert b_hat(30, 6, 30, "kl", 0.01) == 6
