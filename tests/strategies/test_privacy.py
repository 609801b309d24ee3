from __future__ import annotations

import numpy as np
import pytest
import torch

from strategies.privacy import (
    SubsampledGaussian,
    advantage,
    bayes_risk,
    clip_rows,
    delta_divergence,
    excess_bayes_vulnerability,
    gaussian_tradeoff,
    symmetric_delta,
)

ALPHA = np.linspace(0.0, 1.0, 2001)


def test_gaussian_tradeoff_closed_form_and_from_the_pld():
    from scipy.stats import norm

    a = np.array([0.001, 0.01, 0.1, 0.5, 0.9])
    expect = norm.cdf(norm.ppf(1 - a) - 1.3)
    np.testing.assert_allclose(gaussian_tradeoff(a, 1.3), expect, rtol=0, atol=1e-12)
    # one Gaussian mechanism with noise multiplier sigma is (1/sigma)-GDP: riskcal's curve
    # from dp-accounting's PLD matches the closed form
    m = SubsampledGaussian(1.0, 1 / 1.3, 1)
    np.testing.assert_allclose(m.tradeoff(a), expect, atol=2e-3)
    # k compositions: sqrt(k)/sigma-GDP
    np.testing.assert_allclose(SubsampledGaussian(1.0, 2.0, 4).tradeoff(a),
                               gaussian_tradeoff(a, 1.0), atol=2e-3)


def test_delta_divergence_properties():
    f = gaussian_tradeoff(ALPHA, 1.0)
    assert delta_divergence(ALPHA, f, f) == 0.0
    values = [delta_divergence(ALPHA, f, gaussian_tradeoff(ALPHA, mu)) for mu in (1.5, 2, 3, 5)]
    assert all(v > 0 for v in values) and values == sorted(values)  # grows as noise falls
    # the less private mechanism never costs anything to replace: Delta(less || more) = 0
    assert all(delta_divergence(ALPHA, gaussian_tradeoff(ALPHA, mu), f) == 0.0 for mu in (1.5, 3))
    assert symmetric_delta(ALPHA, f, gaussian_tradeoff(ALPHA, 2)) == pytest.approx(values[1])
    # hand-checkable: f = 1 - a (perfect privacy) against g = 0 (none): kappa = 1/2
    assert delta_divergence(ALPHA, 1 - ALPHA, np.zeros_like(ALPHA)) == pytest.approx(0.5, abs=1e-5)


def _delta_continuous(f, g) -> float:
    """Delta(f || g) for curves given as functions, without our grid: for each alpha the kappa
    solving f(alpha + kappa) - kappa = g(alpha) (brentq), maximised over alpha."""
    from scipy.optimize import brentq, minimize_scalar

    def kappa(a: float) -> float:
        h = lambda k: (f(a + k) if a + k <= 1 else 0.0) - k - g(a)
        return 0.0 if h(0.0) <= 0 else brentq(h, 0.0, 1.0, xtol=1e-12)

    grid = np.linspace(0, 1, 201)
    a0 = grid[int(np.argmax([kappa(a) for a in grid]))]
    best = minimize_scalar(lambda a: -kappa(a), bounds=(max(a0 - 0.01, 0), min(a0 + 0.01, 1)),
                           method="bounded", options={"xatol": 1e-10})
    return max(-best.fun, kappa(a0))


def _f_eps_delta(eps: float, delta: float):
    """The trade-off curve of (eps, delta)-DP (Dong, Roth, Su 2022, eq. 5)."""
    return lambda a: np.maximum.reduce([np.zeros_like(a), 1 - delta - np.exp(eps) * a,
                                        np.exp(-eps) * (1 - delta - a)])


