"""Privacy attacks and their scoring (strategies/privacy_attacks.py), by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import norm
from torch import nn

from simulator.models import build_model
from strategies.privacy_attacks import (
    LiRA,
    advantage_at,
    balanced_inclusion,
    dlg,
    infer_labels,
    inverting_gradients,
    lira_scores,
    logit_confidence,
    match,
    membership_scores,
    nearest_is_target,
    psnr,
    simulated_update,
    ssim,
    tpr_at_fpr,
)
from strategies.protocols import AttackView


def one_sample(model: nn.Module, shape=(8, 8), label: int = 3, lr: float = 0.1, seed: int = 0):
    """A digit-sized sample in [0, 1], its FedSGD update and the attacker's view of it."""
    x = torch.rand((1, *shape), generator=torch.Generator().manual_seed(seed))
    y = nn.functional.one_hot(torch.tensor([label]), 10).to(torch.float32)
    u = simulated_update(model, x, y, lr, 1).detach()
    return x, u, AttackView(model, u, 1, lr, 1, shape, 10, (0.0, 1.0))


def test_simulated_update_is_minus_lr_times_the_gradient():
    model = build_model({"name": "logreg"}, (8, 8), 10, 0).eval()
    x = torch.rand(2, 8, 8)
    y = torch.tensor([1, 4])
    u = simulated_update(model, x, nn.functional.one_hot(y, 10).float(), 0.3, 1)
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(u, -0.3 * g)


def test_labels_are_read_off_the_output_bias():
    """One sample: the bias update is -lr (softmax - onehot), positive at the label only."""
    model = build_model({"name": "mlp", "hidden": [16]}, (8, 8), 10, 0).eval()
    for label in (0, 3, 9):
        _, u, _ = one_sample(model, label=label)
        assert infer_labels(model, u, 1, 10).tolist() == [label]


def test_dlg_reconstructs_one_sample_without_noise_and_fails_with_it():
    """FedSGD on logistic regression, one sample: iDLG recovers it to beyond 60 dB (the
    sample is the weight update's row over the bias update, exactly); Gaussian noise of std
    0.05 an entry on the update (its norm is about 0.4) leaves it under 20 dB."""
    model = build_model({"name": "logreg"}, (8, 8), 10, 0).eval()
    x, u, view = one_sample(model)
    out = dlg(view, torch.Generator().manual_seed(1), 100, 1.0, "infer")
    assert float(psnr(out.inputs, x, 1.0)[0, 0]) > 60 and out.labels.tolist() == [3]
    noisy = u + 0.05 * torch.randn(u.shape, generator=torch.Generator().manual_seed(2))
    out = dlg(AttackView(model, noisy, 1, 0.1, 1, (8, 8), 10, (0.0, 1.0)),
              torch.Generator().manual_seed(1), 100, 1.0, "infer")
    assert float(psnr(out.inputs, x, 1.0)[0, 0]) < 20


def test_inverting_gradients_reconstructs_through_a_clipped_update():
    """The cosine loss ignores the update's scale: a clipped (shrunk) update of an MLP is
    inverted as well as the raw one, above 30 dB."""
    model = build_model({"name": "mlp", "hidden": [16]}, (8, 8), 10, 0).eval()
    x, u, _ = one_sample(model)
    clipped = u / max(1.0, float(u.norm()) / 0.01)
    view = AttackView(model, clipped, 1, 0.1, 1, (8, 8), 10, (0.0, 1.0))
    out = inverting_gradients(view, torch.Generator().manual_seed(1), 300)
    assert float(psnr(out.inputs, x, 1.0)[0, 0]) > 30


