"""Codecs: the stages of the message path between a client's message and the robust pipeline
(``codecs:`` in a scenario; the contract is :class:`strategies.protocols.Codec`).

* ``float16`` (:class:`Float16`, functional twin :func:`to_float16`): half-precision
  transport, as pfl-research's precision-reduction postprocessor and FederatedScope's
  quantization to 16 bits ship it. Each entry is rounded to the nearest float16 (round half to
  even), so a finite entry ``v`` with ``|v| <= 65504`` comes back with a relative error of at
  most ``2^-11`` (about 4.9e-4) in the normal range (``|v| >= 2^-14``) and an absolute error
  of at most ``2^-25`` below it; an entry beyond 65504 becomes ``inf`` (the row is then
  non-finite, as the robust rules see it). The payload costs 2 bytes an entry, half the
  identity's 4.
* ``top_k`` (:class:`TopK`, functional twins :func:`top_k` and :func:`scatter_rows`): each
  message's ``k`` entries of largest magnitude (ties to the lower index), sent as int32
  indices and float32 values: ``8 k`` bytes a message (Stich, Cordonnier, Jaggi, "Sparsified
  SGD with memory", NeurIPS 2018; Aji and Heafield, EMNLP 2017), optionally with error
  feedback (:class:`Compressor`).
* ``rand_k`` (:class:`RandK`, functional twin :func:`rand_k`): ``k`` entries a message
  (the keys of ``top_k``) chosen uniformly without replacement from the client's generator,
  scaled by ``w / k`` so the decoded row is unbiased; ``8 k`` bytes a message (Stich et al.,
  NeurIPS 2018; Wangni, Wang, Liu, Zhang, NeurIPS 2018).
* ``qsgd`` (:class:`QSGD`, functional twins :func:`qsgd` and :func:`qsgd_decode`): the
  message's L2 norm and one signed level in ``{-s, ..., s}`` an entry, stochastically
  rounded (unbiased, variance at most ``min(w / s^2, sqrt(w) / s) ||x||^2``); ``w + 4`` bytes
  (int8 levels, ``s <= 127``) or ``2 w + 4`` (int16) (Alistarh, Grubic, Li, Tomioka,
  Vojnovic, NeurIPS 2017).
* ``sign`` (:class:`SignCompressor`, functional twins :func:`pack_signs` and
  :func:`unpack_signs`): one bit an entry, its sign (0 counts as +1), packed 8 to a byte,
  and with ``scale`` the mean magnitude ``||x||_1 / w``: ``ceil(w / 8)`` bytes, ``+ 4``
  with the scale (signSGD, Bernstein et al., ICML 2018; scaled as EF-SignSGD, Karimireddy
  et al., ICML 2019). Unscaled signs pair with the ``majority_vote`` aggregator.
* ``quantize`` (:class:`Quantize`, functional twins :func:`quantize_int8`,
  :func:`round_float` and :func:`stochastic_round`): int8 on a per-message scale
  (``w + 4`` bytes) or float16 / bfloat16 (``2 w``), stochastically rounded (unbiased,
  Gupta et al., ICML 2015) or to the nearest value; FedPAQ's quantised updates (Reisizadeh
  et al., AISTATS 2020).
* ``powersgd`` (:class:`PowerSGD`, functional twins :func:`power_step` and
  :func:`low_rank`): each parameter matrix as rank-``r`` factors from one warm-started power
  iteration, the rest dense: ``4 (sum_j (a_j + b_j) r + dense)`` bytes (Vogels, Karimireddy,
  Jaggi, NeurIPS 2019); it always keeps per-client state (its warm start).

Every compressor (:class:`Compressor`: ``top_k`` and the five above) takes
``error_feedback: true`` (EF-SGD), draws only from its clients' generators and works on the
whole ``(k, w)`` batch at once (a loop over rows only for the draws).

* :class:`ClientLevelDP`: client-level differential privacy (DP-FedAvg, McMahan, Ramage,
  Talwar, Zhang, ICLR 2018) as a codec: its server half clips every row before the pipeline
  and adds the Gaussian noise to the aggregate. Built from the scenario's ``privacy`` block
  (a :class:`strategies.protocols.Privacy` plugin with ``privacy_level: client``), not
  registered under a name of its own.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import torch
from annotated_types import Ge, Gt, Le
from torch import nn

from strategies.protocols import (
    ROWS,
    Codec,
    CodecBatch,
    MessageShape,
    Parts,
    PartSpec,
    Privacy,
    payload_bytes,
)

__all__ = ["QSGD", "ClientLevelDP", "Compressor", "Float16", "PowerSGD", "Quantize", "RandK",
           "SignCompressor", "Sparsifier", "TopK", "chain_bytes", "chain_layout",
           "decode_chain", "encode_chain", "finish", "low_rank", "message_shape", "pack_signs",
           "power_step", "qsgd", "qsgd_decode", "quantize_int8", "rand_k", "reach_chain", "round_float",
           "scatter_rows", "screen", "stochastic_round", "to_float16", "top_k", "unpack_signs"]

RESIDUAL = "residual"  # an error-feedback codec's per-client state
ESTIMATE = "estimate"  # EF21's per-client estimate (on the client and on the server)


def to_float16(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` rounded to float16 (nearest, ties to even; beyond 65504: inf)."""
    return rows.to(torch.float16)


class Float16(Codec):
    """Half-precision transport (see the module docstring for its error bound): every
    float32 part of the payload travels as float16 (the dense rows; top-k's values, its
    indices untouched), the server reads it back into float32 exactly (every float16 is a
    float32), so the only loss is the rounding of :func:`to_float16`.

    Example: ``1 + 2^-12`` rounds to ``1`` (the tie goes to even), ``65520`` to ``inf``.

    >>> from strategies.protocols import ROWS, CodecBatch, MessageShape
    >>> Float16().encode({ROWS: torch.tensor([[1 + 2**-12, 0.1, 65520.0]])},
    ...                  CodecBatch(0, [], MessageShape(3)))[ROWS].float().tolist()
    [[1.0, 0.0999755859375, inf]]
    """

    def encode(self, parts: Parts, batch: CodecBatch) -> Parts:
        return {k: to_float16(v) if v.dtype == torch.float32 else v for k, v in parts.items()}

    def decode(self, parts: Parts, shape: MessageShape) -> Parts:
        return {k: v.to(torch.float32) if v.dtype == torch.float16 else v
                for k, v in parts.items()}

    def layout(self, inner: dict[str, PartSpec], shape: MessageShape) -> dict[str, PartSpec]:
        """Each float32 part at 2 bytes an entry."""
        return {k: PartSpec(p.entries, "float16") if p.dtype == "float32" else p
                for k, p in inner.items()}


