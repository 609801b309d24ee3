"""The maths the robust rules share: finite rows, partial sorts, the Gram matrix of the rows
centred on a data row and the pairwise distances from it, content-keyed ranking (a selection
that does not depend on the clients' order), Krum scores.

Pairwise geometry comes from one Gram matrix of the rows centred on the finite row of
smallest norm: one float32 ``(n, d) x (d, n)`` product (as ``torch.cdist`` computes
distances), then float64 on the small ``(n, n)`` side. Centring on a data row keeps the
cancellation error at the scale of the spread of the rows, not of their norms, and makes the
geometry translation invariant. A row with a NaN or infinite entry (or a float32 norm that
overflows) is at infinite distance from every other row.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from strategies.protocols import check_weights

GRAM_BLOCK = 8192  # columns per block of the Gram product (measured: 1.5x faster than one block)


def finite_rows(x: torch.Tensor) -> torch.Tensor:
    """Boolean ``(n,)`` mask of the rows whose entries, and Euclidean norm, are finite (one
    pass: a NaN or infinite entry makes the norm NaN or infinite)."""
    return torch.isfinite(torch.linalg.vector_norm(x, dim=1))


def partition(x: torch.Tensor, kth: list[int]) -> torch.Tensor:
    """``x`` partially sorted along the rows: each position in ``kth`` holds the value a full
    sort would put there, with smaller values before it and larger after (NaN sorts last).
    NumPy's introselect, about twice as fast as ``torch.sort`` along dim 0."""
    return torch.from_numpy(np.partition(x.detach().cpu().numpy(), kth, axis=0)).to(x.device)


