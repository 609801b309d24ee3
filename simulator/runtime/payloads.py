"""The codec chain in the actors (``codecs:``; ``strategies.codecs``): a worker encodes its
clients' messages into what travels (:func:`encode_payload`), keeping the codecs' per-client
state (:class:`CodecStates`); the server and the adversary read them back as float32 rows
(:func:`decoded`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from simulator.messages import ClientRows, Encoded
from simulator.runtime.state import ClientStateStore
from simulator.seeding import torch_generator
from strategies.codecs import chain_layout, decode_chain, encode_chain
from strategies.protocols import Codec, MessageShape

Chain = tuple[Codec, ...]


class CodecStates:
    """The chain's per-client state in a worker (error-feedback residuals), or with
    ``server`` in the server (EF21's estimates): codec ``i``'s entry ``name`` of a client
    is kept as ``codec.{i}.{name}`` in float32 (whatever ``runtime.state_dtype`` says: a
    residual rounded each round would be another method)."""

    PREFIX = "codec."

    def __init__(self, chain: Chain, server: bool = False) -> None:
        self.chain = chain
        self.kept = [c.server_keeps_state() if server else c.keeps_state() for c in chain]
        self.keeping = any(self.kept)
        self.store = ClientStateStore(torch.float32)

    def __contains__(self, client: int) -> bool:
        return client in self.store

    def batch(self, clients: Sequence[int]) -> list[list[dict[str, torch.Tensor]]] | None:
        """Per codec, each client's state (``{}`` for a codec that keeps none); None when no
        codec keeps any."""
        if not self.keeping:
            return None
        held = [self.store.get(int(c)) for c in clients]
        out: list[list[dict[str, torch.Tensor]]] = []
        for i, kept in enumerate(self.kept):
            head = f"{self.PREFIX}{i}."
            out.append([{k[len(head):]: v for k, v in h.items() if k.startswith(head)}
                        if kept else {} for h in held])
        return out

    def keep(self, clients: Sequence[int], states: list[list[dict[str, torch.Tensor]]]
             ) -> None:
        for j, c in enumerate(clients):
            merged = {f"{self.PREFIX}{i}.{k}": v for i, per in enumerate(states)
                      for k, v in per[j].items()}
            if merged:
                self.store.set(int(c), merged)

    def items(self) -> list[tuple[int, dict[str, torch.Tensor]]]:
        return [(c, {k: v.clone() for k, v in st.items()}) for c, st in self.store.items()]

    def load(self, states: dict[int, dict[str, torch.Tensor]]) -> None:
        """A checkpoint's states (all kinds mixed): the ``codec.`` entries of each client."""
        self.store = ClientStateStore(torch.float32)
        for c, st in states.items():
            mine = {k: v for k, v in st.items() if k.startswith(self.PREFIX)}
            if mine:
                self.store.set(int(c), mine)


def encode_payload(chain: Chain, rows: np.ndarray, round_: int, shape: MessageShape,
                   seed: int, clients: Sequence[int], states: CodecStates | None,
                   purpose: str = "codec") -> np.ndarray | Encoded:
    """Float32 message ``rows`` of ``clients`` as they travel: the rows themselves without a
    chain, else the chain's payload (codec ``i`` draws from ``(seed, purpose, i, round,
    client)``; ``states``: the worker's, None for Byzantine rows, which keep none)."""
    if not chain:
        return rows
    generators = [[torch_generator(seed, purpose, i, round_, int(c)) for c in clients]
                  for i in range(len(chain))]
    held = states.batch(clients) if states is not None else None
    parts = encode_chain(chain, torch.from_numpy(rows), round_, shape, generators, held)
    if states is not None and held is not None:
        states.keep(clients, held)
    return Encoded({k: _array(v) for k, v in parts.items()})


def _array(part: torch.Tensor) -> np.ndarray:
    """A payload's part as it crosses the object store: NumPy has no bfloat16, so a
    bfloat16 part travels as its bit pattern in int16 (the same 2 bytes an entry), read
    back by :func:`decode_payload` from the chain's layout."""
    part = part.contiguous()
    return (part.view(torch.int16) if part.dtype == torch.bfloat16 else part).numpy()


def decode_payload(chain: Chain, updates: np.ndarray | Encoded, shape: MessageShape,
                   clients: Sequence[int] = (), states: CodecStates | None = None
                   ) -> np.ndarray:
    """The float32 rows a payload of ``clients`` stands for (the rows themselves without a
    chain); ``states``: the server's codec state of the clients (EF21), None for rows that
    keep none (Byzantine rows)."""
    if not isinstance(updates, Encoded):
        return updates
    parts = {k: torch.from_numpy(np.array(v)) for k, v in updates.parts.items()}
    if not len(updates):
        width = shape.width
        return np.empty((0, width), dtype=np.float32)
    for k, spec in chain_layout(chain, shape).items():
        if spec.dtype == "bfloat16" and parts[k].dtype == torch.int16:
            parts[k] = parts[k].view(torch.bfloat16)
    held = states.batch(clients) if states is not None else None
    rows = decode_chain(chain, parts, shape, held).numpy()
    if states is not None and held is not None:
        states.keep(clients, held)
    return rows


def decoded(chain: Chain, result: ClientRows, shape: MessageShape,
            states: CodecStates | None = None) -> ClientRows:
    """``result`` with its payload read back into float32 rows (``states``: the server's
    codec state of its clients, moved by it)."""
    if not isinstance(result.updates, Encoded):
        return result
    return dataclasses.replace(result, updates=decode_payload(
        chain, result.updates, shape, result.clients.tolist(), states))


__all__ = ["CodecStates", "decode_payload", "decoded", "encode_payload"]
