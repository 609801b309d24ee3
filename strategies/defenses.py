"""Defences against backdoor (targeted) poisoning: ``(n, d)`` client updates -> ``(d,)``.

Three aggregation rules from the backdoor literature, each a class (an :class:`Aggregator`
whose constructor arguments are its scenario keys) and the pure function it calls:

* :class:`NormBound` / :func:`norm_bound`: clip each update's L2 norm, average, add Gaussian
  noise (Sun et al. 2019);
* :class:`FoolsGold` / :func:`foolsgold`: down-weight clients whose updates point the same way
  (Fung et al., RAID 2020);
* :class:`Flame` / :func:`flame`: keep the majority cluster of HDBSCAN on cosine distances,
  clip to the median norm, average, add noise (Nguyen et al., USENIX Security 2022);
* :class:`FLTrust` / :func:`fltrust`: weigh each update by its cosine similarity to the
  server's own update on a clean root set (Cao et al., NDSS 2021).

They measure directions and norms from the origin (an update is a model delta), so unlike the
rules of ``strategies.aggregators`` they are not translation equivariant. None has a weighted
definition (``traits.weighted`` is False). The random ones (``traits.random``: NormBound and
Flame, whose noise is drawn from the ``generator`` argument) need a generator only when their
noise scale is positive. Non-finite rows (NaN, +/-inf, a float32 norm that overflows) have no
direction: each rule says what it does with them. The input is never modified.
"""

from __future__ import annotations

import math
from typing import Annotated

import torch
from annotated_types import Ge, Gt
from pydantic import AllowInfNan

from strategies.geometry import finite_rows
from strategies.protocols import Aggregator, Traits, require_generator

__all__ = [
    "FLTrust",
    "Flame",
    "FoolsGold",
    "NormBound",
    "cosine_similarities",
    "flame",
    "flame_admitted",
    "fltrust",
    "foolsgold",
    "foolsgold_weights",
    "norm_bound",
]


def cosine_similarities(x: torch.Tensor) -> torch.Tensor:
    """``(n, n)`` float64 cosine similarities of the (finite) rows ``x``, on the CPU, clamped
    to [-1, 1] and exactly symmetric. The rows are scaled to unit norm before the one
    ``(n, d) x (d, n)`` product (no overflow for huge rows); a zero row has similarity 0 with
    every row, itself included, as scikit-learn's ``cosine_similarity`` gives."""
    norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    unit = x / torch.where(norms > 0, norms, torch.ones((), dtype=x.dtype))
    g = (unit @ unit.T).double().cpu()
    return ((g + g.T) / 2).clamp(-1.0, 1.0)


def _drawing(generator: torch.Generator | None, rule: str) -> torch.Generator:
    """``generator``, or a TypeError naming the pure function ``rule`` that was asked to draw
    noise without one (a plugin never draws from torch's global generator)."""
    if generator is None:
        raise TypeError(f"{rule}: a positive noise scale draws from generator: pass "
                        "generator=torch.Generator")
    return generator


