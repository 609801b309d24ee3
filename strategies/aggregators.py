"""Aggregators: ``(n, d)`` matrix of client updates -> ``(d,)`` aggregate.

Each aggregator is a small class whose constructor arguments are exactly its keys in a
scenario file (``aggregator: {name: cwtm, f: 2}``). ``check(n)`` states the constraints that
depend on how many rows it will receive, with a message naming the parameter. Every rule is
called as ``rule(x, generator=...)``: one that draws from the generator declares
``traits = Traits(random=True)``, the others ignore it. A rule with a weighted definition
(``traits.weighted``: mean, CWMed, CWTM, geometric median, Krum, Multi-Krum) also takes
``weights``, one positive weight per row (an asynchronous server weighs its updates, Dahan &
Levy, "Weight for Robustness: A Comprehensive Approach towards Optimal Fault-Tolerant
Asynchronous ML", NeurIPS 2024); ``weights=None`` runs the unweighted code unchanged. A
stateful rule (centered clipping) keeps its state in attributes
exposed by ``state_dict()`` / ``load_state_dict()``, as torch.optim does. The contract is
``strategies.protocols.Aggregator``; the shared maths is in ``strategies.geometry``.

Conventions shared by every rule here:

* the input matrix is never modified in place;
* pairwise geometry (Krum, Bulyan, MDA, NNM, CAF, SMEA, geometric median) comes from one Gram
  matrix of the rows centred on the finite row of smallest norm: one float32 ``(n, d) x (d, n)``
  product (as ``torch.cdist`` computes distances), then float64 on the small ``(n, n)`` side.
  Centring on a data row keeps the cancellation error at the scale of the spread of the rows,
  not of their norms, and makes the geometry translation invariant;
* a row with a NaN or infinite entry (or a float32 norm that overflows) is at infinite distance
  from every other row, so distance-based rules never select it while at most ``f`` rows are
  non-finite; coordinate-wise rules sort NaN above every number and trim it like a huge value.
"""

from __future__ import annotations

import itertools
import math
from typing import Annotated, Literal

import torch
from annotated_types import Ge, Gt
from pydantic import AllowInfNan

from strategies.geometry import (
    coordinate_median,
    finite_rows,
    gram,
    krum_scores,
    mean_around_median,
    mean_of_rows,
    partition,
    rank,
    row_keys,
    squared_distances,
    weight_vector,
    weighted_coordinate_median,
    weighted_krum_scores,
    weighted_mean,
    weighted_mean_of_rows,
    weighted_trimmed_mean,
)
from strategies.protocols import Aggregator, Traits, require_generator


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _check_half(f: int, n: int) -> None:
    _require(2 * f < n, f"f: must be < n/2 = {n / 2:g}, got {f}")


def _subsets(n: int, k: int, chunk: int = 16384):
    """All ``k``-subsets of ``range(n)`` in lexicographic order, as ``(c, k)`` int64 chunks."""
    it = itertools.combinations(range(n), k)
    while True:
        block = list(itertools.islice(it, chunk))
        if not block:
            return
        yield torch.tensor(block, dtype=torch.int64)


def _check_subsets(f: int, n: int, limit: int, rule: str) -> None:
    _check_half(f, n)
    c = math.comb(n, f)
    _require(c <= limit, f"f: {rule} enumerates C(n, f) = C({n}, {f}) = {c} subsets, more than "
             f"max_subsets = {limit}; lower f or the clients per round, or raise max_subsets")


# ---------------------------------------------------------------------------- averaging


class Mean(Aggregator):
    """Arithmetic mean of the rows: FedAvg's aggregation (McMahan et al., AISTATS 2017).

    Not robust: a single unbounded Byzantine row moves it arbitrarily far.

    Weighted (Dahan & Levy, NeurIPS 2024): ``sum_i w_i x_i / sum_i w_i``; row i moves it by
    at most ``w_i / W`` times its norm.
    """

    traits = Traits(averaging=True, weighted=True)

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
        if weights is None:
            return x.mean(dim=0)
        return weighted_mean(x, weight_vector(weights, x.shape[0], x.device))

    def check(self, n: int) -> None:
        return None


