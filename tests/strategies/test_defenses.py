"""The backdoor defences of strategies/defenses.py: hand-computed outputs on small matrices,
the noise they draw measured against its declared scale, and the conformance checks."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from fedray.testing import check_plugin
from simulator import registry
from strategies.defenses import (
    Flame,
    FoolsGold,
    NormBound,
    flame,
    flame_admitted,
    foolsgold,
    foolsgold_weights,
    norm_bound,
)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------- NormBound

# norms 5, 1, 10, 3
ROWS = torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 1.0], [0.0, 6.0, 8.0], [1.0, 2.0, 2.0]])


def test_norm_bound_clips_then_averages_by_hand():
    # bound 2.5: [1.5, 2, 0], [0, 0, 1] (kept), [0, 1.5, 2], (2.5/3) [1, 2, 2]; sum / 4
    expected = torch.tensor([7 / 12, 31 / 24, 7 / 6])
    torch.testing.assert_close(NormBound(bound=2.5)(ROWS), expected)
    torch.testing.assert_close(norm_bound(ROWS, 2.5), expected)
    # a bound above every norm clips nothing: the mean; inf likewise
    torch.testing.assert_close(NormBound(bound=10.0)(ROWS), ROWS.mean(0))
    torch.testing.assert_close(NormBound(bound=math.inf)(ROWS), ROWS.mean(0))


def test_norm_bound_bounds_one_huge_row_where_the_mean_breaks():
    x = torch.cat([ROWS, torch.tensor([[1e6, 1e6, 1e6]])])
    out = NormBound(bound=2.5)(x)
    # the huge row adds at most bound / n = 0.5 in norm to the clipped honest sum / 5
    honest = NormBound(bound=2.5)(ROWS) * 4 / 5
    assert float((out - honest).norm()) == pytest.approx(0.5, rel=1e-5)
    assert float(x.mean(0).norm()) > 3e5


def test_norm_bound_makes_a_nonfinite_row_the_zero_row():
    x = torch.cat([ROWS, torch.tensor([[math.nan, 0.0, 0.0]])])
    torch.testing.assert_close(NormBound(bound=2.5)(x), NormBound(bound=2.5)(ROWS) * 4 / 5)


def test_norm_bound_noise_has_std_sigma():
    d = 40_000
    x = torch.ones((4, d)) * 0.001  # norm 0.2 < bound: the mean is 0.001 everywhere
    out = NormBound(bound=1.0, sigma=0.5)(x, generator=gen(3))
    noise = out - 0.001
    assert float(noise.std()) == pytest.approx(0.5, rel=0.02)  # std error ~ 0.5 / sqrt(2d)
    assert abs(float(noise.mean())) < 0.01  # ~ 4 standard errors (0.5 / sqrt(d) = 0.0025)
    assert torch.equal(out, NormBound(bound=1.0, sigma=0.5)(x, generator=gen(3)))
    assert not torch.equal(out, NormBound(bound=1.0, sigma=0.5)(x, generator=gen(4)))


def test_norm_bound_needs_a_generator_only_when_it_draws():
    assert NormBound.traits.random and not NormBound.traits.weighted
    NormBound(bound=1.0)(ROWS)  # sigma 0 draws nothing
    with pytest.raises(TypeError, match="NormBound is random"):
        NormBound(bound=1.0, sigma=0.1)(ROWS)
    with pytest.raises(TypeError, match="norm_bound: a positive noise scale"):
        norm_bound(ROWS, 1.0, 0.1)


# ---------------------------------------------------------------------------- FoolsGold

# three honest clients (orthogonal) and two sybils pointing the same way (norms differ)
HONEST = torch.eye(3)
SYBILS = torch.tensor([[2.0, 2.0, 0.0], [4.0, 4.0, 0.0]])


def test_foolsgold_weights_by_hand():
    """cs(h0, s) = cs(h1, s) = 1/sqrt2, cs(h2, s) = 0, cs(s, s') = 1: v = (1/sqrt2, 1/sqrt2,
    0, 1, 1). Pardoning: cs(h0, s) <- (1/sqrt2) (1/sqrt2) / 1 = 1/2. alpha = (1/2, 1/2, 1, 0,
    0), max 1 -> 0.99; logit: ln(1) + 0.5 = 0.5 for h0, h1, ln 99 + 0.5 > 1 -> 1 for h2,
    -inf -> 0 for the sybils."""
    x = torch.cat([HONEST, SYBILS])
    w = foolsgold_weights(x)
    torch.testing.assert_close(w, torch.tensor([0.5, 0.5, 1.0, 0.0, 0.0], dtype=torch.float64))
    # (0.5 h0 + 0.5 h1 + h2) / 2
    torch.testing.assert_close(FoolsGold()(x), torch.tensor([0.25, 0.25, 0.5]))
    torch.testing.assert_close(foolsgold(x), FoolsGold()(x))
    # kappa 0.5: 0.25 for h0, h1; h2 still clipped to 1: (0.25 h0 + 0.25 h1 + h2) / 1.5
    torch.testing.assert_close(FoolsGold(kappa=0.5)(x), torch.tensor([1 / 6, 1 / 6, 2 / 3]))


def test_foolsgold_gives_identical_sybils_weight_zero_among_distinct_honest_rows():
    g = gen(7)
    honest = torch.randn((6, 50), generator=g)  # nearly orthogonal in 50 dimensions
    sybil = torch.randn((1, 50), generator=g) * 3
    x = torch.cat([honest, sybil.expand(4, -1)])
    w = foolsgold_weights(x)
    # the sybils' pairwise similarity is 1 (float32: to ~1e-7), alpha ~ 0, logit -> 0; the
    # honest rows' largest alpha is normalised to 0.99 and every other one stays high enough
    # for a logit above 1
    assert torch.all(w[6:] == 0.0) and torch.all(w[:6] == 1.0), w
    # the mean is dragged 4/10 of the way to the sybils; FoolsGold returns the honest mean
    torch.testing.assert_close(FoolsGold()(x), honest.mean(0), rtol=0, atol=1e-5)
    assert float((x.mean(0) - honest.mean(0)).norm()) > 5.0


def test_foolsgold_is_scale_free_and_drops_nonfinite_rows():
    x = torch.cat([HONEST, SYBILS])
    torch.testing.assert_close(foolsgold_weights(x * torch.tensor([[1.0], [3.0], [0.5], [7.0], [1.0]])),
                               foolsgold_weights(x))
    y = torch.cat([x, torch.tensor([[math.nan, 1.0, 1.0], [math.inf, 0.0, 0.0]])])
    assert foolsgold_weights(y)[5:].tolist() == [0.0, 0.0]
    torch.testing.assert_close(FoolsGold()(y), FoolsGold()(x))


def test_foolsgold_averages_when_every_row_has_a_parallel_twin():
    """All alphas 0: the paper's normalisation is 0/0 (NaN in the authors' code); we average."""
    x = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0], [0.0, 3.0]])
    assert foolsgold_weights(x).tolist() == [1.0] * 4
    torch.testing.assert_close(FoolsGold()(x), x.mean(0))
    torch.testing.assert_close(FoolsGold()(x[:1]), x[0])  # one row: its own weight is 1


# ---------------------------------------------------------------------------- Flame

U = torch.tensor([1.0, 2.0, 2.0])  # norm 3
A = torch.tensor([2.0, -2.0, 1.0])  # norm 3, orthogonal to U
# six honest rows along U (norms 3, 6, ..., 18) and two attackers along A (norms 30, 60)
FLAME_ROWS = torch.cat([torch.arange(1.0, 7.0)[:, None] * U, torch.tensor([[10.0], [20.0]]) * A])


def test_flame_excludes_the_outlier_cluster_and_clips_to_the_median_norm_by_hand():
    """Median of the 8 norms (3, 6, 9, 12, 15, 18, 30, 60): (12 + 15) / 2 = 13.5. The six
    honest rows clipped to it have norms 3, 6, 9, 12, 13.5, 13.5, mean 9.5: 9.5 U / 3."""
    assert flame_admitted(FLAME_ROWS).tolist() == [True] * 6 + [False] * 2
    expected = 9.5 * U / 3
    torch.testing.assert_close(Flame(lam=0.0)(FLAME_ROWS), expected)
    torch.testing.assert_close(flame(FLAME_ROWS, 0.0), expected)
    assert float(FLAME_ROWS.mean(0) @ A) > 0  # the mean follows the attackers; Flame does not
    assert float(Flame(lam=0.0)(FLAME_ROWS) @ A) == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_flame_rejects_attackers_among_jittered_honest_rows(seed):
    """Honest rows jittered around U: scikit-learn's single-cluster labelling may leave an
    honest row out as noise, never an attacker; the output is the admitted rows clipped to
    the median norm of all eight, averaged."""
    x = FLAME_ROWS.clone()
    x[:6] += 0.3 * torch.randn((6, 3), generator=gen(seed))
    admitted = flame_admitted(x)
    assert not admitted[6:].any() and int(admitted.sum()) >= 4
    norms = x.norm(dim=1)
    median = float(norms.sort().values[3:5].mean())
    kept = x[admitted]
    ref = (kept * torch.clamp(median / kept.norm(dim=1, keepdim=True), max=1.0)).mean(0)
    torch.testing.assert_close(Flame(lam=0.0)(x), ref)


def test_flame_counts_a_nonfinite_row_as_an_infinite_norm():
    """Rows 3U/3 .. along U with norms 3, 6, 9 and a NaN row: size 4 // 2 + 1 = 3 finite rows
    cluster; median of (3, 6, 9, inf) = 7.5; clipped norms 3, 6, 7.5, mean 5.5."""
    x = torch.cat([torch.tensor([[1.0], [2.0], [3.0]]) * U, torch.tensor([[math.nan, 0.0, 0.0]])])
    assert flame_admitted(x).tolist() == [True, True, True, False]
    torch.testing.assert_close(Flame(lam=0.0)(x), 5.5 * U / 3)
    # fewer than n // 2 + 1 finite rows: nothing admitted, the zero update
    y = torch.cat([x[:2], torch.full((3, 3), math.inf)])
    assert not flame_admitted(y).any()
    assert torch.equal(Flame()(y, generator=gen()), torch.zeros(3))


def test_flame_noise_has_std_lambda_times_the_median_norm():
    d = 40_000
    row = torch.full((d,), 0.01)  # norm 0.01 sqrt(d) = 2
    x = row.expand(5, -1).clone()
    out = Flame(lam=0.1)(x, generator=gen(5))
    noise = out - row
    assert float(noise.std()) == pytest.approx(0.1 * 2.0, rel=0.02)
    assert abs(float(noise.mean())) < 0.005  # ~ 5 standard errors (0.2 / sqrt(d) = 0.001)
    assert torch.equal(out, Flame(lam=0.1)(x, generator=gen(5)))
    assert Flame.traits.random and Flame().lam == 0.001
    with pytest.raises(TypeError, match="Flame is random"):
        Flame()(x)
    Flame(lam=0.0)(x)  # no noise, no generator needed


# ---------------------------------------------------------------------------- registry, conformance

# What tests/strategies/test_conformance.py needs for these three (PARAMS, SKIP), applied here.
PARAMS = {"norm_bound": {"bound": 100.0}, "foolsgold": None, "flame": {"lam": 0.0}}
SKIP = {"foolsgold": {"translation_equivariance": "cosine similarities from the origin"},
        "flame": {"translation_equivariance": "cosine distances and norms from the origin"}}


@pytest.mark.parametrize("name, cls", [("norm_bound", NormBound), ("foolsgold", FoolsGold),
                                       ("flame", Flame)])
def test_registered_and_conformant(name, cls):
    assert registry.get("aggregators", name) is cls
    check_plugin("aggregators", cls, PARAMS[name], SKIP.get(name))


def test_flame_with_its_default_noise_passes_the_randomness_checks():
    """The checks a noisy Flame can pass: deterministic under a seed, picklable,
    permutation invariant (the noise is drawn once, for the aggregate)."""
    check_plugin("aggregators", Flame, None,
                 {"identical_rows": "noise", "translation_equivariance": "cosine"})
    check_plugin("aggregators", NormBound, {"bound": 100.0, "sigma": 0.1},
                 {"identical_rows": "noise"})


def test_keys_are_validated():
    from pydantic import ValidationError

    model = registry.params_model(NormBound)
    with pytest.raises(ValidationError):
        model(sigma=0.1)  # bound has no default
    with pytest.raises(ValidationError):
        model(bound=0.0)
    model(bound=math.inf)
    with pytest.raises(ValidationError):
        registry.params_model(FoolsGold)(kappa=0.0)
    with pytest.raises(ValidationError):
        registry.params_model(Flame)(lam=-0.1)


def test_pickled_rules_give_the_same_numbers():
    x = torch.cat([FLAME_ROWS, FLAME_ROWS[:2] * 0.5])
    for rule in (NormBound(bound=5.0, sigma=0.2), FoolsGold(kappa=2.0), Flame(lam=0.01)):
        copy = pickle.loads(pickle.dumps(rule))
        assert torch.equal(copy(x, generator=gen(9)), rule(x, generator=gen(9)))


# ---------------------------------------------------------------------------- FLTrust


def test_fltrust_weighs_rows_by_their_cosine_to_the_server_update_at_its_norm():
    """Reference g0 = (3, 4) (norm 5). Rows: (6, 8) (cos 1, rescaled to (3, 4)), (4, -3)
    (cos 0: weight 0), (-3, -4) (cos -1: ReLU 0), (0, 2) (cos 0.8, rescaled to (0, 5)).
    Aggregate: (1 * (3, 4) + 0.8 * (0, 5)) / (1 + 0.8) = (3, 8) / 1.8."""
    from strategies.defenses import FLTrust, fltrust

    x = torch.tensor([[6.0, 8.0], [4.0, -3.0], [-3.0, -4.0], [0.0, 2.0]])
    ref = torch.tensor([3.0, 4.0])
    want = torch.tensor([3.0, 8.0]) / 1.8
    torch.testing.assert_close(fltrust(x, ref), want)
    torch.testing.assert_close(FLTrust()(x, reference=ref), want)
    # a non-finite row scores 0; every row against the reference: the model stays
    torch.testing.assert_close(fltrust(torch.cat([x, torch.full((1, 2), float("nan"))]), ref),
                               want)
    assert torch.equal(fltrust(-x[:1], ref), torch.zeros(2))
    assert torch.equal(fltrust(x, torch.zeros(2)), torch.zeros(2))
    with pytest.raises(ValueError, match="reference"):
        FLTrust()(x)
