"""DP-SGD mechanisms calibrated to one (epsilon, delta) and compared beyond that point with the
Delta-divergence (Kaissis et al., ICML 2024): the numbers of docs/privacy.md.

    python benchmarks/privacy_delta.py
"""

from __future__ import annotations

import numpy as np

from strategies.privacy import (
    SubsampledGaussian,
    advantage,
    delta_divergence,
    excess_bayes_vulnerability,
)

EPSILON, DELTA = 2.0, 1e-5
CONFIGS = [("full batch, 10 steps", 1.0, 10), ("q = 0.1, 100 steps", 0.1, 100),
           ("q = 0.01, 1000 steps", 0.01, 1000), ("q = 0.001, 1000 steps", 0.001, 1000)]


def calibrate(q: float, steps: int, epsilon: float = EPSILON, delta: float = DELTA) -> float:
    """The noise multiplier at which ``steps`` compositions reach ``epsilon`` at ``delta``."""
    lo, hi = 0.05, 100.0
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        if SubsampledGaussian(q, mid, steps).epsilon(delta) > epsilon:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-4:
            break
    return hi


def main() -> None:
    alpha = np.linspace(0.0, 1.0, 4001)
    mechs, curves = [], []
    print(f"calibrated to epsilon = {EPSILON} at delta = {DELTA:g} (PLD accountant)\n")
    print("| mechanism | noise multiplier | epsilon | beta at alpha = 0.01 | beta at alpha = 0.1 "
          "| advantage |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, q, steps in CONFIGS:
        m = SubsampledGaussian(q, calibrate(q, steps), steps)
        beta = m.tradeoff(alpha)
        mechs.append((name, m))
        curves.append(beta)
        print(f"| {name} | {m.sigma:.4f} | {m.epsilon(DELTA):.4f} | {np.interp(0.01, alpha, beta):.4f} "
              f"| {np.interp(0.1, alpha, beta):.4f} | {advantage(alpha, beta):.4f} |")
    print("\nDelta(row || column): the excess vulnerability of choosing the column's mechanism "
          "over the row's\n")
    print("| | " + " | ".join(n for n, _ in mechs) + " |")
    print("|---|" + "---:|" * len(mechs))
    for (name, _), f in zip(mechs, curves):
        cells = [f"{delta_divergence(alpha, f, g):.4f}" for g in curves]
        print(f"| {name} | " + " | ".join(cells) + " |")

    (name_a, a), (name_b, b) = mechs[-1], mechs[0]
    kappa = delta_divergence(alpha, curves[-1], curves[0])
    excess, prior = excess_bayes_vulnerability(alpha, curves[-1], curves[0])
    print(f"\nChoosing '{name_b}' over '{name_a}': Delta = {kappa:.4f}; the best attacker's "
          f"error falls by at most {excess:.4f} over all priors, at prior {prior:.2f}. In (epsilon, "
          "delta) terms, delta_B(eps) <= delta_A(eps) + (1 + e^eps) Delta:\n")
    eps = np.array([0.0, 0.5, 1.0, 2.0, 3.0, 4.0])
    da, db = a.profile(eps), b.profile(eps)
    print("| epsilon | delta_A | delta_B | (delta_B - delta_A) / (1 + e^eps) |")
    print("|---:|---:|---:|---:|")
    for e, x, y in zip(eps, da, db):
        print(f"| {e:g} | {x:.3g} | {y:.3g} | {(y - x) / (1 + np.exp(e)):.4f} |")


if __name__ == "__main__":
    main()
