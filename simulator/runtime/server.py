"""The Server actor (a plain Python class: the ray backend wraps it with ``ray.remote``, the
inline backend calls it in-process): the global model, the message path's server halves, the
aggregation pipeline and the server optimizer. Across the Ray boundary parameters and
updates travel as float32 NumPy arrays; ``ray.get`` gives read-only views, so nothing here
updates an argument in place."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from simulator.config.plan import Plan, build_codecs, build_downlink, build_server_optimizer
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
)
from simulator.models import build_model
from simulator.registry import instantiate
from simulator.runtime.audit import CanaryAudit
from simulator.runtime.common import (
    buffers_to_vector,
    combine_buffers,
    deterministic_mode,
    float_buffer_mask,
    model_input,
    norm_parameter_mask,
    resolve_device,
    single_thread,
    torch_threads,
    vector_to_buffers,
)
from simulator.runtime.evaluation import ServerEvaluation
from simulator.runtime.payloads import CodecStates, decode_payload, decoded
from simulator.runtime.pipeline import Pipeline
from simulator.runtime.pool import Reusable
from simulator.runtime.privacy_attacks import AttackTargets
from simulator.runtime.rows import ModeRows, with_means
from simulator.seeding import torch_generator
from strategies.codecs import decode_chain, encode_chain, finish, message_shape, screen
from strategies.protocols import MessageShape
from strategies.trainers import local_sgd, minibatches

LOG = logging.getLogger("fedray.server")


def _timings(t0: float, results: tuple[ClientRows, ...]) -> dict[str, float]:
    """The round's times: the server's step since ``t0``, the workers' training summed and
    the slowest worker's (a round waits for it)."""
    seconds = [float(r.seconds) for r in results]
    return {"server_seconds": time.perf_counter() - t0, "train_seconds": sum(seconds),
            "slowest_worker_seconds": max(seconds, default=0.0)}


SKIPS_NAMED = 3  # skipped rounds named on the terminal; the aggregation_skipped metric counts all


