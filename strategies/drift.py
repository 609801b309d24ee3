"""Client-drift methods: local SGD whose steps are corrected, and whose message is made from
the local update, for heterogeneous (non-IID) clients.

* ``fedprox`` (client rule): FedProx, Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated
  Optimization in Heterogeneous Networks" (MLSys 2020): the proximal term
  ``mu / 2 ||w - x||^2`` added to each client's loss; with ``clients.stragglers.partial``
  stragglers send the work they finished (the paper's systems heterogeneity).
* ``fednova`` (client rule): FedNova, Wang, Liu, Liang, Joshi, Poor, "Tackling the Objective
  Inconsistency Problem in Heterogeneous Federated Optimization" (NeurIPS 2020): each update
  normalised by the client's number of local steps.
* ``scaffold`` (server optimizer with its client half): SCAFFOLD, Karimireddy, Kale, Mohri,
  Reddi, Stich, Suresh, "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning"
  (ICML 2020), Algorithm 1 with option II.
* ``ditto`` (client rule): Ditto, Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated
  Learning Through Personalization" (ICML 2021), Algorithm 1: a personal model per client.
* ``feddyn`` (server optimizer with its client half): FedDyn, Acar, Zhao, Matas, Mattina,
  Whatmough, Saligrama, "Federated Learning Based on Dynamic Regularization" (ICLR 2021),
  Algorithm 1.

Every client half is a :class:`strategies.protocols.DriftRule`: ``correction`` gives the term added to each local
step's gradient, ``message`` turns the local update into what the client sends (and its
new state). The one trainer, ``drift_sgd`` (:class:`DriftSGD`, functional twin
:func:`drift_sgd`), runs torch.optim.SGD's steps (:func:`strategies.trainers.local_sgd`) with
that correction. A rule whose correction is None runs exactly the steps of ``sgd`` (FedProx
with ``mu = 0`` is FedAvg bit for bit).

Byzantine clients: each message goes through the robust pipeline as any update does.
SCAFFOLD's message has two parts, ``[y - x, c_i+ - c_i]`` (``delta`` and ``control``),
aggregated as one row (one rule, one selection per client: a rule that keeps a client keeps
both of its halves); its server half receives the aggregated parts by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import numpy as np
import torch
from annotated_types import Ge, Gt, Le
from torch import nn

from strategies.protocols import (
    DELTA,
    PERSONAL,
    ClientData,
    Correction,
    DriftRule,
    LocalSettings,
    MessageLayout,
    Part,
    ServerOptimizer,
    Task,
    Trainer,
    Traits,
)
from strategies.trainers import client_batches, local_sgd, step_counts

__all__ = ["Ditto", "DriftSGD", "FedDyn", "FedDynClient", "FedNova", "FedProx",
           "Scaffold", "ScaffoldClient", "drift_sgd", "momentum_norm"]


CONTROL = "control"  # SCAFFOLD's second message part: the client's control-variate delta


def drift_sgd(model: nn.Module, start: torch.Tensor, client: ClientData, rule: DriftRule,
              local: LocalSettings, task: Task) -> tuple[torch.Tensor, float]:
    """One client's round under ``rule``: local SGD from ``start`` with the rule's gradient
    correction, then the rule's message. Returns (message, mean loss); ``client.state``
    becomes the rule's new state."""
    batches = client_batches(client, local)
    state = {k: v.to(start.device) for k, v in client.state.items()}
    shared = client.shared.to(start.device) if client.shared is not None else None
    update, loss = local_sgd(model, start, client.x, client.y, batches, local.lr,
                             local.momentum, local.weight_decay, task,
                             rule.correction(start, state, shared))
    message, new = rule.message(update, len(batches), state, shared, local)
    if rule.traits.personal:  # the personal model's steps, over a fresh draw of the work
        v0 = state.get(PERSONAL, start)
        own, _ = local_sgd(model, v0, client.x, client.y, client_batches(client, local),
                           local.lr, local.momentum, local.weight_decay, task,
                           rule.personal_correction(start))
        new = {**new, PERSONAL: v0 + own}
    client.state = {k: v.detach() for k, v in new.items()}
    return message, loss


