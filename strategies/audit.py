"""Empirical privacy auditing with canaries: the maths only (no Ray, no MLflow, no simulator).

A canary is a random unit direction in parameter space (``unit_directions``, drawn from its
own generator so that the auditor can redraw it), scaled to the clipping norm and inserted as
an extra client update; each canary is inserted independently with probability 1/2. After
training, each canary's score is the cosine between the model's total change (final minus
initial parameters) and the canary's direction: an inserted canary pulls the model towards
itself, so its cosine is shifted up, by less the more noise the mechanism adds.

Two readings of the scores, which answer different questions:

* Andrew, Kairouz, Oh, Oprea, McMahan, Suriyakumar, "One-shot Empirical Privacy Estimation for
  Federated Learning", ICLR 2024 (``one_shot_epsilon``): fit a Gaussian to the inserted
  canaries' cosines, compare it with the cosine of a random direction, N(0, 1/d), and report
  the epsilon at ``delta`` of that pair of Gaussians (``gaussian_pair_epsilon``). This is an
  *estimate* of the privacy a worst-case-ish canary gets, not a bound: it can be below the
  true epsilon or (if the Gaussian fit is poor) above it, and comes with no confidence level.
* Steinke, Nasr, Jagielski, "Privacy Auditing with One (1) Training Run", NeurIPS 2023
  (``one_run_epsilon``): guess inserted / not inserted for the highest / lowest scores, count
  the correct guesses, and reject "the run is (eps, delta)-DP" for every eps whose p-value
  (``one_run_p_value``) is at most 1 - confidence. The largest such eps is a *lower bound* on
  the run's epsilon that holds with the stated confidence, whatever the score. The theorem
  needs every canary included independently with probability exactly 1/2: a different rate
  voids the bound (the binomial null is then wrong).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.optimize import brentq
from scipy.special import expit
from scipy.stats import binom, norm

_MAX_EPS_DOUBLINGS = 60  # an upper end of 2**60 for epsilon: past it we report inf


def null_std(d: int) -> float:
    """The standard deviation of the cosine between a fixed vector and a uniformly random
    direction in R^d: its mean is 0 and its variance exactly 1/d."""
    return float(d) ** -0.5


def unit_directions(generators: list[torch.Generator], d: int) -> torch.Tensor:
    """One random unit direction per generator (``torch.randn(d, generator=g)`` normalised to
    l2 norm 1): the canaries of Andrew et al. Shape (len(generators), d), float32. A loop over
    the generators only: there are a handful of canaries, each a d-vector."""
    if not generators:
        return torch.empty(0, d, dtype=torch.float32)
    rows = torch.stack([torch.randn(d, generator=g, dtype=torch.float32) for g in generators])
    return rows / torch.linalg.vector_norm(rows, dim=1, keepdim=True)


# ------------------------------------------------------------ a pair of Gaussians


def _log1mexp(x: float) -> float:
    """log(1 - e^x) for x <= 0, accurate at both ends."""
    return math.log(-math.expm1(x)) if x > -math.log(2) else math.log1p(-math.exp(x))


def _privacy_loss_region(eps: float, mu0: float, s0: float, mu1: float,
                         s1: float) -> tuple[str, float, float]:
    """The set where log p1(x) - log p0(x) > eps, as (kind, lo, hi): the loss minus eps is the
    quadratic a x^2 + b x + c, and the set is "empty", "all", "below" (x < lo), "above"
    (x > lo), "inside" (lo < x < hi) or "outside" (x < lo or x > hi)."""
    a = 0.5 / s0**2 - 0.5 / s1**2
    b = mu1 / s1**2 - mu0 / s0**2
    c = 0.5 * mu0**2 / s0**2 - 0.5 * mu1**2 / s1**2 + math.log(s0 / s1) - eps
    if a == 0:  # equal stds: linear
        if b == 0:
            return ("all" if c > 0 else "empty"), 0.0, 0.0
        return ("above" if b > 0 else "below"), -c / b, 0.0
    disc = b * b - 4 * a * c
    if disc <= 0:  # the sign of a everywhere (but at most one point)
        return ("all" if a > 0 else "empty"), 0.0, 0.0
    q = -0.5 * (b + math.copysign(math.sqrt(disc), b))  # the stable pair of roots; q != 0
    r1, r2 = sorted((q / a, c / q))
    return ("outside" if a > 0 else "inside"), r1, r2


def _log_mass(kind: str, lo: float, hi: float, mu: float, s: float) -> float:
    """log N(mu, s^2)(region), from log-CDFs and log-survival functions so that tail masses
    far below 1e-16 keep their relative accuracy."""
    if kind == "empty":
        return -math.inf
    if kind == "all":
        return 0.0
    z1, z2 = (lo - mu) / s, (hi - mu) / s
    if kind == "below":
        return float(norm.logcdf(z1))
    if kind == "above":
        return float(norm.logsf(z1))
    if kind == "outside":
        return float(np.logaddexp(norm.logcdf(z1), norm.logsf(z2)))
    if z1 > 0:  # inside, in the upper tail: sf(z1) - sf(z2)
        upper, lower = float(norm.logsf(z1)), float(norm.logsf(z2))
    elif z2 < 0:  # inside, in the lower tail: cdf(z2) - cdf(z1)
        upper, lower = float(norm.logcdf(z2)), float(norm.logcdf(z1))
    else:  # straddles the mean: the mass is at least that of a neighbourhood of the mode
        return math.log1p(-(float(norm.cdf(z1)) + float(norm.sf(z2))))
    return -math.inf if lower >= upper else upper + _log1mexp(lower - upper)


def gaussian_pair_delta(eps: float, mu0: float, s0: float, mu1: float, s1: float) -> float:
    """The hockey-stick divergence sup_S P1(S) - e^eps P0(S) = int max(0, p1 - e^eps p0) dx
    between P1 = N(mu1, s1^2) and P0 = N(mu0, s0^2), exactly: S is where the privacy loss
    log p1 - log p0 (a quadratic in x) exceeds eps, and both masses of S come from normal
    log-CDFs, so that deltas like 1e-10 keep their relative accuracy. A zero std is a point
    mass: against anything else the two are mutually singular and delta is 1."""
    if s0 < 0 or s1 < 0:
        raise ValueError(f"standard deviations must be >= 0, got {s0} and {s1}")
    if s0 == 0 or s1 == 0:
        same = s0 == s1 and mu0 == mu1
        return max(0.0, -math.expm1(eps)) if same else 1.0
    kind, lo, hi = _privacy_loss_region(eps, mu0, s0, mu1, s1)
    lp1 = _log_mass(kind, lo, hi, mu1, s1)
    if lp1 == -math.inf:
        return 0.0
    lp0 = _log_mass(kind, lo, hi, mu0, s0)
    # P1 - e^eps P0 = P1 (1 - e^(eps + log P0 - log P1)): no cancellation between the two
    return max(0.0, -math.exp(lp1) * math.expm1(eps + lp0 - lp1))


def gaussian_pair_epsilon(mu0: float, s0: float, mu1: float, s1: float, delta: float) -> float:
    """The smallest eps >= 0 at which N(mu0, s0^2) and N(mu1, s1^2) are (eps, delta)-
    indistinguishable in both directions (DP is symmetric in the neighbouring pair):
    max(delta_{1||0}(eps), delta_{0||1}(eps)) <= delta. Bracketed by doubling, then solved by
    Brent's method to 1e-12 absolute. nan on non-finite input; inf where no finite eps will do
    (a point mass against a different distribution, e.g. s1 = 0 with mu1 != mu0; or delta = 0
    for two different Gaussians, whose privacy loss is unbounded in at least one direction)."""
    if not all(math.isfinite(x) for x in (mu0, s0, mu1, s1, delta)):
        return math.nan

    def excess(eps: float) -> float:
        return max(gaussian_pair_delta(eps, mu0, s0, mu1, s1),
                   gaussian_pair_delta(eps, mu1, s1, mu0, s0)) - delta

    if excess(0.0) <= 0:
        return 0.0
    if s0 == 0 or s1 == 0 or delta <= 0:
        return math.inf
    hi = 1.0
    for _ in range(_MAX_EPS_DOUBLINGS):
        if excess(hi) <= 0:
            lo = hi / 2 if hi > 1 else 0.0
            return float(brentq(excess, lo, hi, xtol=1e-12, rtol=4 * np.finfo(float).eps))
        hi *= 2
    return math.inf


# ------------------------------------------------------------ the two audits


def one_shot_epsilon(cosines: np.ndarray, d: int, delta: float) -> float:
    """Andrew et al. (ICLR 2024)'s one-shot estimate: the epsilon at ``delta`` between the
    Gaussian fitted to the inserted canaries' cosines (mean; sample std, ddof=1) and the null
    N(0, 1/d), the cosine of the model's change with a random direction it never saw.

    Departure: the null's exact law is a rescaled Beta with mean 0 and variance exactly 1/d;
    the paper replaces it by N(0, 1/d) for d >= 1000 (where the two are indistinguishable); we
    use the Gaussian for every d. nan with fewer than 2 cosines or a non-finite one; inf for
    identical non-zero cosines (std 0, mean != 0: a point mass away from the null); nan for
    all-zero cosines, which only a model that did not move produces: nothing to estimate."""
    x = np.asarray(cosines, dtype=np.float64).ravel()
    if x.size < 2 or not np.isfinite(x).all():
        return math.nan
    mean, std = float(x.mean()), float(x.std(ddof=1))
    if std == 0:
        return math.inf if mean != 0 else math.nan
    return gaussian_pair_epsilon(0.0, null_std(d), mean, std, delta)


def one_run_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """Steinke, Nasr, Jagielski (NeurIPS 2023), approximate DP: the probability of at least v
    correct guesses out of r, under the null "the run is (eps, delta)-DP", when each of the m
    canaries was included independently with probability 1/2. With q = e^eps / (1 + e^eps)
    (the accuracy of eps-randomised response),

        p = P[Binomial(r, q) >= v] + 2 m delta max_{1<=i<=v} P[v - i <= Binomial(r, q) < v] / i,

    capped at 1 (the formula of their paper's p-value code). The max is one cumulative sum
    of the binomial pmf, no loop over i."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got m={m}, r={r}, v={v}")
    if v == 0:
        return 1.0
    q = float(expit(eps))  # e^eps / (1 + e^eps) without overflow
    p = float(binom.sf(v - 1, r, q))
    if delta > 0:
        window = np.cumsum(binom.pmf(np.arange(v - 1, -1, -1), r, q))  # i = 1..v: k in [v-i, v)
        p += 2 * m * delta * float(np.max(window / np.arange(1, v + 1)))
    return min(p, 1.0)


