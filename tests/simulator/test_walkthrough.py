"""docs/architecture.md's walk-throughs, run: a client rule with per-client state added as a
third party adds it (a rule, its trainer, two entry points; nothing in the engine), and a
round protocol sees the engine only through its hooks."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from simulator.config.load import load
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine
from simulator.sim.rounds.server import ServerRounds
from strategies.protocols import ClientRule, Trainer, Traits
from strategies.trainers import local_sgd, minibatches
from tests.entry_points import registered

SMALL = """\
name: walk
rounds: 5
data: {dataset: {name: digits}}
model: {name: logreg}
clients: {total: 10, per_round: 4}
local: {steps: 2, batch_size: 16, lr: 0.1}
"""


class Drift(ClientRule):
    """A client rule with per-client state (a SCAFFOLD-like correction, kept simple): each
    client remembers the sum of its past updates and sends its local SGD update plus
    ``rate`` times that sum."""

    traits = Traits(client_state=True, trainer="drift_sgd")

    def __init__(self, rate: float = 0.5) -> None:
        self.rate = rate


class DriftSGD(Trainer):
    """Local SGD plus the client's remembered drift (``Drift``); the state it leaves is the
    new sum of the client's updates."""

    traits = Traits(context=("model", "local", "task", "rule"))

    def __init__(self, model, local, task, rule) -> None:
        self.model, self.local, self.task, self.rule = model, local, task, rule

    def train(self, round_, clients, start):
        updates = torch.empty((len(clients), start.numel()))
        losses = torch.empty(len(clients), dtype=torch.float64)
        for i, c in enumerate(clients):
            batches = minibatches(len(c.y), self.local, c.generator)
            u, losses[i] = local_sgd(self.model, start, c.x, c.y, batches, self.local.lr,
                                     task=self.task)
            past = c.state.get("sum", torch.zeros_like(u))
            updates[i] = u + self.rule.rate * past
            c.state = {"sum": past + u, "rounds": c.state.get("rounds", torch.zeros(1)) + 1}
        return updates, losses


@pytest.fixture()
def drift_registered(monkeypatch):
    """The two entry points a plugin package would declare (pyproject.toml)."""
    here = __name__
    with registered(monkeypatch, {"client_optimizers": {"drift": f"{here}:Drift"},
                                  "trainers": {"drift_sgd": f"{here}:DriftSGD"}}):
        yield


def _point(tmp_path: Path, *over: str):
    p = tmp_path / "s.yaml"
    p.write_text(SMALL)
    return load(p, list(over)).points[0].scenario


def test_a_client_rule_with_state_needs_no_engine_change(tmp_path, drift_registered):
    sc = _point(tmp_path, "local.optimizer={name: drift, rate: 0.5}", "runtime.checkpoint_every=2")
    eng = Engine(sc, InlineBackend(), workers=3)
    assert eng.plan.client_state and eng.plan.trainer == {"name": "drift_sgd"}
    saved = {}
    res = eng.run(on_checkpoint=lambda r, state: saved.update({r: copy.deepcopy(state)}))
    # each client's state counts the rounds it was sampled in, on the worker that owns it
    sampled = np.zeros(10)
    from simulator.sim.sampling import sample_clients
    for r in range(sc.rounds):
        sampled[sample_clients(sc.seeds[0], r, 10, 4)] += 1
    states = eng.pool.client_states()
    assert {c: int(s["rounds"][0]) for c, s in states.items()} == \
        {c: int(n) for c, n in enumerate(sampled) if n}
    assert all(eng.pool.worker_of(c) == c % 3 for c in states)
    # the checkpoints carry the state: after round 2, the rounds of rounds 1-2
    after_two = np.zeros(10)
    for r in range(2):
        after_two[sample_clients(sc.seeds[0], r, 10, 4)] += 1
    assert {c: int(s["rounds"][0]) for c, s in saved[1]["clients"].items()} == \
        {c: int(n) for c, n in enumerate(after_two) if n}
    # the numbers do not depend on the worker count; the state changes them (rate 0 does not)
    one = Engine(sc, InlineBackend(), workers=1).run()
    assert one.metrics == res.metrics
    plain = Engine(_point(tmp_path, "local.optimizer={name: drift, rate: 0.0}"),
                   InlineBackend()).run()
    sgd = Engine(_point(tmp_path), InlineBackend()).run()
    np.testing.assert_array_equal(plain.final_params, sgd.final_params)
    assert not np.array_equal(res.final_params, sgd.final_params)
    # resuming from the checkpoint after round 2 gives the uninterrupted numbers
    resumed = Engine(sc, InlineBackend(), workers=2).run(resume={**saved[1], "round": 1})
    assert resumed.metrics == res.metrics


