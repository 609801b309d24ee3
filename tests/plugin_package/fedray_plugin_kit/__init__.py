"""One plugin of every fedray kind, written against ``strategies.protocols`` only: what a
third-party package looks like (see docs/architecture.md)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import numpy as np
import torch
from annotated_types import Ge, Gt, Le, Lt
from torch import nn

from strategies.privacy import SubsampledGaussian
from strategies.protocols import (
    Aggregator,
    Attack,
    AttackResult,
    AttackView,
    ClientData,
    ClientRule,
    Codec,
    CodecBatch,
    Dataset,
    DatasetInfo,
    DatasetSplit,
    GossipDefense,
    GossipStep,
    LocalSettings,
    MetaAggregator,
    Model,
    Partitioner,
    Parts,
    PreAggregator,
    Privacy,
    PrivacyAttack,
    ServerOptimizer,
    Task,
    Topology,
    Trainer,
    Traits,
)


class NanMedian(Aggregator):
    """Coordinate-wise median ignoring NaN (infinite values sort to the ends)."""

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.nanmedian(x, dim=0).values


class ShrinkToMedian(PreAggregator):
    """Every row moved a fraction ``alpha`` of the way to the coordinate-wise median."""

    def __init__(self, alpha: Annotated[float, Ge(0), Le(1)] = 0.5) -> None:
        self.alpha = alpha

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        med = torch.nanmedian(x, dim=0).values
        return x + self.alpha * (med - x)


class Recentered(MetaAggregator):
    """The aggregator applied to the rows centred on its own first output."""

    def __call__(self, x: torch.Tensor, aggregator: Callable[[torch.Tensor], torch.Tensor],
                 generator: torch.Generator | None = None) -> torch.Tensor:
        a = aggregator(x)
        return aggregator(x - a) + a


class Shift(Attack):
    """The honest mean moved by ``scale`` in every coordinate, sent by every Byzantine client."""

    traits = Traits(omniscient=True)

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def __call__(self, seen: torch.Tensor, f: int, generator: torch.Generator) -> torch.Tensor:
        return (seen.mean(0) + self.scale).expand(f, -1).clone()


class PathGraph(Topology):
    """Peers on a line, Metropolis weights."""

    def check(self, n: int) -> None:
        if n < 2:
            raise ValueError(f"n: a path needs 2 peers at least, got {n}")

    def mixing_matrix(self, n: int, seed: int, step: int = 0) -> np.ndarray:
        deg = np.full(n, 2)
        deg[[0, -1]] = 1
        w = np.zeros((n, n))
        for i in range(n - 1):
            w[i, i + 1] = w[i + 1, i] = 1 / (1 + max(deg[i], deg[i + 1]))
        np.fill_diagonal(w, 1 - w.sum(1))
        return w


class Damped(GossipDefense):
    """Plain gossip, damped: each peer keeps ``keep`` of its own model."""

    def __init__(self, keep: Annotated[float, Ge(0), Lt(1)] = 0.5) -> None:
        self.keep = keep

    def __call__(self, x: torch.Tensor, step: GossipStep,
                 messages: torch.Tensor | None) -> torch.Tensor:
        mixed = torch.from_numpy(step.w_hh.astype(np.float32)) @ x
        if messages is not None:
            mixed = mixed + torch.from_numpy(step.w_byz.astype(np.float32))[:, None] * messages
        return self.keep * x + (1 - self.keep) * mixed


class ScaledStep(ServerOptimizer):
    """x + lr * aggregate, counting its steps (state)."""

    def __init__(self, lr: Annotated[float, Gt(0)] = 1.0) -> None:
        self.lr, self.steps = lr, 0

    def step(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return x + self.lr * delta

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])


class SignMomentum(ClientRule):
    """Sends -lr sign(m), m the client's momentum of its minibatch gradients."""

    traits = Traits(gradient_rule=True)

    def __init__(self, beta: Annotated[float, Ge(0), Lt(1)] = 0.9) -> None:
        self.beta = beta

    def client_message(self, round_: int, x: torch.Tensor,
                       grad: Callable[[torch.Tensor], tuple[torch.Tensor, float]],
                       state: dict[str, torch.Tensor], lr: float
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
        g, loss = grad(x)
        m = g if "m" not in state else self.beta * state["m"] + (1 - self.beta) * g
        return -lr * torch.sign(m), {"m": m}, loss


class FullBatch(Trainer):
    """``steps`` full-batch gradient steps per client with ``local.lr``."""

    def __init__(self, model: nn.Module, local: LocalSettings,
                 steps: Annotated[int, Ge(1)] = 2) -> None:
        self.model, self.local, self.steps = model, local, steps

    def train(self, round_: int, clients: Sequence[ClientData], start: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        params = list(self.model.parameters())
        updates = torch.empty((len(clients), start.numel()))
        losses = torch.empty(len(clients), dtype=torch.float64)
        for i, c in enumerate(clients):
            nn.utils.vector_to_parameters(start.clone(), params)
            total = 0.0
            for _ in range(self.steps):
                loss = nn.functional.cross_entropy(self.model(c.x), c.y)
                grads = torch.autograd.grad(loss, params)
                with torch.no_grad():
                    for p, g in zip(params, grads):
                        p -= self.local.lr * g
                total += float(loss.detach())
            with torch.no_grad():
                updates[i] = nn.utils.parameters_to_vector(params) - start
            losses[i] = total / self.steps
        return updates, losses


class GaussianSGD(Privacy):
    """Sample-level Gaussian mechanism accounted as DP-SGD (noise added by a DP trainer)."""

    traits = Traits(privacy_level="sample")

    def __init__(self, clip: Annotated[float, Gt(0)] = 1.0,
                 noise_multiplier: Annotated[float, Ge(0)] = 1.0,
                 delta: Annotated[float, Gt(0), Lt(1)] = 1e-5, accountant: str = "rdp") -> None:
        self.clip, self.noise_multiplier = clip, noise_multiplier
        self.delta, self.accountant = delta, accountant

    def mechanism(self, rounds: int, client_rate: float, sample_rate: float,
                  steps_per_round: int) -> Any:
        return SubsampledGaussian(sample_rate, self.noise_multiplier, rounds * steps_per_round)


class Blobs(Dataset):
    """``classes`` Gaussian blobs in ``dimension`` dimensions, ``samples`` points."""

    def __init__(self, samples: Annotated[int, Ge(20)] = 400, dimension: Annotated[int, Ge(1)] = 8,
                 classes: Annotated[int, Ge(2)] = 3) -> None:
        self.samples, self.dimension, self.classes = samples, dimension, classes

    def describe(self, num_clients: int, seed: int, test_fraction: float) -> DatasetInfo:
        n_test = round(self.samples * test_fraction)
        return DatasetInfo(self.samples - n_test, (self.dimension,), self.classes)

    def load(self, num_clients: int, seed: int, test_fraction: float) -> DatasetSplit:
        rng = np.random.default_rng(seed)
        centres = rng.normal(0, 3, (self.classes, self.dimension))
        y = rng.integers(0, self.classes, self.samples)
        x = (centres[y] + rng.normal(0, 1, (self.samples, self.dimension))).astype(np.float32)
        n_test = round(self.samples * test_fraction)
        return DatasetSplit(x[n_test:], y[n_test:].astype(np.int64), x[:n_test],
                            y[:n_test].astype(np.int64), (self.dimension,), self.classes)


class RoundRobin(Partitioner):
    """Sample i to client i mod n."""

    def check(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"n: needs a client at least, got {n}")

    def __call__(self, y: np.ndarray, num_clients: int, rng: np.random.Generator,
                 clients: np.ndarray | None = None) -> list[np.ndarray]:
        return [np.arange(k, len(y), num_clients) for k in range(num_clients)]


class TinyNet(Model):
    """One hidden layer of ``hidden`` tanh units."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int,
                 hidden: Annotated[int, Ge(1)] = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden),
                                 nn.Tanh(), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Hinge(Task):
    """Multi-class hinge loss (Crammer and Singer, JMLR 2001): max(0, 1 + max_{j != y} s_j -
    s_y); accuracy as classification's."""

    def __init__(self, margin: Annotated[float, Ge(0)] = 1.0) -> None:
        self.margin = margin

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        true = output.gather(1, target[:, None])
        others = output.scatter(1, target[:, None], float("-inf")).amax(dim=1, keepdim=True)
        return torch.clamp(self.margin + others - true, min=0).squeeze(1)

    def hits(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output.argmax(dim=1) == target).float()


class Rounded(Codec):
    """Each entry of a message rounded to ``decimals`` decimal places before it travels
    (a toy transport; the payload keeps its float32 width, so it costs what it did)."""

    def __init__(self, decimals: Annotated[int, Ge(0), Le(8)] = 3) -> None:
        self.decimals = decimals

    def encode(self, parts: Parts, batch: CodecBatch) -> Parts:
        return {k: torch.round(v, decimals=self.decimals) if v.is_floating_point() else v
                for k, v in parts.items()}


class Confidence(PrivacyAttack):
    """Membership by confidence (Salem et al., "ML-Leaks", NDSS 2019, their third
    adversary): a member is predicted with more confidence; the score is the largest
    softmax probability raised to ``power`` (a monotone map: the same ranking)."""

    def __init__(self, power: Annotated[float, Gt(0)] = 1.0) -> None:
        self.power = power

    def attack(self, view: AttackView, generator: torch.Generator) -> AttackResult:
        assert view.queries is not None
        x, _ = view.queries
        with torch.no_grad():
            top = torch.softmax(view.model(x), dim=1).max(dim=1).values
        return AttackResult(scores=top ** self.power)
