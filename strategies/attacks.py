"""Byzantine attacks: the rows the Byzantine clients send.

``attack(honest, f, generator) -> (f, d)``. An attack with ``omniscient = True`` receives the
honest updates of the round; otherwise it receives the Byzantine clients' own honestly
computed updates (what a non-omniscient adversary knows).
"""

from __future__ import annotations

from typing import Annotated

import torch
from annotated_types import Ge


class SignFlip:
    """Every Byzantine client sends the negated mean of the honest updates (as in Allouah et
    al., AISTATS 2023, and ByzFL's ``SignFlipping``)."""

    omniscient = True

    def __call__(self, honest: torch.Tensor, f: int, generator: torch.Generator) -> torch.Tensor:
        return (-honest.mean(dim=0)).expand(f, -1).clone()


class GaussianNoise:
    """Every Byzantine client sends an independent N(mu, sigma^2 I) vector."""

    omniscient = False

    def __init__(self, mu: float = 0.0, sigma: Annotated[float, Ge(0)] = 200.0) -> None:
        self.mu = mu
        self.sigma = sigma

    def __call__(self, honest: torch.Tensor, f: int, generator: torch.Generator) -> torch.Tensor:
        d = honest.shape[1]
        noise = torch.randn((f, d), generator=generator, dtype=honest.dtype)
        return self.mu + self.sigma * noise
