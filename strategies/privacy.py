"""Differential privacy: the mechanisms' maths, accounting, trade-off curves and the
Delta-divergence between mechanisms.

Accounting is not ours: epsilon comes from Google's ``dp-accounting`` (the PLD accountant, tight
up to discretisation, or the RDP accountant), and f-DP trade-off curves from the PLD through
``riskcal`` (Kulynych et al. 2024, ``get_beta_from_pld``). Both are maintained libraries that
implement the published algorithms; re-deriving subsampled-Gaussian composition here would be
code nobody audits.

A run's privacy mechanism is T compositions of a (Poisson-)subsampled Gaussian mechanism with
noise multiplier sigma and sampling rate q (``SubsampledGaussian``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
import torch
from annotated_types import Ge, Gt, Lt

from strategies.protocols import Privacy, Traits

PLD_DISCRETIZATION = 1e-3


def clip_rows(x: torch.Tensor, clip: float) -> torch.Tensor:
    """Each row scaled to norm at most ``clip`` (a new tensor)."""
    norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    return x * torch.clamp(clip / norms.clamp_min(1e-30), max=1.0)


def gaussian_tradeoff(alpha: np.ndarray | float, mu: float) -> np.ndarray:
    """The trade-off curve of mu-GDP (Dong, Roth, Su 2022): G_mu(a) = Phi(Phi^-1(1 - a) - mu)."""
    from scipy.stats import norm

    return norm.cdf(norm.ppf(1 - np.asarray(alpha, dtype=np.float64)) - mu)


@dataclass(frozen=True)
class SubsampledGaussian:
    """``steps`` compositions of the Gaussian mechanism with noise multiplier ``sigma`` on a
    Poisson sample of rate ``q`` (q = 1: no subsampling)."""

    q: float
    sigma: float
    steps: int

    def event(self):
        import dp_accounting

        inner = dp_accounting.GaussianDpEvent(self.sigma)
        if self.q < 1:
            inner = dp_accounting.PoissonSampledDpEvent(self.q, inner)
        return dp_accounting.SelfComposedDpEvent(inner, self.steps)

    def pld(self):
        """The privacy loss distribution of the composition (dp-accounting), composed once
        per mechanism: epsilon, the profile and the trade-off curve all read it."""
        if "_pld" not in self.__dict__:
            from dp_accounting.pld import privacy_loss_distribution as pld_lib

            one = pld_lib.from_gaussian_mechanism(
                self.sigma, sensitivity=1.0, sampling_prob=self.q,
                value_discretization_interval=PLD_DISCRETIZATION)
            object.__setattr__(self, "_pld", one.self_compose(self.steps))  # frozen dataclass
        return self.__dict__["_pld"]

    def epsilon(self, delta: float, accountant: str = "pld") -> float:
        """epsilon at ``delta``; infinite without noise."""
        if self.steps == 0:
            return 0.0
        if self.sigma == 0:
            return math.inf
        if accountant == "pld":
            return float(self.pld().get_epsilon_for_delta(delta))
        from dp_accounting import rdp

        acc = rdp.RdpAccountant()
        acc.compose(self.event())
        return float(acc.get_epsilon(delta))

    def profile(self, epsilons: np.ndarray) -> np.ndarray:
        """The privacy profile delta(epsilon) (PLD); 1 everywhere without noise."""
        if self.sigma == 0:
            return np.ones(len(epsilons))
        pld = self.pld()
        return np.array([pld.get_delta_for_epsilon(float(e)) for e in epsilons])

    def tradeoff(self, alpha: np.ndarray) -> np.ndarray:
        """The f-DP trade-off curve beta(alpha) of the composition (riskcal, from the PLD)."""
        from riskcal.analysis import get_beta_from_pld

        if self.sigma == 0:
            return np.zeros_like(np.asarray(alpha, dtype=np.float64))
        return np.asarray(get_beta_from_pld(self.pld(), alpha=np.asarray(alpha, np.float64)))


def delta_divergence(alpha: np.ndarray, f: np.ndarray, g: np.ndarray, tol: float = 1e-6) -> float:
    """Delta(f || g) = inf{kappa >= 0 : f(a + kappa) - kappa <= g(a) for all a in [0, 1]},
    for trade-off curves sampled on the increasing grid ``alpha`` (f beyond 1 is 0). It is 0
    exactly when f <= g everywhere, i.e. when mechanism g is at least as private as f at every
    operating point (g Blackwell-dominates f); otherwise it is the smallest shift along both
    axes that puts f under g: the worst-case excess vulnerability of choosing the mechanism
    of g over that of f. This is our reading of Kaissis, Kolek, Balle, Hayes, Rueckert
    (ICML 2024); see docs/privacy.md for what we could and could not check."""
    alpha = np.asarray(alpha, dtype=np.float64)
    f = np.asarray(f, dtype=np.float64)
    g = np.asarray(g, dtype=np.float64)

    def ok(kappa: float) -> bool:
        shifted = np.interp(alpha + kappa, alpha, f, right=0.0) - kappa
        return bool((shifted <= g + 1e-12).all())

    if ok(0.0):
        return 0.0
    lo, hi = 0.0, 1.0  # kappa = 1 always works: f(a + 1) - 1 <= 0 <= g(a)
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def symmetric_delta(alpha: np.ndarray, f: np.ndarray, g: np.ndarray) -> float:
    """max(Delta(f || g), Delta(g || f)): a Levy-type distance between the two curves."""
    return max(delta_divergence(alpha, f, g), delta_divergence(alpha, g, f))


def bayes_risk(alpha: np.ndarray, f: np.ndarray, priors: np.ndarray) -> np.ndarray:
    """The error of the best membership test against a mechanism with trade-off curve f, for
    each prior pi that the record is in: R_f(pi) = min_a pi a + (1 - pi) f(a) (a: type-I,
    f(a): type-II error). One (priors, alpha) matrix, no Python loop."""
    alpha = np.asarray(alpha, dtype=np.float64)
    f = np.asarray(f, dtype=np.float64)
    pi = np.asarray(priors, dtype=np.float64)[:, None]
    return np.min(pi * alpha[None, :] + (1 - pi) * f[None, :], axis=1)


def advantage(alpha: np.ndarray, f: np.ndarray) -> float:
    """The best membership attacker's advantage max_a (1 - f(a)) - a, i.e. max TPR - FPR
    (= delta(0), the total variation between the neighbouring output distributions)."""
    return float(1 - np.min(np.asarray(alpha, dtype=np.float64) + np.asarray(f, dtype=np.float64)))


def excess_bayes_vulnerability(alpha: np.ndarray, f: np.ndarray, g: np.ndarray,
                               priors: np.ndarray | None = None) -> tuple[float, float]:
    """sup over priors pi of R_f(pi) - R_g(pi) (clamped at 0), and the prior attaining it: by
    how much choosing g's mechanism over f's can lower the best attacker's error.

    Delta(f || g) >= this always: if f(a + k) - k <= g(a) for all a then R_g >= R_f - k at
    every prior. With e^eps = pi / (1 - pi) it reads (delta_g(eps) - delta_f(eps)) / (1 + e^eps)
    in terms of the privacy profiles, so Delta also bounds the excess delta at every epsilon:
    delta_g(eps) <= delta_f(eps) + (1 + e^eps) Delta(f || g). The two are equal whenever the
    optimal test for f at the binding prior has type-I error >= Delta, which held for every
    pair we computed (tests/strategies/test_privacy.py)."""
    if priors is None:
        priors = np.linspace(0.0, 1.0, 2001)
    gap = bayes_risk(alpha, f, priors) - bayes_risk(alpha, g, priors)
    i = int(np.argmax(gap))
    return max(float(gap[i]), 0.0), float(np.asarray(priors)[i])


# ---------------------------------------------------------------------------- plugins


class _GaussianDP(Privacy):
    """Shared keys of the privacy plugins (``privacy: {name: ..., clip, noise_multiplier,
    delta, accountant}``): the clipping norm, the noise multiplier sigma (noise std =
    sigma * clip), the delta at which epsilon is reported, and dp-accounting's accountant."""

    def __init__(
        self,
        clip: Annotated[float, Gt(0)] = 1.0,
        noise_multiplier: Annotated[float, Ge(0)] = 1.0,
        delta: Annotated[float, Gt(0), Lt(1)] = 1e-5,
        accountant: Literal["pld", "rdp"] = "pld",
    ) -> None:
        self.clip, self.noise_multiplier = clip, noise_multiplier
        self.delta, self.accountant = delta, accountant


