"""The Server, Adversary and Mixer actors. Plain Python classes: the ray backend wraps them
with ``ray.remote``, the inline backend calls them in-process, so both run exactly the same
code. Each receives the Plan of its run (``simulator.plan``) and exchanges the typed
messages of ``simulator.messages``; the engine calls them through their typed handles
(``simulator.runtime.handles``).

Across the Ray boundary parameters and updates travel as float32 NumPy arrays (zero-copy
reads from the object store); ``ray.get`` gives read-only views, so nothing here updates an
argument in place.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from simulator.errors import TooFewRows, guarded
from simulator.messages import (
    ByzantineRows,
    ClientRows,
    EvalData,
    EvalScores,
    RowBuffer,
    ServerCheckpoint,
    StepLayout,
    stack_groups,
    stack_rows,
)
from simulator.models import build_model
from simulator.plan import Plan, build_codecs, build_server_optimizer
from simulator.registry import instantiate
from simulator.runtime.common import (
    buffers_to_vector,
    client_accuracy,
    combine_buffers,
    combine_scores,
    evaluate_model,
    float_buffer_mask,
    gather_scores,
    model_input,
    norm_parameter_mask,
    resolve_device,
    single_thread,
    torch_threads,
    vector_to_buffers,
)
from simulator.runtime.pipeline import Pipeline
from simulator.seeding import torch_generator
from strategies.codecs import decode_rows, encode_rows, finish
from strategies.geometry import group_means
from strategies.gossip import consensus_distance, sparse_rows
from strategies.protocols import GossipStep
from strategies.trainers import local_sgd, minibatches

LOG = logging.getLogger("fedray.server")


class Adversary:
    """Produces the Byzantine rows of a round with the scenario's attack plugin."""

    def __init__(self, plan: Plan) -> None:
        single_thread()
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

    def _rows(self, attack: Any, seen: torch.Tensor, f: int, round_: int, purpose: str
              ) -> np.ndarray:
        rows = guarded("attack", self.name, attack)(
            seen, f, torch_generator(self.seed, purpose, round_))
        if tuple(rows.shape) != (f, seen.shape[1]):
            raise ValueError(f"attack: returned shape {tuple(rows.shape)}, expected "
                             f"{(f, seen.shape[1])}")
        return encode_rows(self.codecs, rows.to(torch.float32).numpy())

    def attack_rows(self, round_: int, f: int, groups: list[tuple[list[int], int]], d: int,
                    d_buffers: int, *results: ClientRows) -> ByzantineRows:
        """``f`` Byzantine rows (``rows``) and, for a model with buffers, their ``buffers``
        rows. ``results`` hold the honest updates of the round (omniscient attack) or the
        Byzantine clients' own honest updates, stacked by ``groups`` (``stack_groups``:
        the clients of each train call and its number of results)."""
        self._round = round_
        rows = self._rows(self.attack, torch.from_numpy(stack_groups(groups, results, d)), f,
                          round_, "attack")
        buffers = None
        if d_buffers:
            seen = torch.from_numpy(stack_groups(groups, results, d_buffers, "buffers"))
            buffers = self._rows(self.buffer_attack, seen, f, round_, "attack-buffers")
        return ByzantineRows(rows, buffers)


def _timings(t0: float, results: tuple[ClientRows, ...]) -> dict[str, float]:
    """The round's times: the server's step since ``t0``, the workers' training summed and
    the slowest worker's (a round waits for it)."""
    seconds = [float(r.seconds) for r in results]
    return {"server_seconds": time.perf_counter() - t0, "train_seconds": sum(seconds),
            "slowest_worker_seconds": max(seconds, default=0.0)}


SKIPS_NAMED = 3  # skipped rounds named on the terminal; the aggregation_skipped metric counts all


