"""What a ClientWorker does besides training its clients' round: evaluation (its clients'
personal models, its share of a data-parallel evaluation of the global model) and D-SGD's
peer models, which live in the worker that trains them. Mixins of ``ClientWorker``
(simulator/runtime/worker.py), typed against ``WorkerHost``, what they use of it."""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np
import torch

from simulator.config.plan import Plan
from simulator.messages import ClientRows, EvalData, EvalScores, PersonalScores
from simulator.registry import instantiate
from simulator.runtime.common import evaluate_model, score_spans, torch_threads, vector_to_buffers
from simulator.runtime.state import ClientStateStore
from strategies.protocols import PERSONAL, ClientData


class WorkerHost(Protocol):
    """What the jobs use of their ClientWorker."""

    plan: Plan
    model: torch.nn.Module
    device: torch.device
    buffer_dim: int
    local_buffers: bool
    norm_mask: torch.Tensor | None
    client_state: ClientStateStore
    client_buffers: ClientStateStore
    peer_x: dict[int, torch.Tensor]

    def read(self, clients: list[int]) -> None: ...
    def client_data(self, round_: int, client: int) -> ClientData: ...
    def _run(self, round_: int, clients: list[ClientData], start: torch.Tensor
             ) -> tuple[np.ndarray, np.ndarray]: ...


class EvaluationJobs:
    """A worker's evaluations."""

    def evaluate_personal(self: WorkerHost, exclude: tuple[int, ...], eval_data: EvalData,
                          buffers: np.ndarray | None = None,
                          params: np.ndarray | None = None) -> PersonalScores:
        """The accuracy of each personal model this worker holds on its client's own test
        samples, the clients in ``exclude`` (the Byzantine ones) left out, as are clients
        without test samples. A personal model is a client rule's (``traits.personal``:
        Ditto), else under ``server.buffers: fedbn`` the global ``params`` with the client's
        own BatchNorm weights. A model with buffers evaluates with the client's own
        (``server.buffers: local``, ``fedbn``) or the server's ``buffers``."""
        c_test = eval_data.test_clients
        out = set(exclude)
        if self.plan.personal:
            held = sorted(c for c, st in self.client_state.items()
                          if PERSONAL in st and c not in out)
        else:  # fedbn: the clients holding their own BatchNorm weights
            held = sorted(c for c, st in self.client_buffers.items()
                          if "norm" in st and c not in out)
        if c_test is None or not held:
            return PersonalScores(np.empty(0, np.int64), np.empty(0))
        order = np.argsort(c_test, kind="stable")
        bounds = np.searchsorted(c_test[order], np.stack([held, np.add(held, 1)]))
        task = instantiate("tasks", self.plan.scenario.task)
        weights = list(self.model.parameters())
        ids, accs = [], []
        for c, lo, hi in zip(held, bounds[0], bounds[1], strict=True):
            if lo == hi:
                continue
            idx = np.sort(order[lo:hi])
            if self.plan.personal:
                vec = self.client_state.get(c)[PERSONAL]
            else:
                assert params is not None and self.norm_mask is not None
                vec = torch.from_numpy(np.array(params, dtype=np.float32))
                vec[self.norm_mask] = self.client_buffers.get(c)["norm"]
            torch.nn.utils.vector_to_parameters(vec.to(self.device), weights)
            if self.buffer_dim:
                own = self.client_buffers.get(c).get("buffers") if self.local_buffers else None
                assert own is not None or buffers is not None, "a model with buffers needs them"
                vector_to_buffers(own if own is not None else
                                  torch.from_numpy(np.array(buffers, np.float32)), self.model)
            acc, _, _ = evaluate_model(self.model, eval_data.x_test[idx],
                                       eval_data.y_test[idx], task)
            if acc is not None:
                ids.append(c)
                accs.append(acc)
        return PersonalScores(np.asarray(ids, np.int64), np.asarray(accs, np.float64))

    def evaluate_spans(self: WorkerHost, params: np.ndarray, buffers: np.ndarray | None,
                       eval_data: EvalData, shares: list[tuple[str, tuple[tuple[int, int], ...]]]
                       ) -> list[EvalScores]:
        """This worker's share of a data-parallel evaluation of the global model ``params``
        (and ``buffers``): for each ``(part, spans)`` of ``shares``, every sample's loss and
        accuracy, computed as the server computes them (its ``runtime.eval_threads``
        threads, the same spans), so the combined numbers are the server's own."""
        torch.nn.utils.vector_to_parameters(
            torch.from_numpy(np.array(params, dtype=np.float32)).to(self.device),
            self.model.parameters())
        if self.buffer_dim:
            assert buffers is not None, "a model with buffers needs the server's buffers"
            vector_to_buffers(torch.from_numpy(np.array(buffers, np.float32)), self.model)
        task = instantiate("tasks", self.plan.scenario.task)
        out = []
        with torch_threads(self.plan.scenario.runtime.eval_threads):
            for part, spans in shares:
                x, y = ((eval_data.x_test, eval_data.y_test) if part == "test"
                        else (eval_data.x_train, eval_data.y_train))
                out.append(EvalScores(part, spans, *score_spans(self.model, x, y, task, spans)))
        return out



class PeerModels:
    """D-SGD's peer models, kept in the worker that trains them."""

    def peer_step(self: WorkerHost, round_: int, peers: list[int], start: np.ndarray,
                  mixed: ClientRows | None = None, train: bool = True) -> ClientRows:
        """A D-SGD phase for this worker's ``peers``, whose models live here: take their rows
        from ``mixed`` (a gossip result; ``start`` at first), then (``train``) run the trainer
        from each peer's own model. Returns the peers' models as ``updates`` rows."""
        t0 = time.perf_counter()
        x0 = torch.from_numpy(np.array(start, dtype=np.float32))
        for p in peers:  # new here: at the start, or moved off a lost worker
            self.peer_x.setdefault(int(p), x0)
        if mixed is not None:
            pos = {int(c): i for i, c in enumerate(mixed.clients)}
            for p in peers:
                self.peer_x[int(p)] = torch.from_numpy(np.array(mixed.dense[pos[int(p)]]))
        rows = np.empty((len(peers), x0.numel()), dtype=np.float32)
        losses = np.full(len(peers), np.nan)
        if train:
            self.read(peers)
        for i, p in enumerate(peers):
            if train:
                update, loss = self._run(round_, [self.client_data(round_, int(p))],
                                         self.peer_x[int(p)])
                losses[i] = loss[0]
                self.peer_x[int(p)] = self.peer_x[int(p)] + torch.from_numpy(update[0])
            rows[i] = self.peer_x[int(p)].numpy()
        return ClientRows(np.asarray(peers, dtype=np.int64), rows, losses,
                          time.perf_counter() - t0)