class Compressor(Codec):
    """A codec that compresses the dense rows (:meth:`compress` on the client,
    :meth:`decompress` on the server), optionally with **error feedback**
    (``error_feedback: true``): each client keeps the residual ``e`` of what compression
    dropped and adds it to its next message, ``p = u + e``, sends ``C(p)`` and keeps
    ``e' = p - D(C(p))`` (EF-SGD: Karimireddy, Rebjock, Stich, Jaggi, "Error feedback fixes
    SignSGD and other gradient compression schemes", ICML 2019; Stich, Cordonnier, Jaggi,
    NeurIPS 2018). A client's residual starts at zero, is kept by the worker that trains it
    (in checkpoints, moved with a lost worker) and changes only when it takes part.
    Departure: fedray applies it to the client's whole message (its model delta after local
    training, as FL's compressed-update papers do), not to each minibatch gradient; a
    Byzantine client's crafted row is compressed without a residual (``states`` None).

    Or **EF21** (``ef21: true``; Richtárik, Sokolov, Fatkhullin, "EF21: A new, simpler,
    theoretically better, and practically faster error feedback", NeurIPS 2021): client
    and server keep the same estimate ``g`` of the client's message (zero at the start);
    the client sends ``c = C(u - g)``, both set ``g += D(c)``, and the server's row for
    the client is ``g``: its robust rule runs over the estimates, as Byz-EF21 does
    (Rammal, Gorbunov, Richtárik et al., "Communication compression for Byzantine robust
    learning", AISTATS 2024). The server's estimates are kept per client in the server
    (in checkpoints). A Byzantine client's row is its decoded crafted payload, not an
    estimate: it may move its row anywhere ``C`` reaches in one round (the worst case);
    an omniscient attack sees the honest clients' decoded payloads (under EF21 their
    compressed changes, not the server's estimates)."""

    def __init__(self, error_feedback: bool = False, ef21: bool = False) -> None:
        self.error_feedback = error_feedback
        self.ef21 = ef21

    def check(self, n: int) -> None:
        if self.error_feedback and self.ef21:
            raise ValueError("ef21: is an error feedback of its own; give error_feedback or "
                             "ef21, not both")

    def compress(self, rows: torch.Tensor, batch: CodecBatch) -> Parts:
        """The payload of float32 ``rows`` ``(k, w)`` (the batch's generators: one a row)."""
        raise NotImplementedError

    def decompress(self, parts: Parts, shape: MessageShape) -> torch.Tensor:
        """The float32 rows ``(n, shape.width)`` a stacked payload stands for."""
        raise NotImplementedError

    def encode(self, parts: Parts, batch: CodecBatch) -> Parts:
        rows = parts[ROWS].to(torch.float32)
        if self.ef21 and batch.states is not None:
            estimate = _stacked(batch.states, ESTIMATE, rows)
            out = self.compress(rows - estimate, batch)
            moved = estimate + self.decompress(out, batch.shape)
            for st, g in zip(batch.states, moved, strict=True):
                st[ESTIMATE] = g.clone()
            return out
        if not (self.error_feedback and batch.states is not None):
            return self.compress(rows, batch)
        residual = _stacked(batch.states, RESIDUAL, rows)
        p = rows + residual
        out = self.compress(p, batch)
        left = p - self.decompress(out, batch.shape)
        for st, e in zip(batch.states, left, strict=True):
            st[RESIDUAL] = e.clone()
        return out

    def decode(self, parts: Parts, shape: MessageShape) -> Parts:
        return {ROWS: self.decompress(parts, shape)}

    def decode_kept(self, parts: Parts, shape: MessageShape,
                    states: list[dict[str, torch.Tensor]]) -> Parts:
        """EF21's server half: each row's estimate moved by its decoded payload, and the
        estimates as the rows."""
        change = self.decompress(parts, shape)
        moved = _stacked(states, ESTIMATE, change) + change
        for st, g in zip(states, moved, strict=True):
            st[ESTIMATE] = g.clone()
        return {ROWS: moved}

    def needs_rows(self) -> bool:
        return True

    def dense(self) -> bool:
        return False

    def keeps_state(self) -> bool:
        return self.error_feedback or self.ef21

    def server_keeps_state(self) -> bool:
        return self.ef21


def _stacked(states: list[dict[str, torch.Tensor]], key: str, like: torch.Tensor
             ) -> torch.Tensor:
    """The rows' state ``key`` stacked (zeros where a row has none yet)."""
    if not len(like):
        return torch.zeros_like(like)
    return torch.stack([st.get(key, torch.zeros(like.shape[1])) for st in states])