def test_delta_divergence_matches_an_independent_continuous_computation():
    from scipy.stats import norm

    gauss = lambda mu: (lambda a: float(norm.cdf(norm.ppf(1 - a) - mu)))
    for mu_f, mu_g in [(1.0, 1.5), (1.0, 3.0), (0.5, 5.0)]:
        ours = delta_divergence(ALPHA, gaussian_tradeoff(ALPHA, mu_f), gaussian_tradeoff(ALPHA, mu_g))
        assert ours == pytest.approx(_delta_continuous(gauss(mu_f), gauss(mu_g)), abs=2e-4)
        assert advantage(ALPHA, gaussian_tradeoff(ALPHA, mu_g)) == pytest.approx(
            2 * norm.cdf(mu_g / 2) - 1, abs=2e-5)  # grid of 2001 alphas
        # closed form: the binding prior is 1/2, where mu-GDP leaves the attacker Phi(-mu/2)
        assert ours == pytest.approx(norm.cdf(mu_g / 2) - norm.cdf(mu_f / 2), abs=1e-5)
    # crossing curves: pure 1-DP against 1-GDP, both ways (neither dominates)
    ed = _f_eps_delta(1.0, 0.0)
    pure = lambda a: float(ed(np.array(a)))
    for f, g, fs, gs in [(ed(ALPHA), gaussian_tradeoff(ALPHA, 1.0), pure, gauss(1.0)),
                         (gaussian_tradeoff(ALPHA, 1.0), ed(ALPHA), gauss(1.0), pure)]:
        value = delta_divergence(ALPHA, f, g)
        assert value > 0.03
        assert value == pytest.approx(_delta_continuous(fs, gs), abs=2e-4)


def test_delta_is_the_worst_excess_bayes_vulnerability_over_priors():
    # a hand-checkable risk: perfect privacy (1 - a) leaves the attacker min(pi, 1 - pi)
    pis = np.array([0.1, 0.5, 0.8])
    np.testing.assert_allclose(bayes_risk(ALPHA, 1 - ALPHA, pis), [0.1, 0.5, 0.2], atol=1e-12)
    pairs = [(gaussian_tradeoff(ALPHA, 1.0), gaussian_tradeoff(ALPHA, mu)) for mu in (1.5, 3)]
    pairs += [(_f_eps_delta(e, d)(ALPHA), gaussian_tradeoff(ALPHA, mu))
              for e, d, mu in [(1, 0, 1), (2, 1e-5, 1), (0.5, 0.05, 0.7)]]
    pairs += [(g, f) for f, g in pairs] + [((1 - ALPHA) ** 2, gaussian_tradeoff(ALPHA, 1.0))]
    priors = np.linspace(0, 1, 4001)
    binding = set()
    for f, g in pairs:
        delta = delta_divergence(ALPHA, f, g)
        excess, prior = excess_bayes_vulnerability(ALPHA, f, g, priors)
        assert delta >= excess - 1e-6  # always, by the shift argument
        assert delta == pytest.approx(excess, abs=1e-4)  # and equal on every pair here
        if excess > 0:
            binding.add(round(prior, 2))
    assert len(binding) > 2  # not only the symmetric prior 1/2 binds


def test_delta_bounds_the_excess_delta_of_dp_sgd_profiles():
    """Two DP-SGD mechanisms: Delta from riskcal's trade-off curves bounds, and is reached by,
    the excess of dp-accounting's privacy profile: delta_B(eps) <= delta_A(eps) + (1 + e^eps)
    Delta(A || B) for every epsilon."""
    a = SubsampledGaussian(0.001, 0.5601, 1000)  # heavy subsampling
    b = SubsampledGaussian(1.0, 6.3051, 10)  # full batch, same (2, 1e-5)
    assert a.epsilon(1e-5) == pytest.approx(2.0, abs=0.01)
    assert b.epsilon(1e-5) == pytest.approx(2.0, abs=0.01)
    kappa = delta_divergence(ALPHA, a.tradeoff(ALPHA), b.tradeoff(ALPHA))
    assert kappa == pytest.approx(0.072, abs=0.002)
    assert delta_divergence(ALPHA, b.tradeoff(ALPHA), a.tradeoff(ALPHA)) == 0.0
    # the advantage (max TPR - FPR) from riskcal's curve is dp-accounting's delta(0)
    assert advantage(ALPHA, a.tradeoff(ALPHA)) == pytest.approx(a.profile(np.zeros(1))[0], abs=1e-3)
    assert advantage(ALPHA, b.tradeoff(ALPHA)) == pytest.approx(b.profile(np.zeros(1))[0], abs=1e-3)
    eps = np.linspace(0.0, 6.0, 61)
    excess = (b.profile(eps) - a.profile(eps)) / (1 + np.exp(eps))
    assert (excess <= kappa + 1e-3).all()
    assert excess.max() == pytest.approx(kappa, abs=1e-3)
    assert excess[np.searchsorted(eps, 2.0)] < kappa / 3  # at the calibration point: hidden


