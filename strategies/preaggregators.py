"""Pre-aggregators: ``(n, d)`` -> ``(m, d)``, applied in a chain before the aggregator."""

from __future__ import annotations

from typing import Annotated

import torch
from annotated_types import Gt


class StaticClipping:
    """Rescale every row whose Euclidean norm exceeds ``c`` to norm ``c``.

    Returns a new matrix: the input is never modified in place.
    """

    def __init__(self, c: Annotated[float, Gt(0)] = 1.0) -> None:
        self.c = c

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
        scale = torch.clamp(self.c / norms.clamp_min(torch.finfo(x.dtype).tiny), max=1.0)
        return x * scale

    def output_rows(self, n: int) -> int:
        return n
