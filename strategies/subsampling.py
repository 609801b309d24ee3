"""Client subsampling with Byzantine clients: how many Byzantine clients a round samples, and
the trimming parameter ``b_hat`` to give the robust aggregator.

A round samples ``s`` of ``n`` clients without replacement, ``f`` of which are Byzantine, so
the number it samples is hypergeometric, ``B ~ Hypergeom(n, f, s)``. Allouah, Farhadkhani,
Guerraoui, Gupta, Pinot, Rizk, Voitovych, "Byzantine-Robust Federated Learning: Impact of
Client Subsampling and Local Updates" (ICML 2024) tell the aggregator a ``b_hat`` that the
round exceeds only with small probability, bounding the tail with the Bernoulli
KL-divergence (Hoeffding 1963: sampling without replacement concentrates at least as well as
with replacement)::

    P(B >= s t) <= exp(-s KL(t || f/n))        for f/n <= t <= 1.

Both that bound and the exact hypergeometric tail are offered; the exact tail never gives a
larger ``b_hat``. Pure Python integers: exact, no SciPy.
"""

from __future__ import annotations

import math
from fractions import Fraction

B_HAT_RULES = ("fixed", "kl", "hypergeometric")


def hypergeometric_pmf(n: int, f: int, s: int, k: int) -> float:
    """P(B = k): ``k`` Byzantine clients among ``s`` sampled from ``n`` of which ``f`` are."""
    if k < max(0, s - (n - f)) or k > min(f, s):
        return 0.0
    return float(Fraction(math.comb(f, k) * math.comb(n - f, s - k), math.comb(n, s)))


def hypergeometric_tail(n: int, f: int, s: int, b: int) -> float:
    """P(B > b), exactly (computed as one fraction, then rounded to a float)."""
    num = sum(math.comb(f, k) * math.comb(n - f, s - k) for k in range(max(b + 1, 0), min(f, s) + 1))
    return float(Fraction(num, math.comb(n, s)))


def bernoulli_kl(a: float, p: float) -> float:
    """KL(Bernoulli(a) || Bernoulli(p)), with 0 log 0 = 0."""
    out = 0.0
    if a > 0:
        out += a * math.log(a / p) if p > 0 else math.inf
    if a < 1:
        out += (1 - a) * math.log((1 - a) / (1 - p)) if p < 1 else math.inf
    return out


def kl_tail_bound(n: int, f: int, s: int, b: int) -> float:
    """Upper bound on P(B > b) = P(B >= b + 1): exp(-s KL((b + 1)/s || f/n)) when
    (b + 1)/s exceeds the mean fraction f/n, else 1 (the bound says nothing there); exactly 0
    from b = min(f, s) on, since no sample holds more than f Byzantine clients."""
    if b >= min(f, s):
        return 0.0
    t = (b + 1) / s
    if t <= f / n:
        return 1.0
    return math.exp(-s * bernoulli_kl(t, f / n))


def b_hat(n: int, f: int, s: int, rule: str, level: float) -> int:
    """The smallest ``b`` in ``[ceil(f s / n), s/2)`` whose tail P(B > b) is at most ``level``
    (``rule = "hypergeometric"``: the exact tail; ``"kl"``: the KL bound). Raises ValueError
    naming ``level`` when no ``b`` below ``s/2`` qualifies: the aggregator would have to trim
    half the sample."""
    if rule not in ("kl", "hypergeometric"):
        raise ValueError(f"rule: must be one of 'kl' or 'hypergeometric', got {rule!r}")
    if f == 0:
        return 0
    tail = hypergeometric_tail if rule == "hypergeometric" else kl_tail_bound
    lo = math.ceil(f * s / n)
    for b in range(lo, (s + 1) // 2):  # b < s/2
        if tail(n, f, s, b) <= level:
            return b
    worst = tail(n, f, s, (s - 1) // 2)
    raise ValueError(
        f"level: no b_hat < s/2 = {s / 2:g} has P(sampled Byzantine > b_hat) <= {level:g} "
        f"with n = {n}, f = {f}, s = {s} ({rule}; at b_hat = {(s - 1) // 2} it is {worst:.3g}); "
        "sample more clients or raise the level")
