"""Server rounds (the FedAvg family): sample clients, broadcast the global model once, train
the sampled clients on the ClientWorker pool, let the Adversary make the Byzantine clients'
rows, aggregate on the Server (pre-aggregators -> aggregator -> meta-aggregator), step the
server optimizer, evaluate every ``evaluation.every`` rounds."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simulator import registry
from simulator.config.plan import build_codecs, build_downlink
from simulator.config.schema import Speeds
from simulator.errors import WorkerLost
from simulator.messages import (
    ByzantineRows,
    ClientRows,
    EvalScores,
    Group,
    Ref,
    RoundReport,
    StepLayout,
)
from simulator.pinning import strict_options
from simulator.runtime.adversary import Adversary
from simulator.runtime.common import personal_accuracy
from simulator.runtime.handles import AdversaryHandle, ServerHandle
from simulator.runtime.server import Server
from simulator.sim.rounds import RoundProtocol, RunContext
from simulator.sim.sampling import attacker_ranks, missed_round, sample_clients
from strategies.codecs import chain_bytes
from strategies.protocols import MessageShape


@dataclass(frozen=True)
class Participation:
    """Who of a round's sampled honest clients takes part, as a protocol decides
    (:meth:`ServerRounds.participants`)."""

    dropped: set[int]  # dropped out of the round: never trained
    late: set[int]  # missed the round's deadline
    partial: dict[int, int]  # late clients that send partial work: client -> steps done
    honest: list[int]  # trained, and their updates are this round's (sorted)
    # trained from this round's model, their updates applied in a later step (sorted)
    carried: list[int] = field(default_factory=list)


@dataclass
class Training:
    """A round's submitted training: who was sampled and takes part, and the workers'
    result refs."""

    round_: int
    t0: float  # when it was submitted
    sampled: list[int]
    byz: list[int]
    who: Participation
    honest_refs: list[Ref[ClientRows]]
    carried_refs: list[Ref[ClientRows]]  # the updates of ``who.carried``
    # the rows the attack sees: (clients, refs)
    seen: tuple[list[int], list[Ref[ClientRows]]] | None

    @property
    def honest(self) -> list[int]:
        return self.who.honest


class ServerRounds(RoundProtocol):
    """A Server (and an Adversary with Byzantine clients) beside the worker pool.

    A round: sample, :meth:`participants` (who of the sampled honest clients trains, and
    whose update counts this round), train, the Byzantine rows, the server's step on
    :meth:`step_rows`, evaluate; it lasts :meth:`duration` on the simulated clock and adds
    :meth:`round_metrics`. A protocol that changes who takes part, what a step aggregates,
    how long a round lasts or what it logs overrides those hooks (the semi-synchronous
    server, simulator/sim/rounds/deadline.py), not the round."""

    name = "server"
    prefetch = True
    # set by ``start``, which spawns the actors: the server's handle, the held-out data in
    # the object store, its sizes, and whether the workers share the final evaluation
    server: ServerHandle
    eval_ref: Any
    eval_sizes: tuple[int, int]
    parallel_eval: bool

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        attack = ctx.plan.attack
        self.omniscient = attack is not None and attack.omniscient
        self.poison = attack.spec if attack is not None and attack.data_poisoning else None
        self.adversary: AdversaryHandle | None = None  # with an attack, from ``start``
        self._next: Training | None = None  # the next round's training, when prefetched
        self._round_end = 0.0  # when the last round ended (perf_counter)
        self._clock = 0.0  # simulated seconds so far (a scenario with speeds)
        self._bytes = [0, 0]  # bytes sent up and down so far
        # set by ``ready``, once the server's model is known
        self.dim = self.d_buffers = self.bytes_up = self.bytes_down = 0
        self.shape = MessageShape(0)  # a client message's (the server's model says)
        self.devices: Any = None  # the simulated devices (speeds), when the run has them
        self.task_seconds: Callable[[int, int], float] | None = None
        # privacy attacks: the scenario's, and the client each reconstruction targeted
        self.attacks = [registry.instantiate("privacy_attacks", s)
                        for s in ctx.plan.scenario.privacy_attacks]
        self.attack_clients: dict[int, int] = {}
        self.attack_tables: dict[str, dict[str, list]] = {}

    def start(self) -> list[Any]:
        ctx = self.ctx
        b, plan, data = ctx.backend, ctx.plan, ctx.data
        eval_data = data.eval_data()
        eval_ref = self.eval_ref = b.put(eval_data)
        rt = plan.scenario.runtime
        # the final evaluation (the workers idle, nothing prefetched) is dealt out over the
        # workers when they run beside each other on the server's kind of device: the same
        # spans, threads and kernels as the server's, so the same numbers, sooner
        self.eval_sizes = (len(eval_data.y_test), len(eval_data.y_train))
        self.parallel_eval = (b.pipelined and rt.device == "cpu" and rt.server_device == "cpu"
                              and min(self.eval_sizes) > 0)
        self.server = ServerHandle(b, b.spawn(Server, plan, data.input_shape, data.num_classes,
                                              eval_ref, data.vocabulary, role="server",
                                              options=ctx.pool.server_options))
        self.adversary = (AdversaryHandle(b, b.spawn(
            Adversary, plan, role="adversary", options=strict_options(rt.strict)))
            if plan.attack is not None else None)
        return [self.server.actor] + ([self.adversary.actor] if self.adversary else [])

    def ready(self) -> dict[str, str]:
        b = self.ctx.backend
        params_ref = self.server.params()
        derived = self.ctx.pool.keep_faster_trainer(params_ref)
        plan = self.ctx.plan
        d = len(b.get(params_ref))
        # a client's row: its whole message (the parts the client rule declares)
        self.dim = plan.message.width(d)
        self.shape = b.get(self.server.message_shape())
        self.d_buffers = len(b.get(self.server.buffers()))
        # what one client receives (the model, its buffers, the server optimizer's broadcast
        # state: SCAFFOLD's control variate, of the model's size) and sends (its message's
        # payload after the codecs, and its buffers), in bytes
        model = chain_bytes(build_downlink(plan), MessageShape(d, self.shape.shapes))
        self.bytes_down = model + 4 * (self.d_buffers + (d if plan.shared_state else 0))
        c = plan.scenario.clients
        self.bytes_up = chain_bytes(build_codecs(plan), self.shape, min(c.sampled, c.total)) \
            + 4 * self.d_buffers
        self.task_seconds = self._devices()
        return derived

    def _devices(self) -> Callable[[int, int], float] | None:
        """``task_seconds(client, task)`` of the scenario's simulated devices (``speeds``;
        None without)."""
        from simulator.sim.speeds import profiles

        ctx = self.ctx
        sc = ctx.plan.scenario
        speeds = (sc.speeds or Speeds()) if ctx.plan.mode.timed else sc.speeds
        if speeds is None:
            return None
        prof = self.devices = profiles(speeds, sc.clients.total, ctx.plan.seed,
                        np.asarray(sorted(ctx.byzantine), dtype=np.int64))
        samples = np.asarray(ctx.pool.local_steps, dtype=np.int64) * sc.local.batch_size
        down, up = 8.0 * self.bytes_down, 8.0 * self.bytes_up  # bits on each link

        def task_seconds(client: int, task: int) -> float:
            return prof.task_seconds(client, int(samples[client]), down, task, up)

        return task_seconds

    @property
    def has_buffers(self) -> bool:
        return self.d_buffers > 0

    def participants(self, round_: int, honest: list[int]) -> Participation:
        """Who of the round's sampled ``honest`` clients (sorted) takes part: the
        dropouts and ``clients.stragglers`` (those late for the deadline, or FedProx's
        stragglers that run fewer epochs; with ``partial`` the ones that finished some steps
        send them)."""
        sc = self.ctx.plan.scenario
        c, local = sc.clients, sc.local
        # the whole blocks a client's work is made of (kind epochs): its epochs, or steps
        blocks = local.steps or local.epochs or 1
        dropped, late = missed_round(self.ctx.plan.seed, round_, honest,
                                     self.ctx.pool.local_steps, c.dropout, c.stragglers,
                                     blocks)
        partial = ({i: k for i, k in late.items() if k > 0}
                   if c.stragglers is not None and c.stragglers.partial else {})
        return Participation(dropped, set(late), partial,
                             [i for i in honest if i not in dropped
                              and (i not in late or i in partial)])

    def submit(self, round_: int) -> Training:
        """Round ``round_``'s sampling and its training calls (the workers start as soon as
        the server's parameters are there); nothing in it changes the server."""
        ctx = self.ctx
        pool, c, seed, byzantine = ctx.pool, ctx.plan.scenario.clients, ctx.plan.seed, \
            ctx.byzantine_at(round_)
        t0 = time.perf_counter()
        sampled = sample_clients(seed, round_, c.total, c.sampled).tolist()
        byz = [i for i in sampled if i in byzantine]
        who = self.participants(round_, [i for i in sampled if i not in byzantine])
        honest = who.honest
        params_ref = self.server.broadcast()  # stored once, read by every worker
        buffers_ref = self.server.buffers() if self.d_buffers else None
        shared_ref = self.server.shared() if ctx.plan.shared_state else None
        honest_refs = pool.train(round_, honest, params_ref, buffers_ref, None, shared_ref,
                                 who.partial)
        carried_refs = pool.train(round_, who.carried, params_ref, buffers_ref, None,
                                  shared_ref) if who.carried else []
        seen: tuple[list[int], list[Ref[ClientRows]]] | None = None
        if byz:
            seen = (honest, honest_refs) if self.omniscient else \
                (byz, pool.train(round_, byz, params_ref, buffers_ref, self.poison,
                                 shared_ref,
                                 attackers=attacker_ranks(byzantine) if self.poison else None))
        return Training(round_, t0, sampled, byz, who, honest_refs, carried_refs, seen)

    def step_rows(self, round_: int, tr: Training
                  ) -> tuple[tuple[Group, ...], list[Ref[ClientRows]], tuple[float, ...] | None]:
        """What the round's step aggregates: (the honest groups, their results, each honest
        then Byzantine row's scale or None): this round's honest updates, as sent."""
        return ((round_, tuple(tr.honest), len(tr.honest_refs)),), tr.honest_refs, None

    def duration(self, round_: int, tr: Training) -> float:
        """The round's simulated seconds: its slowest participant's task (a straggler's
        partial work: its share of the task's time)."""
        assert self.task_seconds is not None
        steps, partial = self.ctx.pool.local_steps, tr.who.partial
        return max((self.task_seconds(c, round_) * (
            partial[c] / max(int(steps[c]), 1) if c in partial else 1.0)
            for c in tr.honest + tr.byz), default=0.0)

    def round_metrics(self, round_: int, tr: Training) -> dict[str, float]:
        """The protocol's own metrics of the round (``partial_work``: the stragglers that
        sent some)."""
        s = self.ctx.plan.scenario.clients.stragglers
        return {"partial_work": float(len(tr.who.partial))} if s is not None and s.partial \
            else {}

    def after_step(self, round_: int, tr: Training) -> None:
        """Called once the round's step is submitted (the next round's is not yet)."""
        return

    def drop_prefetched(self) -> None:
        self._next = None

    def run_round(self, round_: int, prefetch: bool = False) -> RoundReport:
        """Round ``round_``: its training (submitted already when the round before
        prefetched it), the Byzantine rows, the server's step, the evaluation when due.
        ``prefetch``: the next round's training is submitted right after this round's step,
        so the workers start it as soon as the step is done, while this round's metrics come
        back to the driver."""
        b, ctx = self.ctx.backend, self.ctx
        tr, self._next = self._next, None
        if tr is None or tr.round_ != round_:
            tr = self.submit(round_)
        byz_ref: Ref[ByzantineRows] | None = None
        if tr.seen is not None:
            assert self.adversary is not None  # Byzantine clients come with an attack
            byz_ref = self.adversary.attack_rows(round_, len(tr.byz),
                                                 [(tr.seen[0], len(tr.seen[1]))], self.shape,
                                                 self.d_buffers, tr.seen[1])
        groups, refs, scales = self.step_rows(round_, tr)
        self._aim_attacks(round_, tr)
        step_ref = self.server.step(round_, StepLayout(groups, scales=scales), byz_ref, refs)
        self.after_step(round_, tr)
        # the personal models (Ditto) after this round's training, before a prefetched
        # round trains them again in the workers' queues
        personal = self.ctx.pool.evaluate_personal(
            sorted(ctx.byzantine_at(round_)), self.eval_ref,
            self.server.buffers() if self.d_buffers else None,
            self.server.params() if ctx.plan.local_norm else None) \
            if (ctx.plan.personal or ctx.plan.local_norm) and ctx.evaluate_now(round_) else []
        if prefetch:  # its params call comes before the evaluation in the server's queue
            self._next = self.submit(round_ + 1)
        eval_ref = None
        if ctx.evaluate_now(round_):
            eval_ref = self.server.evaluate(() if prefetch else self._worker_scores())
        metrics = dict(b.get(step_ref))
        if eval_ref is not None:
            metrics.update(b.get(eval_ref))
            metrics.update(personal_accuracy(b.get(personal)) if personal else {})
            metrics.update(ctx.accountant.spent(round_ + 1))
        if self.audit_now(round_):
            metrics.update(b.get(self.server.audit()))
        if self.attacks and round_ + 1 == ctx.plan.scenario.rounds:
            metrics.update(self._run_attacks())
        timings = {k: metrics.pop(k) for k in list(metrics) if k.endswith("_seconds")}
        end = time.perf_counter()
        # from the later of its submission and the previous round's end
        timings["round_seconds"] = end - max(tr.t0, self._round_end)
        self._round_end = end
        b_hat = ctx.plan.b_hat
        if self.task_seconds is not None:
            self._clock += self.duration(round_, tr)
            metrics["sim_time"] = self._clock
        who = tr.who
        metrics.update(self._traffic(len(tr.honest) + len(who.carried) + len(tr.byz),
                                     len(tr.sampled) - len(who.dropped)))
        metrics.update(self.round_metrics(round_, tr))
        metrics = {"sampled": float(len(tr.sampled)), "byzantine_sampled": float(len(tr.byz)),
                   "dropped": float(len(who.dropped)), "stragglers": float(len(who.late)),
                   "participants": float(len(tr.honest) + len(tr.byz)),
                   "b_hat": float(b_hat),
                   "byzantine_exceeded": float(len(tr.byz) > b_hat), **metrics}
        return RoundReport(metrics, timings)

    def audit_now(self, round_: int) -> bool:
        """Whether round ``round_`` ends with the audit's statistics: every
        ``audit.every`` rounds, and the last (never without ``audit:``)."""
        sc = self.ctx.plan.scenario
        if sc.audit is None:
            return False
        return round_ + 1 == sc.rounds or (
            sc.audit.every is not None and (round_ + 1) % sc.audit.every == 0)

    def tables(self) -> dict[str, dict[str, list]]:
        """The audit's canary cosines at the end (``audit_canaries``), with ``audit:``;
        each reconstruction attack's samples (``attack_<name>``)."""
        out = dict(self.attack_tables)
        if self.ctx.plan.scenario.audit is not None:
            out["audit_canaries"] = self.ctx.backend.get(self.server.audit_table())
        return out

    def _aim_attacks(self, round_: int, tr: Training) -> None:
        """The reconstruction attacks on round ``round_``: each targets its ``client``
        (the round's first honest client when None) if it sends an update this round."""
        for i, attack in enumerate(self.attacks):
            if not attack.traits.reconstructs or attack.round != round_ + 1:
                continue
            client = attack.client if attack.client is not None else \
                (tr.honest[0] if tr.honest else None)
            if client is not None and client in tr.honest:
                self.server.aim_attack(i, client)
                self.attack_clients[i] = client

    def _run_attacks(self) -> dict[str, float]:
        """The privacy attacks' metrics at the end of the run, each beside the bound the
        run's DP implies (1 without DP, or where the server sees what DP does not cover):
        Hayes et al.'s on a reconstruction's success with prior 1 / candidates, from one
        round's mechanism; the best membership advantage of the run's mechanism."""
        ctx = self.ctx
        truths = {}
        for i, client in self.attack_clients.items():
            x, y = ctx.data.source.train([client])[0]
            truths[i] = (np.asarray(x), np.asarray(y), int(ctx.pool.local_steps[client]))
        metrics = dict(ctx.backend.get(self.server.run_privacy_attacks(
            truths, ctx.plan.scenario.local.lr, ctx.data.candidates)))
        self.attack_tables = ctx.backend.get(self.server.privacy_attack_tables())
        for spec, attack in zip(ctx.plan.scenario.privacy_attacks, self.attacks, strict=True):
            if attack.traits.reconstructs:
                metrics[f"{spec['name']}_success_bound"] = ctx.accountant.reconstruction_bound(
                    attack.target, 1.0 / attack.candidates)
            else:
                metrics[f"{spec['name']}_advantage_bound"] = ctx.accountant.advantage_bound()
        return metrics

    def _traffic(self, senders: int, receivers: int) -> dict[str, float]:
        """The step's bytes: ``senders`` messages up, the model to ``receivers`` clients down
        (each as ``ready`` sized them), and the run's totals so far."""
        up, down = senders * self.bytes_up, receivers * self.bytes_down
        self._bytes = [self._bytes[0] + up, self._bytes[1] + down]
        return {"bytes_up": float(up), "bytes_down": float(down),
                "bytes_up_total": float(self._bytes[0]),
                "bytes_down_total": float(self._bytes[1])}

    def _worker_scores(self) -> list[EvalScores]:
        """The live workers' shares of evaluating the model the step just made (none where
        the evaluation is not dealt out, or a worker was lost meanwhile: the server then
        evaluates alone, and the next round moves the lost worker's clients)."""
        pool = self.ctx.pool
        if not self.parallel_eval or len(pool.live) < 2:
            return []
        params = self.server.params()  # after the step in the server's queue
        buffers = self.server.buffers() if self.d_buffers else None
        try:
            return [s for share in self.ctx.backend.get(
                pool.evaluate_spans(params, buffers, self.eval_ref, *self.eval_sizes))
                for s in share]
        except WorkerLost:
            return []

    def checkpoint(self) -> dict[str, Any]:
        """The server's state (global model, optimizer, stateful aggregation rules) and the
        simulated time."""
        return {"server": self.ctx.backend.get(self.server.checkpoint()),
                "sim_time": self._clock, "bytes": list(self._bytes),
                "attack_clients": dict(self.attack_clients)}

    def restore(self, state: dict[str, Any]) -> list[Any]:
        self._clock = float(state.get("sim_time", 0.0))
        self._bytes = [int(v) for v in state.get("bytes", [0, 0])]
        self.attack_clients = {int(i): int(c) for i, c in state.get("attack_clients", {}).items()}
        return [self.server.restore(state["server"])]

    def final(self) -> tuple[np.ndarray, dict[str, Any], dict[str, str]]:
        b = self.ctx.backend
        return np.asarray(b.get(self.server.params())), b.get(self.server.state_dict()), {}
