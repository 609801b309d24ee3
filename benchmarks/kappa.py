"""Empirical (f, kappa)-robustness of every registered aggregator, with and without NNM.

Allouah, Farhadkhani, Guerraoui, Gupta, Pinot, Stephan ("Fixing by Mixing", AISTATS 2023,
Definition 2): F is (f, kappa)-robust if for every input and every set S of n - f honest rows,
``||F(x) - mean_S||^2 <= kappa / |S| * sum_{i in S} ||x_i - mean_S||^2``. The estimate here is
the largest ratio of the two sides seen over random honest inputs (Gaussian rows with a random
spread per trial) and the library's attacks (each attack placing its f rows, plus a huge-row
attack and, for the omniscient line search, the rule itself as the target). It is a lower
estimate of the true kappa (the worst case over all inputs), to compare rules, not to prove
bounds; no rule can have kappa < f / (n - 2f) (the paper's lower bound).

Run: ``python benchmarks/kappa.py [--trials 20] [--markdown]``.
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulator import registry
from simulator.registry import instantiate
from strategies.preaggregators import NearestNeighborMixing

ATTACKS = ["sign_flip", "ipm", "foe", "alie", "min_max", "min_sum", "mimic", "gaussian",
           "optimal_alie", "optimal_ipm", "huge"]
SKIP = {"label_flip", "inf", "nan"}  # data poisoning; non-finite rows have infinite ratio


def rule_params(name: str, f: int) -> dict:
    cls = registry.get("aggregators", name)
    params = {}
    if "f" in inspect.signature(cls).parameters:
        params["f"] = f
    if name == "cc":
        params = {"tau": 1.0, "iterations": 3}
    return params


def make_rule(name: str, f: int, with_nnm: bool):
    agg = instantiate("aggregators", {"name": name, **rule_params(name, f)})
    gen = torch.Generator().manual_seed(0)

    def rule(x: torch.Tensor) -> torch.Tensor:
        if with_nnm:
            x = NearestNeighborMixing(f)(x)
        return agg(x, generator=gen)
    return rule


def byzantine_rows(attack: str, honest: torch.Tensor, f: int, rule, g: torch.Generator):
    if attack == "huge":
        return torch.full((f, honest.shape[1]), 1e6)
    ctx = {"aggregate": rule} if attack.startswith("optimal") else {}
    a = instantiate("attacks", {"name": attack}, **ctx)
    seen = honest if a.traits.omniscient else honest[:f]
    return a(seen, f, g)


def empirical_kappa(name: str, n: int, f: int, d: int, trials: int, with_nnm: bool,
                    attacks=ATTACKS, seed: int = 0) -> tuple[float, str]:
    """(largest ratio seen, the attack that reached it)."""
    rule = make_rule(name, f, with_nnm)
    g = torch.Generator().manual_seed(seed)
    worst, arg = 0.0, ""
    for _ in range(trials):
        spread = float(torch.rand((), generator=g)) * 2 + 0.1
        honest = torch.randn((n - f, d), generator=g) * spread + torch.randn(d, generator=g)
        mu = honest.mean(dim=0)
        var = float(((honest - mu) ** 2).sum(dim=1).mean())
        for attack in attacks:
            rows = byzantine_rows(attack, honest, f, rule, g)
            out = rule(torch.cat([honest, rows]))
            ratio = float(((out - mu) ** 2).sum()) / var
            ratio = ratio if math.isfinite(ratio) else math.inf
            if ratio > worst:
                worst, arg = ratio, attack
    return worst, arg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=19)
    ap.add_argument("--f", type=int, default=4)
    ap.add_argument("--d", type=int, default=50)
    ap.add_argument("--trials", type=int, default=20)
    a = ap.parse_args()
    n, f = a.n, a.f
    print(f"n = {n}, f = {f}, d = {a.d}, {a.trials} trials x {len(ATTACKS)} attacks; "
          f"lower bound f/(n-2f) = {f / (n - 2 * f):.3f}\n")
    print("| aggregator | kappa (alone) | worst attack | kappa (NNM + rule) | worst attack |")
    print("|---|---:|---|---:|---|")
    for name in registry.available("aggregators"):
        alone = empirical_kappa(name, n, f, a.d, a.trials, False)
        mixed = empirical_kappa(name, n, f, a.d, a.trials, True)
        print(f"| {name} | {alone[0]:.3g} | {alone[1]} | {mixed[0]:.3g} | {mixed[1]} |")


if __name__ == "__main__":
    main()