def test_epsilon_equals_dp_accounting_for_known_dp_sgd_settings():
    import dp_accounting
    from dp_accounting import rdp
    from dp_accounting.pld import pld_privacy_accountant

    for q, sigma, steps in [(0.01, 1.1, 1000), (0.004, 1.0, 5000), (1.0, 5.0, 50)]:
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
        pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
        pld.compose(event)
        acc = rdp.RdpAccountant()
        acc.compose(event)
        m = SubsampledGaussian(q, sigma, steps)
        assert m.epsilon(1e-5) == pytest.approx(pld.get_epsilon(1e-5), rel=1e-6)
        assert m.epsilon(1e-5, "rdp") == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    # the PLD accountant is tighter than RDP, and more noise spends less
    m = SubsampledGaussian(0.01, 1.1, 1000)
    assert m.epsilon(1e-5) < m.epsilon(1e-5, "rdp")
    assert SubsampledGaussian(0.01, 2.0, 1000).epsilon(1e-5) < m.epsilon(1e-5)
    assert SubsampledGaussian(0.01, 0.0, 10).epsilon(1e-5) == float("inf")


def test_privacy_profile_is_the_delta_for_epsilon():
    m = SubsampledGaussian(0.05, 1.0, 100)
    eps = m.epsilon(1e-5)
    assert m.profile(np.array([eps]))[0] == pytest.approx(1e-5, rel=0.05)
    prof = m.profile(np.linspace(0, 5, 11))
    assert (np.diff(prof) <= 1e-15).all()  # delta falls as epsilon grows


def test_clip_rows():
    x = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    torch.testing.assert_close(clip_rows(x, 1.0), torch.tensor([[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]]))
    assert x[0, 0] == 3.0  # not in place


def _curves() -> dict[str, np.ndarray]:
    """Trade-off curves of several kinds: GDP, (eps, delta)-DP, DP-SGD, and a Laplace one."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib
    from riskcal.analysis import get_beta_from_pld

    lap = pld_lib.from_laplace_mechanism(1.0, value_discretization_interval=1e-3)
    return {"G1": gaussian_tradeoff(ALPHA, 1.0), "G2": gaussian_tradeoff(ALPHA, 2.0),
            "pure1": _f_eps_delta(1.0, 0.0)(ALPHA), "ed": _f_eps_delta(0.5, 0.05)(ALPHA),
            "dpsgd": SubsampledGaussian(0.05, 1.0, 50).tradeoff(ALPHA),
            "laplace": np.asarray(get_beta_from_pld(lap, alpha=ALPHA))}


def test_delta_satisfies_the_triangle_inequality_and_its_symmetrisation_is_a_metric():
    curves = _curves()
    names = list(curves)
    d = {(a, b): delta_divergence(ALPHA, curves[a], curves[b]) for a in names for b in names}
    for a in names:
        for b in names:
            for c in names:  # shifting by k1 then k2 is shifting by k1 + k2
                assert d[a, c] <= d[a, b] + d[b, c] + 2e-6
            if a != b:  # distinct curves are at a positive symmetrised distance
                assert max(d[a, b], d[b, a]) > 1e-3
                assert symmetric_delta(ALPHA, curves[a], curves[b]) == max(d[a, b], d[b, a])


def test_composition_orders_mechanisms_that_one_release_leaves_unordered():
    """Laplace (scale 1) against Gaussian (sigma 1.2), both from dp-accounting's PLDs: after one
    release neither curve lies above the other (Delta > 0 both ways); after 16 compositions the
    Gaussian one is at least as private everywhere, as composition drives both towards
    Gaussian curves, which are totally ordered."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib
    from riskcal.analysis import get_beta_from_pld

    lap = pld_lib.from_laplace_mechanism(1.0, value_discretization_interval=1e-3)
    gauss = pld_lib.from_gaussian_mechanism(1.2, value_discretization_interval=1e-3)
    for k, both_ways in [(1, True), (16, False)]:
        fl = np.asarray(get_beta_from_pld(lap.self_compose(k), alpha=ALPHA))
        fg = np.asarray(get_beta_from_pld(gauss.self_compose(k), alpha=ALPHA))
        lap_over_gauss = delta_divergence(ALPHA, fg, fl)  # choosing Laplace over Gaussian
        gauss_over_lap = delta_divergence(ALPHA, fl, fg)
        assert lap_over_gauss > 0.005
        # ordered: 0 up to the PLD's numerical noise (curves within 5e-8) and the bisection's 1e-6
        assert (gauss_over_lap > 0.01) if both_ways else (gauss_over_lap < 2e-6)
