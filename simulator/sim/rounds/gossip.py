"""Gossip rounds: D-SGD on a topology (Le Bars, Bellet, Tommasi, Scaman, Neglia, ICML 2024,
study its generalization). No server: every honest peer keeps its own model in the
ClientWorker that owns it, runs local SGD and gossips with its neighbours through the Mixer,
in the scenario's ``dsgd.order``. Byzantine peers hold no model; the gossip attack makes
their messages. Every draw is derived from (seed, purpose, round, peer)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from simulator.config.plan import Plan
from simulator.messages import ClientRows, Ref, RoundReport, stack_rows
from simulator.pinning import strict_options
from simulator.runtime.handles import MixerHandle
from simulator.runtime.mixer import Mixer
from simulator.sim.rounds import RoundProtocol


class GossipRounds(RoundProtocol):
    """The Mixer beside the worker pool; the peers' models live in the workers."""

    name = "gossip"

    prefetch = False  # a round's training starts from the last round's gossip

    @classmethod
    def trainings_per_round(cls, plan: Plan) -> float:
        """Every peer trains in every round."""
        return float(plan.scenario.clients.total)

    def start(self) -> list[Any]:
        ctx = self.ctx
        b, plan, data = ctx.backend, ctx.plan, ctx.data
        self.honest = [i for i in range(plan.scenario.clients.total) if i not in ctx.byzantine]
        eval_ref = b.put(data.eval_data())
        self.mixer = MixerHandle(b, b.spawn(Mixer, plan, self.honest, sorted(ctx.byzantine),
                                            data.input_shape, data.num_classes, eval_ref,
                                            data.vocabulary, role="server",
                                            options=strict_options(plan.scenario.runtime.strict)))
        self._state: list[Ref[ClientRows]] | None = None  # the peers' current models
        # the peer_step arguments that made _state (None: the Mixer's gossip made it), to
        # make it again when a worker holding part of it is lost
        self._made_by: tuple[int, Ref[ClientRows] | None, bool] | None = None
        self._round_start: tuple[Any, Any] = (None, None)
        return [self.mixer.actor]

    def ready(self) -> dict[str, str]:
        self._x0 = self.mixer.params()
        return self.ctx.pool.keep_faster_trainer(self._x0)

    def _peer_step(self, round_: int, mixed: Ref[ClientRows] | None, train: bool
                   ) -> list[Ref[ClientRows]]:
        pool = self.ctx.pool
        return [pool.workers[w].peer_step(round_, ids, self._x0, mixed, train)
                for w, ids in pool.by_owner(self.honest)]

    def workers_moved(self, round_: int, redo_round: bool) -> None:
        """The peers' models are made again where they lived in workers: those of the round
        before when the round is computed again, else this round's."""
        if redo_round:
            self._state, self._made_by = self._round_start
        if self._made_by is not None:
            self._state = self._peer_step(*self._made_by)

    def run_round(self, round_: int, prefetch: bool = False) -> RoundReport:
        b, ctx = self.ctx.backend, self.ctx
        t0 = time.perf_counter()
        self._round_start = (self._state, self._made_by)
        if ctx.plan.scenario.dsgd.order == "local_then_gossip":
            mixed = self._state[0] if self._state else None
            trained = self._peer_step(round_, mixed, True)
            self._state, self._made_by = [self.mixer.gossip(round_, trained)], None
        else:
            if self._state is None:
                self._made_by = (round_, None, False)
                self._state = self._peer_step(*self._made_by)
            mixed = self.mixer.gossip(round_, self._state)
            self._made_by = (round_, mixed, True)
            self._state = self._peer_step(*self._made_by)
        metrics: dict[str, float] = {"byzantine_peers": float(len(ctx.byzantine))}
        if ctx.evaluate_now(round_):
            metrics.update(b.get(self.mixer.evaluate(self._state)))
            metrics.update(ctx.accountant.spent(round_ + 1))
        else:
            b.get(self._state[0])  # finish the round before timing it
        return RoundReport(metrics, {"round_seconds": time.perf_counter() - t0})

    def checkpoint(self) -> dict[str, Any]:
        """Every honest peer's model (rows in peer order)."""
        import torch

        assert self._state is not None  # a round has run
        results = self.ctx.backend.get(list(self._state))
        x = stack_rows(self.honest, results, results[0].dense.shape[1])
        return {"peers": torch.from_numpy(x)}

    def restore(self, state: dict[str, Any]) -> list[Any]:
        x = state["peers"].numpy()
        self._made_by = None
        self._state = [self.ctx.backend.put(ClientRows(np.asarray(self.honest, dtype=np.int64),
                                                       x, np.full(len(x), np.nan)))]
        return []

    def final(self) -> tuple[np.ndarray, dict[str, Any], dict[str, str]]:
        """The honest peers' averaged model, and the topology's spectral gap and degree."""
        b = self.ctx.backend
        assert self._state is not None
        final, state = b.get(self.mixer.averaged(self._state))
        summary = b.get(self.mixer.topology_summary())
        return np.asarray(final), state, {k: f"{v:.6g}" for k, v in summary.items()}