def test_psnr_ssim_by_hand():
    a, b = torch.zeros(1, 8, 8), torch.full((1, 8, 8), 0.1)
    assert float(psnr(a, b, 1.0)[0, 0]) == pytest.approx(20.0)  # mse 0.01
    assert float(ssim(a, a, 1.0)[0]) == pytest.approx(1.0)
    # constant images: only the luminance term, (2 m1 m2 + C1) / (m1^2 + m2^2 + C1)
    c1 = 0.01 ** 2
    got = float(ssim(torch.full((1, 8, 8), 0.5), torch.full((1, 8, 8), 0.6), 1.0)[0])
    assert got == pytest.approx((2 * 0.3 + c1) / (0.25 + 0.36 + c1))


def test_match_undoes_a_permutation():
    truth = torch.rand(4, 8, 8, generator=torch.Generator().manual_seed(0))
    rec = truth[[2, 0, 3, 1]] + 0.01
    assert match(rec, truth, 1.0).tolist() == [1, 3, 0, 2]


def test_membership_auc_and_advantage_by_hand():
    """Scores 3, 2, 1, 0 for member, non-member, member, non-member: 3 of the 4
    member/non-member pairs ordered right (AUC 0.75); the best threshold takes the top
    score (TPR 0.5, FPR 0)."""
    scores, member = np.array([3.0, 2.0, 1.0, 0.0]), np.array([True, False, True, False])
    assert membership_scores(scores, member) == (0.75, 0.5, 3.0)
    assert advantage_at(scores, member, 1.0) == 0.5  # TPR 1, FPR 0.5
    assert advantage_at(scores, member, 2.5) == 0.5
    # ties count half, and no threshold splits them
    assert membership_scores(np.array([1.0, 1.0]), np.array([True, False])) == \
        (0.5, 0.0, math.inf)


def test_nearest_candidate():
    cands = torch.stack([torch.zeros(3), torch.ones(3), -torch.ones(3)])
    assert nearest_is_target(torch.full((3,), 0.2), cands)
    assert not nearest_is_target(torch.full((3,), 0.8), cands)


def test_hayes_bound_of_one_gaussian_by_hand():
    """sigma = 0.5, one step, q = 1: 2-GDP, f(a) = Phi(Phi^-1(1 - a) - 2); the bound on a
    reconstruction's success with prior 1/10 is 1 - f(0.1) = 0.7638."""
    from strategies.privacy import SubsampledGaussian

    alpha = np.linspace(0, 1, 10001)
    f = SubsampledGaussian(1.0, 0.5, 1).tradeoff(alpha)
    got = 1 - float(np.interp(0.1, alpha, f))
    want = 1 - norm.cdf(norm.ppf(0.9) - 2)
    assert got == pytest.approx(want, abs=2e-3) and want == pytest.approx(0.7638, abs=1e-4)
    assert math.isfinite(got)


def test_a_few_step_client_is_inverted_through_its_simulated_steps():
    """FedAvg with 3 local steps on one sample: the attack simulates the 3 steps (exactly
    the client's: one sample is every minibatch), and recovers the sample above 30 dB;
    simulating 1 step instead does worse."""
    model = build_model({"name": "mlp", "hidden": [16]}, (8, 8), 10, 0).eval()
    x = torch.rand((1, 8, 8), generator=torch.Generator().manual_seed(0))
    y = nn.functional.one_hot(torch.tensor([3]), 10).to(torch.float32)
    u = simulated_update(model, x, y, 0.5, 3).detach()
    got = {}
    for steps in (3, 1):
        view = AttackView(model, u, 1, 0.5, steps, (8, 8), 10, (0.0, 1.0))
        out = inverting_gradients(view, torch.Generator().manual_seed(1), 300)
        got[steps] = float(psnr(out.inputs, x, 1.0)[0, 0])
    assert got[3] > 30 and got[3] > got[1], got


# ---------------------------------------------------------------- LiRA (shadow runs)


