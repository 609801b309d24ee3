"""Aggregators: ``(n, d)`` matrix of client updates -> ``(d,)`` aggregate.

Each aggregator is a small class whose constructor arguments are exactly its keys in a
scenario file (``aggregator: {name: cwtm, f: 2}``). ``check(n)`` states the constraints that
depend on how many rows it will receive, with a message naming the parameter.
"""

from __future__ import annotations

from typing import Annotated

import torch
from annotated_types import Ge


class Mean:
    """Arithmetic mean of the rows: FedAvg's aggregation (McMahan et al., AISTATS 2017).

    Not robust: a single unbounded Byzantine row moves it arbitrarily far.
    """

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=0)

    def check(self, n: int) -> None:
        return None


class CoordinateWiseMedian:
    """Coordinate-wise median (Yin, Chen, Ramchandran, Bartlett, ICML 2018).

    For an even number of rows the mean of the two middle values is returned (the usual
    statistical median, as NumPy computes it), not torch's lower median.
    """

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        s = torch.sort(x, dim=0).values
        if n % 2 == 1:
            return s[n // 2].clone()
        return (s[n // 2 - 1] + s[n // 2]) / 2

    def check(self, n: int) -> None:
        return None


class CoordinateWiseTrimmedMean:
    """Coordinate-wise trimmed mean (Yin et al., ICML 2018): in each coordinate drop the f
    largest and the f smallest values and average the remaining n - 2f."""

    def __init__(self, f: Annotated[int, Ge(0)] = 0) -> None:
        self.f = f

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if 2 * self.f >= n:
            raise ValueError(f"f: must be < n/2 = {n / 2:g}, got {self.f}")
        s = torch.sort(x, dim=0).values
        return s[self.f : n - self.f].mean(dim=0)

    def check(self, n: int) -> None:
        if 2 * self.f >= n:
            raise ValueError(f"f: must be < n/2 = {n / 2:g}, got {self.f}")