def test_a_trainer_that_cannot_hold_the_rules_state_is_refused(tmp_path, drift_registered):
    from simulator.config import ScenarioError

    with pytest.raises(ScenarioError, match=r"local.trainer: 'sgd' does not take 'rule', which "
                                            r"client rule 'drift' \(it runs inside its trainer\) "
                                            r"needs"):
        _point(tmp_path, "local.optimizer={name: drift}", "local.trainer={name: sgd}")


def test_a_round_protocol_sees_the_engine_through_its_hooks(tmp_path, monkeypatch):
    """The engine drives a protocol by its hooks only, in the documented order; the numbers
    are the protocol's."""
    import simulator.sim.engine as engine_module

    calls = []

    class Recorded(ServerRounds):
        def start(self):
            calls.append("start")
            return super().start()

        def ready(self):
            calls.append("ready")
            return super().ready()

        def run_round(self, round_, prefetch=False):
            calls.append(f"round {round_}")
            return super().run_round(round_, prefetch)

        def checkpoint(self):
            calls.append("checkpoint")
            return super().checkpoint()

        def final(self):
            calls.append("final")
            return super().final()

    sc = _point(tmp_path, "rounds=4", "runtime.checkpoint_every=2")
    plain = Engine(sc, InlineBackend()).run()
    monkeypatch.setitem(engine_module.PROTOCOLS, "server", Recorded)
    got = Engine(sc, InlineBackend()).run(on_checkpoint=lambda r, s: None)
    assert calls == ["start", "ready", "round 0", "round 1", "checkpoint", "round 2",
                     "round 3", "final"]
    assert got.metrics == plain.metrics


ENGINE = ("simulator", "strategies", "fedray", "dashboards")


def _sources_naming(pattern: str) -> set[str]:
    """The product's source files (not tests or docs) whose text matches ``pattern``."""
    import re

    root = Path(__file__).resolve().parents[2]
    return {str(p.relative_to(root)) for top in ENGINE for p in (root / top).rglob("*.py")
            if re.search(pattern, p.read_text())}


def test_a_server_optimizer_with_a_multipart_message_is_one_module(tmp_path):
    """q-FedAvg (its client half sends the delta and the scalar h, a message of two parts)
    went in as one module and three entry points: nothing under simulator/ names it, and a
    run of it steps as its server half says (q = 0, L = 1: FedAvg to the bit)."""
    assert _sources_naming(r"qfedavg|QFedAvg|strategies\.fairness") == {"strategies/fairness.py"}
    fedavg = Engine(_point(tmp_path), InlineBackend()).run()
    q0 = Engine(_point(tmp_path, "server.optimizer={name: qfedavg, q: 0, lipschitz: 1}"),
                InlineBackend()).run()
    np.testing.assert_array_equal(q0.final_params, fedavg.final_params)
    assert q0.metrics[0]["bytes_up"] == fedavg.metrics[0]["bytes_up"] + 4 * 4  # h: 4 clients


def test_a_round_protocol_is_two_files(tmp_path):
    """The semi-synchronous server: its protocol module and its mode's line in the schema
    (the mode's name, its keys); the engine finds the protocol by name."""
    assert _sources_naming(r'"deadline"|DeadlineRounds') == \
        {"simulator/sim/rounds/deadline.py", "simulator/config/schema.py"}
    res = Engine(_point(tmp_path, "server.mode=deadline", "server.deadline=1e9"),
                 InlineBackend()).run()
    plain = Engine(_point(tmp_path), InlineBackend()).run()
    np.testing.assert_array_equal(res.final_params, plain.final_params)