class CoordinateWiseMedian(Aggregator):
    """Coordinate-wise median (Yin, Chen, Ramchandran, Bartlett, ICML 2018).

    For an even number of rows the mean of the two middle values is returned (the usual
    statistical median, as NumPy computes it), not torch's lower median.

    Weighted (w-CWMed, Dahan & Levy, NeurIPS 2024): per coordinate, the smallest value whose
    cumulative weight (values in ascending order) reaches half the total ``W``; where it
    equals ``W / 2`` exactly, the mean of that value and the next. Equal weights give the
    median above (the even-n midpoint included), integer weights the median of the rows
    repeated as often as their weight. The authors' code takes the first value whose
    normalised cumulative weight exceeds 1/2, with no midpoint: it differs only at such
    exact halves.
    """

    traits = Traits(weighted=True)

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
        if weights is None:
            return coordinate_median(x)
        return weighted_coordinate_median(x, weight_vector(weights, x.shape[0], x.device))

    def check(self, n: int) -> None:
        return None


class CoordinateWiseTrimmedMean(Aggregator):
    """Coordinate-wise trimmed mean (Yin et al., ICML 2018): in each coordinate drop the f
    largest and the f smallest values and average the remaining n - 2f.

    Weighted (in the spirit of Dahan & Levy, NeurIPS 2024, whose paper weighs CWMed and the
    geometric median; this extension is ours): per coordinate, remove the weight
    ``f W / n`` from each end of the sorted values (``W`` the total weight; the value at
    each boundary loses part of its weight) and take the weighted mean of the weight
    ``(n - 2f) W / n`` that is left. Equal weights give the rule above; integer weights the
    rule on the rows repeated as often as their weight, with ``f' = f W / n`` when that is an
    integer.
    """

    traits = Traits(weighted=True)

    def __init__(self, f: Annotated[int, Ge(0)] = 0) -> None:
        self.f = f

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
        n = x.shape[0]
        self.check(n)
        if weights is not None:
            w = weight_vector(weights, n, x.device)
            if self.f == 0:
                return weighted_mean(x, w)
            return weighted_trimmed_mean(x, w, self.f * float(w.sum()) / n)
        if self.f == 0:
            return x.mean(dim=0)
        if bool(finite_rows(x).all()):
            # sum minus the f largest and the f smallest, in float64 so that huge trimmed
            # values cannot cancel the precision of the kept ones (faster than a sort)
            hi = torch.topk(x, self.f, dim=0).values.sum(dim=0, dtype=torch.float64)
            lo = torch.topk(x, self.f, dim=0, largest=False).values.sum(dim=0, dtype=torch.float64)
            return ((x.sum(dim=0, dtype=torch.float64) - hi - lo) / (n - 2 * self.f)).to(x.dtype)
        s = partition(x, [self.f - 1, n - self.f])  # rows f..n-f-1 are the middle values
        return s[self.f : n - self.f].mean(dim=0)

    def check(self, n: int) -> None:
        _check_half(self.f, n)


class MeaMed(Aggregator):
    """Mean around the median (Xie, Koyejo, Gupta, "Generalized Byzantine-tolerant SGD", 2018):
    per coordinate, the mean of the n - f values closest to the coordinate-wise median."""

    def __init__(self, f: Annotated[int, Ge(0)] = 0) -> None:
        self.f = f

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        self.check(x.shape[0])
        return mean_around_median(x, x.shape[0] - self.f)

    def check(self, n: int) -> None:
        _check_half(self.f, n)


# ---------------------------------------------------------------------------- geometric


