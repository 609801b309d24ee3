"""Fair federated learning: q-FedAvg, a server optimizer with its client half and a message of
two parts.

q-FedAvg: Li, Sanjabi, Beirami, Smith, "Fair Resource Allocation in Federated Learning"
(ICLR 2020), Algorithm 2. Client k, from the global model ``w``, runs the scenario's local SGD
to ``w_k`` (``update = w_k - w``) and measures its loss ``F_k`` at ``w``; with the Lipschitz
estimate ``L``:

* ``Delta w_k = L (w - w_k) = -L update``,
* ``Delta_k = F_k^q Delta w_k``, ``h_k = q F_k^(q-1) ||Delta w_k||^2 + L F_k^q``,
* the server steps ``w - sum_k Delta_k / sum_k h_k``.

In fedray's convention a row is a step to add (a model delta), so a client sends the parts
``delta = -Delta_k = L F_k^q update`` (model-sized, in the robust row) and ``h`` (one float,
averaged beside the pipeline), and the server steps ``w + aggregate(delta) / mean(h)``: with
the ``mean`` aggregator, the paper's ``sum / sum``. ``q = 0`` is FedAvg (``delta = L update``,
``h = L``); with ``lipschitz: 1`` bit for bit.

Departures: ``F_k`` is the client's mean loss at ``w`` over its training samples (the paper's
``F_k(w^t)``; Flower's QFedAvg takes the loss its clients report); as Flower's QFedAvg does,
``F_k + 1e-10`` is raised to the powers, so a client with zero loss gives finite numbers.
``lipschitz`` defaults to ``1 / local.lr``, the paper's choice (its code's ``L = 1/lr``).
Byzantine clients send both parts; the robust pipeline sees ``delta`` and ``h`` as one row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import torch
from annotated_types import Ge, Gt, Le
from torch import nn
from torch.nn.utils import vector_to_parameters

from strategies.protocols import (
    DELTA,
    ClientData,
    ClientRule,
    LocalSettings,
    MessageLayout,
    Part,
    ServerOptimizer,
    Task,
    Trainer,
    Traits,
)
from strategies.trainers import client_batches, local_sgd

__all__ = ["H", "QFedAvg", "QFedAvgClient", "QFedAvgSGD", "qfedavg_message", "qfedavg_step"]

H = "h"  # q-FedAvg's second message part: the client's share of the step's denominator
EPS = 1e-10  # added to F_k before it is raised to a power (as Flower's QFedAvg)


def qfedavg_message(update: torch.Tensor, loss: float, q: float, lipschitz: float
                    ) -> torch.Tensor:
    """A client's message ``[L F^q update, q F^(q-1) L^2 ||update||^2 + L F^q]`` from its local
    ``update`` and its ``loss`` F at the global model (module docstring)."""
    f = float(loss) + EPS
    fq = f ** q
    delta = update * (lipschitz * fq)
    square = float(torch.linalg.vector_norm(update, dtype=torch.float64)) ** 2
    h = (q * f ** (q - 1) * lipschitz ** 2 * square if q else 0.0) + lipschitz * fq
    return torch.cat([delta, torch.tensor([h], dtype=delta.dtype)])


def qfedavg_step(x: torch.Tensor, delta: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The server's step ``x + delta / h`` from the aggregate of the deltas and the mean of
    the ``h`` (one entry)."""
    return x + delta / h


class QFedAvgClient(ClientRule):
    """q-FedAvg's client half: its message is the parts ``delta`` (model-sized, in the robust
    row) and ``h`` (one float, averaged beside it); it runs with the ``qfedavg_sgd`` trainer."""

    traits = Traits(trainer="qfedavg_sgd",
                    message=MessageLayout((Part(DELTA), Part(H, size=1, role="mean"))))

    def __init__(self, q: float = 1.0, lipschitz: float | None = None) -> None:
        self.q, self.lipschitz = q, lipschitz


class QFedAvgSGD(Trainer):
    """The scenario's local SGD (:func:`strategies.trainers.local_sgd`) for each client, whose
    loss at the global model is measured first, then :func:`qfedavg_message`."""

    traits = Traits(context=("model", "local", "task", "rule"))

    def __init__(self, model: nn.Module, local: LocalSettings, task: Task,
                 rule: QFedAvgClient) -> None:
        self.model, self.local, self.task, self.rule = model, local, task, rule

    def start_loss(self, start: torch.Tensor, c: ClientData) -> float:
        """Client ``c``'s mean loss at the flat parameters ``start`` over its samples."""
        params = list(self.model.parameters())
        vector_to_parameters(start.clone(), params)
        self.model.eval()
        with torch.no_grad():
            x = c.x.to(start.device)
            out = self.model(x)
            return float(self.task.losses(out, self.task.target(x, c.y.to(start.device)))
                         .mean())

    def train(self, round_: int, clients: Sequence[ClientData], start: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        lc, rule = self.local, self.rule
        lipschitz = rule.lipschitz if rule.lipschitz is not None else 1.0 / lc.lr
        updates = torch.empty((len(clients), start.numel() + 1))  # host memory
        losses = torch.empty(len(clients), dtype=torch.float64)
        for i, c in enumerate(clients):
            f = self.start_loss(start, c)
            update, losses[i] = local_sgd(self.model, start, c.x, c.y, client_batches(c, lc),
                                          lc.lr, lc.momentum, lc.weight_decay, self.task)
            updates[i] = qfedavg_message(update.cpu(), f, rule.q, lipschitz)
        return updates, losses


class QFedAvg(ServerOptimizer):
    """q-FedAvg's server (Li et al., ICLR 2020, Algorithm 2; module docstring): from the
    aggregated ``delta`` and the mean ``h`` of the step's messages, ``x + delta / h``. ``q``
    trades average accuracy for fairness (0: FedAvg; the paper uses up to 15);
    ``lipschitz``: the estimate L of the loss's gradient Lipschitz constant (default
    ``1 / local.lr``). Flower ships it as ``QFedAvg`` (``q_param``, ``qffl_learning_rate``)."""

    def __init__(self, q: Annotated[float, Ge(0), Le(100)] = 1.0,
                 lipschitz: Annotated[float, Gt(0)] | None = None) -> None:
        self.q, self.lipschitz = q, lipschitz

    def client_rule(self) -> QFedAvgClient:
        return QFedAvgClient(self.q, self.lipschitz)

    def step_parts(self, x: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return qfedavg_step(x, parts[DELTA], parts[H])
