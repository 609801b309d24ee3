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
* :class:`ClientLevelDP`: client-level differential privacy (DP-FedAvg, McMahan, Ramage,
  Talwar, Zhang, ICLR 2018) as a codec: its server half clips every row before the pipeline
  and adds the Gaussian noise to the aggregate. Built from the scenario's ``privacy`` block
  (a :class:`strategies.protocols.Privacy` plugin with ``privacy_level: client``), not
  registered under a name of its own.
"""

from __future__ import annotations

import numpy as np
import torch

from strategies.protocols import Codec, Privacy

__all__ = ["ClientLevelDP", "Float16", "chain_bytes", "decode_rows", "encode_rows", "finish", "to_float16"]

FLOAT32_BYTES = 4


def to_float16(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` rounded to float16 (nearest, ties to even; beyond 65504: inf)."""
    return rows.to(torch.float16)


class Float16(Codec):
    """Half-precision transport (see the module docstring for its error bound): the client
    sends each entry as a float16, the server reads it back into float32 exactly (every
    float16 is a float32), so the only loss is the rounding of :func:`to_float16`.

    Example: ``1 + 2^-12`` rounds to ``1`` (the tie goes to even), ``65520`` to ``inf``.

    >>> Float16().encode(torch.tensor([[1 + 2**-12, 0.1, 65520.0]])).float().tolist()
    [[1.0, 0.0999755859375, inf]]
    """

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        return to_float16(rows)

    def wire_bytes(self, inner: int, width: int) -> int:
        """Half of what it carries (each float32 entry becomes 2 bytes)."""
        return inner // 2


class ClientLevelDP(Codec):
    """Client-level DP as the server's half of a codec: :meth:`decode` clips every row
    (``privacy.privatize``), :meth:`finish` adds the noise calibrated to the mean of ``m``
    clipped rows (``privacy.noise``). The same numbers as calling the mechanism around the
    pipeline; the client half sends the message as it is (the server clips, as DP-FedAvg
    does, so Byzantine rows are clipped too)."""

    def __init__(self, privacy: Privacy) -> None:
        self.privacy = privacy

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        return self.privacy.privatize(payload)

    def finish(self, aggregate: torch.Tensor, m: int, generator: torch.Generator
               ) -> torch.Tensor:
        return self.privacy.noise(aggregate, m, generator)


def chain_bytes(chain: list[Codec] | tuple[Codec, ...], width: int) -> int:
    """What one client's payload of a ``width``-entry message costs after ``chain`` (each
    codec's ``wire_bytes`` of the one before it; the raw float32 message first)."""
    out = FLOAT32_BYTES * width
    for codec in chain:
        out = codec.wire_bytes(out, width)
    return out


def encode_rows(chain: list[Codec] | tuple[Codec, ...], rows: np.ndarray) -> np.ndarray:
    """``rows`` (float32 messages) through the chain's client halves, in order, as the
    array that travels (``rows`` itself without a codec that changes it)."""
    if not chain:
        return rows
    t = torch.from_numpy(rows)
    for codec in chain:
        t = codec.encode(t)
    return t.numpy()


def decode_rows(chain: list[Codec] | tuple[Codec, ...], rows: torch.Tensor) -> torch.Tensor:
    """Stacked payload rows (float32) through the chain's server halves, in reverse."""
    for codec in reversed(chain):
        rows = codec.decode(rows)
    return rows


def finish(chain: list[Codec] | tuple[Codec, ...], aggregate: torch.Tensor, m: int,
           generator: torch.Generator) -> torch.Tensor:
    """The pipeline's aggregate through the chain's ``finish``, in reverse."""
    for codec in reversed(chain):
        aggregate = codec.finish(aggregate, m, generator)
    return aggregate