def _correct_guesses(scores: np.ndarray, inserted: np.ndarray, guesses: int) -> int:
    """Guess "inserted" for the guesses//2 + guesses%2 highest scores and "not inserted" for
    the guesses//2 lowest, abstaining on the rest; the number of correct guesses. One stable
    ascending order (ties by index) ranks both ends, so the two sets never overlap."""
    order = np.argsort(scores, kind="stable")
    k_in, k_out = guesses // 2 + guesses % 2, guesses // 2
    hits_in = int(np.count_nonzero(inserted[order[len(order) - k_in:]]))
    hits_out = int(np.count_nonzero(~inserted[order[:k_out]]))
    return hits_in + hits_out


def one_run_epsilon(scores: np.ndarray, inserted: np.ndarray, guesses: int, delta: float,
                    confidence: float) -> tuple[float, int, int]:
    """Steinke et al.'s lower bound: (eps_lower, r, v) with r = ``guesses`` guesses of which
    v are correct (``_correct_guesses``), and eps_lower the largest eps >= 0 whose p-value is
    at most 1 - confidence (bisection on [0, hi] to 1e-10, hi doubled until the p-value
    exceeds 1 - confidence; 0.0 when even eps = 0 is not rejected). With the stated
    confidence the run is not (eps, delta)-DP for any eps below eps_lower. Valid only if
    every canary was inserted independently with probability exactly 1/2."""
    s = np.asarray(scores, dtype=np.float64).ravel()
    ins = np.asarray(inserted, dtype=bool).ravel()
    m = len(s)
    if len(ins) != m:
        raise ValueError(f"{m} scores but {len(ins)} inclusion flags")
    if not 1 <= guesses <= m:
        raise ValueError(f"guesses must be in [1, {m}] (the number of canaries), got {guesses}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    v = _correct_guesses(s, ins, guesses)
    alpha = 1 - confidence

    def rejected(eps: float) -> bool:
        return one_run_p_value(m, guesses, v, eps, delta) <= alpha

    if not rejected(0.0):
        return 0.0, guesses, v
    lo, hi = 0.0, 1.0
    while rejected(hi):  # p -> 1 as eps grows (q -> 1), so this ends
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-10:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rejected(mid) else (lo, mid)
    return lo, guesses, v
