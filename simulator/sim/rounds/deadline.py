"""The semi-synchronous server (``server.mode: deadline``): a synchronous round closed by a
deadline on the simulated clock.

Each round samples its clients as a synchronous one does. A sampled honest client's task
(its local work, the model down and its message up, at its device's simulated speed:
``speeds``, whose defaults apply when absent) either ends by ``server.deadline`` simulated
seconds and counts in the round's step, or is late: with ``server.late: drop`` (the default)
its update is lost, as FedAvg's deadline-based client selection does (Bonawitz et al.,
"Towards Federated Learning at Scale: System Design", MLSys 2019: a round's reporting
deadline); with ``carry`` it trains from the round's model and its update joins the next
round's step, one round stale, scaled by FedBuff's default staleness ``1 / sqrt(1 + 1)``
(Nguyen et al., AISTATS 2022), as a semi-synchronous server that keeps stragglers' work
does; with ``partial`` it sends the minibatch steps it finished by the deadline,
``floor(steps * deadline / duration)`` (FedProx's systems heterogeneity, Li et al., MLSys
2020), the rule ``clients.stragglers`` applies to its own step times (``late_work``). A round lasts until its last on-time participant's task ends, or until the deadline
when someone is late. Byzantine clients are never late (the worst case), as under
``clients.stragglers``.

Departure: a carried client is sampled for the next round independently of its lateness (a
real device still uploading might be skipped).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from simulator.config.schema import Staleness
from simulator.messages import ClientRows, Encoded, Group, Ref, stack_payloads, stack_rows
from simulator.sim.clock import staleness_scale
from simulator.sim.rounds import RunContext
from simulator.sim.rounds.server import Participation, ServerRounds, Training
from simulator.sim.sampling import late_work, missed_round

# a carried update's scale: FedBuff's default staleness function at one round
_DEFAULT = Staleness()
CARRIED_SCALE = float(staleness_scale(_DEFAULT.function, _DEFAULT.a, _DEFAULT.b,
                                    np.ones(1))[0])


class DeadlineRounds(ServerRounds):
    """Server rounds closed at ``server.deadline`` simulated seconds (module docstring)."""

    name = "deadline"

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        server = ctx.plan.scenario.server
        assert server.deadline is not None  # required with this mode (validation)
        self.deadline = float(server.deadline)
        self.late = server.late or "drop"
        # the late updates by the round they were late in (rows in client order): round r's
        # step applies round r - 1's, kept until round r + 1 (a round computed again after a
        # lost worker applies them again)
        self._carried: dict[int, ClientRows] = {}
        self._applied = 0  # how many carried updates the round's step applies

    def participants(self, round_: int, honest: list[int]) -> Participation:
        """The dropouts, then the clients whose task ends after the deadline (the deadline
        rule ``clients.stragglers`` follows too, ``late_work``): dropped, carried into the
        next round's step (``late: carry``) or sending the steps they finished (``late:
        partial``)."""
        assert self.task_seconds is not None  # a timed mode always has devices
        c = self.ctx.plan.scenario.clients
        steps = self.ctx.pool.local_steps
        dropped, _ = missed_round(self.ctx.plan.seed, round_, honest, steps, c.dropout, None)
        ids = np.asarray([i for i in honest if i not in dropped], dtype=np.int64)
        duration = np.zeros(len(steps))
        duration[ids] = [self.task_seconds(int(i), round_) for i in ids]
        late = late_work(ids, duration, self.deadline, np.asarray(steps))
        partial = {i: k for i, k in late.items() if k > 0} if self.late == "partial" else {}
        sent = [int(i) for i in ids if i not in late or i in partial]
        return Participation(dropped, set(late), partial, sent,
                             sorted(late) if self.late == "carry" else [])

    def step_rows(self, round_: int, tr: Training
                  ) -> tuple[tuple[Group, ...], list[Ref[ClientRows]], tuple[float, ...] | None]:
        """This round's on-time updates, then the last round's late ones (scaled)."""
        groups, refs, _ = super().step_rows(round_, tr)
        rows = self._carried.get(round_ - 1)
        self._applied = 0 if rows is None else len(rows.clients)
        if rows is None or not self._applied:
            return groups, refs, None
        scales = [1.0] * len(tr.honest) + [CARRIED_SCALE] * self._applied + \
            [1.0] * len(tr.byz)
        return ((*groups, (round_ - 1, tuple(rows.clients.tolist()), 1)),
                [*refs, self.ctx.backend.put(rows)], tuple(scales))

    def after_step(self, round_: int, tr: Training) -> None:
        """The round's late updates, fetched for the next round's step (held by the driver,
        so a lost worker loses none of them)."""
        self._carried = {r: rows for r, rows in self._carried.items() if r == round_ - 1}
        late = tr.who.carried
        if not late:
            return
        got = list(self.ctx.backend.get(tr.carried_refs))
        self._carried[round_] = ClientRows(
            np.asarray(late, dtype=np.int64), stack_payloads([(late, len(got))], got),
            stack_rows(late, got, 0, "losses"), 0.0,
            stack_rows(late, got, self.d_buffers, "buffers") if self.d_buffers else None)

    def duration(self, round_: int, tr: Training) -> float:
        """Until the last on-time task ends, or the deadline when someone is late."""
        on_time = super().duration(round_, tr)
        return self.deadline if tr.who.late else min(on_time, self.deadline)

    def round_metrics(self, round_: int, tr: Training) -> dict[str, float]:
        """``late``: the round's late clients; ``carried``: last round's late updates this
        step applied; ``partial_work`` (``late: partial``): late clients that sent some."""
        out = {"late": float(len(tr.who.late)), "carried": float(self._applied)}
        if self.late == "partial":
            out["partial_work"] = float(len(tr.who.partial))
        return out

    def checkpoint(self) -> dict[str, Any]:
        """The server's state and the late updates it holds, by round (as tensors; an
        encoded payload's parts as ``updates.NAME``)."""
        out = super().checkpoint()
        if self._carried:
            out["carried"] = {r: {k: torch.from_numpy(np.array(v)) for k, v in (
                ("clients", rows.clients), *_payload_items(rows.updates),
                ("losses", rows.losses), ("buffers", rows.buffers)) if v is not None}
                for r, rows in self._carried.items()}
        return out

    def restore(self, state: dict[str, Any]) -> list[Any]:
        self._carried = {int(r): ClientRows(
            c["clients"].numpy(), _payload(c), c["losses"].numpy(), 0.0,
            c["buffers"].numpy() if "buffers" in c else None)
            for r, c in state.get("carried", {}).items()}
        return super().restore(state)


_PARTS = "updates."  # an encoded payload's part in a checkpoint


def _payload_items(updates: np.ndarray | Encoded) -> list[tuple[str, np.ndarray]]:
    if isinstance(updates, Encoded):
        return [(_PARTS + k, v) for k, v in updates.parts.items()]
    return [("updates", updates)]


def _payload(saved: dict[str, Any]) -> np.ndarray | Encoded:
    if "updates" in saved:
        return saved["updates"].numpy()
    return Encoded({k[len(_PARTS):]: v.numpy() for k, v in saved.items()
                    if k.startswith(_PARTS)})