class Server:
    """Owns the global model, the aggregation pipeline (pre-aggregators -> aggregator ->
    meta-aggregator), the server optimizer, and evaluation on the held-out data."""

    def __init__(self, plan: Plan, input_shape: tuple[int, ...], num_classes: int,
                 eval_data: EvalData, vocabulary: int | None = None) -> None:
        single_thread()
        scenario = plan.scenario
        self.eval_threads = scenario.runtime.eval_threads
        seed = plan.seed
        self.model = build_model(scenario.model, input_shape, num_classes, seed, vocabulary)
        self.x = parameters_to_vector(self.model.parameters()).detach().clone()
        self.b = buffers_to_vector(self.model)  # the global model's buffers (BatchNorm)
        # aggregation and evaluation run on the server's device; its state stays on the host
        self.agg_device = resolve_device(scenario.runtime.server_device)
        self.model.to(self.agg_device)
        self.b_stats = float_buffer_mask(self.model)  # statistics, not batch counters
        self.buffer_rule = plan.buffer_rule
        self.pipeline = Pipeline.from_plan(plan.pipeline, seed)
        self.optimizer = build_server_optimizer(scenario)
        self.message = plan.message  # a row is a whole message, its parts side by side
        self.norm_mask = norm_parameter_mask(self.model).cpu() \
            if plan.local_norm and self.b.numel() else None
        self.optimizer_name = scenario.server.optimizer["name"]
        # the message path's server halves (client-level DP among them: DP-FedAvg clips
        # each row and noises the aggregate here; sample-level DP acts in the trainer)
        self.codecs = build_codecs(plan)
        self.seed = seed
        self.skips = 0  # rounds whose aggregation was skipped (the first SKIPS_NAMED named)
        self.task = instantiate("tasks", scenario.task)
        self.x_test, self.y_test = eval_data.x_test, eval_data.y_test
        self.x_tr, self.y_tr, self.c_test = eval_data.x_train, eval_data.y_train, \
            eval_data.test_clients
        # FLTrust's root set: server.root_samples training samples, drawn once (seeded)
        self.root: tuple[torch.Tensor, torch.Tensor] | None = None
        self.local = scenario.local
        if self.pipeline.aggregator.traits.reference:
            pick = np.sort(np.random.default_rng([seed, 0xF7]).choice(
                len(self.y_tr), size=min(scenario.server.root_samples, len(self.y_tr)),
                replace=False))
            self.root = (model_input(self.x_tr[pick]),
                         torch.from_numpy(np.array(self.y_tr[pick])))
        # a targeted attack's success set (a backdoor's triggered test samples), built once
        self.x_asr: np.ndarray | None = None
        self.y_asr: np.ndarray | None = None
        if plan.attack is not None and plan.attack.targeted:
            attack = instantiate("attacks", plan.attack.spec)
            xt, yt = guarded("attack", plan.attack.spec["name"], attack.triggered)(
                model_input(self.x_test), torch.from_numpy(np.array(self.y_test)))
            self.x_asr, self.y_asr = xt.numpy(), yt.numpy()
        # asynchronous modes: the model's version (server steps so far) and the older
        # versions clients still train from ({version: [parameters, buffers]})
        self.mode = plan.mode
        self.basgd_buffers = plan.asynchrony.buffers if plan.asynchrony is not None else 0
        self.version = 0
        self.versions: dict[int, list[torch.Tensor]] = {}
        self.latest: dict[int, torch.Tensor] = {}  # server.mode latest: each client's last row
        self.row_buffer = RowBuffer()  # the round's update matrix, its pages kept mapped

    @property
    def dim(self) -> int:
        """The length of a client's row: its whole message (``plan.message``)."""
        return self.message.width(int(self.x.numel()))

    def _on_delta(self, rows: torch.Tensor, op: Any) -> torch.Tensor:
        """``op`` applied to the model-delta part of ``rows`` (the mode's transforms: FedAsync's
        mixing, staleness scales), the message's other parts as they are."""
        d = int(self.x.numel())
        if rows.shape[1] == d:
            return op(rows)
        return torch.cat([op(rows[:, :d]), rows[:, d:]], dim=1)

    def shared(self) -> np.ndarray:
        """The server optimizer's broadcast state (SCAFFOLD's control variate; empty
        without one, or before its first step)."""
        c = self.optimizer.shared()
        return np.empty(0, dtype=np.float32) if c is None else c.numpy().copy()

    def params(self) -> np.ndarray:
        return self.x.numpy().copy()

    def buffers(self) -> np.ndarray:
        """The global model's buffers (empty for a model without any)."""
        return self.b.numpy().copy()

    def _step_buffers(self, honest: torch.Tensor, byzantine: np.ndarray | None
                      ) -> dict[str, float]:
        """The global buffers from the round's reported ones (``honest`` rows, then the
        Byzantine rows), by ``server.buffers``' rule; non-finite results leave them as they
        were."""
        # np.array: a copy, since the adversary's rows arrive as read-only views of Ray's store
        rows = honest if byzantine is None else torch.cat(
            [honest, torch.from_numpy(np.array(byzantine, dtype=np.float32))])
        new = combine_buffers(rows, self.buffer_rule)
        finite = bool(torch.isfinite(new).all())
        if finite:
            self.b = new
        gap = (new - honest.mean(dim=0))[self.b_stats]
        # how far the statistics are from the honest participants' mean (counters left out)
        return {"buffer_aggregation_error": float(torch.linalg.vector_norm(gap))
                if finite else float("inf")}

    def _skipped(self, round_: int, why: str) -> None:
        """A round whose aggregation is skipped (the model stays): logged, 1-based as the
        progress lines count, for the first SKIPS_NAMED of a run (a run with frequent empty
        rounds would fill the terminal); the aggregation_skipped metric counts them all."""
        self.skips += 1
        if self.skips <= SKIPS_NAMED:
            last = ("; further skipped rounds are not printed (the aggregation_skipped "
                    "metric counts them)" if self.skips == SKIPS_NAMED else "")
            LOG.warning("fedray: round %d: aggregation skipped: %s%s", round_ + 1, why, last)

    def params_at(self, version: int) -> np.ndarray:
        """The parameters of model ``version`` (the current one, or one the asynchronous
        modes keep while clients train from it)."""
        x = self.x if version == self.version else self.versions[version][0]
        return x.numpy().copy()

    def latest_rows(self, clients: list[int]) -> ClientRows:
        """The latest rows of ``clients`` (``server.mode: latest``), as one train call's
        results: what an omniscient attack sees of the honest clients there."""
        rows = np.stack([self.latest[c].numpy() for c in clients]) if clients else \
            np.empty((0, self.dim), dtype=np.float32)
        return ClientRows(np.asarray(clients, dtype=np.int64), rows,
                          np.zeros(len(clients)))

    def buffers_at(self, version: int) -> np.ndarray:
        b = self.b if version == self.version else self.versions[version][1]
        return b.numpy().copy()

    def _rows(self, layout: StepLayout, honest: torch.Tensor, byz: np.ndarray | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(the step's rows, its honest rows, their weights), as the server's mode makes
        them: FedAsync's row of an update is the client's model minus the server's
        (``x_v + update - x``, so that a step of 1 replaces the model by the client's);
        rows scaled by their staleness; BASGD's rows are its
        buffers' means."""
        rows = honest if byz is None else torch.cat(
            [honest, torch.from_numpy(np.array(byz, dtype=np.float32))]  # writable copy
        )
        if self.mode.mixing:
            versions = layout.honest_versions + [v for _, v in layout.byzantine]
            base = {v: self.versions[v][0] - self.x for v in set(versions)
                    if v != self.version}
            gap = torch.stack([base[v] if v in base else torch.zeros_like(self.x)
                               for v in versions])
            rows = self._on_delta(rows, lambda r: r + gap)
        if layout.scales is not None:
            scales = torch.tensor(layout.scales, dtype=torch.float64)[:, None].to(rows.dtype)
            rows = self._on_delta(rows, lambda r: r * scales)
        n_honest = honest.shape[0]
        honest_rows = rows[:n_honest]
        if layout.table is not None:  # Dahan & Levy: every client's latest row
            ids = [c for _, clients, _ in layout.groups for c in clients] + \
                [c for c, _ in layout.byzantine]
            for c, row in zip(ids, rows):
                self.latest[c] = row.clone()
            rows = torch.stack([self.latest[c] for c in layout.table])
            byz_ids = set(layout.table_byzantine)
            honest_rows = rows[[i for i, c in enumerate(layout.table) if c not in byz_ids]]
        if layout.buffer_of is not None:  # BASGD: each buffer's mean (as bucketing's)
            rows = group_means(rows, torch.tensor(layout.buffer_of, dtype=torch.int64),
                               self.basgd_buffers)
        weights = (torch.tensor(layout.weights, dtype=torch.float64)
                   if layout.weights is not None else None)
        return rows, honest_rows, weights

    def step(self, round_: int, layout: StepLayout, byzantine: ByzantineRows | None,
             *results: ClientRows) -> dict[str, float]:
        """Aggregate the step's updates (the honest rows of ``layout``'s groups, then the
        Byzantine ``rows`` and ``buffers``), step the global model, and return the step's
        server-side metrics. In the asynchronous modes the model version advances, and the
        server keeps the versions ``layout.keep`` names."""
        x_before, b_before = self.x, self.b
        metrics = self._step(round_, layout, byzantine, results)
        if self.mode.clock:
            kept = {**self.versions, self.version: [x_before, b_before]}
            self.version += 1
            self.versions = {v: kept[v] for v in layout.keep if v != self.version}
        return metrics

    def _step(self, round_: int, layout: StepLayout, byzantine: ByzantineRows | None,
              results: tuple[ClientRows, ...]) -> dict[str, float]:
        t0 = time.perf_counter()
        groups = [(clients, n) for _, clients, n in layout.groups]
        honest = torch.from_numpy(stack_groups(groups, results, self.dim, into=self.row_buffer))
        byz = byzantine.rows if byzantine is not None and len(byzantine.rows) else None
        rows, honest_rows, weights = self._rows(layout, honest, byz)
        losses = stack_groups(groups, results, 0, "losses")
        rows = decode_rows(self.codecs, rows)  # DP-FedAvg: every row clipped
        d = int(self.x.numel())
        width = self.message.row_width(d)  # the robust pipeline's columns
        robust = rows if width == rows.shape[1] else rows[:, :width]
        agg = None
        if not len(honest_rows):
            self._skipped(round_, "no sampled honest client sent an update (dropout, "
                                  "stragglers)")
        else:
            try:
                reference = self._root_update(round_) if self.root is not None else None
                agg = self.pipeline.aggregate(robust.to(self.agg_device), round_, weights,
                                              reference).cpu()
            except TooFewRows as e:  # too few rows left this round (dropouts, stragglers)
                self._skipped(round_, str(e))
        if agg is None:  # nothing to aggregate: the model stays, the round is counted
            return {"aggregation_skipped": 1.0,
                    "client_loss": float(losses.mean()) if len(losses) else float("nan"),
                    **_timings(t0, results)}
        if self.codecs:  # DP-FedAvg: the noise on the mean
            agg = finish(self.codecs, agg, rows.shape[0],
                         torch_generator(self.seed, "dp-noise", round_))
        if self.norm_mask is not None:  # fedbn: BatchNorm weights stay with the clients,
            agg[: self.norm_mask.numel()][self.norm_mask] = 0.0  # whatever Byzantine rows say
        honest_mean = honest_rows[:, :width].mean(dim=0)
        buffer_metrics = {}
        if self.b.numel():
            byz_buffers = byzantine.buffers if byzantine is not None and byz is not None \
                else None
            buffer_metrics = self._step_buffers(
                torch.from_numpy(stack_groups(groups, results, int(self.b.numel()),
                                              "buffers")), byz_buffers)
        finite = bool(torch.isfinite(agg).all())
        if finite:
            parts = self.message.split(self._with_means(agg, rows[:, width:], weights), d)
            self.x = guarded("server.optimizer", self.optimizer_name,
                             self.optimizer.step_parts)(self.x, parts)
        honest_norm = float(torch.linalg.vector_norm(honest_mean))
        error = float(torch.linalg.vector_norm(agg - honest_mean)) if finite else float("inf")
        return {
            "honest_update_norm": honest_norm,
            "aggregate_norm": float(torch.linalg.vector_norm(agg)) if finite else float("inf"),
            "aggregation_error": error,
            # the error due to Byzantine clients on the scale of the honest step
            "relative_aggregation_error": error / honest_norm if honest_norm > 0 else float("nan"),
            "nonfinite_aggregate": 0.0 if finite else 1.0,
            "aggregation_skipped": 0.0,
            "client_loss": float(losses.mean()) if len(losses) else float("nan"),
            **buffer_metrics,
            **_timings(t0, results),
        }

    @staticmethod
    def _with_means(agg: torch.Tensor, rest: torch.Tensor, weights: torch.Tensor | None
                    ) -> torch.Tensor:
        """The aggregate of the row parts followed by the (weighted) mean of the message's
        other parts (``rest``: their columns of every row); ``agg`` alone without any."""
        if not rest.shape[1]:
            return agg
        if weights is None:
            means = rest.mean(dim=0)
        else:
            w = weights.to(rest.dtype)
            means = (w[:, None] * rest).sum(dim=0) / w.sum()
        return torch.cat([agg, means.to(agg.dtype)])

    def _load_model(self) -> None:
        """The global parameters and buffers into the server's model (on its device)."""
        vector_to_parameters(self.x.to(self.agg_device, copy=True), self.model.parameters())
        vector_to_buffers(self.b.to(self.agg_device), self.model)

    def _root_update(self, round_: int) -> torch.Tensor:
        """The server's own update of the round (FLTrust): the scenario's local training from
        the global model on the root set, with the round's seeded minibatches."""
        assert self.root is not None
        x, y = self.root
        self._load_model()  # the global model's parameters and buffers
        batches = minibatches(len(y), self.local, torch_generator(self.seed, "root", round_))
        with torch_threads(self.eval_threads):
            update, _ = local_sgd(self.model, self.x.to(self.agg_device), x, y, batches,
                                  self.local.lr, self.local.momentum, self.local.weight_decay,
                                  self.task)
        return update.to(self.agg_device)

    def evaluate(self, scores: tuple[EvalScores, ...] = ()) -> dict[str, float]:
        """The global model's test metrics and train loss: from ``scores``, the ClientWorkers'
        shares of a data-parallel evaluation (the same numbers: ``eval_shares``), when given;
        else computed here. A targeted attack's success rate is measured here."""
        if scores:
            (acc, loss, hits), (_, train_loss, _) = (
                combine_scores(*gather_scores(scores, part)) for part in ("test", "train"))
        else:
            self._load_model()
            with torch_threads(self.eval_threads):
                acc, loss, hits = evaluate_model(self.model, self.x_test, self.y_test,
                                                 self.task)
                _, train_loss, _ = evaluate_model(self.model, self.x_tr, self.y_tr, self.task)
        per_client = (client_accuracy(hits, self.c_test)
                      if self.c_test is not None and hits is not None else {})
        if self.x_asr is not None and self.y_asr is not None:
            if scores:
                self._load_model()
            with torch_threads(self.eval_threads):
                asr, _, _ = evaluate_model(self.model, self.x_asr, self.y_asr, self.task)
            per_client["attack_success_rate"] = float("nan") if asr is None else asr
        return {**{f"test_{k}": v for k, v in self.task.metrics(loss, acc).items()},
                "train_loss": train_loss, **per_client}

    def checkpoint(self) -> ServerCheckpoint:
        """Everything the server's future depends on: global model, optimizer state and the
        state of stateful aggregation rules (centered clipping's centre, ...)."""
        state: ServerCheckpoint = {
            "x": self.x.clone(), "buffers": self.b.clone(),
            "optimizer": self.optimizer.state_dict(), "pipeline": self.pipeline.state_dict()}
        if self.mode.clock:
            state["version"] = self.version
            state["versions"] = {v: [x.clone(), b.clone()] for v, (x, b) in self.versions.items()}
            state["latest"] = {c: r.clone() for c, r in self.latest.items()}
        return state

    def restore(self, state: ServerCheckpoint) -> None:
        self.x = state["x"].clone()
        self.b = state.get("buffers", self.b).clone()
        self.version = int(state.get("version", 0))
        self.versions = {int(v): [x.clone(), b.clone()]
                         for v, (x, b) in state.get("versions", {}).items()}
        self.latest = {int(c): r.clone() for c, r in state.get("latest", {}).items()}
        self.optimizer.load_state_dict(state["optimizer"])
        self.pipeline.load_state_dict(state["pipeline"])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The global model as a torch state_dict (for the final-model artifact)."""
        self._load_model()
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}


class Mixer:
    """D-SGD's gossip and evaluation: the topology's mixing matrices, the Byzantine peers'
    messages (a gossip attack; they depend on each receiver's neighbourhood, so they are made
    where the gossip is computed), the defense, and the evaluation of the honest peers'
    models. Honest peers' models travel as ``ClientRows`` (their ``updates`` rows)."""

    def __init__(self, plan: Plan, honest: list[int], byzantine: list[int],
                 input_shape: tuple[int, ...], num_classes: int, eval_data: EvalData,
                 vocabulary: int | None = None) -> None:
        single_thread()
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
