"""Server optimizers: apply the aggregated update to the global model.

The aggregate is a model *delta* (local model minus global model, averaged robustly), so
``x + lr * aggregate`` with ``lr = 1`` is FedAvg. Stateful rules follow torch.optim:
``state_dict()`` / ``load_state_dict()`` for checkpoints; the maths is in pure functions.
"""

from __future__ import annotations

from typing import Annotated, Any

import torch
from annotated_types import Ge, Gt, Lt


def sgd_step(
    x: torch.Tensor, delta: torch.Tensor, buf: torch.Tensor | None, lr: float, momentum: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Server SGD with heavy-ball momentum on the pseudo-gradient ``-delta``."""
    if momentum > 0:
        buf = delta.clone() if buf is None else momentum * buf + delta
        return x + lr * buf, buf
    return x + lr * delta, None


class ServerSGD:
    """Server SGD (FedAvg when ``lr = 1`` and ``momentum = 0``; FedAvgM with momentum,
    Hsu, Qi, Brown 2019)."""

    def __init__(
        self, lr: Annotated[float, Gt(0)] = 1.0, momentum: Annotated[float, Ge(0), Lt(1)] = 0.0
    ) -> None:
        self.lr = lr
        self.momentum = momentum
        self.buf: torch.Tensor | None = None

    def step(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        out, self.buf = sgd_step(x, delta, self.buf, self.lr, self.momentum)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"buf": None if self.buf is None else self.buf.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buf = state["buf"]


def adam_step(
    x: torch.Tensor,
    delta: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    tau: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One FedAdam step; returns the new (x, m, v)."""
    m = beta1 * m + (1 - beta1) * delta
    v = beta2 * v + (1 - beta2) * delta * delta
    return x + lr * m / (v.sqrt() + tau), m, v


class FedAdam:
    """FedAdam (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2):
    Adam on the server with the aggregated delta as the negative gradient, no bias
    correction, adaptivity ``tau``."""

    def __init__(
        self,
        lr: Annotated[float, Gt(0)] = 0.01,
        beta1: Annotated[float, Ge(0), Lt(1)] = 0.9,
        beta2: Annotated[float, Ge(0), Lt(1)] = 0.99,
        tau: Annotated[float, Gt(0)] = 1e-3,
    ) -> None:
        self.lr, self.beta1, self.beta2, self.tau = lr, beta1, beta2, tau
        self.m: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def step(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        if self.m is None or self.v is None:
            self.m = torch.zeros_like(delta)
            self.v = torch.zeros_like(delta)
        x, self.m, self.v = adam_step(
            x, delta, self.m, self.v, self.lr, self.beta1, self.beta2, self.tau
        )
        return x

    def state_dict(self) -> dict[str, Any]:
        return {"m": self.m, "v": self.v}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.m, self.v = state["m"], state["v"]