class DriftSGD(Trainer):
    """:func:`drift_sgd` for each client (the trainer of every :class:`DriftRule`)."""

    traits = Traits(context=("model", "local", "task", "rule", "client_sizes"), buffers=True)

    def __init__(self, model: nn.Module, local: LocalSettings, task: Task, rule: DriftRule,
                 client_sizes: np.ndarray) -> None:
        self.model, self.local, self.task, self.rule = model, local, task, rule
        rule.prepare(step_counts(np.asarray(client_sizes), local), local)

    def train(self, round_: int, clients: Sequence[ClientData], start: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.rule.traits.message.width(start.numel())
        updates = torch.empty((len(clients), d))  # host memory
        losses = torch.empty(len(clients), dtype=torch.float64)
        for i, c in enumerate(clients):
            updates[i], losses[i] = drift_sgd(self.model, start, c, self.rule, self.local,
                                              self.task)
        return updates, losses


# ---------------------------------------------------------------------------- FedProx


class FedProx(DriftRule):
    """FedProx (Li et al., MLSys 2020): each client minimises its loss plus
    ``mu / 2 ||w - x||^2`` (x: the global model) with local SGD, so each step's gradient
    gains ``mu (w - x)``; the message is the model delta. ``mu = 0`` is FedAvg (the same
    steps, bit for bit). The paper's inexact local solver is local SGD here, with
    ``local.epochs``/``local.steps`` as the work budget; its systems heterogeneity (stragglers
    send partial work instead of being dropped) is ``clients.stragglers.partial``, and the
    paper's straggler model (a fraction of the clients run 1 to E epochs) is
    ``clients.stragglers.kind: epochs``."""

    def __init__(self, mu: Annotated[float, Ge(0), Le(1e6)] = 0.01) -> None:
        self.mu = mu

    def correction(self, start: torch.Tensor, state: dict[str, torch.Tensor],
                   shared: torch.Tensor | None) -> Correction | None:
        if not self.mu:
            return None
        mu = self.mu
        return lambda w: torch.sub(w, start).mul_(mu)


# ---------------------------------------------------------------------------- FedNova


def momentum_norm(steps: np.ndarray | float, momentum: float) -> np.ndarray:
    """``||a_i||_1`` of FedNova (Wang et al. 2020, Section 4) for ``steps`` local SGD steps
    with momentum ``rho``: ``steps`` without momentum, else
    ``(steps - rho (1 - rho^steps) / (1 - rho)) / (1 - rho)``."""
    t = np.asarray(steps, dtype=np.float64)
    if not momentum:
        return t
    r = momentum
    return (t - r * (1 - r**t) / (1 - r)) / (1 - r)


class FedNova(DriftRule):
    """FedNova (Wang et al., NeurIPS 2020): client i's update after tau_i local steps is
    normalised, ``d_i = update_i / ||a_i||_1`` (``||a_i||_1 = tau_i`` for plain SGD, see
    :func:`momentum_norm` with momentum), and the server's step is ``tau_eff`` times the
    aggregate of the d_i. The client sends ``tau_eff * d_i``, so any aggregation rule and
    server optimizer apply unchanged.

    Departure: the paper's ``tau_eff = sum_i p_i ||a_i||_1`` runs over the round's clients
    with data-size weights p_i; fedray's aggregation weighs rows equally, and a Byzantine
    client could lie about its steps, so ``tau_eff`` is the mean of ``||a_i||_1`` over all
    clients, fixed before the first round (the paper allows any server-chosen ``tau_eff``;
    with full participation and equal weights it is the paper's value). When every client
    takes the same number of steps the message is the update itself (FedAvg)."""

    def __init__(self) -> None:
        self.tau_eff: float | None = None
        self.momentum = 0.0

    def prepare(self, steps: np.ndarray, local: LocalSettings) -> None:
        self.momentum = local.momentum
        self.tau_eff = float(np.mean(momentum_norm(steps, local.momentum)))

    def message(self, update: torch.Tensor, steps: int, state: dict[str, torch.Tensor],
                shared: torch.Tensor | None, local: LocalSettings
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        norm = float(momentum_norm(max(steps, 1), self.momentum))
        tau = norm if self.tau_eff is None else self.tau_eff
        return (update if tau == norm else update * (tau / norm)), state


# ---------------------------------------------------------------------------- SCAFFOLD


def scaffold_control(c_i: torch.Tensor | None, c: torch.Tensor | None, update: torch.Tensor,
                     steps: int, lr: float) -> torch.Tensor:
    """SCAFFOLD's option II control variate ``c_i+ = c_i - c + (x - y_i) / (K lr)``
    (``update = y_i - x``, K = ``steps``); a missing ``c_i`` or ``c`` is zero."""
    out = -update / (max(steps, 1) * lr)
    if c_i is not None:
        out = out + c_i
    if c is not None:
        out = out - c
    return out


class ScaffoldClient(DriftRule):
    """SCAFFOLD's client (Karimireddy et al., ICML 2020, Algorithm 1): each local step's
    gradient is corrected by ``c - c_i`` (server and client control variates; zero at first,
    so the first round's update is FedAvg's), then option II gives ``c_i+``; the client
    sends ``[y_i - x, c_i+ - c_i]`` (the parts ``delta`` and ``control``, both in the robust
    row) and keeps ``c_i+``."""

    traits = Traits(trainer="drift_sgd", client_state=True, shared_state=True,
                    message=MessageLayout((Part(DELTA), Part(CONTROL))))

    def correction(self, start: torch.Tensor, state: dict[str, torch.Tensor],
                   shared: torch.Tensor | None) -> Correction | None:
        c_i = state.get("c")
        if c_i is None and shared is None:
            return None  # c = c_i = 0: plain local SGD, bit for bit
        if c_i is None:
            fixed = shared
        elif shared is None:
            fixed = -c_i
        else:
            fixed = shared - c_i
        assert fixed is not None
        return lambda w: fixed

    def message(self, update: torch.Tensor, steps: int, state: dict[str, torch.Tensor],
                shared: torch.Tensor | None, local: LocalSettings
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        c_i = state.get("c")
        new = scaffold_control(c_i, shared, update, steps, local.lr)
        delta_c = new if c_i is None else new - c_i
        return torch.cat([update, delta_c]), {"c": new}


class Scaffold(ServerOptimizer):
    """SCAFFOLD's server (Karimireddy et al., ICML 2020, Algorithm 1): from the aggregate
    ``[dy, dc]`` of the clients' two-part messages (``delta``, ``control``), ``x + lr * dy`` (``lr``: the global step
    size eta_g) and ``c + (|S| / N) dc``; ``c`` is broadcast to the clients with the model.
    |S| / N is the scenario's sampling fraction (``clients.per_round / clients.total``;
    rounds that lose clients to dropouts or stragglers still use it). The aggregate is the
    robust pipeline's (the paper's mean with the ``mean`` aggregator)."""

    traits = Traits(context=("participation",))

    def __init__(self, participation: float, lr: Annotated[float, Gt(0)] = 1.0) -> None:
        self.participation, self.lr = participation, lr
        self.c: torch.Tensor | None = None

    def client_rule(self) -> ScaffoldClient:
        return ScaffoldClient()

    def shared(self) -> torch.Tensor | None:
        return self.c

    def step(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The step from a whole aggregated message, its parts side by side."""
        return self.step_parts(x, ScaffoldClient.traits.message.split(delta, x.numel()))

    def step_parts(self, x: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        dc = parts[CONTROL] * self.participation
        self.c = dc if self.c is None else self.c + dc
        return x + self.lr * parts[DELTA]

    def state_dict(self) -> dict[str, Any]:
        return {"c": None if self.c is None else self.c.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.c = state["c"]


# ---------------------------------------------------------------------------- FedDyn


class FedDynClient(DriftRule):
    """FedDyn's client (Acar et al., ICLR 2021, Algorithm 1): it minimises
    ``L_k(w) - <g_k, w> + alpha / 2 ||w - x||^2`` with local SGD (each step's gradient gains
    ``alpha (w - x) - g_k``), then keeps ``g_k <- g_k - alpha (w_k - x)`` (``g_k = 0`` at
    first); it sends the model delta ``w_k - x``."""

    traits = Traits(trainer="drift_sgd", client_state=True)

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha

    def correction(self, start: torch.Tensor, state: dict[str, torch.Tensor],
                   shared: torch.Tensor | None) -> Correction | None:
        alpha, g = self.alpha, state.get("g")
        if g is None:
            return lambda w: alpha * (w - start)
        return lambda w: alpha * (w - start) - g

    def message(self, update: torch.Tensor, steps: int, state: dict[str, torch.Tensor],
                shared: torch.Tensor | None, local: LocalSettings
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        g = state.get("g")
        new = -self.alpha * update if g is None else g - self.alpha * update
        return update, {"g": new}


class FedDyn(ServerOptimizer):
    """FedDyn's server (Acar et al., ICLR 2021, Algorithm 1) on the aggregate ``a`` of the
    model deltas (the paper's mean of ``w_k - x`` over the round's clients P):
    ``h <- h - alpha (|P| / m) a`` and ``x <- x + a - h / alpha`` (the paper's
    ``mean_k w_k - h / alpha``). |P| / m is the scenario's sampling fraction
    (``clients.per_round / clients.total``), as in SCAFFOLD. The paper's runs use
    alpha in {0.1, 0.01, 0.001} with weight decay (``local.weight_decay``)."""

    traits = Traits(context=("participation",))

    def __init__(self, participation: float,
                 alpha: Annotated[float, Gt(0), Le(1e6)] = 0.01) -> None:
        self.participation, self.alpha = participation, alpha
        self.h: torch.Tensor | None = None

    def client_rule(self) -> FedDynClient:
        return FedDynClient(self.alpha)

    def step(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        dh = -self.alpha * self.participation * delta
        self.h = dh if self.h is None else self.h + dh
        return x + delta - self.h / self.alpha

    def state_dict(self) -> dict[str, Any]:
        return {"h": None if self.h is None else self.h.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.h = state["h"]


# ---------------------------------------------------------------------------- Ditto


class Ditto(DriftRule):
    """Ditto (Li, Hu, Beirami, Smith, ICML 2021, Algorithm 1): each sampled client runs
    FedAvg's local steps on the global model ``x`` and sends the delta, then updates its
    personal model ``v_k`` (kept as its state, ``x`` at first) with as many local steps on
    ``F_k(v) + lam / 2 ||v - x||^2`` (each gradient gains ``lam (v - x)``). ``lam`` trades
    personalisation (0: local training only) for the global model (large: v_k -> x). The
    personal models are measured on each client's own test samples (a natural partition's:
    Synthetic, LEAF, a Parquet client column), ``personal_test_accuracy_mean`` and ``_p10``.

    Departures: the paper's personal solver takes ``s`` steps with its own rate; here it is
    the scenario's local work and ``local.lr`` (the paper's experiments use the same budget
    as the global steps), on a fresh draw of minibatches. A client never sampled has no
    personal model yet (the paper's ``v_k = w^0``): it is left out of the personal metrics,
    which are over the clients that have one. Byzantine clients' updates go through the
    robust pipeline (the paper's robust Ditto pairs it with a robust aggregator)."""

    traits = Traits(trainer="drift_sgd", client_state=True, personal=True)

    def __init__(self, lam: Annotated[float, Ge(0), Le(1e6)] = 0.1) -> None:
        self.lam = lam

    def personal_correction(self, start: torch.Tensor) -> Correction | None:
        lam = self.lam
        return (lambda w: lam * (w - start)) if lam else None