class GeometricMedian(Aggregator):
    """Geometric median by the smoothed Weiszfeld algorithm of RFA (Pillutla, Kakade,
    Harchaoui, "Robust Aggregation for Federated Learning", IEEE TSP 2022, Algorithm 2).

    ``z <- sum_i w_i x_i / sum_i w_i`` with ``w_i = 1 / max(nu, ||x_i - z||)``, at most
    ``iterations`` times, stopping when ``||z_new - z|| <= tol * ||z||``. ``init`` is the
    starting point: the mean (default, as RFA's code), the coordinate-wise median, or zero
    (ByzFL's choice). Non-finite rows get weight 0.

    Every iterate after the first is a weighted average of the rows, so the iterations run on
    the ``n x n`` Gram matrix (distances ``||x_i - z||^2 = G_ii - 2 (G a)_i + a'Ga`` for
    ``z = X'a``) and the ``(n, d)`` matrix is read once more at the end.

    Weighted (w-GM, Dahan & Levy, NeurIPS 2024, as their code's weighted RFA): the
    minimiser of ``sum_i s_i ||z - x_i||`` for row weights ``s_i``, by the same iteration
    with ``w_i = s_i / max(nu, ||x_i - z||)``; the ``mean`` start is the ``s``-weighted mean,
    the ``median`` start the weighted coordinate-wise median. Equal weights give the same
    iterates as the unweighted rule; integer weights those of the rows repeated as often as
    their weight (to float rounding).
    """

    traits = Traits(weighted=True)

    def __init__(
        self,
        nu: Annotated[float, Gt(0)] = 1e-6,
        iterations: Annotated[int, Ge(1)] = 100,
        tol: Annotated[float, Ge(0)] = 1e-6,
        init: Literal["mean", "median", "zero"] = "mean",
    ) -> None:
        self.nu, self.iterations, self.tol, self.init = nu, iterations, tol, init

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
        ok = finite_rows(x)
        every = bool(ok.all())
        xs = x if every else x[ok]
        # s: the rows' weights, None for the unweighted rule (whose arithmetic is unchanged)
        s = None
        if weights is not None:
            s = weight_vector(weights, x.shape[0], torch.device("cpu"))  # the (n, n) side
            s = s if every else s[ok]
        m = xs.shape[0]
        if m == 0:
            return torch.full_like(x[0], math.nan)
        g, _ = gram(xs)
        # ||z|| for the stopping rule: z = c + Y'a with c the centring row, so
        # ||z||^2 = ||c||^2 + 2 a'(Y c) + a'Ga
        c_idx = int(torch.argmin(torch.linalg.vector_norm(xs, dim=1)))
        c = xs[c_idx]
        yc = (xs @ c).double().cpu() - float(c.double() @ c.double())
        cc = float(c.double() @ c.double())
        left = self.iterations
        if self.init == "mean":
            a = torch.full((m,), 1.0 / m, dtype=torch.float64) if s is None else s / s.sum()
        else:
            z0 = torch.zeros_like(xs[0]) if self.init == "zero" else \
                coordinate_median(xs) if s is None else \
                weighted_coordinate_median(xs, s.to(xs.device))
            a = self._weights(torch.linalg.vector_norm(xs - z0, dim=1).double().cpu(), s)
            left -= 1
        diag = torch.diagonal(g)
        for _ in range(left):
            ga = g @ a
            dist = (diag - 2 * ga + a @ ga).clamp_min(0).sqrt()
            new = self._weights(dist, s)
            delta = new - a
            step = float((delta @ g @ delta).clamp_min(0).sqrt())
            a = new
            if self.tol > 0:
                norm_z = math.sqrt(max(cc + 2 * float(a @ yc) + float(a @ g @ a), 0.0))
                if step <= self.tol * norm_z:
                    break
        return (a.to(device=xs.device, dtype=xs.dtype) @ xs).to(x.dtype)

    def _weights(self, dist: torch.Tensor, s: torch.Tensor | None = None) -> torch.Tensor:
        """Weiszfeld's coefficients of the rows at ``dist`` (summing to 1), for the row
        weights ``s`` (None: all 1)."""
        w = 1.0 / dist.clamp_min(self.nu) if s is None else s / dist.clamp_min(self.nu)
        return w / w.sum()

    def check(self, n: int) -> None:
        return None


