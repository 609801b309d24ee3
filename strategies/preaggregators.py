"""Pre-aggregators: ``(n, d)`` -> ``(m, d)``, applied in a chain before the aggregator.

Same contract as the aggregators: constructor arguments are the scenario keys, the input is
never modified in place, every rule is called as ``rule(x, generator=...)`` (the
``traits.random`` ones draw from it, the others ignore it),
``output_rows(n)`` says how many rows come out, ``check(n)`` validates against the rows in.
"""

from __future__ import annotations

import math
from typing import Annotated

import torch
from annotated_types import Ge, Gt
from pydantic import AllowInfNan

from strategies.geometry import finite_rows, group_means, squared_distances
from strategies.protocols import PreAggregator, Traits, require_generator


def clip_rows(x: torch.Tensor, threshold: torch.Tensor | float) -> torch.Tensor:
    """A copy of ``x`` with every row of norm above ``threshold`` rescaled to that norm.

    A non-finite row has no direction to keep and becomes the zero row (norm 0 <= threshold).
    """
    norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    ok = torch.isfinite(norms)
    th = torch.as_tensor(threshold, dtype=x.dtype)
    scale = torch.clamp(th / norms.clamp_min(torch.finfo(x.dtype).tiny), max=1.0)
    if bool(ok.all()):
        return x * scale
    return torch.where(ok, x, torch.zeros((), dtype=x.dtype)) * torch.where(ok, scale, 0.0)


class StaticClipping(PreAggregator):
    """Rescale every row whose Euclidean norm exceeds ``c`` to norm ``c`` (``c: .inf`` in a
    scenario: no clipping)."""

    def __init__(self, c: Annotated[float, Gt(0), AllowInfNan(True)] = 1.0) -> None:
        self.c = c

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        return clip_rows(x, self.c)

    def output_rows(self, n: int) -> int:
        return n


class AdaptiveRobustClipping(PreAggregator):
    """Adaptive robust clipping, ARC (Allouah, Guerraoui, Gupta, Jellouli, Rizk, Stephan,
    "Boosting Robustness by Clipping Gradients in Distributed Learning", 2024): clip the
    k = floor(2 (f/n) (n - f)) rows of largest norm to the norm of the (k+1)-th largest.

    Unlike ByzFL's ``ARC`` (which writes into its argument) a new matrix is returned.
    """

    def __init__(self, f: Annotated[int, Ge(0)] = 0) -> None:
        self.f = f

    def clipped(self, n: int) -> int:
        return math.floor(2 * self.f / n * (n - self.f)) if n else 0

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        n = x.shape[0]
        self.check(n)
        k = self.clipped(n)
        if k == 0:
            return x.clone()
        norms = torch.linalg.vector_norm(x, dim=1)
        norms = torch.where(torch.isfinite(norms), norms, torch.full((), math.inf, dtype=x.dtype))
        threshold = torch.sort(norms).values[n - k - 1]
        return clip_rows(x, threshold)

    def check(self, n: int) -> None:
        if not 2 * self.f < n:
            raise ValueError(f"f: must be < n/2 = {n / 2:g}, got {self.f}")

    def output_rows(self, n: int) -> int:
        return n


class NearestNeighborMixing(PreAggregator):
    """Nearest-neighbour mixing, NNM (Allouah, Farhadkhani, Guerraoui, Gupta, Pinot, Stephan,
    "Fixing by Mixing: A Recipe for Optimal Byzantine ML under Heterogeneity", AISTATS 2023):
    each row is replaced by the mean of its n - f nearest rows (itself included).

    Computed as one ``(n, n) @ (n, d)`` product with the 0/1 neighbour matrix.
    """

    def __init__(self, f: Annotated[int, Ge(0)] = 0) -> None:
        self.f = f

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        n = x.shape[0]
        self.check(n)
        d2 = squared_distances(x)
        nn_idx = torch.sort(d2, dim=1, stable=True).indices[:, : n - self.f]
        mix = torch.zeros((n, n), dtype=x.dtype, device=x.device)
        mix.scatter_(1, nn_idx.to(x.device), 1.0 / (n - self.f))
        ok = finite_rows(x)
        # Zero the non-finite rows so that 0 * inf cannot leak into rows that do not use them;
        # rows that do mix one (the non-finite rows themselves, which are their own nearest
        # neighbour, and any row once more than f rows are non-finite) come out NaN, for the
        # aggregator to discard.
        xs = torch.where(ok[:, None], x, torch.zeros((), dtype=x.dtype))
        out = mix @ xs
        bad_used = (mix[:, ~ok] > 0).any(dim=1) if bool((~ok).any()) else None
        if bad_used is not None and bool(bad_used.any()):
            out[bad_used] = math.nan
        return out

    def check(self, n: int) -> None:
        if not self.f < n:
            raise ValueError(f"f: must be < n = {n}, got {self.f}")

    def output_rows(self, n: int) -> int:
        return n


class Bucketing(PreAggregator):
    """Bucketing (Karimireddy, He, Jaggi, "Byzantine-Robust Learning on Heterogeneous Datasets
    via Bucketing", ICLR 2022): shuffle the rows, return the means of consecutive buckets of
    ``s`` rows (the last bucket holds the remainder), ceil(n / s) rows in all."""

    traits = Traits(random=True)

    def __init__(self, s: Annotated[int, Ge(1)] = 2) -> None:
        self.s = s

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        n = x.shape[0]
        perm = torch.randperm(n, generator=require_generator(generator, self))
        bucket = torch.empty(n, dtype=torch.int64)
        bucket[perm] = torch.arange(n) // self.s
        return group_means(x, bucket, self.output_rows(n))

    def output_rows(self, n: int) -> int:
        return math.ceil(n / self.s)
