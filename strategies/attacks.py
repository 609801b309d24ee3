"""Byzantine attacks: the rows the Byzantine clients send.

``attack(seen, f, generator) -> (f, d)``. An attack with ``traits.omniscient`` sees the honest
updates of the round; otherwise it sees the Byzantine clients' own honestly computed updates
(what a non-omniscient adversary knows). An attack that needs the scenario's aggregation
pipeline lists ``aggregate`` in ``traits.context``: the Adversary passes a pure function
``(n, d) -> (d,)`` that runs the scenario's pre-aggregators, aggregator and meta-aggregator.
A data-poisoning attack (``traits.data_poisoning``) changes the Byzantine clients' training
data through ``poison_labels`` and sends the resulting updates unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from statistics import NormalDist
from typing import Annotated, Literal

import torch
from annotated_types import Ge, Gt, Lt
from pydantic import AllowInfNan

from strategies.geometry import squared_distances
from strategies.protocols import Attack, GossipAttack, Traits


def _repeat(row: torch.Tensor, f: int) -> torch.Tensor:
    return row.expand(f, -1).clone()


class SignFlip(Attack):
    """Every Byzantine client sends the negated mean of the honest updates (as in Allouah et
    al., AISTATS 2023, and ByzFL's ``SignFlipping``)."""

    traits = Traits(omniscient=True)

    def __call__(self, honest: torch.Tensor, f: int, generator: torch.Generator) -> torch.Tensor:
        return _repeat(-honest.mean(dim=0), f)


class GaussianNoise(Attack):
    """Every Byzantine client sends an independent N(mu, sigma^2 I) vector (``mu: .nan`` or
    ``.inf`` in a scenario: non-finite rows, a Byzantine client may send anything)."""


    def __init__(self, mu: Annotated[float, AllowInfNan(True)] = 0.0,
                 sigma: Annotated[float, Ge(0)] = 200.0) -> None:
        self.mu = mu
        self.sigma = sigma

    def __call__(self, honest: torch.Tensor, f: int, generator: torch.Generator) -> torch.Tensor:
        d = honest.shape[1]
        noise = torch.randn((f, d), generator=generator, dtype=honest.dtype)
        return self.mu + self.sigma * noise


class InnerProductManipulation(Attack):
    """Inner-product manipulation, IPM (Xie, Koyejo, Gupta, "Fall of Empires: Breaking
    Byzantine-tolerant SGD by Inner Product Manipulation", UAI 2019): every Byzantine client
    sends ``-epsilon`` times the honest mean, making the aggregate's inner product with the
    true gradient negative. The small-epsilon regime (0.1, the default) targets Krum-like
    rules."""

    traits = Traits(omniscient=True)

    def __init__(self, epsilon: Annotated[float, Ge(0)] = 0.1) -> None:
        self.epsilon = epsilon

    def __call__(self, honest: torch.Tensor, f: int, generator: torch.Generator) -> torch.Tensor:
        return _repeat(-self.epsilon * honest.mean(dim=0), f)


class CraftedIPM(InnerProductManipulation):
    """IPM whose Byzantine clients build their payloads themselves
    (``traits.crafts_payload``) rather than pass their rows through the codecs' client
    halves: the server decodes the worst case within each codec's range
    (``strategies.protocols.Codec.reach``): top-k's or rand-k's ``k`` largest entries
    unscaled, QSGD's row on any grid, and under secure aggregation words beyond the
    clients' clip, which wrap the group sum modulo ``2^bits``. Without a codec it is IPM."""

    traits = Traits(omniscient=True, crafts_payload=True)


class FallOfEmpires(InnerProductManipulation):
    """Fall of empires, FOE (Xie, Koyejo, Gupta, UAI 2019): the same ``-epsilon`` times the
    honest mean as IPM, in the paper's large-epsilon regime (default 10) aimed at median and
    trimmed-mean rules. The two names follow the literature (e.g. Allouah et al. 2023 call the
    attack FOE, Karimireddy et al. 2022 call it IPM)."""

    def __init__(self, epsilon: Annotated[float, Ge(0)] = 10.0) -> None:
        super().__init__(epsilon)


def alie_z(n: int, f: int) -> float:
    """ALIE's default z (Baruch, Baruch, Goldberg, NeurIPS 2019, Algorithm 3):
    ``s = floor(n/2 + 1) - f`` supporters needed, ``z = Phi^-1((n - s) / n)``."""
    s = math.floor(n / 2 + 1) - f
    p = (n - s) / n
    p = min(max(p, 1e-12), 1 - 1e-12)
    return NormalDist().inv_cdf(p)


class ALittleIsEnough(Attack):
    """A little is enough, ALIE (Baruch, Baruch, Goldberg, NeurIPS 2019, Algorithm 3): every
    Byzantine client sends ``mu_j - z * sigma_j`` per coordinate, with the mean and the standard
    deviation (1/n, as the paper defines it) of the honest updates; ``z`` defaults to the
    paper's value from n (rows in the round) and f.

    Where the peer differs, we follow the paper: ByzFL's ``ALittleIsEnough(tau)`` sends
    ``mu + tau * sigma`` with the n - 1 sample std, which is ours with
    ``z = -tau * sqrt(n / (n - 1))`` (tested)."""

    traits = Traits(omniscient=True)

    def __init__(self, z: float | None = None) -> None:
        self.z = z

    def __call__(self, honest: torch.Tensor, f: int, generator: torch.Generator) -> torch.Tensor:
        z = alie_z(honest.shape[0] + f, f) if self.z is None else self.z
        return _repeat(honest.mean(dim=0) - z * honest.std(dim=0, correction=0), f)


class Mimic(Attack):
    """Mimic (Karimireddy, He, Jaggi, "Byzantine-Robust Learning on Heterogeneous Datasets via
    Bucketing", ICLR 2022): every Byzantine client copies one honest client's update, row
    ``target`` of the round's honest rows (ordered by client id), over-representing that
    client's data under heterogeneity."""

    traits = Traits(omniscient=True)

    def __init__(self, target: Annotated[int, Ge(0)] = 0) -> None:
        self.target = target

    def __call__(self, honest: torch.Tensor, f: int, generator: torch.Generator) -> torch.Tensor:
        return _repeat(honest[min(self.target, honest.shape[0] - 1)], f)


class Infinity(Attack):
    """Every Byzantine client sends a vector of +inf (ByzFL's ``Inf``)."""


    def __call__(self, honest: torch.Tensor, f: int, generator: torch.Generator) -> torch.Tensor:
        return torch.full((f, honest.shape[1]), math.inf, dtype=honest.dtype)


class NotANumber(Attack):
    """Every Byzantine client sends a vector of NaN."""


    def __call__(self, honest: torch.Tensor, f: int, generator: torch.Generator) -> torch.Tensor:
        return torch.full((f, honest.shape[1]), math.nan, dtype=honest.dtype)


def _perturbation(honest: torch.Tensor, kind: str) -> torch.Tensor:
    mu = honest.mean(dim=0)
    if kind == "unit_vec":
        return -mu / torch.linalg.vector_norm(mu).clamp_min(torch.finfo(mu.dtype).tiny)
    if kind == "std":
        return -honest.std(dim=0)
    return -torch.sign(mu)


class MinMax(Attack):
    """Min-max (Shejwalkar & Houmansadr, NDSS 2021, AGR-agnostic): send ``mu + gamma * p`` with
    the largest gamma whose maximum distance to any honest update stays within the largest
    distance between two honest updates. ``p`` is the inverse unit mean (``unit_vec``, the
    authors' default), the inverse std or the inverse sign.

    Each constraint ``||mu - x_i + gamma p||^2 <= R^2`` is a quadratic in gamma, so gamma is
    solved exactly (the authors approximate the same number by bisection).
    """

    traits = Traits(omniscient=True)

    def __init__(self, perturbation: Literal["unit_vec", "std", "sign"] = "unit_vec") -> None:
        self.perturbation = perturbation

    def gamma(self, honest: torch.Tensor, p: torch.Tensor) -> float:
        h = honest.double()
        p = p.double()
        diff = h.mean(dim=0) - h  # mu - x_i
        a = (diff * diff).sum(dim=1)
        b = diff @ p
        c = float(p @ p)
        if c == 0:
            return 0.0
        r2 = float(squared_distances(honest).max())
        roots = (-b + torch.sqrt((b * b - c * (a - r2)).clamp_min(0))) / c
        return max(float(roots.min()), 0.0)

    def __call__(self, honest: torch.Tensor, f: int, generator: torch.Generator) -> torch.Tensor:
        p = _perturbation(honest, self.perturbation)
        return _repeat(honest.mean(dim=0) + self.gamma(honest, p) * p, f)


class MinSum(MinMax):
    """Min-sum (Shejwalkar & Houmansadr, NDSS 2021): ``mu + gamma * p`` with the largest gamma
    whose sum of squared distances to the honest updates stays within the largest such sum of
    an honest update. Since ``sum_i (mu - x_i) = 0`` the constraint gives
    ``gamma = sqrt((S_max - sum_i ||mu - x_i||^2) / (n ||p||^2))`` exactly."""

    def gamma(self, honest: torch.Tensor, p: torch.Tensor) -> float:
        h = honest.double()
        diff = h.mean(dim=0) - h
        a = float((diff * diff).sum())
        c = float(p.double() @ p.double())
        if c == 0:
            return 0.0
        s_max = float(squared_distances(honest).sum(dim=1).max())
        return math.sqrt(max(s_max - a, 0.0) / (honest.shape[0] * c))


class _LineSearch(Attack):
    """Shared by the optimal attacks: the scale maximising ``||aggregate(honest + f copies of
    row(scale)) - honest mean||``, found as ByzFL's ``Optimal_*`` attacks do (expansion from
    ``start`` by ``delta``, doubling while the distance grows, then ``ratio``-shrinking steps,
    ``evals`` evaluations in all)."""

    traits = Traits(omniscient=True, context=("aggregate",))

    def __init__(
        self,
        aggregate: Callable[[torch.Tensor], torch.Tensor],
        evals: Annotated[int, Ge(1)] = 20,
        start: float = 0.0,
        delta: float = 10.0,
        ratio: Annotated[float, Gt(0.5), Lt(1)] = 0.8,
    ) -> None:
        self.aggregate = aggregate
        self.evals, self.start, self.delta, self.ratio = evals, start, delta, ratio

    def row(self, honest: torch.Tensor, f: int, scale: float) -> torch.Tensor:
        raise NotImplementedError

    def distance(self, honest: torch.Tensor, f: int, scale: float) -> float:
        rows = torch.cat([honest, _repeat(self.row(honest, f, scale), f)])
        agg = self.aggregate(rows)
        d = float(torch.linalg.vector_norm(agg - honest.mean(dim=0)))
        return d if math.isfinite(d) else -math.inf

    def best_scale(self, honest: torch.Tensor, f: int) -> float:
        best_x, best_y = self.start, self.distance(honest, f, self.start)
        delta, left = self.delta, self.evals - 1
        while left > 0:  # expansion
            x = best_x + delta
            y = self.distance(honest, f, x)
            left -= 1
            if y > best_y:
                best_x, best_y, delta = x, y, delta * 2
            else:
                delta *= self.ratio
                break
        while left > 0:  # contraction
            x = best_x + delta
            y = self.distance(honest, f, x)
            left -= 1
            if y > best_y:
                best_x, best_y = x, y
            delta *= self.ratio
        return best_x

    def __call__(self, honest: torch.Tensor, f: int, generator: torch.Generator) -> torch.Tensor:
        return _repeat(self.row(honest, f, self.best_scale(honest, f)), f)


class OptimalIPM(_LineSearch):
    """IPM (``-scale`` times the honest mean) with the scale line-searched against the
    scenario's own aggregation pipeline (ByzFL's ``Optimal_InnerProductManipulation``)."""

    def row(self, honest: torch.Tensor, f: int, scale: float) -> torch.Tensor:
        return -scale * honest.mean(dim=0)


class OptimalALIE(_LineSearch):
    """ALIE (``mu - z * sigma``, the paper's sign and 1/n std) with z line-searched against the
    scenario's own aggregation pipeline (as ByzFL's ``Optimal_ALittleIsEnough`` searches its
    ``mu + tau * sigma``)."""

    def row(self, honest: torch.Tensor, f: int, scale: float) -> torch.Tensor:
        return honest.mean(dim=0) - scale * honest.std(dim=0, correction=0)


class LabelFlip(Attack):
    """Label flipping (data poisoning, e.g. Allouah et al. AISTATS 2023): the Byzantine clients
    train honestly on their own data with every label ``y`` replaced by ``C - 1 - y`` and send
    the resulting updates."""

    traits = Traits(data_poisoning=True)

    def poison_labels(self, y: torch.Tensor, num_classes: int) -> torch.Tensor:
        return num_classes - 1 - y

    def __call__(self, own: torch.Tensor, f: int, generator: torch.Generator) -> torch.Tensor:
        return own.clone()


class Dissensus(GossipAttack):
    """The dissensus attack on gossip (He, Karimireddy, Jaggi, "Byzantine-Robust Decentralized
    Learning via ClippedGossip", 2022): the Byzantine neighbours of honest peer i all send
    m_i = x_i - epsilon sum_{j in H} W_ij (x_j - x_i) / sum_{k in B} W_ik, so that plain
    gossip moves i by (1 - epsilon) times its honest pull: epsilon = 1 freezes every peer,
    epsilon > 1 drives the peers apart. A gossip attack (``traits.gossip``): only for D-SGD."""


    def __init__(self, epsilon: Annotated[float, Ge(0)] = 1.5) -> None:
        self.epsilon = epsilon

    def messages(self, x: torch.Tensor, w_hh: torch.Tensor, w_byz: torch.Tensor,
                 generator: torch.Generator) -> torch.Tensor:
        """``(h, d)`` messages, row i for honest peer i (``w_hh`` dense ``(h, h)``)."""
        off = w_hh - torch.diag(torch.diagonal(w_hh))
        pull = off @ x - off.sum(dim=1, keepdim=True) * x  # sum_j W_ij (x_j - x_i)
        scale = torch.where(w_byz > 0, self.epsilon / w_byz.clamp_min(1e-30), torch.zeros_like(w_byz))
        return x - scale[:, None] * pull
