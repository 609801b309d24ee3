"""Optimizers: what a client sends (client half) and how the server applies the aggregate
(server half).

The aggregate is a model *delta* (local model minus global model, averaged robustly), so
``x + lr * aggregate`` with ``lr = 1`` is FedAvg. Stateful rules follow torch.optim:
``state_dict()`` / ``load_state_dict()`` for checkpoints; the maths is in pure functions.

Client halves (``local.optimizer`` in a scenario, entry-point group
``fedray.client_optimizers``): ``sgd`` is local SGD over ``local.steps``/``local.epochs`` (the
worker runs it itself); the others are *gradient rules*: each round the worker draws one
minibatch and the rule computes the client's message from stochastic gradients on it,
keeping per-client state (``client_message``). A server optimizer that spans both sides
(mu2-SGD) gives its client half with ``client_rule()``.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import Annotated, Any, ClassVar

import torch
from annotated_types import Ge, Gt, Lt

from strategies.protocols import ClientRule, ServerOptimizer, Traits

# A client's stochastic gradient oracle for the round: parameters -> (gradient, loss) on the
# round's minibatch (the same batch at every point it is asked for).
GradFn = Callable[[torch.Tensor], tuple[torch.Tensor, float]]


def sgd_step(
    x: torch.Tensor, delta: torch.Tensor, buf: torch.Tensor | None, lr: float, momentum: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Server SGD with heavy-ball momentum on the pseudo-gradient ``-delta``."""
    if momentum > 0:
        buf = delta.clone() if buf is None else momentum * buf + delta
        return x + lr * buf, buf
    return x + lr * delta, None


class ServerSGD(ServerOptimizer):
    """Server SGD (FedAvg when ``lr = 1`` and ``momentum = 0``). FedAvgM (Hsu, Qi, Brown,
    "Measuring the Effects of Non-Identical Data Distribution for Federated Visual
    Classification", arXiv 2019) is ``sgd`` with momentum: ``{name: sgd, lr: 1, momentum:
    beta}`` keeps their v <- beta v + delta and steps x + v (no dampening), and ``lr`` is the
    server learning rate of FedOpt's FedAvgM (Reddi et al., ICLR 2021)."""

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