def top_k(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``k`` entries of largest magnitude: ``(indices (n, k) int32 ascending,
    values (n, k))``; among equal magnitudes at the threshold the lower index wins, so the
    choice is the same on any platform and thread count. A partial selection over the
    matrix (``torch.topk`` gives each row's threshold; a cumulative count settles ties
    there), not a sort of each row.

    >>> top_k(torch.tensor([[0.5, -2.0, 1.0, 2.0]]), 2)
    (tensor([[1, 3]], dtype=torch.int32), tensor([[-2.,  2.]]))
    >>> top_k(torch.tensor([[1.0, -1.0, 1.0, 0.0]]), 2)  # a tie: the lower indices
    (tensor([[0, 1]], dtype=torch.int32), tensor([[ 1., -1.]]))
    """
    n, width = rows.shape
    if k >= width:
        idx = torch.arange(width).expand(n, width)
        return idx.to(torch.int32).contiguous(), rows.clone()
    mag = rows.abs()
    # each row's k-th largest magnitude (a partial selection, not a sort)
    threshold = torch.topk(mag, k, dim=1, sorted=False).values.min(dim=1, keepdim=True).values
    at = (mag >= threshold).nonzero()  # row-major: ascending within each row
    if bool((torch.bincount(at[:, 0], minlength=n) == k).all()):  # no tie at a threshold
        idx = at[:, 1].reshape(n, k)
    else:  # the tied entries at the threshold: the lower indices take the room left
        above, tied = mag > threshold, mag == threshold
        room = k - above.sum(dim=1, keepdim=True)
        keep = above | (tied & (torch.cumsum(tied, dim=1) <= room))
        idx = keep.nonzero()[:, 1].reshape(n, k)
    return idx.to(torch.int32), torch.gather(rows, 1, idx)


def scatter_rows(indices: torch.Tensor, values: torch.Tensor, width: int) -> torch.Tensor:
    """Dense float32 rows ``(n, width)``: ``values`` at ``indices``, zero elsewhere."""
    out = torch.zeros(indices.shape[0], width, dtype=torch.float32)
    return out.scatter_(1, indices.long(), values.to(torch.float32))


class Sparsifier(Compressor):
    """A compressor that keeps ``k`` entries of each message (or its ``fraction`` of ``w``,
    at least one) and sends them as int32 indices and float32 values, ``8 k`` bytes: the
    shared half of :class:`TopK` and :class:`RandK`, which differ in which entries they keep
    (:meth:`compress`). At most one of ``k`` and ``fraction`` (neither: ``fraction`` 0.01,
    the 1 % of Stich et al.'s experiments); a ``k`` beyond the message's width is refused
    before anything runs."""

    def __init__(self, k: Annotated[int, Ge(1)] | None = None,
                 fraction: Annotated[float, Gt(0), Le(1)] | None = None,
                 error_feedback: bool = False, ef21: bool = False) -> None:
        super().__init__(error_feedback, ef21)
        self.k = k
        self.fraction = 0.01 if k is None and fraction is None else fraction

    def check(self, n: int) -> None:
        super().check(n)
        if self.k is not None and self.fraction is not None:
            raise ValueError(f"fraction: give k or fraction, not both (k is {self.k})")

    def entries(self, width: int) -> int:
        """The entries a message of ``width`` keeps."""
        if self.k is not None:
            if self.k > width:
                raise ValueError(f"k: must be <= a message's {width:,} entries, got {self.k}")
            return self.k
        assert self.fraction is not None
        return max(1, math.ceil(self.fraction * width))

    def decompress(self, parts: Parts, shape: MessageShape) -> torch.Tensor:
        return scatter_rows(parts["indices"], parts["values"], shape.width)

    def reach(self, rows: torch.Tensor, shape: MessageShape) -> torch.Tensor:
        """A crafted payload picks its ``k`` indices and their values: the row's ``k``
        entries of largest magnitude, as they are (no ``w / k`` scaling for rand-k)."""
        idx, vals = top_k(rows.to(torch.float32), self.entries(shape.width))
        return scatter_rows(idx, vals, shape.width)

    def layout(self, inner: dict[str, PartSpec], shape: MessageShape) -> dict[str, PartSpec]:
        k = self.entries(shape.width)
        return {"indices": PartSpec(k, "int32"), "values": PartSpec(k, "float32")}


class TopK(Sparsifier):
    """Top-k sparsification: each message's ``k`` entries of largest magnitude (or its
    ``fraction`` of ``w``, at least one), sent as int32 indices and float32 values,
    ``8 k`` bytes against the identity's ``4 w`` (:func:`top_k`). Biased; with
    ``error_feedback: true`` the dropped mass is sent later (Stich et al., NeurIPS 2018).
    At most one of ``k`` and ``fraction`` (neither: ``fraction`` 0.01, the 1 % of
    Stich et al.'s experiments); a ``k`` beyond the message's width is refused before
    anything runs.

    >>> from strategies.protocols import ROWS, CodecBatch
    >>> c, shape = TopK(k=1), MessageShape(3)
    >>> c.decode(c.encode({ROWS: torch.tensor([[0.1, -3.0, 2.0]])}, CodecBatch(0, [], shape)),
    ...          shape)
    {'rows': tensor([[ 0., -3.,  0.]])}
    """

    def compress(self, rows: torch.Tensor, batch: CodecBatch) -> Parts:
        idx, vals = top_k(rows, self.entries(rows.shape[1]))
        return {"indices": idx, "values": vals}


def _uniforms(generators: list[torch.Generator], rows: torch.Tensor) -> torch.Tensor:
    """Uniform ``[0, 1)`` draws of ``rows``' shape ``(k, w)``, row ``i`` from
    ``generators[i]`` (the only loop over rows: the draws)."""
    k, w = rows.shape
    if len(generators) != k:
        raise ValueError(f"a batch of {k} rows with {len(generators)} generators")
    if not k:
        return torch.empty(0, w)
    return torch.stack([torch.rand(w, generator=g) for g in generators])


def stochastic_round(r: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``r`` rounded up with probability its fractional part (``u`` uniform ``[0, 1)`` of
    its shape), else down: ``E[round(r)] = r`` (Gupta, Agrawal, Gopalakrishnan, Narayanan,
    "Deep learning with limited numerical precision", ICML 2015).

    >>> stochastic_round(torch.tensor([1.25, 1.25, -0.5]), torch.tensor([0.2, 0.3, 0.7]))
    tensor([ 2.,  1., -1.])
    """
    low = torch.floor(r)
    return low + (u < r - low).to(r.dtype)


def rand_k(rows: torch.Tensor, k: int, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``k`` entries chosen uniformly without replacement (the ``k`` largest of
    the uniform keys ``u``, a random permutation's first ``k``), scaled by ``w / k`` so that
    the row they stand for is unbiased: ``(indices (n, k) int32 ascending, values (n, k))``.

    >>> rand_k(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), 2, torch.tensor([[0.1, 0.9, 0.2, 0.5]]))
    (tensor([[1, 3]], dtype=torch.int32), tensor([[4., 8.]]))
    """
    w = rows.shape[1]
    idx = torch.sort(torch.topk(u, k, dim=1).indices, dim=1).values
    return idx.to(torch.int32), torch.gather(rows, 1, idx) * (w / k)


class RandK(Sparsifier):
    """Random-k sparsification: each message keeps ``k`` entries (or its ``fraction`` of
    ``w``, at least one; the same keys as :class:`TopK`) chosen uniformly without
    replacement from the client's own generator, scaled by ``w / k``, so the decoded row is
    an unbiased estimate of the message (:func:`rand_k`; Stich, Cordonnier, Jaggi,
    "Sparsified SGD with memory", NeurIPS 2018; Wangni, Wang, Liu, Zhang, "Gradient
    sparsification for communication-efficient distributed optimization", NeurIPS 2018).
    Sent as int32 indices (ascending) and float32 values: ``8 k`` bytes a message.
    Departure: Stich et al. send the chosen entries unscaled with error feedback (a
    contraction); fedray scales them (unbiased, Wangni et al.'s uniform case), with or
    without ``error_feedback``.

    Example: the client's generator picks the first two entries, each sent times
    ``w / k = 2`` (see :func:`rand_k` for the choice by uniform keys):

    >>> from strategies.protocols import ROWS, CodecBatch
    >>> c, shape = RandK(k=2), MessageShape(4)
    >>> out = c.encode({ROWS: torch.tensor([[1.0, 2.0, 3.0, 4.0]])},
    ...                CodecBatch(0, [torch.Generator().manual_seed(0)], shape))
    >>> out["indices"].tolist(), out["values"].tolist()
    ([[0, 1]], [[2.0, 4.0]])
    """

    def compress(self, rows: torch.Tensor, batch: CodecBatch) -> Parts:
        idx, vals = rand_k(rows, self.entries(rows.shape[1]), _uniforms(batch.generators, rows))
        return {"indices": idx, "values": vals}


def qsgd(rows: torch.Tensor, s: int, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """QSGD's quantisation of each row ``x`` (Alistarh et al., NeurIPS 2017, Section 3.1):
    ``(norm (n, 1), signed levels (n, w))`` with ``norm = ||x||_2`` and each entry's level
    ``s |x_i| / norm`` rounded stochastically (``u`` uniform, of the rows' shape) to an
    integer in ``{0, ..., s}`` carrying ``x_i``'s sign; a zero row has level 0 everywhere.
    ``norm * levels / s`` (:func:`qsgd_decode`) is unbiased.

    Example, ``x = (3, -4)``, ``s = 2``: levels ``2 * (0.6, 0.8) = (1.2, 1.6)`` round to
    ``(2, 1)`` with these draws, and decode to ``5 * (2, -1) / 2``:

    >>> norm, levels = qsgd(torch.tensor([[3.0, -4.0]]), 2, torch.tensor([[0.1, 0.9]]))
    >>> norm, levels, qsgd_decode(norm, levels, 2)
    (tensor([[5.]]), tensor([[ 2., -1.]]), tensor([[ 5.0000, -2.5000]]))
    """
    norm = torch.linalg.vector_norm(rows, dim=1, keepdim=True)
    safe = torch.where(norm > 0, norm, torch.ones_like(norm))
    # |x_i| / norm <= 1 in exact arithmetic; the clamp keeps float rounding below s + 1
    r = torch.clamp(s * rows.abs() / safe, max=float(s))
    return norm, torch.sign(rows) * stochastic_round(r, u)


def qsgd_decode(norm: torch.Tensor, levels: torch.Tensor, s: int) -> torch.Tensor:
    """The float32 rows ``norm * levels / s`` of :func:`qsgd`'s payload."""
    return norm.to(torch.float32) * levels.to(torch.float32) / s


class QSGD(Compressor):
    """QSGD (Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD: Communication-efficient SGD via
    gradient quantization and encoding", NeurIPS 2017): each message ``x`` travels as its
    norm ``||x||_2`` (part ``norm``, one float32) and one signed level an entry (part
    ``levels``): ``s |x_i| / ||x||`` rounded stochastically to ``{0, ..., s}``, as int8
    when ``levels`` ``s <= 127`` (``w + 4`` bytes a message), int16 above (``2 w + 4``).
    Decoded as ``||x|| * level / s`` (:func:`qsgd`): unbiased, with variance
    ``E||Q(x) - x||^2 <= min(w / s^2, sqrt(w) / s) ||x||^2`` (Lemma 3.1). A zero message
    decodes to zero. Departure: the paper's Elias coding of the levels (its variable-length
    bit stream) is not simulated; a level costs a fixed int8 or int16. The norm is the
    whole message's, not per bucket (the paper's bucket size ``d`` = the message's width).

    >>> from strategies.protocols import ROWS, CodecBatch
    >>> c, shape = QSGD(levels=1), MessageShape(2)
    >>> out = c.encode({ROWS: torch.tensor([[3.0, -4.0]])},
    ...                CodecBatch(0, [torch.Generator().manual_seed(0)], shape))
    >>> out["norm"].tolist(), out["levels"].tolist(), out["levels"].dtype
    ([[5.0]], [[1, -1]], torch.int8)
    >>> c.decode(out, shape)
    {'rows': tensor([[ 5., -5.]])}
    """

    def __init__(self, levels: Annotated[int, Ge(1), Le(32767)] = 1,
                 error_feedback: bool = False, ef21: bool = False) -> None:
        super().__init__(error_feedback, ef21)
        self.levels = levels

    @property
    def dtype(self) -> torch.dtype:
        """The levels' integer type: int8 up to 127 levels, int16 above."""
        return torch.int8 if self.levels <= 127 else torch.int16

    def compress(self, rows: torch.Tensor, batch: CodecBatch) -> Parts:
        norm, levels = qsgd(rows, self.levels, _uniforms(batch.generators, rows))
        return {"norm": norm, "levels": levels.to(self.dtype)}

    def decompress(self, parts: Parts, shape: MessageShape) -> torch.Tensor:
        return qsgd_decode(parts["norm"], parts["levels"], self.levels)

    def reach(self, rows: torch.Tensor, shape: MessageShape) -> torch.Tensor:
        """A crafted payload picks any norm and any levels in ``[-s, s]``: the row on the
        grid of its largest magnitude over ``s``, nearest levels (its magnitude is not
        bounded by the honest rows': QSGD's norm is the sender's word)."""
        x = rows.to(torch.float32)
        step = x.abs().amax(dim=1, keepdim=True) / self.levels
        safe = torch.where(step > 0, step, torch.ones_like(step))
        return torch.round(x / safe).clamp(-self.levels, self.levels) * step

    def layout(self, inner: dict[str, PartSpec], shape: MessageShape) -> dict[str, PartSpec]:
        return {"norm": PartSpec(1, "float32"),
                "levels": PartSpec(shape.width, str(self.dtype).removeprefix("torch."))}


_BIT = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)  # first entry: the high bit


def pack_signs(rows: torch.Tensor) -> torch.Tensor:
    """Each row's signs as bits, 8 entries a byte (the first entry in the high bit, as
    ``numpy.packbits``; the last byte padded with zeros): ``(n, ceil(w / 8))`` uint8, bit 1
    where the entry is non-negative (``0`` and ``-0`` count as ``+1``), 0 where negative.

    >>> pack_signs(torch.tensor([[0.5, -1.0, 0.0, -2.0, 3.0, 1.0, 1.0, 1.0, -1.0]]))
    tensor([[175,   0]], dtype=torch.uint8)
    """
    n, w = rows.shape
    bits = torch.zeros(n, -(-w // 8) * 8, dtype=torch.uint8)
    bits[:, :w] = (rows >= 0).to(torch.uint8)
    return torch.bitwise_left_shift(bits.view(n, -1, 8), _BIT).sum(2, dtype=torch.uint8)


def unpack_signs(bits: torch.Tensor, width: int) -> torch.Tensor:
    """The float32 ``+-1`` rows ``(n, width)`` of :func:`pack_signs`' bytes.

    >>> unpack_signs(torch.tensor([[175, 0]], dtype=torch.uint8), 9)
    tensor([[ 1., -1.,  1., -1.,  1.,  1.,  1.,  1., -1.]])
    """
    on = torch.bitwise_and(torch.bitwise_right_shift(bits.unsqueeze(2), _BIT), 1)
    return on.view(bits.shape[0], -1)[:, :width].to(torch.float32) * 2 - 1


class SignCompressor(Compressor):
    """Sign compression: each entry travels as one bit, its sign (``0`` counts as ``+1``),
    packed 8 to a byte (part ``bits``, ``ceil(w / 8)`` uint8; :func:`pack_signs`), as signSGD
    sends it (Bernstein, Wang, Azizzadenesheli, Anandkumar, "signSGD: Compressed
    optimisation for non-convex problems", ICML 2018). With ``scale`` (the default) the
    message's mean magnitude ``||x||_1 / w`` travels beside it (part ``scale``, one float32)
    and the row decodes to ``scale * sign(x)``: the scaled sign of EF-SignSGD (Karimireddy,
    Rebjock, Stich, Jaggi, "Error feedback fixes SignSGD and other gradient compression
    schemes", ICML 2019; with ``error_feedback: true`` it is their method). Without
    ``scale`` the row decodes to ``+-1``, the vote of signSGD with majority vote (pair it
    with the ``majority_vote`` aggregator). ``ceil(w / 8)`` bytes a message, ``+ 4`` with
    ``scale``. Departure: signSGD's ``sign(0) = 0`` needs a third symbol; fedray sends
    ``+1`` for a zero entry (one bit an entry, as the papers' implementations do).

    >>> from strategies.protocols import ROWS, CodecBatch
    >>> c, shape = SignCompressor(), MessageShape(4)
    >>> out = c.encode({ROWS: torch.tensor([[1.0, -2.0, 0.0, 3.0]])}, CodecBatch(0, [], shape))
    >>> out["bits"].tolist(), out["scale"].tolist()
    ([[176]], [[1.5]])
    >>> c.decode(out, shape)
    {'rows': tensor([[ 1.5000, -1.5000,  1.5000,  1.5000]])}
    """

    def __init__(self, scale: bool = True, error_feedback: bool = False,
                 ef21: bool = False) -> None:
        super().__init__(error_feedback, ef21)
        self.scale = scale

    def compress(self, rows: torch.Tensor, batch: CodecBatch) -> Parts:
        out = {"bits": pack_signs(rows)}
        if self.scale:
            out["scale"] = rows.abs().mean(1, keepdim=True)
        return out

    def decompress(self, parts: Parts, shape: MessageShape) -> torch.Tensor:
        signs = unpack_signs(parts["bits"], shape.width)
        return signs * parts["scale"].to(torch.float32) if self.scale else signs

    def layout(self, inner: dict[str, PartSpec], shape: MessageShape) -> dict[str, PartSpec]:
        out = {"bits": PartSpec(-(-shape.width // 8), "uint8")}
        if self.scale:
            out["scale"] = PartSpec(1, "float32")
        return out


def quantize_int8(rows: torch.Tensor, u: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row on the int8 grid of its largest magnitude: ``(scale (n, 1), levels (n, w)
    int8)`` with ``scale = max |x| / 127`` and ``x / scale`` rounded stochastically with the
    uniform draws ``u`` (unbiased), or to the nearest level where ``u`` is None, into
    ``[-127, 127]``; a zero row has scale 0 and levels 0.

    >>> quantize_int8(torch.tensor([[-1.27, 0.5, 0.005]]), None)
    (tensor([[0.0100]]), tensor([[-127,   50,    0]], dtype=torch.int8))
    """
    scale = rows.abs().amax(1, keepdim=True) / 127
    r = rows / torch.where(scale > 0, scale, torch.ones_like(scale))
    levels = torch.round(r) if u is None else stochastic_round(r, u)
    return scale, torch.clamp(levels, -127, 127).to(torch.int8)


def round_float(rows: torch.Tensor, dtype: torch.dtype, u: torch.Tensor | None
                ) -> torch.Tensor:
    """Float32 ``rows`` in ``dtype`` (float16 or bfloat16): to the nearest value where ``u``
    is None (round half to even), else to one of the two representable neighbours of each
    entry with the probabilities that make it unbiased (``u`` uniform ``[0, 1)`` of the
    rows' shape; the upper neighbour where ``u`` is below the probability of rounding up).
    bfloat16: ``2^16 - 1 - floor(u * 2^16)`` is added to the float32 bit pattern and the 16
    low bits are dropped (the carry is the round up); float16: the neighbours are the
    nearest value and the next one toward the entry (``torch.nextafter``), the upper taken
    with probability ``(x - low) / (high - low)``. Stochastic float16 saturates: an entry
    beyond ``+-65504`` is clamped to it first (nearest rounding gives ``inf`` beyond 65519).

    Example: a quarter of the way from ``1`` to the next value up (``1 + 2^-7`` in
    bfloat16, ``1 + 2^-10`` in float16), rounded up when ``u < 1/4``:

    >>> u = torch.tensor([[0.2, 0.3]])
    >>> round_float(torch.full((1, 2), 1 + 2**-9), torch.bfloat16, u).tolist()
    [[1.0078125, 1.0]]
    >>> round_float(torch.full((1, 2), 1 + 2**-12), torch.float16, u).tolist()
    [[1.0009765625, 1.0]]
    """
    if u is None:
        return rows.to(dtype)
    if dtype == torch.bfloat16:
        carry = 65535 - torch.floor(u * 65536).to(torch.int32)
        bits = torch.bitwise_and(rows.contiguous().view(torch.int32) + carry, -65536)
        return bits.view(torch.float32).to(torch.bfloat16)
    top = float(torch.finfo(torch.float16).max)
    x = torch.clamp(rows, -top, top)  # saturate: both neighbours finite
    near = x.to(torch.float16)
    toward = torch.where(near.to(torch.float32) < x, math.inf, -math.inf).to(torch.float16)
    a, b = near.to(torch.float32), torch.nextafter(near, toward).to(torch.float32)
    low, high = torch.minimum(a, b), torch.maximum(a, b)
    out = torch.where(u < (x - low) / (high - low), high, low)
    return torch.where(a == x, a, out).to(torch.float16)


class Quantize(Compressor):
    """Low-precision transport with stochastic rounding: each message travels in ``dtype``,
    rounded stochastically (``stochastic: true``, the default: unbiased, Gupta, Agrawal,
    Gopalakrishnan, Narayanan, "Deep learning with limited numerical precision", ICML 2015)
    or to the nearest value. ``int8``: the message's grid of ``max |x| / 127`` (part
    ``scale``, one float32) and one int8 level in ``[-127, 127]`` an entry (part
    ``levels``; :func:`quantize_int8`), ``w + 4`` bytes; ``float16`` / ``bfloat16``: one
    value an entry (part ``values``; :func:`round_float`), ``2 w`` bytes. The quantised
    update of FedPAQ (Reisizadeh, Mokhtari, Hassani, Jadbabaie, Pedarsani, "FedPAQ: A
    communication-efficient federated learning method with periodic averaging and
    quantization", AISTATS 2020), whose analysis asks for an unbiased quantiser of bounded
    variance. Departure: FedPAQ's experiments use QSGD's quantiser (the ``qsgd`` codec);
    this one is the low-precision number formats with a per-message scale.

    >>> from strategies.protocols import ROWS, CodecBatch
    >>> c, shape = Quantize("int8", stochastic=False), MessageShape(3)
    >>> out = c.encode({ROWS: torch.tensor([[-2.54, 1.0, 0.0]])}, CodecBatch(0, [], shape))
    >>> out["levels"].tolist(), c.decode(out, shape)[ROWS].tolist()
    ([[-127, 50, 0]], [[-2.5399999618530273, 1.0, 0.0]])
    """

    def __init__(self, dtype: Literal["int8", "float16", "bfloat16"] = "int8",
                 stochastic: bool = True, error_feedback: bool = False,
                 ef21: bool = False) -> None:
        super().__init__(error_feedback, ef21)
        self.dtype = dtype
        self.stochastic = stochastic

    def compress(self, rows: torch.Tensor, batch: CodecBatch) -> Parts:
        u = _uniforms(batch.generators, rows) if self.stochastic else None
        if self.dtype == "int8":
            scale, levels = quantize_int8(rows, u)
            return {"scale": scale, "levels": levels}
        return {"values": round_float(rows, getattr(torch, self.dtype), u)}

    def decompress(self, parts: Parts, shape: MessageShape) -> torch.Tensor:
        if self.dtype == "int8":
            return parts["levels"].to(torch.float32) * parts["scale"].to(torch.float32)
        return parts["values"].to(torch.float32)

    def reach(self, rows: torch.Tensor, shape: MessageShape) -> torch.Tensor:
        """A crafted payload rounds to the nearest representable value (no draws)."""
        x = rows.to(torch.float32)
        if self.dtype == "int8":
            scale, levels = quantize_int8(x, None)
            return levels.to(torch.float32) * scale
        return round_float(x, getattr(torch, self.dtype), None).to(torch.float32)

    def layout(self, inner: dict[str, PartSpec], shape: MessageShape) -> dict[str, PartSpec]:
        if self.dtype == "int8":
            return {"scale": PartSpec(1, "float32"), "levels": PartSpec(shape.width, "int8")}
        return {"values": PartSpec(shape.width, self.dtype)}


def power_step(m: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One power-iteration step of PowerSGD (Vogels et al., NeurIPS 2019, Algorithm 1) on
    a batch of matrices ``m`` ``(k, a, b)`` from the starts ``q`` ``(k, b, r)``:
    ``p = orthonormal(m q)`` (reduced QR) and ``q' = m^T p``; ``m ~= p q'^T``
    (:func:`low_rank`), the projection of ``m`` on the span of ``p``.

    Example: ``diag(2, 1)`` from ``q = (1, 1)``: ``p = (2, 1) / sqrt(5)`` (up to its sign),
    ``p q'^T = p p^T m = (8, 2; 4, 1) / 5``:

    >>> p, q = power_step(torch.tensor([[[2.0, 0.0], [0.0, 1.0]]]), torch.ones(1, 2, 1))
    >>> low_rank(p, q) * 5
    tensor([[[8.0000, 2.0000],
             [4.0000, 1.0000]]])
    """
    p = torch.linalg.qr(torch.bmm(m, q)).Q
    return p, torch.bmm(m.transpose(1, 2), p)


def low_rank(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The matrices ``p q^T`` ``(k, a, b)`` of the factors ``p`` ``(k, a, r)`` and ``q``
    ``(k, b, r)``."""
    return torch.bmm(p, q.transpose(1, 2))


class PowerSGD(Compressor):
    """PowerSGD (Vogels, Karimireddy, Jaggi, "PowerSGD: Practical low-rank gradient
    compression for distributed optimization", NeurIPS 2019): each model parameter of two
    or more dimensions, viewed as the matrix ``M`` ``(shape[0], numel / shape[0])``, travels
    as its rank-``rank`` factors: ``P = orthonormal(M Q)`` and ``Q' = M^T P``
    (:func:`power_step`), decoded as ``P Q'^T`` (parts ``p`` and ``q``, the factors of every
    such matrix concatenated, float32). A matrix with ``rank >= min(its dims)`` (no saving),
    the one-dimensional parameters (biases) and the message's entries after the parameters
    (other named parts) travel as they are (part ``dense``, float32). A message costs
    ``4 (sum_j (a_j + b_j) r + dense)`` bytes. Each client keeps its ``Q'`` as the next
    round's start (the paper's warm start; drawn standard normal from the client's generator
    the first time, and every time for a Byzantine row, which keeps no state), so the codec
    always keeps per-client state; ``error_feedback: true`` adds the residual, as the
    paper's Algorithm 2 does. Departures: the paper all-reduces ``P`` before orthogonalising
    and then ``Q'`` (the factors of the workers' mean); fedray compresses each client's
    message alone and decodes it per row, because robust rules need the rows, so the server
    averages rank-``r`` approximations rather than approximating the average. Error
    feedback is off unless asked for (the paper always uses it). Orthogonalisation is by
    QR, not Gram-Schmidt: the same span, the signs of ``P``'s columns may differ, ``P Q'^T``
    does not.

    >>> from strategies.protocols import ROWS, CodecBatch
    >>> c, shape = PowerSGD(rank=1), MessageShape(5, ((2, 2), (1,)))
    >>> x = torch.tensor([[1.0, 2.0, 2.0, 4.0, 7.0]])  # (1, 2; 2, 4) is of rank 1, bias 7
    >>> states = [{}]
    >>> out = c.encode({ROWS: x}, CodecBatch(0, [torch.Generator().manual_seed(0)], shape,
    ...                                     states))
    >>> sorted(out), out["dense"].tolist(), sorted(states[0])
    (['dense', 'p', 'q'], [[7.0]], ['q'])
    >>> torch.allclose(c.decode(out, shape)[ROWS], x)
    True
    """

    def __init__(self, rank: Annotated[int, Ge(1)] = 1, error_feedback: bool = False,
                 ef21: bool = False) -> None:
        super().__init__(error_feedback, ef21)
        self.rank = rank

    def matrices(self, shape: MessageShape) -> tuple[list[tuple[int, int, int]], torch.Tensor]:
        """The compressed matrices ``(offset, rows, columns)`` of a message of ``shape`` and
        the mask ``(width,)`` of its entries sent dense."""
        total = sum(math.prod(s) for s in shape.shapes)
        if total > shape.width:
            raise ValueError(f"the parameters' {total} entries exceed the message's width "
                             f"{shape.width}")
        out, dense, offset = [], torch.ones(shape.width, dtype=torch.bool), 0
        for s in shape.shapes:
            size = math.prod(s)
            if len(s) >= 2 and size and self.rank < min(s[0], size // s[0]):
                out.append((offset, s[0], size // s[0]))
                dense[offset:offset + size] = False
            offset += size
        return out, dense

    def compress(self, rows: torch.Tensor, batch: CodecBatch) -> Parts:
        mats, dense = self.matrices(batch.shape)
        k, r = rows.shape[0], self.rank
        starts = self._starts(batch, sum(b for _, _, b in mats) * r, k)
        ps, qs, at = [], [], 0
        for offset, a, b in mats:
            m = rows[:, offset:offset + a * b].reshape(k, a, b)
            p, q = power_step(m, starts[:, at:at + b * r].reshape(k, b, r))
            ps.append(p.reshape(k, -1))
            qs.append(q.reshape(k, -1))
            at += b * r
        out = {"dense": rows[:, dense]}
        if mats:
            out["p"], out["q"] = torch.cat(ps, 1), torch.cat(qs, 1)
            if batch.states is not None:
                for st, q in zip(batch.states, out["q"], strict=True):
                    st["q"] = q.clone()
        return out

    @staticmethod
    def _starts(batch: CodecBatch, size: int, k: int) -> torch.Tensor:
        """Each row's ``Q`` ``(k, size)``: its warm start where its state holds one, else
        standard normal from its generator."""
        kept = batch.states if batch.states is not None else [{}] * k
        if not size or not k:
            return torch.empty(k, size)
        return torch.stack([st["q"] if "q" in st and st["q"].numel() == size
                            else torch.randn(size, generator=g)
                            for st, g in zip(kept, batch.generators, strict=True)])

    def decompress(self, parts: Parts, shape: MessageShape) -> torch.Tensor:
        mats, dense = self.matrices(shape)
        k, r = parts["dense"].shape[0], self.rank
        out = torch.zeros(k, shape.width, dtype=torch.float32)
        out[:, dense] = parts["dense"].to(torch.float32)
        at_p = at_q = 0
        for offset, a, b in mats:
            p = parts["p"][:, at_p:at_p + a * r].reshape(k, a, r).to(torch.float32)
            q = parts["q"][:, at_q:at_q + b * r].reshape(k, b, r).to(torch.float32)
            out[:, offset:offset + a * b] = low_rank(p, q).reshape(k, -1)
            at_p, at_q = at_p + a * r, at_q + b * r
        return out

    def layout(self, inner: dict[str, PartSpec], shape: MessageShape) -> dict[str, PartSpec]:
        mats, dense = self.matrices(shape)
        matrices = [s for s in shape.shapes if len(s) >= 2 and min(s) > 0]
        if shape.shapes and not matrices:
            raise ValueError("rank: powersgd compresses parameter matrices; the model has "
                             "none (only vectors), so nothing would be compressed")
        if matrices and not mats:  # a rank no matrix is above: nothing would be compressed
            widest = max(min(s[0], _numel(s) // s[0]) for s in matrices)
            raise ValueError(f"rank: must be < the smaller dimension of at least one "
                             f"parameter matrix (at most {widest - 1} here), got {self.rank}:"
                             " every matrix would travel dense")
        out = {"dense": PartSpec(int(dense.sum()), "float32")}
        if mats:
            out["p"] = PartSpec(sum(a for _, a, _ in mats) * self.rank, "float32")
            out["q"] = PartSpec(sum(b for _, _, b in mats) * self.rank, "float32")
        return out

    def keeps_state(self) -> bool:
        return True

class ClientLevelDP(Codec):
    """Client-level DP as a codec. Central (DP-FedAvg, the default): the server's
    :meth:`screen` clips every row (``privacy.privatize``), :meth:`finish` adds the noise
    calibrated to the mean of ``m`` clipped rows (``privacy.noise``); the client half sends
    the message as it is (the server clips, as DP-FedAvg does, so Byzantine rows are clipped
    too). ``distributed`` (under secure aggregation, whose server sees no row): each client
    clips its own row and adds its share of the noise (``privacy.noise_share`` over the
    ``m`` rows of a round), so a sum of all ``m`` rows carries the central noise (Kairouz,
    Liu, Steinke, "The distributed discrete Gaussian mechanism", ICML 2021, shape the noise
    likewise, in integers); a Byzantine client's crafted row goes through it too."""

    def __init__(self, privacy: Privacy, distributed: bool = False, m: int = 1) -> None:
        self.privacy = privacy
        self.distributed, self.m = distributed, m

    def encode(self, parts: Parts, batch: CodecBatch) -> Parts:
        if not self.distributed:
            return parts
        return {ROWS: self.privacy.noise_share(parts[ROWS].to(torch.float32), self.m,
                                                batch.generators)}

    def screen(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.distributed else self.privacy.privatize(rows)

    def reach(self, rows: torch.Tensor, shape: MessageShape) -> torch.Tensor:
        """A crafted payload skips the client's half (distributed DP's clip and noise share;
        central DP-FedAvg clips it on the server all the same)."""
        return rows

    def finish(self, aggregate: torch.Tensor, m: int, generator: torch.Generator
               ) -> torch.Tensor:
        return aggregate if self.distributed else self.privacy.noise(aggregate, m, generator)


Chain = list[Codec] | tuple[Codec, ...]


def message_shape(model: nn.Module, width: int) -> MessageShape:
    """A message row of ``width`` entries whose first ones are ``model``'s parameters."""
    return MessageShape(width, tuple(tuple(p.shape) for p in model.parameters()))


def chain_layout(chain: Chain, shape: MessageShape) -> dict[str, PartSpec]:
    """The parts of one client's payload after ``chain`` (the raw float32 message first)."""
    out = {ROWS: PartSpec(shape.width, "float32")}
    for codec in chain:
        out = codec.layout(out, shape)
    return out


def chain_bytes(chain: Chain, shape: MessageShape | int, n: int = 0) -> int:
    """What one client sends after ``chain`` in a step of ``n`` rows: its payload and its
    protocol's extra bytes (``shape``: a message's shape, or its width)."""
    if isinstance(shape, int):
        shape = MessageShape(shape)
    return payload_bytes(chain_layout(chain, shape)) + sum(c.extra_bytes(shape, n)
                                                           for c in chain)


def encode_chain(chain: Chain, rows: torch.Tensor, round_: int, shape: MessageShape,
                 generators: list[list[torch.Generator]],
                 states: list[list[dict[str, torch.Tensor]]] | None) -> Parts:
    """Float32 ``rows`` ``(k, w)`` through the chain's client halves, in order: codec ``i``
    draws from ``generators[i]`` (one a row) and keeps ``states[i]`` (one dict a row; None
    where no state is kept)."""
    parts: Parts = {ROWS: rows}
    for i, codec in enumerate(chain):
        parts = codec.encode(parts, CodecBatch(round_, generators[i], shape,
                                               None if states is None else states[i]))
    return parts


def decode_chain(chain: Chain, parts: Parts, shape: MessageShape,
                 states: list[list[dict[str, torch.Tensor]]] | None = None) -> torch.Tensor:
    """A stacked payload through the chain's server halves, in reverse: float32 rows;
    ``states[i]``: codec ``i``'s server state a row, for a codec that keeps one (EF21's
    estimates; None: none kept, as for Byzantine rows)."""
    for i in reversed(range(len(chain))):
        codec = chain[i]
        parts = codec.decode_kept(parts, shape, states[i]) \
            if states is not None and codec.server_keeps_state() else codec.decode(parts, shape)
    return parts[ROWS].to(torch.float32)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def reach_chain(chain: Chain, rows: torch.Tensor, shape: MessageShape) -> torch.Tensor:
    """What the server decodes from Byzantine clients that build their payloads to send
    ``rows`` (``traits.crafts_payload``): each codec's ``reach``, in order."""
    for codec in chain:
        rows = codec.reach(rows, shape)
    return rows


def screen(chain: Chain, rows: torch.Tensor) -> torch.Tensor:
    """The step's dense rows through the chain's ``screen``, in reverse."""
    for codec in reversed(chain):
        rows = codec.screen(rows)
    return rows


def finish(chain: Chain, aggregate: torch.Tensor, m: int,
           generator: torch.Generator) -> torch.Tensor:
    """The pipeline's aggregate through the chain's ``finish``, in reverse."""
    for codec in reversed(chain):
        aggregate = codec.finish(aggregate, m, generator)
    return aggregate
