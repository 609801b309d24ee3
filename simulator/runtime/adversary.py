"""The Adversary actor: the Byzantine clients' rows of a round, made by the scenario's attack
(a plain Python class: the ray backend wraps it with ``ray.remote``, the inline backend calls
it in-process). Its rows go through the message path's client halves, as an honest client's
do: Byzantine clients speak the protocol."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from simulator.config.plan import Plan, build_codecs
from simulator.errors import guarded
from simulator.messages import ByzantineRows, ClientRows, Encoded, stack_groups
from simulator.registry import instantiate
from simulator.runtime.common import combine_buffers, deterministic_mode, single_thread
from simulator.runtime.payloads import decoded, encode_payload
from simulator.runtime.pipeline import Pipeline
from simulator.runtime.pool import Reusable
from simulator.seeding import torch_generator
from strategies.codecs import reach_chain
from strategies.protocols import MessageShape


class Adversary(Reusable):
    """Produces the Byzantine rows of a round with the scenario's attack plugin."""

    def __init__(self, plan: Plan) -> None:
        single_thread()
        deterministic_mode(plan.scenario.runtime.deterministic)
        assert plan.attack is not None
        spec = plan.attack.spec
        self.seed = plan.seed
        self._round = 0
        # Optimal attacks simulate the scenario's pipeline on a copy (stateful rules from the
        # adversary's own, never-advanced state: it does not see the server's).
        pipeline = Pipeline.from_plan(plan.pipeline, plan.seed)
        self.attack = instantiate("attacks", spec,
                                  aggregate=lambda x: pipeline.simulate(x, self._round))
        # Byzantine clients poison the model's buffers (BatchNorm statistics) with the same
        # attack, against the server's buffer rule
        rule = plan.buffer_rule
        self.buffer_attack = instantiate("attacks", spec,
                                         aggregate=lambda x: combine_buffers(x, rule))
        self.name = spec["name"]
        self.codecs = build_codecs(plan)  # Byzantine clients send payloads as honest ones do
        self.crafts = plan.attack.crafts_payload  # ... or build them (Codec.reach)

    def _rows(self, attack: Any, seen: torch.Tensor, f: int, round_: int, purpose: str
              ) -> np.ndarray:
        rows = guarded("attack", self.name, attack)(
            seen, f, torch_generator(self.seed, purpose, round_))
        if tuple(rows.shape) != (f, seen.shape[1]):
            raise ValueError(f"attack: returned shape {tuple(rows.shape)}, expected "
                             f"{(f, seen.shape[1])}")
        return rows.to(torch.float32).numpy()

    def attack_rows(self, round_: int, f: int, groups: list[tuple[list[int], int]],
                    shape: MessageShape, d_buffers: int, *results: ClientRows
                    ) -> ByzantineRows:
        """``f`` Byzantine rows (``rows``: messages of ``shape``, as the codec chain sends
        them) and, for a model with buffers, their ``buffers`` rows. ``results`` hold the
        honest updates of the round (omniscient attack) or the Byzantine clients' own
        honest updates, stacked by ``groups`` (``stack_groups``: the clients of each train
        call and its number of results), read back from their payloads as the server
        reads them. The crafted rows go through the chain's client halves (Byzantine
        clients speak the protocol: a sign attacker sends signs), without per-client state
        (error feedback corrects nothing a client crafts afresh each round) and drawing
        from ``(seed, "codec-byzantine", codec, round, j)`` for the ``j``-th row; an attack
        that ``crafts_payload`` sends what the server would decode from payloads it built
        (``reach_chain``: the worst case within each codec's range)."""
        self._round = round_
        if self.codecs:
            results = tuple(decoded(self.codecs, r, shape) for r in results)
        seen = torch.from_numpy(stack_groups(groups, results, shape.width))
        crafted = self._rows(self.attack, seen, f, round_, "attack")
        rows: np.ndarray | Encoded = encode_payload(
            self.codecs, crafted, round_, shape, self.seed, range(f), None, "codec-byzantine") \
            if not self.crafts else \
            reach_chain(self.codecs, torch.from_numpy(crafted), shape).numpy()
        buffers = None
        if d_buffers:
            seen = torch.from_numpy(stack_groups(groups, results, d_buffers, "buffers"))
            buffers = self._rows(self.buffer_attack, seen, f, round_, "attack-buffers")
        return ByzantineRows(rows, buffers)