class _Adaptive(ServerOptimizer):
    """The state FedAdam, FedYogi and FedAdagrad share (Reddi et al., ICLR 2021, Algorithm
    2): the moments ``m`` (0 at first) and ``v`` (``tau^2`` at first, 0 for FedAdam), None
    before the first step; each subclass's ``_step`` is its functional twin."""

    tau: float
    v_starts_at_tau2: ClassVar[bool] = True
    m: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @abstractmethod
    def _step(self, x: torch.Tensor, delta: torch.Tensor, m: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The new (x, m, v)."""

    def step(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        if self.m is None or self.v is None:
            self.m = torch.zeros_like(delta)
            self.v = torch.full_like(delta, self.tau**2) if self.v_starts_at_tau2 \
                else torch.zeros_like(delta)
        x, self.m, self.v = self._step(x, delta, self.m, self.v)
        return x

    def state_dict(self) -> dict[str, Any]:
        return {"m": self.m, "v": self.v}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.m, self.v = state["m"], state["v"]


class FedAdam(_Adaptive):
    """FedAdam (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2):
    Adam on the server with the aggregated delta as the negative gradient, no bias
    correction, adaptivity ``tau``. Departs from Algorithm 2 in one place: v starts at 0
    (the paper asks v_{-1} >= tau^2); FedYogi and FedAdagrad start at tau^2."""

    v_starts_at_tau2 = False

    def __init__(
        self,
        lr: Annotated[float, Gt(0)] = 0.01,
        beta1: Annotated[float, Ge(0), Lt(1)] = 0.9,
        beta2: Annotated[float, Ge(0), Lt(1)] = 0.99,
        tau: Annotated[float, Gt(0)] = 1e-3,
    ) -> None:
        self.lr, self.beta1, self.beta2, self.tau = lr, beta1, beta2, tau

    def _step(self, x: torch.Tensor, delta: torch.Tensor, m: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return adam_step(x, delta, m, v, self.lr, self.beta1, self.beta2, self.tau)


def yogi_step(
    x: torch.Tensor,
    delta: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    tau: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One FedYogi step; returns the new (x, m, v):
    m_t = beta1 m_{t-1} + (1 - beta1) delta,
    v_t = v_{t-1} - (1 - beta2) delta^2 sign(v_{t-1} - delta^2),
    x_{t+1} = x_t + lr m_t / (sqrt(v_t) + tau)."""
    m = beta1 * m + (1 - beta1) * delta
    d2 = delta * delta
    v = v - (1 - beta2) * d2 * torch.sign(v - d2)
    return x + lr * m / (v.sqrt() + tau), m, v


class FedYogi(_Adaptive):
    """FedYogi (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2):
    Yogi (Zaheer et al., NeurIPS 2018) on the server with the aggregated delta as the
    negative gradient. v moves towards delta^2 by (1 - beta2) delta^2 whatever its distance
    (Adam moves it by (1 - beta2)(delta^2 - v)), so when the deltas become small v shrinks,
    and the effective step grows, more gently than FedAdam's. As Algorithm 2: no bias
    correction, m starts at 0 and v at tau^2 (the smallest v_{-1} the paper allows; v then
    stays positive). Defaults: beta1 0.9 and beta2 0.99 as in the paper's experiments, tau
    1e-3 and lr 0.01 as FedAdam's (the paper tunes tau and lr per task)."""

    def __init__(
        self,
        lr: Annotated[float, Gt(0)] = 0.01,
        beta1: Annotated[float, Ge(0), Lt(1)] = 0.9,
        beta2: Annotated[float, Ge(0), Lt(1)] = 0.99,
        tau: Annotated[float, Gt(0)] = 1e-3,
    ) -> None:
        self.lr, self.beta1, self.beta2, self.tau = lr, beta1, beta2, tau

    def _step(self, x: torch.Tensor, delta: torch.Tensor, m: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return yogi_step(x, delta, m, v, self.lr, self.beta1, self.beta2, self.tau)


def adagrad_step(
    x: torch.Tensor,
    delta: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    lr: float,
    beta1: float,
    tau: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One FedAdagrad step; returns the new (x, m, v):
    m_t = beta1 m_{t-1} + (1 - beta1) delta, v_t = v_{t-1} + delta^2,
    x_{t+1} = x_t + lr m_t / (sqrt(v_t) + tau)."""
    m = beta1 * m + (1 - beta1) * delta
    v = v + delta * delta
    return x + lr * m / (v.sqrt() + tau), m, v


class FedAdagrad(_Adaptive):
    """FedAdagrad (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2):
    Adagrad on the server with the aggregated delta as the negative gradient, v the sum of
    every round's delta^2, and momentum ``beta1`` on the step as Algorithm 2 writes it
    (``beta1: 0`` is the momentum-free FedAdagrad of the paper's analysis). As Algorithm 2:
    no bias correction, m starts at 0 and v at tau^2 (the smallest v_{-1} the paper allows).
    Default ``lr`` 0.1: v sums delta^2 where FedAdam averages it with weight 1 - beta2, so
    at equal ``lr`` the first steps would be sqrt(1 / (1 - 0.99)) = 10 times FedAdam's; 0.1
    matches FedAdam's default 0.01 on the first round (the paper tunes ``lr`` per task)."""

    def __init__(
        self,
        lr: Annotated[float, Gt(0)] = 0.1,
        beta1: Annotated[float, Ge(0), Lt(1)] = 0.9,
        tau: Annotated[float, Gt(0)] = 1e-3,
    ) -> None:
        self.lr, self.beta1, self.tau = lr, beta1, tau

    def _step(self, x: torch.Tensor, delta: torch.Tensor, m: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return adagrad_step(x, delta, m, v, self.lr, self.beta1, self.tau)


# ---------------------------------------------------------------------------- client halves


class LocalSGD(ClientRule):
    """Local SGD (FedAvg's client; with ``local.steps = K``, the local steps of FedRo, Allouah
    et al. ICML 2024): ``local.steps`` or ``local.epochs`` of minibatch SGD with
    ``local.lr``, ``local.momentum`` (reset every round) and ``local.weight_decay``; the
    message is the model delta. The worker runs it (no ``client_message``)."""


class WorkerMomentum(ClientRule):
    """Worker (client) momentum, as in Karimireddy, He, Jaggi, "Learning from History for
    Byzantine Robust Optimization" (ICML 2021) and Farhadkhani et al. (ICML 2022): each round
    the client takes one stochastic gradient g_t at the global model and keeps
    m_t = beta m_{t-1} + (1 - beta) g_t (m_0 = 0, kept across rounds by the worker that owns
    the client); it sends -lr m_t, so server SGD with lr 1 steps x - lr * Agg(m)."""

    traits = Traits(gradient_rule=True, trainer="gradient_rule")

    def __init__(self, beta: Annotated[float, Ge(0), Lt(1)] = 0.9) -> None:
        self.beta = beta

    def client_message(self, round_: int, x: torch.Tensor, grad: GradFn, state: dict,
                       lr: float) -> tuple[torch.Tensor, dict, float]:
        g, loss = grad(x)
        m = state.get("m")
        m = (1 - self.beta) * g if m is None else self.beta * m + (1 - self.beta) * g
        return -lr * m, {"m": m}, loss


def mu2_beta(t: int, beta_min: float) -> float:
    """mu2-SGD's STORM weight beta_t = 1/t (the paper), floored at ``beta_min`` (the
    authors' code uses 0.01)."""
    return max(1.0 / t, beta_min)


def storm_estimate(g: torch.Tensor, g_prev: torch.Tensor, d_prev: torch.Tensor | None,
                   beta: float) -> torch.Tensor:
    """d_t = g(x_t; z_t) + (1 - beta_t) (d_{t-1} - g(x_{t-1}; z_t)); d_1 = g(x_1; z_1)."""
    if d_prev is None:
        return g
    return g + (1 - beta) * (d_prev - g_prev)


class Mu2SGDClient(ClientRule):
    """The worker half of mu2-SGD (see ``Mu2SGD``): two gradients on the same minibatch, at
    the current query point x_t and at the previous one x_{t-1}, give the corrected momentum
    d_t; the client sends -d_t."""

    traits = Traits(gradient_rule=True, trainer="gradient_rule")

    def __init__(self, beta_min: float = 0.0) -> None:
        self.beta_min = beta_min

    def client_message(self, round_: int, x: torch.Tensor, grad: GradFn, state: dict,
                       lr: float) -> tuple[torch.Tensor, dict, float]:
        g, loss = grad(x)
        d_prev, x_prev = state.get("d"), state.get("x")
        g_prev = grad(x_prev)[0] if d_prev is not None and x_prev is not None else g
        d = storm_estimate(g, g_prev, d_prev, mu2_beta(round_ + 1, self.beta_min))
        return -d, {"d": d, "x": x.clone()}, loss


# ---------------------------------------------------------------------------- both halves


def anytime_step(x: torch.Tensor, w: torch.Tensor, agg: torch.Tensor, t: int, lr: float,
                 alpha_in_step: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One mu2-SGD server step at iteration t (alpha_s = s): w_{t+1} = w_t + eta alpha_t agg
    (agg = -Agg(d), so this is w_t - eta alpha_t Agg(d); without ``alpha_in_step`` the alpha_t
    is dropped, as the authors' code does), then the AnyTime average
    x_{t+1} = (alpha_{1:t} x_t + alpha_{t+1} w_{t+1}) / alpha_{1:t+1}. Returns (x_{t+1}, w_{t+1})."""
    w = w + (lr * t if alpha_in_step else lr) * agg
    a_sum = t * (t + 1) / 2
    x = (a_sum * x + (t + 1) * w) / (a_sum + t + 1)
    return x, w


class Mu2SGD(ServerOptimizer):
    """mu2-SGD, Dahan & Levy, "Fault Tolerant ML: Efficient Meta-Aggregation and Synchronous
    Training" (ICML 2024): the double momentum of STORM corrections (worker half,
    ``Mu2SGDClient``) and AnyTime averaging (server half): honest workers send
    d_t = grad f(x_t; z_t) + (1 - beta_t)(d_{t-1} - grad f(x_{t-1}; z_t)), the server
    aggregates them robustly, steps w_{t+1} = w_t - eta alpha_t Agg(d) and queries the next
    gradients at x_{t+1} = (alpha_{1:t} x_t + alpha_{t+1} w_{t+1}) / alpha_{1:t+1}, with
    alpha_t = t, beta_t = 1/t. The global model (broadcast and evaluated) is x_t.

    ``alpha_in_step: true`` and ``beta_min: 0`` are the paper; the authors' code drops alpha_t
    from the w-step and floors beta_t at 0.01 (``alpha_in_step: false, beta_min: 0.01``).
    With alpha_t in the step, eta must be small (the effective step grows like t)."""

    def __init__(
        self,
        lr: Annotated[float, Gt(0)] = 0.01,
        alpha_in_step: bool = True,
        beta_min: Annotated[float, Ge(0), Lt(1)] = 0.0,
    ) -> None:
        self.lr, self.alpha_in_step, self.beta_min = lr, alpha_in_step, beta_min
        self.w: torch.Tensor | None = None
        self.t = 0

    def client_rule(self) -> Mu2SGDClient:
        return Mu2SGDClient(self.beta_min)

    def step(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        if self.w is None:
            self.w = x.clone()  # w_1 = x_1
        self.t += 1
        x, self.w = anytime_step(x, self.w, delta, self.t, self.lr, self.alpha_in_step)
        return x

    def state_dict(self) -> dict[str, Any]:
        return {"w": None if self.w is None else self.w.clone(), "t": self.t}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.w, self.t = state["w"], int(state["t"])