class MultiKrum(Aggregator):
    """Multi-Krum (Blanchard, El Mhamdi, Guerraoui, Stainer, NeurIPS 2017): score each row by
    the sum of squared distances to its n - f - 2 nearest other rows, average the ``m`` rows of
    lowest score (``m`` defaults to n - f). Requires n > 2f + 2.

    ByzFL scores with the *mean* over n - f - 1 neighbours instead; we follow the paper.

    Weighted (ours: Dahan & Levy, NeurIPS 2024, define weighted robust aggregation and weigh
    CWMed, the geometric median and CTMA, not Krum): with row weights ``w`` of total ``W``,
    the score of row i is the ``w``-weighted sum of its squared distances to its nearest
    other rows, nearest first, until they cover the weight ``(n - f - 1) W / n - w_i`` (the
    last one fractionally; score 0 when that is <= 0): the weight of n - f - 1 average rows
    less its own, as the unweighted rule counts n - f - 2 others besides itself. The output
    is the ``w``-weighted mean of the ``m`` rows of lowest score (``m`` counts rows, so Krum
    stays Multi-Krum with m = 1). Equal weights give the rule above. With integer weights,
    Krum's choice is the unweighted Krum's on the rows repeated as often as their weight with
    ``f' = (f + 1) W / n - 1`` (when an integer); Multi-Krum's average of ``m`` rows has no
    such reading (it would count copies). Non-finite rows rank after every finite row.
    """

    traits = Traits(weighted=True)

    def __init__(self, f: Annotated[int, Ge(0)] = 0, m: Annotated[int, Ge(1)] | None = None) -> None:
        self.f, self.m = f, m

    def _m(self, n: int) -> int:
        return n - self.f if self.m is None else self.m

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
        n = x.shape[0]
        self.check(n)
        if weights is not None:
            w = weight_vector(weights, n, torch.device("cpu"))  # the (n, n) side
            scores = weighted_krum_scores(squared_distances(x), w, self.f)
            # non-finite rows rank after every finite row, even one of infinite score (a
            # non-finite row whose own weight covers its budget would otherwise score 0)
            scores = torch.where(finite_rows(x).cpu(), scores,
                                 torch.full((), math.nan, dtype=scores.dtype))
            best = rank(scores, row_keys(x))[: self._m(n)]
            return weighted_mean_of_rows(x, best.to(x.device), w.to(x.device))
        scores = krum_scores(squared_distances(x), self.f)
        best = rank(scores, row_keys(x))[: self._m(n)]
        return mean_of_rows(x, best)

    def check(self, n: int) -> None:
        _require(n > 2 * self.f + 2, f"f: Krum needs n > 2f + 2; n = {n} allows f <= "
                 f"{max((n - 3) // 2, 0)}, got {self.f}")
        _require(self._m(n) <= n, f"m: must be <= n = {n}, got {self.m}")


class Krum(MultiKrum):
    """Krum (Blanchard et al., NeurIPS 2017): the single row of lowest Krum score
    (Multi-Krum with m = 1).

    Weighted: the row of lowest weighted Krum score (see :class:`MultiKrum`; ours, not Dahan
    & Levy's, who define no weighted Krum). Equal weights give Krum; integer weights give
    Krum on the rows repeated as often as their weight, with ``f' = (f + 1) W / n - 1``.
    """

    def __init__(self, f: Annotated[int, Ge(0)] = 0) -> None:
        super().__init__(f, m=1)


class Bulyan(Aggregator):
    """Bulyan (El Mhamdi, Guerraoui, Rouault, "The Hidden Vulnerability of Distributed Learning
    in Byzantium", ICML 2018) over Krum: select theta = n - 2f rows by repeatedly taking the
    Krum winner of the remaining rows, then per coordinate average the beta = theta - 2f
    selected values closest to the selection's median. Requires n >= 4f + 3."""

    def __init__(self, f: Annotated[int, Ge(0)] = 0) -> None:
        self.f = f

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        n, f = x.shape[0], self.f
        self.check(n)
        d2 = squared_distances(x)
        k0, k1 = row_keys(x)
        alive = torch.ones(n, dtype=torch.bool)
        chosen = []
        for _ in range(n - 2 * f):
            idx = torch.nonzero(alive).squeeze(1)
            scores = krum_scores(d2[idx][:, idx], f)
            win = int(idx[int(rank(scores, (k0[idx.numpy()], k1[idx.numpy()]))[0])])
            chosen.append(win)
            alive[win] = False
        sel = x[torch.tensor(sorted(chosen))]
        return mean_around_median(sel, n - 4 * f)

    def check(self, n: int) -> None:
        _require(n >= 4 * self.f + 3, f"f: Bulyan needs n >= 4f + 3; n = {n} allows f <= "
                 f"{max((n - 3) // 4, 0)}, got {self.f}")


