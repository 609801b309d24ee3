"""The server's evaluation of the global model (``ServerEvaluation``, held by the Server): the
test metrics and the train loss, per-client accuracy where the test samples have clients,
and a targeted attack's success rate on its triggered test set (a backdoor's), built once."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from simulator.config.plan import Plan
from simulator.errors import guarded
from simulator.messages import EvalData, EvalScores
from simulator.registry import instantiate
from simulator.runtime.common import (
    client_accuracy,
    combine_scores,
    evaluate_model,
    gather_scores,
    model_input,
    torch_threads,
)
from strategies.protocols import Task


class ServerEvaluation:
    """The held-out data and what is measured on it (module docstring)."""

    def __init__(self, plan: Plan, eval_data: EvalData, task: Task) -> None:
        self.task, self.threads = task, plan.scenario.runtime.eval_threads
        self.x_test, self.y_test = eval_data.x_test, eval_data.y_test
        self.x_tr, self.y_tr, self.c_test = eval_data.x_train, eval_data.y_train, \
            eval_data.test_clients
        # a targeted attack's success set (a backdoor's triggered test samples), built once
        self.x_asr: np.ndarray | None = None
        self.y_asr: np.ndarray | None = None
        if plan.attack is not None and plan.attack.targeted:
            attack = instantiate("attacks", plan.attack.spec)
            xt, yt = guarded("attack", plan.attack.spec["name"], attack.triggered)(
                model_input(self.x_test), torch.from_numpy(np.array(self.y_test)))
            self.x_asr, self.y_asr = xt.numpy(), yt.numpy()

    def evaluate(self, model: nn.Module, load: Callable[[], None],
                 scores: tuple[EvalScores, ...] = ()) -> dict[str, float]:
        """The global model's test metrics and train loss: from ``scores``, the ClientWorkers'
        shares of a data-parallel evaluation (the same numbers: ``eval_shares``), when given;
        else computed on ``model`` once ``load`` put the global model in it. A targeted
        attack's success rate is measured here."""
        if scores:
            (acc, loss, hits), (_, train_loss, _) = (
                combine_scores(*gather_scores(scores, part)) for part in ("test", "train"))
        else:
            load()
            with torch_threads(self.threads):
                acc, loss, hits = evaluate_model(model, self.x_test, self.y_test, self.task)
                _, train_loss, _ = evaluate_model(model, self.x_tr, self.y_tr, self.task)
        per_client = (client_accuracy(hits, self.c_test)
                      if self.c_test is not None and hits is not None else {})
        if self.x_asr is not None and self.y_asr is not None:
            if scores:
                load()
            with torch_threads(self.threads):
                asr, _, _ = evaluate_model(model, self.x_asr, self.y_asr, self.task)
            per_client["attack_success_rate"] = float("nan") if asr is None else asr
        return {**{f"test_{k}": v for k, v in self.task.metrics(loss, acc).items()},
                "train_loss": train_loss, **per_client}