class DPSGD(_GaussianDP):
    """Sample-level DP: DP-SGD (Abadi et al., CCS 2016) inside each client (Poisson-sampled
    minibatches at rate batch_size / size, per-sample gradients clipped to ``clip``, Gaussian
    noise of std ``noise_multiplier * clip``). The client's update is DP with respect to its
    examples, so robust aggregation of it is post-processing: it composes with any
    pipeline."""

    traits = Traits(privacy_level="sample", trainer="dp_sgd")

    def mechanism(self, rounds: int, client_rate: float, sample_rate: float,
                  steps_per_round: int) -> SubsampledGaussian:
        """Every DP-SGD step of the worst-placed client in every round (client-sampling
        amplification not counted: a conservative bound)."""
        return SubsampledGaussian(sample_rate, self.noise_multiplier, rounds * steps_per_round)


class DPFedAvg(_GaussianDP):
    """Client-level DP: DP-FedAvg (McMahan, Ramage, Talwar, Zhang, ICLR 2018): the server
    clips every update to ``clip``, averages the m rows and adds Gaussian noise of std
    ``noise_multiplier * clip / m``: calibrated to the mean's sensitivity, so it needs the
    mean aggregator."""

    traits = Traits(privacy_level="client")

    def mechanism(self, rounds: int, client_rate: float, sample_rate: float,
                  steps_per_round: int) -> SubsampledGaussian:
        """One Gaussian per round on the sampled clients (Poisson approximation of
        fixed-size client sampling, as DP-FedAvg's analysis does)."""
        return SubsampledGaussian(client_rate, self.noise_multiplier, rounds)

    def privatize(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows clipped to ``clip`` (before the mean)."""
        return clip_rows(rows, self.clip)

    def noise(self, aggregate: torch.Tensor, m: int, generator: torch.Generator) -> torch.Tensor:
        """The mean of m clipped rows with its Gaussian noise."""
        if self.noise_multiplier == 0:
            return aggregate
        std = self.noise_multiplier * self.clip / m
        return aggregate + std * torch.randn(aggregate.shape, generator=generator)
