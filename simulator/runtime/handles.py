"""Typed handles on the actors: one class per actor class, whose methods have the actor
method's signature with ``Ref``s where the backend passes object references, and return a
``Ref`` of what the actor returns. mypy checks every call the engine makes across the actor
boundary; no method name is written as a string (the backend reads it off the method)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from simulator.messages import (
    ByzantineRows,
    ClientRows,
    EvalData,
    EvalScores,
    PersonalScores,
    Ref,
    ServerCheckpoint,
    StepLayout,
    TrainRequest,
)
from simulator.registry import PluginSpec
from simulator.runtime.adversary import Adversary
from simulator.runtime.backend import Backend
from simulator.runtime.mixer import Mixer
from simulator.runtime.server import Server
from simulator.runtime.worker import ClientWorker
from strategies.protocols import MessageShape


class _Handle:
    def __init__(self, backend: Backend, actor: Any) -> None:
        self.backend = backend
        self.actor = actor  # the Ray actor handle, or the object itself in-process


class WorkerHandle(_Handle):
    """A ``ClientWorker``."""

    def train(self, request: TrainRequest, params: Ref[np.ndarray],
              buffers: Ref[np.ndarray] | None, shared: Ref[np.ndarray] | None = None
              ) -> Ref[ClientRows]:
        return self.backend.call(self.actor, ClientWorker.train, request, params, buffers,
                                 shared)

    def probe(self, specs: list[PluginSpec], clients: list[int], params: Ref[np.ndarray],
              steps: int) -> Ref[list[float]]:
        return self.backend.call(self.actor, ClientWorker.probe, specs, clients, params, steps)

    def use_trainer(self, spec: PluginSpec) -> Ref[None]:
        return self.backend.call(self.actor, ClientWorker.use_trainer, spec)

    def client_states(self) -> Ref[dict[int, dict[str, Any]]]:
        return self.backend.call(self.actor, ClientWorker.client_states)

    def evaluate_personal(self, exclude: tuple[int, ...], eval_data: Ref[EvalData],
                          buffers: Ref[np.ndarray] | None, params: Ref[np.ndarray] | None
                          ) -> Ref[PersonalScores]:
        return self.backend.call(self.actor, ClientWorker.evaluate_personal, exclude, eval_data,
                                 buffers, params)

    def evaluate_spans(self, params: Ref[np.ndarray], buffers: Ref[np.ndarray] | None,
                       eval_data: Ref[EvalData],
                       shares: list[tuple[str, tuple[tuple[int, int], ...]]]
                       ) -> Ref[list[EvalScores]]:
        return self.backend.call(self.actor, ClientWorker.evaluate_spans, params, buffers,
                                 eval_data, shares)

    def load_client_states(self, states: dict[int, dict[str, Any]]) -> Ref[None]:
        return self.backend.call(self.actor, ClientWorker.load_client_states, states)

    def peer_step(self, round_: int, peers: list[int], start: Ref[np.ndarray],
                  mixed: Ref[ClientRows] | None, train: bool) -> Ref[ClientRows]:
        return self.backend.call(self.actor, ClientWorker.peer_step, round_, peers, start, mixed,
                                 train)

    def node(self) -> Ref[str | None]:
        return self.backend.call(self.actor, ClientWorker.node)

    def resources(self) -> Ref[dict[str, Any]]:
        return self.backend.call(self.actor, ClientWorker.resources)

    def peak_memory(self) -> Ref[int]:
        return self.backend.call(self.actor, ClientWorker.peak_memory)


class ServerHandle(_Handle):
    """The ``Server``."""

    def params(self) -> Ref[np.ndarray]:
        return self.backend.call(self.actor, Server.params)

    def broadcast(self) -> Ref[np.ndarray]:
        return self.backend.call(self.actor, Server.broadcast)

    def message_shape(self) -> Ref[MessageShape]:
        return self.backend.call(self.actor, Server.message_shape)

    def buffers(self) -> Ref[np.ndarray]:
        return self.backend.call(self.actor, Server.buffers)

    def shared(self) -> Ref[np.ndarray]:
        return self.backend.call(self.actor, Server.shared)

    def params_at(self, version: int) -> Ref[np.ndarray]:
        return self.backend.call(self.actor, Server.params_at, version)

    def latest_rows(self, clients: list[int]) -> Ref[ClientRows]:
        return self.backend.call(self.actor, Server.latest_rows, clients)

    def buffers_at(self, version: int) -> Ref[np.ndarray]:
        return self.backend.call(self.actor, Server.buffers_at, version)

    def step(self, round_: int, layout: StepLayout, byzantine: Ref[ByzantineRows] | None,
             results: Sequence[Ref[ClientRows]]) -> Ref[dict[str, float]]:
        return self.backend.call(self.actor, Server.step, round_, layout, byzantine, *results)

    def evaluate(self, scores: Sequence[EvalScores] = ()) -> Ref[dict[str, float]]:
        return self.backend.call(self.actor, Server.evaluate, tuple(scores))

    def aim_attack(self, attack: int, client: int) -> Ref[None]:
        return self.backend.call(self.actor, Server.aim_attack, attack, client)

    def run_privacy_attacks(self, truths: dict[int, tuple[np.ndarray, np.ndarray, int]],
                            lr: float,
                            candidates: tuple[np.ndarray, np.ndarray, np.ndarray] | None
                            ) -> Ref[dict[str, float]]:
        return self.backend.call(self.actor, Server.run_privacy_attacks, truths, lr,
                                 candidates)

    def privacy_attack_tables(self) -> Ref[dict[str, dict[str, list]]]:
        return self.backend.call(self.actor, Server.privacy_attack_tables)

    def audit(self) -> Ref[dict[str, float]]:
        return self.backend.call(self.actor, Server.audit)

    def audit_table(self) -> Ref[dict[str, list]]:
        return self.backend.call(self.actor, Server.audit_table)

    def checkpoint(self) -> Ref[ServerCheckpoint]:
        return self.backend.call(self.actor, Server.checkpoint)

    def restore(self, state: ServerCheckpoint) -> Ref[None]:
        return self.backend.call(self.actor, Server.restore, state)

    def state_dict(self) -> Ref[dict[str, Any]]:
        return self.backend.call(self.actor, Server.state_dict)


class AdversaryHandle(_Handle):
    """The ``Adversary``."""

    def attack_rows(self, round_: int, f: int, groups: list[tuple[list[int], int]],
                    shape: MessageShape, d_buffers: int, results: Sequence[Ref[ClientRows]]
                    ) -> Ref[ByzantineRows]:
        return self.backend.call(self.actor, Adversary.attack_rows, round_, f, groups, shape,
                                 d_buffers, *results)


class MixerHandle(_Handle):
    """D-SGD's ``Mixer``."""

    def params(self) -> Ref[np.ndarray]:
        return self.backend.call(self.actor, Mixer.params)

    def gossip(self, round_: int, results: Sequence[Ref[ClientRows]]) -> Ref[ClientRows]:
        return self.backend.call(self.actor, Mixer.gossip, round_, *results)

    def evaluate(self, results: Sequence[Ref[ClientRows]]) -> Ref[dict[str, float]]:
        return self.backend.call(self.actor, Mixer.evaluate, *results)

    def averaged(self, results: Sequence[Ref[ClientRows]]
                 ) -> Ref[tuple[np.ndarray, dict[str, Any]]]:
        return self.backend.call(self.actor, Mixer.averaged, *results)

    def topology_summary(self) -> Ref[dict[str, float]]:
        return self.backend.call(self.actor, Mixer.topology_summary)