def test_logit_confidence_is_log_p_over_one_minus_p():
    """Carlini et al.'s score from the logits: log p_y - log(1 - p_y), also where p_y
    rounds to 1 in float32 (a logit gap of 40)."""
    model = nn.Identity()
    z = torch.tensor([[2.0, 0.0, -1.0], [0.0, 40.0, 0.0]])
    y = torch.tensor([0, 1])
    view = AttackView(model, None, 2, 0.0, 0, (3,), 3, (0.0, 1.0), (z, y))
    got = logit_confidence(view).scores.numpy()
    p = np.exp(2.0) / (np.exp(2.0) + 1 + np.exp(-1.0))
    assert got[0] == pytest.approx(np.log(p / (1 - p)), abs=1e-12)
    assert got[1] == pytest.approx(40 - np.log(2.0), abs=1e-9)


def test_balanced_inclusion_trains_each_candidate_in_half_the_runs():
    inc = balanced_inclusion(np.random.default_rng(0), 500, 9)
    assert inc.shape == (9, 500) and (inc.sum(axis=0) == 4).all()
    assert 0.35 < inc[0].mean() < 0.55  # a run's share: random, about 4/9


def test_lira_scores_by_hand():
    """Two candidates, four shadows. Candidate 0: IN scores 3, 5 (median 4), OUT 0, 2
    (median 1); candidate 1: IN 6, 8 (7), OUT 1, 3 (2). Global variances pool each side's
    squared deviations from the candidate's mean: all 1, so s_in = s_out = 1; the target's
    scores 4 and 2 give online log N(4; 4, 1) - log N(4; 1, 1) = 4.5 and log N(2; 7, 1) -
    log N(2; 2, 1) = -12.5; offline log Phi((4 - 1) / 1) and log Phi(0)."""
    shadows = np.array([[3.0, 6.0], [5.0, 8.0], [0.0, 1.0], [2.0, 3.0]])
    included = np.array([[True, True], [True, True], [False, False], [False, False]])
    target = np.array([4.0, 2.0])
    np.testing.assert_allclose(lira_scores(target, shadows, included), [4.5, -12.5])
    np.testing.assert_allclose(lira_scores(target, shadows, included, online=False),
                               [norm.logcdf(3.0), np.log(0.5)])
    # per example: the same here (every candidate's spread is 1)
    np.testing.assert_allclose(
        lira_scores(target, shadows, included, variance="per_example"), [4.5, -12.5])
    # a candidate no shadow trained on takes the IN mean of the others (median 4)
    lone = included.copy()
    lone[:, 1] = False
    got = lira_scores(target, shadows, lone)
    assert np.isfinite(got).all()


def test_lira_beats_the_global_threshold_on_scores_with_per_example_offsets():
    """Each candidate's score has its own offset (its hardness) and membership adds 1: the
    global threshold on the score alone is weak, LiRA, which learns each offset from the
    shadows, is not (Carlini et al.'s point)."""
    from strategies.privacy_attacks import membership_scores

    rng = np.random.default_rng(0)
    inc = balanced_inclusion(rng, 400, 16)
    scores = rng.normal(0, 2, 400) + 1.0 * inc + 0.3 * rng.normal(size=(16, 400))
    alone = membership_scores(scores[0], inc[0])[0]
    lira = membership_scores(LiRA().combine(scores[0], scores[1:], inc[1:]), inc[0])[0]
    assert alone < 0.7 and lira > 0.95


def test_tpr_at_fpr_by_hand():
    """Scores 5 4 3 2 1 of member, non, member, member, non: at FPR 0 the threshold 5 takes
    one of three members; at FPR 0.5 the threshold 2 takes all three; ties move together."""
    s = np.array([5.0, 4.0, 3.0, 2.0, 1.0])
    m = np.array([True, False, True, True, False])
    assert tpr_at_fpr(s, m, 0.0) == pytest.approx(1 / 3)
    assert tpr_at_fpr(s, m, 0.5) == 1.0
    tied = np.array([5.0, 5.0, 3.0, 2.0, 1.0])
    assert tpr_at_fpr(tied, m, 0.0) == 0.0  # 5 takes the non-member with the member