class MinimumDiameterAveraging(Aggregator):
    """Minimum diameter averaging (El Mhamdi, Guerraoui, Guirguis, Hoang, Rouault, "Genuinely
    Distributed Byzantine Machine Learning", PODC 2020): the mean of the subset of n - f rows
    whose largest pairwise distance is smallest.

    Exact, by enumerating all C(n, f) subsets (vectorised in chunks); ``max_subsets`` bounds the
    work and ``check`` rejects larger problems before a run starts.
    """

    def __init__(self, f: Annotated[int, Ge(0)] = 0,
                 max_subsets: Annotated[int, Ge(1)] = 2_000_000) -> None:
        self.f, self.max_subsets = f, max_subsets

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        n = x.shape[0]
        self.check(n)
        d2 = squared_distances(x)
        best, best_val = None, math.inf
        for s in _subsets(n, n - self.f):
            diam = d2[s[:, :, None], s[:, None, :]].amax(dim=(1, 2))
            i = int(torch.argmin(diam))
            if float(diam[i]) < best_val or best is None:
                best, best_val = s[i], float(diam[i])
        assert best is not None  # n >= 1 rows: some subset was scored
        return mean_of_rows(x, best)

    def check(self, n: int) -> None:
        _check_subsets(self.f, n, self.max_subsets, "MDA")


class MoNNA(Aggregator):
    """MoNNA (Farhadkhani, Guerraoui, Gupta, Hoang, Pinot, Stephan, "Robust Collaborative
    Learning with Linear Gradient Overhead", ICML 2023): the mean of the n - f rows nearest to a
    trusted reference row, row ``reference`` of the matrix (the peer's own vector in D-SGD).

    Invariant only under permutations that keep the reference row in place.
    """

    def __init__(self, f: Annotated[int, Ge(0)] = 0, reference: Annotated[int, Ge(0)] = 0) -> None:
        self.f, self.reference = f, reference

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        n = x.shape[0]
        self.check(n)
        diff = x - x[self.reference]
        d2 = torch.linalg.vector_norm(diff, dim=1)
        d2 = torch.where(finite_rows(x), d2, torch.full((), math.inf, dtype=d2.dtype))
        keep = rank(d2, row_keys(x))[: n - self.f]
        return mean_of_rows(x, keep)

    def check(self, n: int) -> None:
        _check_half(self.f, n)
        _require(self.reference < n, f"reference: must be < n = {n}, got {self.reference}")


# ---------------------------------------------------------------------------- spectral


