"""Meta-aggregators: wrap any aggregator ``A``; called as ``meta(x, A, generator=...)`` with
``A`` a callable ``(n, d) -> (d,)`` (the engine binds a random aggregator's generator before
passing it); a random meta-aggregator (``traits.random``) draws from ``generator``, the
others ignore it. A weighted one (``traits.weighted``: CTMA) also takes ``weights`` and calls
``A(rows, weights=...)`` with them; ``weights=None`` runs the unweighted code unchanged."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated

import torch
from annotated_types import Ge

from strategies.geometry import finite_rows, weight_vector
from strategies.preaggregators import Bucketing, NearestNeighborMixing
from strategies.protocols import MetaAggregator, Traits, require_generator

Rule = Callable[[torch.Tensor], torch.Tensor]  # the wrapped aggregator, its generator bound
# the wrapped aggregator of a weighted meta-aggregator: also called A(rows, weights=...)
WeightedRule = Callable[..., torch.Tensor]


class CenteredTrimmedMetaAggregator(MetaAggregator):
    """Centered Trimmed Meta Aggregator, CTMA (Dahan & Levy, "Fault Tolerant ML: Efficient
    Meta-Aggregation and Synchronous Training", ICML 2024, Algorithm 2).

    ``x0 = A(x_1..x_m)``; keep the m - f inputs closest to ``x0``; return
    ``x0 + (1/(m - f)) sum_{kept} (x_i - x0)``. The paper states it with per-input weights
    ``s_i`` and a Byzantine fraction ``lambda``: it keeps the inputs closest to ``x0`` up to a
    total weight of 1 - lambda (cutting the boundary input's weight) and returns
    ``x0 + sum_kept s_i (x_i - x0) / (1 - lambda)``. In a synchronous round every input has
    weight 1/m and lambda = f/m, so the boundary cut is empty and both forms are the same
    number; this is the form the authors' code computes. Cost on top of A: one pass of
    distances, O(md), and a sort, O(m log m).

    Weighted (w-CTMA, Dahan & Levy, "Weight for Robustness: A Comprehensive Approach towards
    Optimal Fault-Tolerant Asynchronous ML", NeurIPS 2024): the paper's form above with
    ``s_i = w_i / W`` and ``lambda = f/m``. ``x0 = A(x, weights=w)``; in order of distance to
    ``x0`` keep the inputs up to the weight ``K = (1 - f/m) W``, the boundary input with the
    part of its weight that reaches ``K``; return ``x0 + sum_kept c_i (x_i - x0) / K`` with
    ``c_i`` the kept weights. Equal weights give the rule above; integer weights the rule on
    the inputs repeated as often as their weight with ``f' = f W / m`` (when an integer, and
    ``A`` weighted that way too).
    """

    traits = Traits(weighted=True)

    def __init__(self, f: Annotated[int, Ge(0)] = 0) -> None:
        self.f = f

    def __call__(self, x: torch.Tensor, aggregator: WeightedRule,
                 generator: torch.Generator | None = None,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
        m = x.shape[0]
        self.check(m)
        w = None if weights is None else weight_vector(weights, m, x.device)
        x0 = aggregator(x) if weights is None else aggregator(x, weights=weights)
        if not bool(torch.isfinite(x0).all()):
            return x0
        dist = torch.linalg.vector_norm(x - x0, dim=1)
        dist = torch.where(finite_rows(x), dist, torch.full((), math.inf, dtype=x.dtype))
        order = torch.sort(dist, stable=True).indices
        if w is None:
            kept = order[: m - self.f]
            return x0 + (x[kept] - x0).mean(dim=0)
        ws = w[order]
        c = torch.minimum(((m - self.f) * w.sum() / m - (ws.cumsum(dim=0) - ws)).clamp_min(0), ws)
        kept, c = order[c > 0], c[c > 0].to(x.dtype)
        return x0 + ((x[kept] - x0) * c[:, None]).sum(dim=0) / c.sum()

    def check(self, n: int) -> None:
        if not 2 * self.f < n:
            raise ValueError(f"f: must be < n/2 = {n / 2:g}, got {self.f}")


class NNMMeta(MetaAggregator):
    """NNM as a meta-aggregator (Allouah et al., AISTATS 2023): ``A(NNM_f(x))``, the same number
    as ``preaggregators: [{name: nnm, f}]`` before ``A`` (tested); offered under ``meta`` for
    the papers that list it as one (Dahan & Levy 2024)."""

    def __init__(self, f: Annotated[int, Ge(0)] = 0) -> None:
        self.f = f

    def __call__(self, x: torch.Tensor, aggregator: Rule,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        return aggregator(NearestNeighborMixing(self.f)(x))

    def check(self, n: int) -> None:
        NearestNeighborMixing(self.f).check(n)


class BucketingMeta(MetaAggregator):
    """Bucketing as a meta-aggregator (Karimireddy, He, Jaggi, ICLR 2022): ``A`` applied to the
    means of random buckets of ``s`` rows; the same number as ``preaggregators:
    [{name: bucketing, s}]`` before ``A`` with the same generator."""

    traits = Traits(random=True)

    def __init__(self, s: Annotated[int, Ge(1)] = 2) -> None:
        self.s = s

    def __call__(self, x: torch.Tensor, aggregator: Rule,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        return aggregator(Bucketing(self.s)(x, require_generator(generator, self)))

    def output_rows(self, n: int) -> int:
        """How many rows the wrapped aggregator receives: one per bucket."""
        return Bucketing(self.s).output_rows(n)
