"""The server's half of the scenario's privacy attacks (``privacy_attacks:``): it keeps what
a reconstruction attack targets when that round's step runs (the global model the client
started from, and the client's row as received or the round's released aggregate), runs the
attacks at the end of the run, and scores them against data the attacks never see
(strategies/privacy_attacks.py says how).

Metrics, at the last round, named after the attack: ``<name>_psnr`` (dB, the mean over the
client's samples of the matched reconstruction's PSNR), ``<name>_ssim`` (image inputs),
``<name>_label_accuracy``, ``<name>_success`` (Hayes et al.: the reconstruction's nearest
among ``candidates`` training samples is the target; a fraction of the client's samples);
a membership attack's ``<name>_auc`` and ``<name>_advantage`` (TPR - FPR of the best
threshold on half the queries, measured on the other half: an unbiased estimate, which may
be below 0). Tables (artifacts): each
reconstructed sample beside the true one.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.utils import vector_to_parameters

from simulator.config.plan import Plan, ShadowRun
from simulator.errors import UsageError
from simulator.messages import EvalData
from simulator.registry import instantiate
from simulator.runtime.common import model_input
from simulator.seeding import numpy_rng, torch_generator
from strategies.privacy_attacks import (
    auc_advantage,
    balanced_inclusion,
    match,
    nearest_is_target,
    psnr,
    ssim,
    tpr_at_fpr,
)
from strategies.protocols import AttackView

LOG = logging.getLogger(__name__)
MAX_QUERIES = 2000  # a membership attack's members, and as many non-members, at most


def shadow_candidates(sizes: np.ndarray, seed: int, shadow: ShadowRun
                      ) -> tuple[np.ndarray, np.ndarray]:
    """A shadow-run attack's candidates: ``shadow.candidates`` rows of the clients' table
    (clients of ``sizes`` samples, in client order), drawn from the point's ``seed`` (the
    same in each of its runs), never a client's first sample (no client is left without
    one), sorted; and whether this run (``shadow.run``) trains on each (exactly half of the
    runs train on a candidate: ``balanced_inclusion``)."""
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    eligible = np.setdiff1d(np.arange(offsets[-1]), offsets[:-1])
    if shadow.candidates > len(eligible):
        raise UsageError(f"privacy_attacks[{shadow.attack}].candidates: at most "
                         f"{len(eligible):,} (the training samples but each client's first), "
                         f"got {shadow.candidates:,}")
    rows = np.sort(numpy_rng(seed, "shadow_runs", "candidates").choice(
        eligible, shadow.candidates, replace=False))
    included = balanced_inclusion(numpy_rng(seed, "shadow_runs", "inclusion"),
                                  shadow.candidates, shadow.runs)[shadow.run]
    return rows, included


class AttackTargets:
    """The scenario's privacy attacks on the server (see the module docstring)."""

    def __init__(self, plan: Plan, eval_data: EvalData, num_classes: int) -> None:
        sc = plan.scenario
        self.plan, self.seed = plan, plan.seed
        self.specs = list(sc.privacy_attacks)
        self.attacks = [instantiate("privacy_attacks", s) for s in self.specs]
        self.num_classes = num_classes
        self.eval_data = eval_data
        # the training samples the server holds, as the model takes them: the data's range,
        # and the candidates a reconstruction's success is scored among
        self.pool = model_input(eval_data.x_train)
        x = self.pool
        self.input_range = (float(x.min()), float(x.max())) if len(x) else (0.0, 1.0)
        self.aimed: dict[int, int] = {}  # attack -> the client it targets in the next step
        # attack -> what it targets: {"client", "x" (the model it started from), "update"}
        self.kept: dict[int, dict[str, Any]] = {}

    def aim(self, attack: int, client: int) -> None:
        """Attack ``attack`` targets ``client`` in the next step."""
        self.aimed[attack] = client

    def keep_rows(self, x: torch.Tensor, clients: list[int], honest: torch.Tensor) -> None:
        """The step's honest rows (``clients``' order): an ``update`` target's row kept."""
        d = int(x.numel())
        for i, client in self.aimed.items():
            if self.attacks[i].target == "update" and client in clients:
                self.kept[i] = {"client": client, "x": x.clone(),
                                "update": honest[clients.index(client), :d].clone()}

    def keep_release(self, x: torch.Tensor, aggregate: torch.Tensor) -> None:
        """The step's released aggregate: a ``release`` target's."""
        d = int(x.numel())
        for i, client in self.aimed.items():
            if self.attacks[i].target == "release":
                self.kept[i] = {"client": client, "x": x.clone(),
                                "update": aggregate[:d].clone()}

    def step_done(self) -> None:
        self.aimed = {}

    def run(self, model: nn.Module, x_final: torch.Tensor, lr: float,
            truths: dict[int, tuple[np.ndarray, np.ndarray, int]],
            candidates: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
            ) -> tuple[dict[str, float], dict[str, dict[str, list]]]:
        """Every attack's metrics and tables; ``truths``: a reconstruction's client's
        samples, labels and local steps; ``candidates``: a shadow-run attack's samples,
        labels and inclusion in this run."""
        model = copy.deepcopy(model).cpu().eval()
        metrics: dict[str, float] = {}
        tables: dict[str, dict[str, list]] = {}
        for i, (spec, attack) in enumerate(zip(self.specs, self.attacks, strict=True)):
            name = spec["name"]
            gen = torch_generator(self.seed, "privacy_attack", i)
            if attack.traits.reconstructs:
                if i not in self.kept or i not in truths:
                    LOG.warning("fedray: privacy attack %s: its client sent no update in round "
                                "%d (dropped out); no reconstruction", name, attack.round)
                    metrics.update({f"{name}_{k}": math.nan for k in
                                    ("psnr", "ssim", "label_accuracy", "success")})
                    continue
                m, table = self._reconstruct(i, attack, model, lr, truths[i], gen)
                metrics.update({f"{name}_{k}": v for k, v in m.items()})
                tables[f"attack_{name}"] = table
            elif attack.runs > 1:
                assert candidates is not None
                m, table = self._shadow_run(attack, model, x_final, candidates)
                metrics.update({f"{name}_{k}": v for k, v in m.items()})
                tables[f"attack_{name}"] = table
            else:
                metrics.update({f"{name}_{k}": v for k, v in
                                self._membership(attack, model, x_final).items()})
        return metrics, tables

    def _reconstruct(self, i: int, attack: Any, model: nn.Module, lr: float,
                     truth: tuple[np.ndarray, np.ndarray, int], gen: torch.Generator
                     ) -> tuple[dict[str, float], dict[str, list]]:
        kept = self.kept[i]
        vector_to_parameters(kept["x"].clone(), model.parameters())
        xs, ys = model_input(truth[0]), torch.from_numpy(np.array(truth[1], dtype=np.int64))
        view = AttackView(model, kept["update"], len(ys), lr, int(truth[2]),
                          tuple(xs.shape[1:]), self.num_classes, self.input_range)
        out = attack.attack(view, gen)
        rec, labels = out.inputs.reshape(xs.shape).to(torch.float32), out.labels
        span = self.input_range[1] - self.input_range[0] or 1.0
        pick = match(rec, xs, span)
        rec, labels = rec[pick], labels[pick]
        quality = psnr(rec, xs, span).diagonal().clamp(max=1e6)
        images = xs.dim() >= 3
        similar = ssim(rec, xs, span) if images else None
        found = [nearest_is_target(rec[j], self._candidates(xs[j], attack.candidates, i, j))
                 for j in range(len(xs))]
        metrics = {"psnr": float(quality.mean()),
                   "ssim": float(similar.mean()) if similar is not None else math.nan,
                   "label_accuracy": float((labels == ys).double().mean()),
                   "success": float(np.mean(found))}
        table = {"sample": list(range(len(xs))), "client": [kept["client"]] * len(xs),
                 "label": ys.tolist(), "reconstructed_label": labels.tolist(),
                 "psnr": quality.tolist(),
                 "truth": xs.reshape(len(xs), -1).tolist(),
                 "reconstruction": rec.reshape(len(xs), -1).tolist(),
                 "shape": [list(xs.shape[1:])] * len(xs)}
        return metrics, table

    def _candidates(self, target: torch.Tensor, n: int, attack: int, sample: int
                    ) -> torch.Tensor:
        """The target first, then ``n - 1`` training samples other than it (seeded)."""
        pool = self.pool
        same = (pool.reshape(len(pool), -1) == target.reshape(1, -1)).all(dim=1)
        others = np.flatnonzero(~same.numpy())
        rng = numpy_rng(self.seed, "privacy_attack", attack, "candidates", sample)
        pick = rng.choice(others, size=min(n - 1, len(others)), replace=False)
        return torch.cat([target.unsqueeze(0), pool[np.sort(pick)]])

    def _membership(self, attack: Any, model: nn.Module, x_final: torch.Tensor
                    ) -> dict[str, float]:
        """Training samples (members) against test samples, as many of each (seeded)."""
        vector_to_parameters(x_final.clone(), model.parameters())
        e = self.eval_data
        n = min(len(e.y_train), len(e.y_test), MAX_QUERIES)
        rng = numpy_rng(self.seed, "privacy_attack", "membership")
        tr = np.sort(rng.choice(len(e.y_train), n, replace=False))
        te = np.sort(rng.choice(len(e.y_test), n, replace=False))
        x = torch.cat([model_input(e.x_train[tr]), model_input(e.x_test[te])])
        y = torch.from_numpy(np.concatenate([e.y_train[tr], e.y_test[te]]).astype(np.int64))
        member = np.r_[np.ones(n, bool), np.zeros(n, bool)]
        scores = self._scores(attack, model, x, y)
        return auc_advantage(scores, member, rng)

    def _shadow_run(self, attack: Any, model: nn.Module, x_final: torch.Tensor,
                    candidates: tuple[np.ndarray, np.ndarray, np.ndarray]
                    ) -> tuple[dict[str, float], dict[str, list]]:
        """A shadow-run attack's scores of the candidates on this run's final model (its
        table, which ``fedray privacy shadows`` combines over the runs), and what they
        tell alone: AUC, held-out advantage and TPR at 1 % FPR of the score as it is,
        candidates trained on against the others."""
        vector_to_parameters(x_final.clone(), model.parameters())
        xs, ys, member = candidates
        scores = self._scores(attack, model, model_input(xs),
                              torch.from_numpy(np.asarray(ys, dtype=np.int64)))
        rng = numpy_rng(self.seed, "privacy_attack", "shadow_run")
        table = {"candidate": list(range(len(ys))), "label": np.asarray(ys).tolist(),
                 "included": member.tolist(), "score": scores.tolist()}
        return {**auc_advantage(scores, member, rng),
                "tpr_at_fpr_0.01": tpr_at_fpr(scores, member, 0.01)}, table

    def _scores(self, attack: Any, model: nn.Module, x: torch.Tensor, y: torch.Tensor
                ) -> np.ndarray:
        """A membership attack's scores of the queries ``(x, y)`` on ``model``."""
        view = AttackView(model, None, len(y), 0.0, 0, tuple(x.shape[1:]), self.num_classes,
                          self.input_range, (x, y))
        out = attack.attack(view, torch_generator(self.seed, "privacy_attack", "membership"))
        return np.asarray(out.scores.numpy(), dtype=np.float64)

    def checkpoint(self) -> dict[int, dict[str, Any]]:
        return {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in t.items()}
                for i, t in self.kept.items()}

    def restore(self, state: dict[int, dict[str, Any]]) -> None:
        self.kept = {int(i): dict(t) for i, t in state.items()}