class Server(Reusable):
    """Owns the global model, the message path's server halves, the aggregation pipeline
    (pre-aggregators -> aggregator -> meta-aggregator), the server optimizer and the model
    versions an asynchronous mode keeps; the mode's rows are a ``ModeRows``', the evaluation
    a ``ServerEvaluation``'s."""

    def __init__(self, plan: Plan, input_shape: tuple[int, ...], num_classes: int,
                 eval_data: EvalData, vocabulary: int | None = None) -> None:
        single_thread()
        deterministic_mode(plan.scenario.runtime.deterministic)
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
        # secure aggregation: its server aggregates group sums, never a client's row
        self.hiding = next((c for c in self.codecs if c.hides_rows()), None)
        # Byzantine rows sent as payloads their clients built (the last rows of a step)
        self.crafts = plan.attack is not None and plan.attack.crafts_payload
        # EF21: the server's estimate of each client's message
        self.codec_states = CodecStates(self.codecs, server=True)
        # downlink compression: the clients' replica of the model, which the server moves
        # each round by the compressed change it broadcasts (its error feedback: what a
        # round's compression dropped stays in x - replica and goes out later)
        self.downlink = build_downlink(plan)
        self.replica = self.x.clone() if self.downlink else None
        self.shape = message_shape(self.model, plan.message.width(int(self.x.numel())))
        self.seed = seed
        self.skips = 0  # rounds whose aggregation was skipped (the first SKIPS_NAMED named)
        self.task = instantiate("tasks", scenario.task)
        self.evaluation = ServerEvaluation(plan, eval_data, self.task)
        # FLTrust's root set: server.root_samples training samples, drawn once (seeded)
        self.root: tuple[torch.Tensor, torch.Tensor] | None = None
        self.local = scenario.local
        if self.pipeline.aggregator.traits.reference:
            x_tr, y_tr = eval_data.x_train, eval_data.y_train
            pick = np.sort(np.random.default_rng([seed, 0xF7]).choice(
                len(y_tr), size=min(scenario.server.root_samples, len(y_tr)), replace=False))
            self.root = (model_input(x_tr[pick]), torch.from_numpy(np.array(y_tr[pick])))
        # asynchronous modes: the model's version (server steps so far) and the older
        # versions clients still train from ({version: [parameters, buffers]})
        self.mode = plan.mode
        self.rows = ModeRows(plan, int(self.x.numel()), self.dim)
        self.version = 0
        self.versions: dict[int, list[torch.Tensor]] = {}
        self.row_buffer = RowBuffer()  # the round's update matrix, its pages kept mapped
        # an empirical privacy audit: canary clients' rows beside the honest ones
        self.canaries = CanaryAudit(plan, self.x) if scenario.audit is not None else None
        self.canary_cosines: np.ndarray | None = None  # at the last audit
        # privacy attacks: what a reconstruction targets, kept when its round's step runs
        self.attacks = AttackTargets(plan, eval_data, num_classes) \
            if scenario.privacy_attacks else None
        self.attack_tables: dict[str, dict[str, list]] = {}

    @property
    def dim(self) -> int:
        """The length of a client's row: its whole message (``plan.message``)."""
        return self.message.width(int(self.x.numel()))

    def shared(self) -> np.ndarray:
        """The server optimizer's broadcast state (SCAFFOLD's control variate; empty
        without one, or before its first step)."""
        c = self.optimizer.shared()
        return np.empty(0, dtype=np.float32) if c is None else c.numpy().copy()

    def params(self) -> np.ndarray:
        return self.x.numpy().copy()

    def broadcast(self) -> np.ndarray:
        """The parameters the clients train from: the global model, or under downlink
        compression their replica of it."""
        return (self.x if self.replica is None else self.replica).numpy().copy()

    def message_shape(self) -> MessageShape:
        """A client message's shape (its width; the model's parameter shapes)."""
        return self.shape

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
        return self.rows.latest_rows(clients)

    def buffers_at(self, version: int) -> np.ndarray:
        b = self.b if version == self.version else self.versions[version][1]
        return b.numpy().copy()

    def _gaps(self, versions: list[int]) -> torch.Tensor:
        """``x_v - x`` for each row's model version ``v`` (zero for the current one)."""
        base = {v: self.versions[v][0] - self.x for v in set(versions) if v != self.version}
        return torch.stack([base[v] if v in base else torch.zeros_like(self.x)
                            for v in versions])

    def step(self, round_: int, layout: StepLayout, byzantine: ByzantineRows | None,
             *results: ClientRows) -> dict[str, float]:
        """Aggregate the step's updates (the honest rows of ``layout``'s groups, then the
        Byzantine ``rows`` and ``buffers``), step the global model, and return the step's
        server-side metrics. In the asynchronous modes the model version advances, and the
        server keeps the versions ``layout.keep`` names."""
        x_before, b_before = self.x, self.b
        metrics = self._step(round_, layout, byzantine, results)
        if self.attacks is not None:
            self.attacks.step_done()
        if self.replica is not None:
            metrics["replica_distance"] = self._advance_replica(round_)
        if self.mode.clock:
            kept = {**self.versions, self.version: [x_before, b_before]}
            self.version += 1
            self.versions = {v: kept[v] for v in layout.keep if v != self.version}
        return metrics

    def _step(self, round_: int, layout: StepLayout, byzantine: ByzantineRows | None,
              results: tuple[ClientRows, ...]) -> dict[str, float]:
        t0 = time.perf_counter()
        if self.codecs:  # the payloads read back into rows, each worker's at once
            results = tuple(decoded(self.codecs, r, self.shape, self.codec_states)
                            for r in results)
        groups = [(clients, n) for _, clients, n in layout.groups]
        honest = torch.from_numpy(stack_groups(groups, results, self.dim, into=self.row_buffer))
        byz = decode_payload(self.codecs, byzantine.rows, self.shape) \
            if byzantine is not None and len(byzantine.rows) else None
        rows, honest_rows, weights = self.rows.build(layout, honest, byz, self._gaps)
        if self.attacks is not None:  # a reconstruction's target row, as received
            self.attacks.keep_rows(self.x, [c for _, cl, _ in layout.groups for c in cl],
                                   honest_rows)
        if self.canaries is not None:  # the round's sampled canaries, after the honest rows
            rows, weights = self._with_canaries(round_, rows, honest_rows, weights)
        losses = stack_groups(groups, results, 0, "losses")
        rows = screen(self.codecs, rows)  # DP-FedAvg: every row clipped
        d = int(self.x.numel())
        width = self.message.row_width(d)  # the robust pipeline's columns
        robust = rows if width == rows.shape[1] else rows[:, :width]
        crafted = len(byz) if self.crafts and byz is not None else 0
        agg, hidden = self._aggregate(round_, robust, len(honest_rows), weights, crafted)
        if agg is None:  # nothing to aggregate: the model stays, the round is counted
            return {"aggregation_skipped": 1.0,
                    "client_loss": float(losses.mean()) if len(losses) else float("nan"),
                    **hidden, **_timings(t0, results)}
        if self.codecs:  # DP-FedAvg: the noise on the mean
            agg = finish(self.codecs, agg, rows.shape[0],
                         torch_generator(self.seed, "dp-noise", round_))
        if self.attacks is not None:  # what the round releases
            self.attacks.keep_release(self.x, agg)
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
            parts = self.message.split(with_means(agg, rows[:, width:], weights), d)
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
            **hidden,
            **buffer_metrics,
            **_timings(t0, results),
        }

    def _with_canaries(self, round_: int, rows: torch.Tensor, honest_rows: torch.Tensor,
                       weights: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``rows`` with round ``round_``'s canary rows after the honest ones (the
        Byzantine rows stay last); a canary weighs as the honest rows' mean weight."""
        assert self.canaries is not None
        extra = self.canaries.rows(round_, honest_rows)
        if not len(extra):
            return rows, weights
        h = len(honest_rows)
        rows = torch.cat([rows[:h], extra.to(rows.dtype), rows[h:]])
        if weights is not None:
            fill = weights[:h].mean() if h else weights.new_ones(())
            weights = torch.cat([weights[:h], fill.expand(len(extra)), weights[h:]])
        return rows, weights

    def aim_attack(self, attack: int, client: int) -> None:
        """Privacy attack ``attack`` targets ``client`` in the next step."""
        assert self.attacks is not None
        self.attacks.aim(attack, client)

    def run_privacy_attacks(self, truths: dict[int, tuple[np.ndarray, np.ndarray, int]],
                            lr: float,
                            candidates: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
                            ) -> dict[str, float]:
        """The privacy attacks' metrics (``AttackTargets.run``); their tables kept for
        :meth:`privacy_attack_tables`."""
        assert self.attacks is not None
        metrics, self.attack_tables = self.attacks.run(self.model, self.x, lr, truths,
                                                       candidates)
        return metrics

    def privacy_attack_tables(self) -> dict[str, dict[str, list]]:
        return self.attack_tables

    def audit(self) -> dict[str, float]:
        """The audit's statistics for the current model (``CanaryAudit.statistics``); the
        canaries' cosines kept for :meth:`audit_table`."""
        assert self.canaries is not None
        metrics, self.canary_cosines = self.canaries.statistics(self.x)
        return metrics

    def audit_table(self) -> dict[str, list]:
        """Every canary's cosine at the last audit (an artifact of the run)."""
        assert self.canaries is not None
        if self.canary_cosines is None:
            self.audit()
        assert self.canary_cosines is not None
        return self.canaries.table(self.canary_cosines)

    def _advance_replica(self, round_: int) -> float:
        """The clients' replica after the round: moved by the decoded downlink payload of
        ``x - replica`` (drawn from ``(seed, "downlink", codec, round)``); the distance left
        between the model and the replica."""
        assert self.replica is not None
        shape = MessageShape(int(self.x.numel()), self.shape.shapes)
        change = (self.x - self.replica).unsqueeze(0)
        gens = [[torch_generator(self.seed, "downlink", i, round_)]
                for i in range(len(self.downlink))]
        parts = encode_chain(self.downlink, change, round_, shape, gens, None)
        self.replica = self.replica + decode_chain(self.downlink, parts, shape)[0]
        return float(torch.linalg.vector_norm(self.x - self.replica))

    def _aggregate(self, round_: int, robust: torch.Tensor, honest: int,
                   weights: torch.Tensor | None, crafted: int = 0
                   ) -> tuple[torch.Tensor | None, dict[str, float]]:
        """The robust pipeline's aggregate of the step's ``robust`` rows (under secure
        aggregation, of the group means its server sees) and the protocol's metrics; None
        when the round has nothing to aggregate (it is then counted as skipped)."""
        hidden: dict[str, float] = {}
        if self.hiding is not None and honest:  # the server sees group sums only
            robust, hidden = self.hiding.combine(robust, round_, self.seed, crafted)
        if not honest:
            self._skipped(round_, "no sampled honest client sent an update (dropout, "
                                  "stragglers)")
            return None, hidden
        if not len(robust):
            self._skipped(round_, "secure aggregation recovered no group (too many "
                                  "dropouts after masking)")
            return None, hidden
        try:
            reference = self._root_update(round_) if self.root is not None else None
            return self.pipeline.aggregate(robust.to(self.agg_device), round_, weights,
                                           reference).cpu(), hidden
        except TooFewRows as e:  # too few rows left this round (dropouts, stragglers)
            self._skipped(round_, str(e))
            return None, hidden

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
        """The global model's test metrics and train loss (``ServerEvaluation.evaluate``):
        from the ClientWorkers' ``scores`` when given, else computed here."""
        return self.evaluation.evaluate(self.model, self._load_model, scores)

    def checkpoint(self) -> ServerCheckpoint:
        """Everything the server's future depends on: global model, optimizer state and the
        state of stateful aggregation rules (centered clipping's centre, ...)."""
        state: ServerCheckpoint = {
            "x": self.x.clone(), "buffers": self.b.clone(),
            "optimizer": self.optimizer.state_dict(), "pipeline": self.pipeline.state_dict()}
        if self.replica is not None:
            state["replica"] = self.replica.clone()
        if self.codec_states.keeping:
            state["codecs"] = dict(self.codec_states.items())
        if self.canaries is not None:  # the model the audit measures the change from
            state["audit_x0"] = self.canaries.x0.clone()
        if self.attacks is not None:  # what the privacy attacks target
            state["attacks"] = self.attacks.checkpoint()
        if self.mode.clock:
            state["version"] = self.version
            state["versions"] = {v: [x.clone(), b.clone()] for v, (x, b) in self.versions.items()}
            state["latest"] = {c: r.clone() for c, r in self.rows.latest.items()}
        return state

    def restore(self, state: ServerCheckpoint) -> None:
        self.x = state["x"].clone()
        self.b = state.get("buffers", self.b).clone()
        if self.replica is not None:
            self.replica = state["replica"].clone()
        if self.canaries is not None:
            self.canaries.x0 = state["audit_x0"].clone()
        if self.attacks is not None:
            self.attacks.restore(state.get("attacks", {}))
        if self.codec_states.keeping:
            self.codec_states.load({int(c): st for c, st in state.get("codecs", {}).items()})
        self.version = int(state.get("version", 0))
        self.versions = {int(v): [x.clone(), b.clone()]
                         for v, (x, b) in state.get("versions", {}).items()}
        self.rows.latest = {int(c): r.clone() for c, r in state.get("latest", {}).items()}
        self.optimizer.load_state_dict(state["optimizer"])
        self.pipeline.load_state_dict(state["pipeline"])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The global model as a torch state_dict (for the final-model artifact)."""
        self._load_model()
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
