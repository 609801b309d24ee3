"""The Mixer actor: D-SGD's gossip (the topology's mixing matrices, the Byzantine peers'
messages, the gossip defense) and the evaluation of the honest peers' models."""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from simulator.config.plan import Plan
from simulator.errors import guarded
from simulator.messages import ClientRows, EvalData, stack_rows
from simulator.models import build_model
from simulator.registry import instantiate
from simulator.runtime.common import (
    deterministic_mode,
    evaluate_model,
    single_thread,
    torch_threads,
)
from simulator.runtime.pool import Reusable
from simulator.seeding import torch_generator
from strategies.gossip import consensus_distance, sparse_rows
from strategies.protocols import GossipStep


class Mixer(Reusable):
    """D-SGD's gossip and evaluation: the topology's mixing matrices, the Byzantine peers'
    messages (a gossip attack; they depend on each receiver's neighbourhood, so they are made
    where the gossip is computed), the defense, and the evaluation of the honest peers'
    models. Honest peers' models travel as ``ClientRows`` (their ``updates`` rows)."""

    def __init__(self, plan: Plan, honest: list[int], byzantine: list[int],
                 input_shape: tuple[int, ...], num_classes: int, eval_data: EvalData,
                 vocabulary: int | None = None) -> None:
        single_thread()
        deterministic_mode(plan.scenario.runtime.deterministic)
        scenario = plan.scenario
        self.eval_threads = scenario.runtime.eval_threads
        assert scenario.topology is not None
        self.seed = plan.seed
        self.n = scenario.clients.total
        self.honest = np.asarray(honest, dtype=np.int64)
        self.byzantine = np.asarray(byzantine, dtype=np.int64)
        self.topology = instantiate("topologies", scenario.topology)
        self.gossip_steps = scenario.dsgd.gossip_steps
        attack = scenario.attack
        self.attack = instantiate("attacks", attack) if attack and len(self.byzantine) else None
        name = scenario.dsgd.defense
        self.defense = guarded("dsgd.defense", name, instantiate(
            "gossip_defenses", {"name": name}, clip_tau=scenario.dsgd.clip_tau,
            aggregator=instantiate("aggregators", scenario.aggregator)))
        self.model = build_model(scenario.model, input_shape, num_classes, self.seed,
                                 vocabulary)
        self.x0 = parameters_to_vector(self.model.parameters()).detach().clone()
        self.task = instantiate("tasks", scenario.task)
        self.x_test, self.y_test = eval_data.x_test, eval_data.y_test
        self.x_tr, self.y_tr = eval_data.x_train, eval_data.y_train
        self._steps_cache: dict[int, GossipStep] = {}

    def params(self) -> np.ndarray:
        return self.x0.numpy().copy()

    def _step(self, step: int) -> GossipStep:
        """The honest peers' matrices of gossip step ``step``."""
        key = step if self.topology.traits.time_varying else 0
        if key not in self._steps_cache:
            w = self.topology.mixing_matrix(self.n, self.seed, key)
            w_hb = w[np.ix_(self.honest, self.byzantine)]
            w_hh = w[np.ix_(self.honest, self.honest)]
            self._steps_cache[key] = GossipStep(w_hh, sparse_rows(w_hh), w_hb.sum(axis=1),
                                                (w_hb > 0).sum(axis=1))
        return self._steps_cache[key]

    def gossip(self, round_: int, *results: ClientRows) -> ClientRows:
        """``dsgd.gossip_steps`` gossip steps (the scenario's defense) over the honest peers'
        models in ``results``."""
        x = torch.from_numpy(stack_rows(self.honest, results, self.x0.numel()))
        losses = stack_rows(self.honest, results, 0, "losses")
        steps = self.gossip_steps
        for s in range(steps):
            step = self._step(round_ * steps + s)
            messages = None
            if self.attack is not None and (step.w_byz > 0).any():
                messages = self.attack.messages(
                    x, torch.from_numpy(step.w_hh.astype(np.float32)),
                    torch.from_numpy(step.w_byz.astype(np.float32)),
                    torch_generator(self.seed, "attack", round_, s))
            x = self.defense(x, step, messages)
        return ClientRows(self.honest, x.numpy(), losses)

    def _eval_vector(self, x: torch.Tensor, with_train: bool = True) -> tuple[float, float, float]:
        vector_to_parameters(x.clone(), self.model.parameters())
        with torch_threads(self.eval_threads):
            acc, loss, _ = evaluate_model(self.model, self.x_test, self.y_test, self.task)
            train_loss = (evaluate_model(self.model, self.x_tr, self.y_tr, self.task)[1]
                          if with_train else float("nan"))
        return float("nan") if acc is None else acc, loss, train_loss

    def evaluate(self, *results: ClientRows) -> dict[str, float]:
        """Mean over honest peers of their own models' test accuracy and loss, the averaged
        model's accuracy, test and train loss and generalization gap, consensus distance."""
        x = torch.from_numpy(stack_rows(self.honest, results, self.x0.numel()))
        per_peer = [self._eval_vector(row, with_train=False) for row in x]
        avg_acc, avg_loss, avg_train = self._eval_vector(x.mean(dim=0))
        losses = stack_rows(self.honest, results, 0, "losses")
        return {
            "test_accuracy": float(np.mean([p[0] for p in per_peer])),
            "test_loss": float(np.mean([p[1] for p in per_peer])),
            "min_peer_accuracy": float(min(p[0] for p in per_peer)),
            "averaged_test_accuracy": avg_acc,
            "averaged_test_loss": avg_loss,
            "train_loss": avg_train,
            "generalization_gap": avg_loss - avg_train,
            "consensus_distance": consensus_distance(x),
            "client_loss": float(np.nanmean(losses)) if np.isfinite(losses).any() else float("nan"),
        }

    def averaged(self, *results: ClientRows) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
        """The honest peers' averaged model: flat vector and torch state_dict."""
        x = torch.from_numpy(stack_rows(self.honest, results, self.x0.numel())).mean(dim=0)
        vector_to_parameters(x.clone(), self.model.parameters())
        return x.numpy(), {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def topology_summary(self) -> dict[str, float]:
        """The topology's spectral gap and degree (``strategies.topologies.topology_summary``)."""
        from strategies.topologies import topology_summary

        return dict(topology_summary(self.topology, self.n, self.seed))
