"""The privacy an (epsilon, delta)-DP guarantee implies, as a trade-off curve: what the report
draws beside a mechanism's f-DP curve for the epsilons an empirical audit measured (its
estimate and its lower bound, ``audit:``; docs/privacy.md)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def _check(epsilon: float, delta: float) -> None:
    if not epsilon >= 0:  # nan too
        raise ValueError(f"epsilon: must be >= 0, got {epsilon}")
    if not 0 <= delta <= 1:
        raise ValueError(f"delta: must be in [0, 1], got {delta}")


def dp_tradeoff(alpha: np.ndarray | Sequence[float] | float, epsilon: float,
                delta: float) -> np.ndarray:
    """The trade-off curve of (epsilon, delta)-DP, f(alpha) = max(0, 1 - delta - e^eps alpha,
    e^-eps (1 - delta - alpha)): the least type II error an attacker telling two neighbouring
    data sets apart can have at type I error ``alpha`` under any (epsilon, delta)-DP mechanism
    (Kairouz, Oh, Viswanath, ICML 2015; Dong, Roth, Su, JRSS B 2022, Prop. 2.5). A mechanism
    is (epsilon, delta)-DP exactly when its own curve is nowhere below this one. ``epsilon``
    may be inf (no privacy past alpha = 0)."""
    _check(epsilon, delta)
    a = np.asarray(alpha, dtype=float)
    with np.errstate(over="ignore", invalid="ignore"):
        grow = np.exp(epsilon)
        # e^eps alpha at alpha = 0 is 0 even for an infinite epsilon
        first = np.where(a > 0, 1.0 - delta - grow * a, 1.0 - delta)
        second = np.exp(-epsilon) * (1.0 - delta - a)
    return np.maximum(0.0, np.maximum(first, second))


def dp_kinks(epsilon: float, delta: float) -> list[float]:
    """The alphas where ``dp_tradeoff`` bends: where its two lines meet,
    (1 - delta) / (1 + e^eps), and where it reaches 0, 1 - delta. A grid holding them draws
    the piecewise-linear curve exactly."""
    _check(epsilon, delta)
    meet = 0.0 if epsilon > 700 else (1.0 - delta) / (1.0 + math.exp(epsilon))  # e^710 overflows
    return [meet, 1.0 - delta]


def dp_curve(epsilon: float, delta: float, grid: Sequence[float] | np.ndarray | None = None
             ) -> tuple[list[float], list[float]]:
    """(alpha, beta) of ``dp_tradeoff`` over ``grid`` (default 1001 points on [0, 1]) and its
    kinks, sorted: a curve to draw."""
    base = np.linspace(0.0, 1.0, 1001) if grid is None else np.asarray(grid, dtype=float)
    alpha = np.unique(np.concatenate([base, dp_kinks(epsilon, delta)]))
    return alpha.tolist(), dp_tradeoff(alpha, epsilon, delta).tolist()
