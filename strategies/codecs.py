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
* :class:`ClientLevelDP`: client-level differential privacy (DP-FedAvg, McMahan, Ramage,
  Talwar, Zhang, ICLR 2018) as a codec: its server half clips every row before the pipeline
  and adds the Gaussian noise to the aggregate. Built from the scenario's ``privacy`` block
  (a :class:`strategies.protocols.Privacy` plugin with ``privacy_level: client``), not
  registered under a name of its own.
"""

from __future__ import annotations

import math
from typing import Annotated

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

__all__ = ["ClientLevelDP", "Compressor", "Float16", "TopK", "chain_bytes", "chain_layout",
           "decode_chain", "encode_chain", "finish", "message_shape", "scatter_rows", "screen", "to_float16",
           "top_k"]

RESIDUAL = "residual"  # an error-feedback codec's per-client state


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
    Byzantine client's crafted row is compressed without a residual (``states`` None)."""

    def __init__(self, error_feedback: bool = False) -> None:
        self.error_feedback = error_feedback

    def compress(self, rows: torch.Tensor, batch: CodecBatch) -> Parts:
        """The payload of float32 ``rows`` ``(k, w)`` (the batch's generators: one a row)."""
        raise NotImplementedError

    def decompress(self, parts: Parts, shape: MessageShape) -> torch.Tensor:
        """The float32 rows ``(n, shape.width)`` a stacked payload stands for."""
        raise NotImplementedError

    def encode(self, parts: Parts, batch: CodecBatch) -> Parts:
        rows = parts[ROWS].to(torch.float32)
        if not (self.error_feedback and batch.states is not None):
            return self.compress(rows, batch)
        residual = torch.stack([st.get(RESIDUAL, torch.zeros(rows.shape[1]))
                                for st in batch.states]) if len(rows) else rows
        p = rows + residual
        out = self.compress(p, batch)
        left = p - self.decompress(out, batch.shape)
        for st, e in zip(batch.states, left, strict=True):
            st[RESIDUAL] = e.clone()
        return out

    def decode(self, parts: Parts, shape: MessageShape) -> Parts:
        return {ROWS: self.decompress(parts, shape)}

    def needs_rows(self) -> bool:
        return True

    def dense(self) -> bool:
        return False

    def keeps_state(self) -> bool:
        return self.error_feedback


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


class TopK(Compressor):
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

    def __init__(self, k: Annotated[int, Ge(1)] | None = None,
                 fraction: Annotated[float, Gt(0), Le(1)] | None = None,
                 error_feedback: bool = False) -> None:
        super().__init__(error_feedback)
        self.k = k
        self.fraction = 0.01 if k is None and fraction is None else fraction

    def check(self, n: int) -> None:
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

    def compress(self, rows: torch.Tensor, batch: CodecBatch) -> Parts:
        idx, vals = top_k(rows, self.entries(rows.shape[1]))
        return {"indices": idx, "values": vals}

    def decompress(self, parts: Parts, shape: MessageShape) -> torch.Tensor:
        return scatter_rows(parts["indices"], parts["values"], shape.width)

    def layout(self, inner: dict[str, PartSpec], shape: MessageShape) -> dict[str, PartSpec]:
        k = self.entries(shape.width)
        return {"indices": PartSpec(k, "int32"), "values": PartSpec(k, "float32")}


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


def decode_chain(chain: Chain, parts: Parts, shape: MessageShape) -> torch.Tensor:
    """A stacked payload through the chain's server halves, in reverse: float32 rows."""
    for codec in reversed(chain):
        parts = codec.decode(parts, shape)
    return parts[ROWS].to(torch.float32)


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
