from __future__ import annotations

import pytest
import torch

from strategies.optimizers import (
    Mu2SGD,
    Mu2SGDClient,
    WorkerMomentum,
    anytime_step,
    mu2_beta,
    storm_estimate,
)


def test_storm_and_beta_closed_form():
    g, gp, dp = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.0]), torch.tensor([3.0, 1.0])
    torch.testing.assert_close(storm_estimate(g, gp, dp, 0.25), g + 0.75 * (dp - gp))
    torch.testing.assert_close(storm_estimate(g, gp, None, 0.25), g)
    assert [mu2_beta(t, 0.0) for t in (1, 2, 4)] == [1.0, 0.5, 0.25]
    assert mu2_beta(1000, 0.01) == 0.01


def test_anytime_average_is_the_alpha_weighted_mean_of_the_w_iterates():
    x1 = torch.tensor([1.0, -1.0])
    opt = Mu2SGD(lr=0.1)
    aggs = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0]), torch.tensor([-1.0, 1.0])]
    x, ws = x1.clone(), [x1.clone()]
    for a in aggs:
        x = opt.step(x, a)
        t = len(ws)
        ws.append(ws[-1] + 0.1 * t * a)  # the paper: w_{t+1} = w_t - eta alpha_t d_t
    # x_{t+1} = sum_s alpha_s w_s / sum_s alpha_s with alpha_s = s
    expect = sum((s + 1) * w for s, w in enumerate(ws)) / sum(range(1, len(ws) + 1))
    torch.testing.assert_close(x, expect)
    # the authors' code drops alpha_t from the w-step
    x2, w2 = anytime_step(x1, x1, aggs[0], 3, 0.1, alpha_in_step=False)
    torch.testing.assert_close(w2, x1 + 0.1 * aggs[0])
    torch.testing.assert_close(x2, (6 * x1 + 4 * w2) / 10)


def test_mu2sgd_state_round_trips():
    a, b = Mu2SGD(lr=0.1), Mu2SGD(lr=0.1)
    x = torch.ones(3)
    x = a.step(x, torch.tensor([1.0, 2.0, 3.0]))
    b.load_state_dict(a.state_dict())
    d = torch.tensor([0.5, 0.5, -1.0])
    torch.testing.assert_close(a.step(x, d), b.step(x, d))


def test_mu2sgd_client_with_exact_gradients_sends_the_gradient():
    # With noiseless gradients the STORM correction is exact: d_t = grad f(x_t).
    A = torch.diag(torch.tensor([1.0, 3.0]))
    grad = lambda p: (A @ p, 0.0)  # f(x) = x^T A x / 2
    client, state, x = Mu2SGDClient(), {}, torch.tensor([1.0, 1.0])
    server = Mu2SGD(lr=0.05)
    for t in range(5):
        msg, state, _ = client.client_message(t, x, grad, state, lr=1.0)
        torch.testing.assert_close(-msg, A @ x)
        x = server.step(x, msg)
    assert float(x.norm()) < 0.5 * 2**0.5  # and the run moves towards the minimum at 0


def test_mu2sgd_client_uses_both_points_on_the_same_batch():
    calls = []

    def grad(p):
        calls.append(p.clone())
        return 2 * p, 0.0

    client = Mu2SGDClient()
    _, state, _ = client.client_message(0, torch.tensor([1.0]), grad, {}, 1.0)
    msg, state, _ = client.client_message(1, torch.tensor([3.0]), grad, state, 1.0)
    # d_2 = g(x_2) + (1 - 1/2) (d_1 - g(x_1)) = 6 + 0.5 (2 - 2) = 6
    assert [float(c) for c in calls] == [1.0, 3.0, 1.0]
    assert float(-msg) == pytest.approx(6.0)


def test_worker_momentum_is_an_exponential_average():
    rule, state = WorkerMomentum(beta=0.5), {}
    gs = [torch.tensor([2.0]), torch.tensor([4.0])]
    out = []
    for t, g in enumerate(gs):
        msg, state, _ = rule.client_message(t, torch.zeros(1), lambda p, g=g: (g, 0.0), state, 0.1)
        out.append(float(msg))
    # m_1 = 0.5 * 2 = 1, m_2 = 0.5 * 1 + 0.5 * 4 = 2.5; messages are -lr m
    assert out == pytest.approx([-0.1, -0.25])
