from __future__ import annotations

import numpy as np
import pytest
import torch

from strategies.privacy import (
    SubsampledGaussian,
    clip_rows,
    delta_divergence,
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
