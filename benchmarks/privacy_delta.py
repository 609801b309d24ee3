"""DP-SGD mechanisms calibrated to one (epsilon, delta) and compared beyond that point with the
Delta-divergence (Kaissis et al., ICML 2024): the numbers of docs/privacy.md.

    python benchmarks/privacy_delta.py
"""

from __future__ import annotations

import numpy as np

from strategies.privacy import SubsampledGaussian, delta_divergence

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
    print("| mechanism | noise multiplier | epsilon | beta at alpha = 0.01 | beta at alpha = 0.1 |")
    print("|---|---:|---:|---:|---:|")
    for name, q, steps in CONFIGS:
        m = SubsampledGaussian(q, calibrate(q, steps), steps)
        beta = m.tradeoff(alpha)
        mechs.append((name, m))
        curves.append(beta)
        print(f"| {name} | {m.sigma:.4f} | {m.epsilon(DELTA):.4f} | {np.interp(0.01, alpha, beta):.4f} "
              f"| {np.interp(0.1, alpha, beta):.4f} |")
    print("\nDelta(row || column): the excess vulnerability of choosing the column's mechanism "
          "over the row's\n")
    print("| | " + " | ".join(n for n, _ in mechs) + " |")
    print("|---|" + "---:|" * len(mechs))
    for (name, _), f in zip(mechs, curves):
        cells = [f"{delta_divergence(alpha, f, g):.4f}" for g in curves]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
