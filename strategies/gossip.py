"""Gossip steps of decentralized SGD, with and without Byzantine peers.

The honest peers' models are one ``(h, d)`` matrix X (rows in the order of ``honest``). The
mixing matrix W is over all n peers; its honest block ``W_HH`` is ``(h, h)`` and the weight
that honest peer i gives its Byzantine neighbours is ``w_byz[i] = sum_{k in B} W_ik``. A
Byzantine peer may send each honest neighbour a different model; as in the attacks studied
(He, Karimireddy, Jaggi, "Byzantine-Robust Decentralized Learning via ClippedGossip", 2022),
all the Byzantine neighbours of peer i send it the same message ``m_i`` (one ``(h, d)``
matrix M).

* ``plain_gossip``: x_i+ = sum_{j in H} W_ij x_j + w_byz[i] m_i, i.e. X <- W X with a sparse W
  when there is no Byzantine peer;
* ``clipped_gossip`` (ClippedGossip, He et al. 2022): x_i+ = x_i + sum_{j != i} W_ij
  clip(x_j - x_i, tau_i), clip(z, tau) = z min(1, tau / ||z||); with ``tau = None`` each tau_i
  is adaptive: the largest distance that keeps the nearest neighbours of total weight
  1 - W_ii - w_byz[i] unclipped (the honest share of i's neighbourhood weight), so the
  farthest neighbours carrying the Byzantine weight are the ones clipped;
* ``robust_gossip``: x_i+ = Agg(x_i, its honest neighbours, and m_i once per Byzantine
  neighbour) with any aggregator of the library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import numpy as np
import torch
from annotated_types import Gt
from pydantic import AllowInfNan

from strategies.protocols import Aggregator, GossipDefense, GossipStep, Traits


def sparse_rows(w: np.ndarray) -> torch.Tensor:
    """A dense float64 matrix as a float32 sparse (COO) tensor for the product X <- W X."""
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to_sparse()


def plain_gossip(x: torch.Tensor, w_hh: torch.Tensor, w_byz: torch.Tensor | None = None,
                 messages: torch.Tensor | None = None) -> torch.Tensor:
    """sum_{j in H} W_ij x_j (+ w_byz[i] m_i): ``w_hh`` dense or sparse ``(h, h)``."""
    out = torch.sparse.mm(w_hh, x) if w_hh.layout != torch.strided else w_hh @ x
    if messages is not None and w_byz is not None:
        out = out + w_byz[:, None] * messages
    return out


def _clip(z: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    norm = torch.linalg.vector_norm(z, dim=-1, keepdim=True)
    return z * torch.clamp(tau[..., None] / norm.clamp_min(1e-30), max=1.0)


def adaptive_tau(dist: np.ndarray, weights: np.ndarray, honest_weight: float) -> float:
    """The smallest radius covering the nearest neighbours of total weight ``honest_weight``
    (``dist``, ``weights``: a peer's neighbours, the Byzantine message included)."""
    order = np.argsort(dist, kind="stable")
    cum = np.cumsum(weights[order])
    k = int(np.searchsorted(cum, honest_weight - 1e-12))
    return float(dist[order[min(k, len(order) - 1)]])


def clipped_gossip(x: torch.Tensor, w_hh: np.ndarray, w_byz: np.ndarray,
                   messages: torch.Tensor | None, tau: float | None) -> torch.Tensor:
    """ClippedGossip over the honest peers (see the module docstring); ``w_hh`` dense."""
    h = x.shape[0]
    off = w_hh.copy()
    np.fill_diagonal(off, 0.0)
    src, dst = np.nonzero(off)  # edge dst <- src: peer dst hears src
    diffs = x[src] - x[dst]
    dist = torch.linalg.vector_norm(diffs, dim=1).numpy().astype(np.float64)
    byz_diff = (messages - x) if messages is not None and (w_byz > 0).any() else None
    has_byz = byz_diff is not None
    byz_dist = torch.linalg.vector_norm(byz_diff, dim=1).numpy() if byz_diff is not None else np.zeros(h)
    if tau is None:
        taus = np.empty(h)
        for i in range(h):  # a small sort per peer over its neighbourhood
            mask = dst == i
            d_i = np.append(dist[mask], byz_dist[i]) if has_byz else dist[mask]
            w_i = np.append(off[i, src[mask]], w_byz[i]) if has_byz else off[i, src[mask]]
            honest_weight = off[i].sum()
            taus[i] = adaptive_tau(d_i, w_i, honest_weight) if len(d_i) else 0.0
    else:
        taus = np.full(h, float(tau))
    tau_t = torch.from_numpy(taus.astype(np.float32))
    moved = torch.zeros_like(x)
    weights = torch.from_numpy(off[dst, src].astype(np.float32))[:, None]
    moved.index_add_(0, torch.from_numpy(dst), weights * _clip(diffs, tau_t[dst]))
    if byz_diff is not None:
        moved += torch.from_numpy(w_byz.astype(np.float32))[:, None] * _clip(byz_diff, tau_t)
    return x + moved


def robust_gossip(x: torch.Tensor, w_hh: np.ndarray, byz_count: np.ndarray,
                  messages: torch.Tensor | None,
                  aggregate: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x_i+ = Agg(x_i, honest neighbours, m_i repeated ``byz_count[i]`` times)."""
    out = torch.empty_like(x)
    for i in range(x.shape[0]):  # neighbourhoods differ in size: one aggregation per peer
        nb = np.flatnonzero(w_hh[i] > 0)
        rows = [x[nb]]
        if messages is not None and byz_count[i] > 0:
            rows.append(messages[i].expand(int(byz_count[i]), -1))
        out[i] = aggregate(torch.cat(rows))
    return out


# ---------------------------------------------------------------------------- defenses


class PlainGossip(GossipDefense):
    """No defense (``dsgd.defense: none``): :func:`plain_gossip`, a sparse product."""

    def __call__(self, x: torch.Tensor, step: GossipStep,
                 messages: torch.Tensor | None) -> torch.Tensor:
        return plain_gossip(x, step.w_sparse, torch.from_numpy(step.w_byz.astype(np.float32)),
                            messages)


class ClippedGossip(GossipDefense):
    """ClippedGossip (He, Karimireddy, Jaggi 2022; ``dsgd.defense: clipped_gossip``):
    :func:`clipped_gossip` with ``dsgd.clip_tau`` (adaptive when null)."""

    traits = Traits(context=("clip_tau",))

    def __init__(self, clip_tau: Annotated[float, Gt(0), AllowInfNan(True)] | None) -> None:
        self.clip_tau = clip_tau

    def __call__(self, x: torch.Tensor, step: GossipStep,
                 messages: torch.Tensor | None) -> torch.Tensor:
        return clipped_gossip(x, step.w_hh, step.w_byz, messages, self.clip_tau)


class AggregatorGossip(GossipDefense):
    """Each honest peer aggregates its neighbourhood with the scenario's aggregator
    (``dsgd.defense: aggregator``): :func:`robust_gossip`."""

    traits = Traits(context=("aggregator",))

    def __init__(self, aggregator: Aggregator) -> None:
        self.aggregator = aggregator

    def __call__(self, x: torch.Tensor, step: GossipStep,
                 messages: torch.Tensor | None) -> torch.Tensor:
        return robust_gossip(x, step.w_hh, step.byz_count, messages, self.aggregator)


def consensus_distance(x: torch.Tensor) -> float:
    """(1/h) sum_i ||x_i - x_bar||^2."""
    return float(((x - x.mean(dim=0)) ** 2).sum(dim=1).mean())