def _noise(d: int, std: float, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``std`` times a standard normal ``(d,)`` vector drawn on the generator's device and
    moved to ``like``'s (the same numbers whatever device aggregates)."""
    z = torch.randn(d, generator=generator, dtype=like.dtype, device=generator.device)
    return z.to(like.device) * std


# ---------------------------------------------------------------------------- NormBound


def norm_bound(x: torch.Tensor, bound: float, sigma: float = 0.0,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """``(1/n) sum_i x_i min(1, bound / ||x_i||) + N(0, sigma^2 I)``: each row clipped to L2
    norm ``bound``, the mean of the clipped rows, then Gaussian noise of standard deviation
    ``sigma`` per coordinate drawn from ``generator`` (needed only when ``sigma > 0``).

    A non-finite row has no direction to keep: it becomes the zero row (it still counts in the
    ``1/n``), as ``strategies.preaggregators.clip_rows`` does. ``bound = inf`` clips nothing.
    """
    n = x.shape[0]
    norms = torch.linalg.vector_norm(x, dim=1)
    ok = torch.isfinite(norms)
    scale = torch.clamp(bound / norms.clamp_min(torch.finfo(x.dtype).tiny), max=1.0)
    coeff = torch.where(ok, scale, torch.zeros((), dtype=x.dtype)) / n
    # 0 * inf would poison the product: zero the non-finite rows first (a copy only then)
    xs = x if bool(ok.all()) else torch.where(ok[:, None], x, torch.zeros((), dtype=x.dtype))
    out = coeff @ xs
    if sigma > 0:
        out = out + _noise(x.shape[1], sigma, out, _drawing(generator, "norm_bound"))
    return out


class NormBound(Aggregator):
    """Norm bounding with optional weak differential privacy (Sun, Kairouz, Suresh, McMahan,
    "Can You Really Backdoor Federated Learning?", arXiv:1911.07963, 2019): every update is
    clipped to L2 norm ``bound`` (the paper's M), the clipped updates are averaged, and
    Gaussian noise of standard deviation ``sigma`` is added (``sigma = 0``, the default: norm
    bounding alone). See :func:`norm_bound`.

    Departures: the paper adds the noise to the new global model; here it is added to the
    aggregate update, which is the same under the server's plain SGD at learning rate 1 (with
    another server optimizer the noise goes through it). ``bound`` has no default: the paper
    tunes it per task, and a default would silently clip (or not clip) at an arbitrary scale.
    """

    traits = Traits(random=True)

    def __init__(self, bound: Annotated[float, Gt(0), AllowInfNan(True)],
                 sigma: Annotated[float, Ge(0)] = 0.0) -> None:
        self.bound, self.sigma = bound, sigma

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        if self.sigma > 0:
            require_generator(generator, self)
        return norm_bound(x, self.bound, self.sigma, generator)


# ---------------------------------------------------------------------------- FoolsGold


def foolsgold_weights(x: torch.Tensor, kappa: float = 1.0) -> torch.Tensor:
    """FoolsGold's weight of each row, ``(n,)`` float64 on the CPU, in [0, 1] (Fung, Yoon,
    Beschastnikh, RAID 2020, Algorithm 1, as the authors' code computes it):

    1. ``cs_ij``: cosine similarity of rows i and j, with ``cs_ii = 0`` (the code's
       ``cs - I``, so ``v_i = max_j cs_ij >= 0``);
    2. pardoning: ``cs_ij <- cs_ij v_i / v_j`` wherever ``v_j > v_i``;
    3. ``alpha_i = clip(1 - max_j cs_ij, 0, 1)``, then ``alpha / max(alpha)``, the maximum
       (exactly 1) replaced by 0.99;
    4. ``alpha_i <- clip(kappa (ln(alpha_i / (1 - alpha_i)) + 0.5), 0, 1)``.

    Non-finite rows get weight 0 and take no part in the similarities. When every alpha is 0
    (each row has a parallel twin, e.g. all rows identical) the normalisation of step 3 is
    0/0 (NaN in the authors' code): the finite rows then get weight 1 each, no row being more
    sybil-like than another.
    """
    n = x.shape[0]
    ok = finite_rows(x).cpu()
    w = torch.zeros(n, dtype=torch.float64)
    idx = torch.nonzero(ok).squeeze(1)
    if len(idx) == 0:
        return w
    cs = cosine_similarities(x if len(idx) == n else x[idx.to(x.device)])
    cs.fill_diagonal_(0.0)
    v = cs.amax(dim=1)
    ratio = v[:, None] / v[None, :].clamp_min(torch.finfo(torch.float64).tiny)
    cs = torch.where(v[None, :] > v[:, None], cs * ratio, cs)
    alpha = (1.0 - cs.amax(dim=1)).clamp(0.0, 1.0)
    top = float(alpha.max())
    if top <= 0.0:
        w[idx] = 1.0
        return w
    alpha = alpha / top
    alpha = torch.where(alpha == 1.0, torch.full((), 0.99, dtype=torch.float64), alpha)
    # alpha = 0 gives log(0) = -inf, clipped to weight 0 as in the authors' code
    w[idx] = (kappa * (torch.log(alpha / (1.0 - alpha)) + 0.5)).clamp(0.0, 1.0)
    return w


def foolsgold(x: torch.Tensor, kappa: float = 1.0) -> torch.Tensor:
    """``sum_i a_i x_i / sum_i a_i`` with ``a = foolsgold_weights(x, kappa)``: the rows
    weighted by FoolsGold (at least one weight is positive whenever a row is finite; NaN
    when none is)."""
    a = foolsgold_weights(x, kappa)
    keep = torch.nonzero(a > 0).squeeze(1)
    if len(keep) == 0:
        return torch.full_like(x[0], math.nan)
    c = (a[keep] / a[keep].sum()).to(device=x.device, dtype=x.dtype)
    return c @ x[keep.to(x.device)]


class FoolsGold(Aggregator):
    """FoolsGold (Fung, Yoon, Beschastnikh, "The Limitations of Federated Learning in Sybil
    Settings", RAID 2020, Algorithm 1): clients whose updates point the same way (sybils
    pushing one poisoning objective) are down-weighted by their maximum pairwise cosine
    similarity, with pardoning of honest clients that merely resemble a sybil and a logit
    of confidence ``kappa``; see :func:`foolsgold_weights` for the weights.

    Departures, all stated:

    * **memoryless**: the paper compares each client's *history* (the sum of its updates over
      all rounds); an aggregator sees only the round's rows, not which client sent which
      across rounds, so the similarities are those of this round's updates;
    * the paper's optional weighting of indicative output-layer features is not applied (a
      row is a flat vector without its layer structure);
    * the output is the *weighted average* ``sum_i a_i x_i / sum_i a_i``, where the paper
      adds ``sum_i a_i x_i`` to the model: the aggregate keeps the scale of one update, so
      the server optimizer's learning rate keeps its meaning;
    * when every weight would be 0/0 (all rows pairwise parallel) the finite rows are
      averaged with equal weights; non-finite rows get weight 0.
    """

    def __init__(self, kappa: Annotated[float, Gt(0)] = 1.0) -> None:
        self.kappa = kappa

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        return foolsgold(x, self.kappa)


# ---------------------------------------------------------------------------- FLAME


def flame_admitted(x: torch.Tensor) -> torch.Tensor:
    """``(n,)`` boolean mask, on the CPU, of the rows FLAME admits: HDBSCAN (scikit-learn's,
    ``metric="precomputed"``) on the cosine distances ``1 - cos(x_i, x_j)`` of the finite
    rows with ``min_cluster_size = n // 2 + 1``, ``min_samples = 1`` and
    ``allow_single_cluster=True``; the admitted rows are those labelled with the (at most one)
    cluster, the others are outliers. Nothing is admitted when fewer than ``n // 2 + 1`` rows
    are finite; a single row (n = 1) is admitted when finite."""
    n = x.shape[0]
    ok = finite_rows(x).cpu()
    size = n // 2 + 1
    idx = torch.nonzero(ok).squeeze(1)
    admitted = torch.zeros(n, dtype=torch.bool)
    if len(idx) < size:
        return admitted
    if size < 2:  # n = 1: HDBSCAN needs clusters of two points or more
        admitted[idx] = True
        return admitted
    # imported here: scikit-learn's import costs start-up time that only FLAME needs
    from sklearn.cluster import HDBSCAN

    dist = (1.0 - cosine_similarities(x if len(idx) == n else x[idx.to(x.device)])).clamp_min(0.0)
    dist.fill_diagonal_(0.0)
    labels = HDBSCAN(min_cluster_size=size, min_samples=1, metric="precomputed",
                     allow_single_cluster=True, copy=True).fit(dist.numpy()).labels_
    admitted[idx[torch.from_numpy(labels >= 0)]] = True
    return admitted


def flame(x: torch.Tensor, lam: float = 0.001,
          generator: torch.Generator | None = None) -> torch.Tensor:
    """FLAME's aggregate: with ``S`` the median L2 norm of all ``n`` rows (the mean of the two
    middle ones for even n; a non-finite row counts as norm +inf) and ``A`` the rows
    :func:`flame_admitted` keeps, ``(1/|A|) sum_{i in A} x_i min(1, S / ||x_i||)`` plus
    Gaussian noise of standard deviation ``lam * S`` per coordinate, drawn from ``generator``
    (needed only when ``lam > 0``). When nothing is admitted the aggregate is the zero update
    (the model stays where it is), without noise."""
    n = x.shape[0]
    admitted = flame_admitted(x)
    if not bool(admitted.any()):
        return torch.zeros_like(x[0])
    norms = torch.linalg.vector_norm(x, dim=1).double().cpu()
    norms = torch.where(torch.isfinite(norms), norms, torch.full((), math.inf, dtype=torch.float64))
    s = torch.sort(norms).values
    median = float((s[(n - 1) // 2] + s[n // 2]) / 2)  # finite: a majority of rows is finite
    keep = torch.nonzero(admitted).squeeze(1)
    scale = torch.clamp(median / norms[keep].clamp_min(torch.finfo(torch.float64).tiny), max=1.0)
    c = (scale / len(keep)).to(device=x.device, dtype=x.dtype)
    out = c @ x[keep.to(x.device)]
    if lam > 0:
        out = out + _noise(x.shape[1], lam * median, out, _drawing(generator, "flame"))
    return out


class Flame(Aggregator):
    """FLAME (Nguyen, Rieger, Chen, Yalame, Möllering, Fereidooni, Marchal, Miettinen,
    Mirhoseini, Zeitouni, Koushanfar, Sadeghi, Schneider, "FLAME: Taming Backdoors in
    Federated Learning", USENIX Security 2022, Algorithm 1): HDBSCAN on the pairwise cosine
    distances with minimum cluster size n/2 + 1 keeps the majority cluster and rejects the
    outliers; the admitted updates are clipped to the median L2 norm ``S`` of all updates and
    averaged; Gaussian noise of standard deviation ``lam * S`` is added (``lam``, the paper's
    lambda, defaults to 0.001, its value for image classification). See :func:`flame` and
    :func:`flame_admitted`.

    Departures, all stated:

    * the cosine distances are between the clients' *updates*; the paper measures them
      between the local models ``W_i = G + update_i``, which the aggregator is not given;
    * HDBSCAN's ``min_samples = 1`` and ``allow_single_cluster=True`` are not in the paper
      (without the latter HDBSCAN never returns the single majority cluster, the only one
      ``min_cluster_size > n/2`` allows); scikit-learn labels the points of a single
      root cluster strictly, so some honest rows may be left out as noise;
    * the noise is added to the aggregate update, where the paper adds it to the new global
      model: the same under the server's plain SGD at learning rate 1;
    * a non-finite row is never admitted and counts as norm +inf in the median; when fewer
      than n/2 + 1 rows are finite, or nothing is admitted, the aggregate is the zero update.
    """

    traits = Traits(random=True)

    def __init__(self, lam: Annotated[float, Ge(0)] = 0.001) -> None:
        self.lam = lam

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        if self.lam > 0:
            require_generator(generator, self)
        return flame(x, self.lam, generator)


# ---------------------------------------------------------------------------- FLTrust


def fltrust(x: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """FLTrust (Cao, Fang, Liu, Gong, NDSS 2021, Algorithm 2) of the rows ``x`` against the
    server's own update ``reference`` (trained on its clean root data): each row's trust score
    is ``ReLU(cos(x_i, reference))``, each row is rescaled to ``reference``'s norm, and the
    aggregate is their trust-weighted mean. A non-finite or zero row scores 0; when every row
    scores 0 (or the reference is zero) the aggregate is zero: the model does not move."""
    out = torch.zeros(x.shape[1], dtype=x.dtype, device=x.device)
    ref = reference.to(x.dtype)
    r = torch.linalg.vector_norm(ref)
    ok = finite_rows(x)
    if not bool(ok.any()) or not bool(torch.isfinite(r)) or float(r) == 0.0:
        return out
    rows = x[ok]
    norms = torch.linalg.vector_norm(rows, dim=1)
    live = norms > 0
    cos = torch.where(live, (rows @ ref) / (norms.clamp_min(1e-30) * r), torch.zeros_like(norms))
    trust = torch.relu(cos)
    total = trust.sum()
    if float(total) <= 0.0:
        return out
    scale = trust * r / norms.clamp_min(1e-30)  # trust times the rescaling to ||reference||
    return (scale[:, None] * rows).sum(0) / total


class FLTrust(Aggregator):
    """FLTrust (Cao, Fang, Liu, Gong, "FLTrust: Byzantine-robust Federated Learning via Trust
    Bootstrapping", NDSS 2021): the server trains the global model on a small clean root set
    each round (``server.root_samples`` training samples, drawn once from the training data
    with the run's seed; the scenario's local training: ``local.steps`` or ``local.epochs``,
    batch, lr), and weighs each client's update by its cosine similarity to that update
    (negative: 0), rescaled to its norm (:func:`fltrust`). It takes the server's update as
    ``reference`` (``traits.reference``).

    Departures: the paper's root set is collected by the service provider (100 samples in its
    experiments); here it is a seeded sample of the training data (clean: poisoning happens
    on the Byzantine clients' copies), so it follows the training distribution as the paper's
    main experiments assume. The paper aggregates gradients and steps with the server's
    learning rate; here rows are model deltas after local training (the server's update is
    trained the same way) and the server optimizer steps on the aggregate."""

    traits = Traits(reference=True)

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None,
                 reference: torch.Tensor | None = None) -> torch.Tensor:
        if reference is None:
            raise ValueError("fltrust needs the server's root update (reference=)")
        return fltrust(x, reference)