def _centred_gram(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Gram matrix of the rows centred on their ``w``-weighted mean (``w`` sums to 1)."""
    gw = g @ w
    return g - gw[:, None] - gw[None, :] + (w @ gw)


class CovarianceAgnosticFilter(Aggregator):
    """Covariance-bound agnostic filter, CAF (Allouah, Guerraoui, Stephan, "Towards Trustworthy
    Federated Learning with Untrusted Participants", ICML 2025).

    Weights ``c = 1``; while ``sum c > n - 2f``: weighted mean ``mu_c``, top eigenpair
    ``(lambda, v)`` of the weighted covariance, ``tau_i = ((x_i - mu_c) . v)^2``,
    ``c_i <- c_i (1 - tau_i / max_j tau_j)``, the max over the points still weighted (as the
    classical filter does, so every pass zeroes at least one weight and at most n passes run;
    ByzFL's max also counts zeroed points); return the ``mu_c`` of smallest ``lambda`` seen.

    The eigenpair is exact, from the ``n x n`` weighted Gram matrix (the d x d covariance shares
    its nonzero spectrum), where ByzFL runs one power iteration from a random vector.
    """

    def __init__(self, f: Annotated[int, Ge(0)] = 0) -> None:
        self.f = f

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        n = x.shape[0]
        self.check(n)
        g, ok = gram(x)
        c = ok.double()  # non-finite rows start with weight 0
        best_lam, best_w = math.inf, None
        while float(c.sum()) > n - 2 * self.f:
            w = c / c.sum()
            gc = _centred_gram(g, w)
            sw = w.sqrt()
            lam, u = torch.linalg.eigh(sw[:, None] * gc * sw[None, :])
            lam_max, u_max = float(lam[-1]), u[:, -1]
            if lam_max < best_lam:
                best_lam, best_w = lam_max, w
            if lam_max <= 0:
                break
            proj = gc @ (sw * u_max) / math.sqrt(lam_max)  # (x_i - mu_c) . v
            tau = torch.where(c > 0, proj**2, torch.zeros((), dtype=torch.float64))
            c = c * (1 - tau / tau.max())
        if best_w is None:  # 2f = 0 and nothing to filter: the mean of the finite rows
            best_w = c / c.sum()
        w, ok = best_w.to(device=x.device, dtype=x.dtype), ok.to(x.device)
        return (w[ok][:, None] * x[ok]).sum(dim=0)

    def check(self, n: int) -> None:
        _check_half(self.f, n)


class SmallestMaxEigenvalueAveraging(Aggregator):
    """Smallest maximum eigenvalue averaging, SMEA (Allouah, Guerraoui, Gupta, Pinot, Stephan,
    "On the Privacy-Robustness-Utility Trilemma in Distributed Learning", ICML 2023): the mean
    of the subset of n - f rows whose empirical covariance has the smallest top eigenvalue.

    Exact: all C(n, f) subsets, each eigenvalue from its ``(n - f) x (n - f)`` centred Gram
    matrix (batched ``eigvalsh``); ``max_subsets`` bounds the work.
    """

    def __init__(self, f: Annotated[int, Ge(0)] = 0,
                 max_subsets: Annotated[int, Ge(1)] = 200_000) -> None:
        self.f, self.max_subsets = f, max_subsets

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        n = x.shape[0]
        self.check(n)
        g, ok = gram(x)
        k = n - self.f
        h = torch.eye(k, dtype=torch.float64) - 1.0 / k
        best, best_val = None, math.inf
        for s in _subsets(n, k, chunk=4096):
            gs = h @ g[s[:, :, None], s[:, None, :]] @ h
            lam = torch.linalg.eigvalsh(gs)[:, -1] / k
            lam = torch.where(ok[s].all(dim=1), lam, torch.full((), math.inf, dtype=torch.float64))
            i = int(torch.argmin(lam))
            if float(lam[i]) < best_val or best is None:
                best, best_val = s[i], float(lam[i])
        assert best is not None  # n >= 1 rows: some subset was scored
        return mean_of_rows(x, best)

    def check(self, n: int) -> None:
        _check_subsets(self.f, n, self.max_subsets, "SMEA")


class DivideAndConquer(Aggregator):
    """Divide-and-conquer, DnC (Shejwalkar & Houmansadr, "Manipulating the Byzantine: Optimizing
    Model Poisoning Attacks and Defenses for Federated Learning", NDSS 2021, Algorithm 3).

    ``iterations`` times: sample ``subsample_dim`` coordinates without replacement, centre the
    rows' sub-vectors, take the top right singular vector ``v``, score ``s_i = ((x_i - mu) . v)^2``
    and keep the n - ``filter_frac`` * f rows of lowest score; return the mean of the rows kept in
    every iteration. Defaults are the paper's (``filter_frac = 1``, b = 10,000 sampled
    coordinates, 5 iterations was the authors' setting for large models).
    """

    traits = Traits(random=True)

    def __init__(
        self,
        f: Annotated[int, Ge(0)] = 0,
        iterations: Annotated[int, Ge(1)] = 5,
        subsample_dim: Annotated[int, Ge(1)] = 10_000,
        filter_frac: Annotated[float, Ge(0)] = 1.0,
    ) -> None:
        self.f, self.iterations = f, iterations
        self.subsample_dim, self.filter_frac = subsample_dim, filter_frac

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        generator = require_generator(generator, self)
        n, d = x.shape
        self.check(n)
        ok = finite_rows(x)
        keep_n = n - int(self.filter_frac * self.f)
        good = ok.clone()
        xs = torch.where(ok[:, None], x, torch.zeros((), dtype=x.dtype)).double()
        for _ in range(self.iterations):
            cols = torch.randperm(d, generator=generator)[: min(self.subsample_dim, d)]
            sub = xs[:, cols]
            mu = sub[ok].mean(dim=0)
            c = torch.where(ok[:, None], sub - mu, torch.zeros((), dtype=torch.float64))
            _, _, vh = torch.linalg.svd(c, full_matrices=False)
            score = (c @ vh[0]) ** 2
            score = torch.where(ok, score, torch.full((), math.inf, dtype=torch.float64))
            kept = torch.zeros(n, dtype=torch.bool, device=x.device)
            kept[torch.sort(score, stable=True).indices[:keep_n]] = True
            good &= kept
        if not bool(good.any()):
            good = ok
        return mean_of_rows(x, torch.nonzero(good).squeeze(1))

    def check(self, n: int) -> None:
        _require(int(self.filter_frac * self.f) < n, f"f: filter_frac * f must be < n = {n}, "
                 f"got {self.filter_frac:g} * {self.f}")


# ---------------------------------------------------------------------------- voting


def majority_vote(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Per coordinate, the sign the rows vote for: ``sign(sum_i w_i sign(x_i))`` (``w_i = 1``
    without ``weights``), 0 on a tie; a NaN entry abstains (votes 0), ``+-inf`` votes
    ``+-1``. On rows of signs (``+-1``) this is ``sign(sum_i w_i x_i)``.

    >>> majority_vote(torch.tensor([[1.0, -1.0, 1.0, -1.0],
    ...                             [1.0, -1.0, -1.0, 1.0],
    ...                             [-1.0, -1.0, 1.0, 0.0]]))
    tensor([ 1., -1.,  1.,  0.])
    """
    votes = torch.nan_to_num(torch.sign(x), nan=0.0)
    if weights is None:
        total = votes.sum(dim=0)
    else:
        total = weight_vector(weights, x.shape[0], x.device) @ votes.to(torch.float64)
    return torch.sign(total).to(x.dtype)


class MajorityVote(Aggregator):
    """signSGD with majority vote (Bernstein, Zhao, Azizzadenesheli, Anandkumar, "signSGD
    with majority vote is communication efficient and fault tolerant", ICLR 2019): each row
    votes the sign of each of its coordinates, the aggregate is the sign of the vote
    (:func:`majority_vote`; a tie gives 0). Paired with the ``sign`` codec with
    ``scale: false`` the rows are the clients' signs, as in the paper; on other rows it
    votes their signs (one client, one vote: a Byzantine row's magnitude buys it nothing,
    which is where the paper's fault tolerance comes from). The aggregate is a sign vector,
    not an estimate of the rows' mean: the server's learning rate sets the step.

    Weighted: ``sign(sum_i w_i sign(x_i))``, each client's vote counted ``w_i`` times.

    Not translation equivariant and not near the rows' mean (it returns signs), so the
    conformance checks that assume an estimate of the mean do not apply.
    """

    traits = Traits(weighted=True)

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
        return majority_vote(x, weights)

    def check(self, n: int) -> None:
        return None


# ---------------------------------------------------------------------------- stateful


class CenteredClipping(Aggregator):
    """Centered clipping (Karimireddy, He, Jaggi, "Learning from History for Byzantine Robust
    Optimization", ICML 2021): from the previous aggregate ``v`` (zero at the start),
    ``iterations`` times ``v <- v + (1/n) sum_i clip_tau(x_i - v)``.

    The centre is the rule's state (``state_dict()``). A non-finite row contributes nothing
    (its clipped difference has no direction); it still counts in the 1/n. ``tau: .inf``
    clips nothing (each iteration moves the centre to the mean).
    """

    def __init__(self, tau: Annotated[float, Gt(0), AllowInfNan(True)] = 1.0,
                 iterations: Annotated[int, Ge(1)] = 1) -> None:
        self.tau, self.iterations = tau, iterations
        self.centre: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        ok = finite_rows(x)
        v = torch.zeros_like(x[0]) if self.centre is None else \
            self.centre.to(device=x.device, dtype=x.dtype)
        xs = x if bool(ok.all()) else torch.where(ok[:, None], x, torch.zeros((), dtype=x.dtype))
        for _ in range(self.iterations):
            diff = xs - v
            norm = torch.linalg.vector_norm(diff, dim=1)
            scale = torch.clamp(self.tau / norm.clamp_min(torch.finfo(x.dtype).tiny), max=1.0)
            scale = torch.where(ok, scale, torch.zeros((), dtype=x.dtype))
            v = v + (scale @ diff) / x.shape[0]
        self.centre = v.clone()
        return v

    def check(self, n: int) -> None:
        return None

    def state_dict(self) -> dict[str, torch.Tensor | None]:
        return {"centre": None if self.centre is None else self.centre.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor | None]) -> None:
        c = state["centre"]
        self.centre = None if c is None else c.clone()