def coordinate_median(x: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median, the mean of the two middle values for even ``n`` (NaN sorts last)."""
    n = x.shape[0]
    if n % 2 == 1:
        return partition(x, [n // 2])[n // 2].clone()
    s = partition(x, [n // 2 - 1, n // 2])
    return (s[n // 2 - 1] + s[n // 2]) / 2


def group_means(x: torch.Tensor, index: torch.Tensor, m: int) -> torch.Tensor:
    """``(m, d)``: row ``g`` is the mean of the rows of ``x`` whose ``index`` is ``g`` (every
    group holds at least one row)."""
    index = index.to(x.device)
    sums = torch.zeros((m, x.shape[1]), dtype=x.dtype, device=x.device).index_add_(0, index, x)
    return sums / torch.bincount(index, minlength=m).to(x.dtype)[:, None]


def mean_of_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Mean of the rows ``idx``: a weighted ``(n,) @ (n, d)`` product (no gathered copy) when
    every row is finite, a gather otherwise (0 * inf would poison the product)."""
    if bool(finite_rows(x).all()):
        w = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
        w[idx.to(x.device)] = 1.0 / len(idx)
        return w @ x
    return x[idx].mean(dim=0)


def gram(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, ok)``: the Gram matrix (float64) of the rows centred on the finite row of smallest
    norm, non-finite rows replaced by zero, and the finite-row mask, both on the CPU (the
    ``(n, d)`` product runs on the rows' device; the small ``(n, n)`` side is the host's)."""
    norms = torch.linalg.vector_norm(x, dim=1)
    ok = torch.isfinite(norms)
    if not bool(ok.any()):
        return torch.zeros((x.shape[0], x.shape[0]), dtype=torch.float64), ok.cpu()
    ref = int(torch.argmin(torch.where(ok, norms, torch.full((), math.inf, dtype=norms.dtype))))
    src = x if bool(ok.all()) else torch.where(ok[:, None], x, x[ref])  # bad rows -> 0 below
    g = torch.zeros((x.shape[0], x.shape[0]), dtype=x.dtype, device=x.device)
    for lo in range(0, x.shape[1], GRAM_BLOCK):  # centre block by block: stays in cache
        y = src[:, lo : lo + GRAM_BLOCK] - x[ref, lo : lo + GRAM_BLOCK]
        g.addmm_(y, y.T)
    g = g.double().cpu()
    return (g + g.T) / 2, ok.cpu()  # exactly symmetric: d(i, j) and d(j, i) are the same number


def squared_distances(x: torch.Tensor) -> torch.Tensor:
    """``(n, n)`` float64 squared Euclidean distances; ``inf`` to and from non-finite rows
    (0 on the diagonal)."""
    g, ok = gram(x)
    sq = torch.diagonal(g)
    d = (sq[:, None] + sq[None, :] - 2 * g).clamp_min(0)
    bad = ~ok
    d[bad, :] = math.inf
    d[:, bad] = math.inf
    d.fill_diagonal_(0.0)
    return d


def row_keys(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Content keys of the rows (their sum, then their first entry) for breaking exact ties."""
    s = torch.nan_to_num(x.sum(dim=1).double(), nan=0.0)
    return torch.nan_to_num(x[:, 0].double(), nan=0.0).cpu().numpy(), s.cpu().numpy()


def rank(scores: torch.Tensor, keys: tuple[np.ndarray, np.ndarray]) -> torch.Tensor:
    """Indices ordering ``scores`` ascending, exact ties broken by the rows' content
    (``row_keys``) rather than their position, so that a selection does not depend on the
    order of the clients."""
    return torch.from_numpy(np.lexsort((*keys, scores.double().cpu().numpy())))


def mean_around_median(x: torch.Tensor, k: int) -> torch.Tensor:
    """Per coordinate, the mean of the ``k`` values closest to the coordinate-wise median.

    Those values are a window of ``k`` consecutive values in sorted order: among the n - k + 1
    windows, the one whose farthest value from the median is nearest (one sort, one cumulative
    sum; ties go to the lower window)."""
    n = x.shape[0]
    s = torch.sort(x, dim=0).values
    med = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    lo, hi = s[: n - k + 1], s[k - 1 :]
    cost = torch.maximum(med - lo, hi - med)
    cost = torch.nan_to_num(cost, nan=math.inf)
    start = torch.argmin(cost, dim=0, keepdim=True)
    # non-finite values lie outside every window of finite cost: zero them so that the running
    # sums stay finite
    sf = torch.nan_to_num(s.double(), nan=0.0, posinf=0.0, neginf=0.0)
    c = torch.cat([torch.zeros_like(sf[:1]), sf.cumsum(dim=0)])
    window = torch.gather(c, 0, start + k) - torch.gather(c, 0, start)
    return (window[0] / k).to(x.dtype)


def krum_scores(d2: torch.Tensor, f: int) -> torch.Tensor:
    """Krum's score of each row: the sum of its squared distances to its ``n - f - 2`` nearest
    other rows (Blanchard et al. 2017)."""
    n = d2.shape[0]
    k = max(n - f - 2, 0)
    s = torch.sort(d2, dim=1).values[:, 1 : 1 + k]  # column 0 is the row itself
    return s.sum(dim=1)


# ---------------------------------------------------------------------------- weights
#
# A weighted rule (traits.weighted) takes one positive weight per row. Its maths here works on
# the weights scaled so that the largest is 1: equal weights become exactly 1.0, so the weighted
# arithmetic repeats the unweighted one (the same sums, the same divisions) and a weighted rule
# at equal weights gives the unweighted numbers.

# entries of the (n, block) work arrays of the coordinate-wise weighted rules (sorted values,
# their weights, cumulative sums): bounds their memory for large models
WEIGHTED_BLOCK_ENTRIES = 1 << 22


def weight_vector(weights: torch.Tensor, n: int, device: torch.device | None = None
                  ) -> torch.Tensor:
    """``weights`` checked (``strategies.protocols.check_weights``) and scaled so that the
    largest is 1, as a new float64 tensor on ``device`` (the input is never modified)."""
    check_weights(weights, n)
    w = weights.detach().to(device=device, dtype=torch.float64)
    return w / w.max()


def weighted_mean(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_i w_i x_i / sum_i w_i`` in the rows' dtype (``w`` from :func:`weight_vector`);
    with equal weights the same number as ``x.mean(dim=0)``."""
    r = w.to(x.dtype)
    return (x * r[:, None]).sum(dim=0) / r.sum()


def weighted_mean_of_rows(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The ``w``-weighted mean of the rows ``idx``, as :func:`mean_of_rows` computes the mean
    (the same number with equal weights)."""
    wi = w[idx]
    if bool(finite_rows(x).all()):
        v = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
        v[idx] = (wi / wi.sum()).to(x.dtype)
        return v @ x
    return weighted_mean(x[idx], wi)


def _column_blocks(x: torch.Tensor):
    """``(lo, hi)`` column ranges of at most ``WEIGHTED_BLOCK_ENTRIES`` entries of ``x``."""
    step = max(1, WEIGHTED_BLOCK_ENTRIES // max(x.shape[0], 1))
    for lo in range(0, x.shape[1], step):
        yield lo, min(lo + step, x.shape[1])


def _sorted_weights(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per column, the values sorted ascending (NaN last) and the weights of their rows."""
    s, idx = torch.sort(x, dim=0)
    return s, w[idx]


def weighted_coordinate_median(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per coordinate, the weighted median: the smallest value whose cumulative weight (values
    sorted ascending, NaN last) reaches half the total; where the cumulative weight equals half
    the total exactly (to float64 rounding, 1e-12 of the total), the mean of that value and
    the next. Equal weights give :func:`coordinate_median`, the even-n midpoint included;
    integer weights give the median of the rows repeated as often as their weight."""
    n = x.shape[0]
    total = float(w.sum())
    half, tol = total / 2, 1e-12 * total
    out = torch.empty(x.shape[1], dtype=x.dtype, device=x.device)
    for lo, hi in _column_blocks(x):
        s, ws = _sorted_weights(x[:, lo:hi], w)
        c = ws.cumsum(dim=0)
        k = (c < half - tol).sum(dim=0, keepdim=True).clamp_max(n - 1)
        tie = (c.gather(0, k) <= half + tol) & (k < n - 1)
        a = s.gather(0, k)
        b = s.gather(0, (k + 1).clamp_max(n - 1))
        out[lo:hi] = torch.where(tie, (a + b) / 2, a)[0]
    return out


def weighted_trimmed_mean(x: torch.Tensor, w: torch.Tensor, trim: float) -> torch.Tensor:
    """Per coordinate, the weighted mean of the values left when weight ``trim`` is removed
    from each end of the sorted values (NaN last), the value at each boundary cut
    fractionally: value j keeps ``max(0, min(C_j, W - trim) - max(C_j - w_j, trim))`` of its
    weight, with ``C_j`` the cumulative weight up to it and ``W`` the total; the kept weight
    is ``W - 2 trim``. Computed in float64."""
    total = float(w.sum())
    keep = total - 2 * trim
    out = torch.empty(x.shape[1], dtype=x.dtype, device=x.device)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    for lo, hi in _column_blocks(x):
        s, ws = _sorted_weights(x[:, lo:hi], w)
        c = ws.cumsum(dim=0)
        kept = (c.clamp_max(total - trim) - (c - ws).clamp_min(trim)).clamp_min(0)
        # a trimmed value (weight 0) may be infinite or NaN: it must not reach the sum
        out[lo:hi] = (torch.where(kept > 0, kept * s.double(), zero).sum(dim=0) / keep).to(x.dtype)
    return out


def weighted_krum_scores(d2: torch.Tensor, w: torch.Tensor, f: int) -> torch.Tensor:
    """The weighted Krum score of each row: the ``w``-weighted sum of its squared distances
    to its nearest other rows, taken nearest first until they cover the weight
    ``B_i = (n - f - 1) W / n - w_i`` (``W`` the total; the last row covered fractionally;
    0 when ``B_i <= 0``). At equal weights ``B_i`` is n - f - 2 rows: :func:`krum_scores`."""
    n = d2.shape[0]
    budget = (n - f - 1) * w.sum() / n - w
    d = d2.clone()
    d.fill_diagonal_(-1.0)  # the row itself sorts first, even among rows at distance 0
    s, idx = torch.sort(d, dim=1)
    s, ws = s[:, 1:], w[idx[:, 1:]]
    cover = torch.minimum((budget[:, None] - (ws.cumsum(dim=1) - ws)).clamp_min(0), ws)
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    return torch.where(cover > 0, cover * s, zero).sum(dim=1)
