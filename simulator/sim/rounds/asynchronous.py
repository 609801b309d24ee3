"""Asynchronous server steps on a simulated clock (``server.mode``: ``fedasync``, ``fedbuff``,
``basgd``; docs/async.md).

One "round" of the engine's loop is one server step. The clock (``simulator.sim.clock``)
decides ahead, from the seed and the devices' simulated speeds (``simulator.sim.speeds``), who
trains from which model version and which updates each step applies; nothing in it depends
on the updates' values. A step's arrivals train when the step comes, grouped by the model
version they started from: one worker call per version (a client's seeds are (seed,
version, client), as a synchronous client's are (seed, round, client)), from that version's
model, which the Server keeps while clients train from it. The Byzantine arrivals' rows
come from the Adversary as in a synchronous round, seeing the step's honest rows
(omniscient attacks) or their own honest updates from their own, stale, models.

The Server then makes the step's rows by the mode: FedBuff scales each update by its
staleness function s(tau); FedAsync mixes one client's model in with weight ``mixing *
s(tau)``; BASGD averages the updates in each of its buffers; ``asynchrony.weights:
updates`` weights each row by how many updates its client has had applied (Dahan & Levy,
NeurIPS 2024). The robust pipeline aggregates the rows; the server optimizer steps.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np

from simulator.config.plan import Plan
from simulator.messages import ByzantineRows, ClientRows, Group, Ref, RoundReport, StepLayout
from simulator.sim.clock import (
    DRAW_POWER,
    Schedule,
    StepPlan,
    concurrency,
    settings,
    staleness_scale,
    step_rule,
)
from simulator.sim.rounds import RunContext
from simulator.sim.rounds.server import ServerRounds
from simulator.sim.sampling import attacker_ranks


class AsyncRounds(ServerRounds):
    """A Server (and an Adversary) beside the worker pool, stepped by the simulated clock.

    It keeps the server's hooks where a step is a server round (``_traffic``, the checkpoint)
    and replaces the round itself: a step's arrivals come from the clock, not from sampling."""

    name = "async"
    prefetch = True

    @classmethod
    def trainings_per_round(cls, plan: Plan) -> float:
        """The updates a server step applies (its step rule; BASGD's at least one a
        buffer)."""
        rule = step_rule(plan.scenario)
        return float(rule.buffer_size if rule.buffers is None else rule.buffers)

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self._plans: dict[int, StepPlan] = {}
        # the next step's honest training, submitted ahead: (step, groups, refs)
        self._ahead: tuple[int, list[Group], list[Ref[ClientRows]]] | None = None
        # each model version's parameters and buffers, fetched once while clients train from
        # it (a version is the start of tasks that arrive over several steps)
        self._models: dict[int, tuple[Ref[np.ndarray], Ref[np.ndarray] | None]] = {}

    def ready(self) -> dict[str, str]:
        derived = super().ready()
        self._schedule = self._new_schedule()
        return derived

    def _model(self, v: int) -> tuple[Ref[np.ndarray], Ref[np.ndarray] | None]:
        if v not in self._models:
            self._models[v] = (self.server.params_at(v),
                               self.server.buffers_at(v) if self.d_buffers else None)
        return self._models[v]

    def _new_schedule(self) -> Schedule:
        sc, a = self.ctx.plan.scenario, settings(self.ctx.plan.scenario)
        assert self.task_seconds is not None and self.devices is not None  # always, here
        avail = self.devices.availability
        fresh = frozenset(self.ctx.byzantine) if a.byzantine_staleness == "fresh" else frozenset()
        return Schedule(sc.clients.total, concurrency(sc), step_rule(sc), a.max_staleness,
                        self.task_seconds, self.ctx.plan.seed,
                        avail.next_start if avail is not None else None, fresh,
                        DRAW_POWER[a.draw], tables=self.ctx.plan.mode.table)

    def _step_plan(self, step: int) -> StepPlan:
        """Step ``step``'s plan, simulated once (a step computed again after a lost worker,
        or trained ahead, takes the same one); older plans are forgotten."""
        while step not in self._plans:
            p = self._schedule.next_step()
            self._plans[p.index] = p
        for k in [k for k in self._plans if k < step]:
            del self._plans[k]
        return self._plans[step]

    def _honest(self, sp: StepPlan) -> tuple[set[int], list[tuple[int, int]]]:
        """(the step's Byzantine clients, its honest arrivals as sorted (version, client))."""
        byzantine = self.ctx.byzantine_at(sp.index)  # who is Byzantine when the step comes
        return byzantine, sorted((t.version, t.client) for t in sp.arrivals
                                 if t.client not in byzantine)

    def drop_prefetched(self) -> None:
        self._ahead = None

    def _train(self, tasks: list[tuple[int, int]], poison: dict[str, Any] | None = None,
               ranks: dict[int, int] | None = None
               ) -> tuple[list[Group], list[Ref[ClientRows]]]:
        """Train ``tasks`` ((version, client), sorted) grouped by version: one train call per
        version, from that version's model (``ranks``: the poisoned clients' indices among
        the Byzantine clients)."""
        groups: list[Group] = []
        refs: list[Ref[ClientRows]] = []
        for v, items in itertools.groupby(tasks, key=lambda t: t[0]):
            clients = [c for _, c in items]
            params, buffers = self._model(v)
            got = self.ctx.pool.train(v, clients, params, buffers, poison, attackers=ranks)
            groups.append((v, tuple(clients), len(got)))
            refs += got
        return groups, refs

    def run_round(self, round_: int, prefetch: bool = False) -> RoundReport:
        """Server step ``round_``: its arrivals trained, the Byzantine rows, the server's
        step, the evaluation when due."""
        b, ctx = self.ctx.backend, self.ctx
        sc = ctx.plan.scenario
        t0 = time.perf_counter()
        sp = self._step_plan(round_)
        byzantine, honest = self._honest(sp)
        contributed = {(t.version, t.client): k for t, k in zip(sp.arrivals, sp.contributed)}
        byz = sorted((t.version, t.client) for t in sp.arrivals if t.client in byzantine)
        ahead, self._ahead = self._ahead, None
        groups, refs = ahead[1:] if ahead is not None and ahead[0] == round_ else \
            self._train(honest)
        byz_ref: Ref[ByzantineRows] | None = None
        mode = ctx.plan.mode
        counts = dict(sp.applied)
        table = sorted(counts) if mode.table else None
        if byz:
            assert self.adversary is not None  # Byzantine clients come with an attack
            if self.omniscient and table is not None:  # the honest clients' latest rows
                kept = [c for c in table if c not in byzantine and c not in
                        {cl for _, cl in honest}]
                seen_groups: list[Group] = [*groups, (round_, tuple(kept), 1)]
                seen_refs = [*refs, self.server.latest_rows(kept)]
            else:
                seen_groups, seen_refs = (groups, refs) if self.omniscient else \
                    self._train(byz, self.poison,
                                attacker_ranks(byzantine) if self.poison else None)
            byz_ref = self.adversary.attack_rows(
                round_, len(byz), [(list(c), n) for _, c, n in seen_groups], self.shape,
                self.d_buffers, seen_refs)
        a = settings(sc)
        weights = (tuple(float(contributed[t]) for t in honest + byz) if a.weights == "updates"
                   else None)
        if table is not None and weights is not None:  # each table row: its client's count
            weights = tuple(float(counts[c]) for c in table)
        true_tau = np.asarray([round_ - v for v, _ in honest + byz], dtype=np.float64)
        if a.byzantine_staleness == "fresh":  # the versions they report, which the server trusts
            byz = [(round_, c) for _, c in byz]
        order = honest + byz
        tau = np.asarray([round_ - v for v, _ in order], dtype=np.float64)
        scale = staleness_scale(a.staleness.function, a.staleness.a, a.staleness.b, tau)
        if mode.mixing:
            scale = scale * a.mixing
        layout = StepLayout(
            tuple(groups), tuple((c, v) for v, c in byz),
            scales=None if bool((scale == 1.0).all()) else tuple(scale.tolist()),
            weights=weights,
            buffer_of=(tuple(c % a.buffers for _, c in order) if mode.buffer_means
                       else None),
            keep=sp.in_flight, table=None if table is None else tuple(table),
            table_byzantine=tuple(c for c in table or () if c in byzantine))
        step_ref = self.server.step(round_, layout, byz_ref, refs)
        # the versions clients still train from after this step
        self._models = {v: m for v, m in self._models.items() if v in set(sp.in_flight)}
        if prefetch:  # the next step's honest training: its models exist once this step is
            # applied (the server's queue runs its params_at calls after this step)
            nxt = self._step_plan(round_ + 1)
            self._ahead = (round_ + 1, *self._train(self._honest(nxt)[1]))
        eval_ref = self.server.evaluate() if ctx.evaluate_now(round_) else None
        metrics = dict(b.get(step_ref))
        if eval_ref is not None:
            metrics.update(b.get(eval_ref))
        timings = {k: metrics.pop(k) for k in list(metrics) if k.endswith("_seconds")}
        end = time.perf_counter()
        timings["round_seconds"] = end - max(t0, self._round_end)
        self._round_end = end
        b_hat = ctx.plan.b_hat
        # up: every arrival, those dropped as too stale too; down: a model to each task started
        metrics.update(self._traffic(len(order) + int(sp.dropped), int(sp.started)))
        metrics = {"sim_time": sp.time,
                   "participants": float(len(order)), "byzantine_sampled": float(len(byz)),
                   "dropped_stale": float(sp.dropped), "started": float(sp.started),
                   # the true staleness (what a timing attack hides from the server)
                   "staleness_mean": float(true_tau.mean()),
                   "staleness_max": float(true_tau.max()),
                   "clients_applied": float(sp.clients_applied),
                   "b_hat": float(b_hat), "byzantine_exceeded": float(len(byz) > b_hat),
                   **metrics}
        return RoundReport(metrics, timings)

    def restore(self, state: dict[str, Any]) -> list[Any]:
        """The server's state, and the schedule simulated again up to its step (the
        schedule is a function of the seed alone)."""
        calls = super().restore(state)
        self._schedule = self._new_schedule()
        self._plans, self._ahead, self._models = {}, None, {}
        for _ in range(int(state["server"].get("version", 0))):
            self._schedule.next_step()
        return calls
