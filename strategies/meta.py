"""Meta-aggregators: wrap any aggregator ``A``; called as ``meta(x, A, generator=...)`` with
``A`` a callable ``(n, d) -> (d,)`` (the engine binds a random aggregator's generator before
passing it); a random meta-aggregator (``traits.random``) draws from ``generator``, the
others ignore it."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated

import torch
from annotated_types import Ge

from strategies.geometry import finite_rows
from strategies.preaggregators import Bucketing, NearestNeighborMixing
from strategies.protocols import MetaAggregator, Traits, require_generator

Rule = Callable[[torch.Tensor], torch.Tensor]  # the wrapped aggregator, its generator bound


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
    """

    def __init__(self, f: Annotated[int, Ge(0)] = 0) -> None:
        self.f = f

    def __call__(self, x: torch.Tensor, aggregator: Rule,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        m = x.shape[0]
        self.check(m)
        x0 = aggregator(x)
        if not bool(torch.isfinite(x0).all()):
            return x0
        dist = torch.linalg.vector_norm(x - x0, dim=1)
        dist = torch.where(finite_rows(x), dist, torch.full((), math.inf, dtype=x.dtype))
        kept = torch.sort(dist, stable=True).indices[: m - self.f]
        return x0 + (x[kept] - x0).mean(dim=0)

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
