"""Targeted (backdoor) attacks in whole runs: the Byzantine clients train on triggered
samples (strategies.backdoor), the server measures the attack success rate (ASR) at every
evaluation beside clean accuracy, and the defences are measured on it."""

from __future__ import annotations

import pytest

from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine
from tests.simulator.test_engine import point

BACKDOOR = """\
name: bd
rounds: 15
data:
  dataset: {name: digits}
model: {name: logreg}
clients: {total: 20, per_round: 10, byzantine: 4}
attack: {name: backdoor_pixel, target: 0, poison_fraction: 0.5}
local: {steps: 10, batch_size: 16, lr: 0.2}
"""


def _last(tmp_path, *over: str) -> dict[str, float]:
    return Engine(point(tmp_path, BACKDOOR, over), InlineBackend(), workers=2).run().metrics[-1]


def test_the_backdoor_is_learnt_under_fedavg_and_measured_every_evaluation(tmp_path):
    res = Engine(point(tmp_path, BACKDOOR, ["evaluation.every=5"]), InlineBackend()).run()
    asr = [m.get("attack_success_rate") for m in res.metrics]
    assert [r for r, a in enumerate(asr) if a is not None] == [4, 9, 14]
    last = res.metrics[-1]
    assert last["attack_success_rate"] > 0.6 and last["test_accuracy"] > 0.85
    # model replacement (boosted updates) succeeds entirely
    assert _last(tmp_path, "attack={name: model_replacement, boost: 5.0}")[
        "attack_success_rate"] > 0.95
    # no targeted attack, no ASR
    clean = _last(tmp_path, "clients.byzantine=2", "attack={name: sign_flip}")
    assert "attack_success_rate" not in clean


@pytest.mark.parametrize("aggregator", ["{name: median}", "{name: flame}"])
def test_robust_rules_and_flame_keep_the_backdoor_out(tmp_path, aggregator):
    last = _last(tmp_path, f"aggregator={aggregator}")
    assert last["attack_success_rate"] < 0.1 and last["test_accuracy"] > 0.85


def test_a_backdoor_refuses_class_keys_the_data_does_not_have(tmp_path):
    from simulator.config import ScenarioError

    with pytest.raises(ScenarioError) as e:
        point(tmp_path, BACKDOOR, ["attack={name: backdoor_pixel, target: 10}"])
    assert e.value.lines[0].endswith("attack.target: must be < num_classes = 10, got 10")


def test_dba_gives_its_parts_to_the_byzantine_clients_in_order(tmp_path, monkeypatch):
    """DBA's i-th attacker (by id) trains with part i: with 4 Byzantine clients and 4 parts
    every part is trained, whatever their ids (seed 0's Byzantine ids are 1, 2, 8, 18: by id
    mod 4 parts 0 and 2 only)."""
    from simulator.sim.sampling import attacker_ranks, byzantine_clients

    byz = byzantine_clients(0, 20, 4)
    assert sorted(attacker_ranks(set(byz.tolist())).values()) == [0, 1, 2, 3]
    from strategies.backdoor import DistributedBackdoor

    seen: list[int] = []
    real = DistributedBackdoor.poison

    def spy(self, x, y, attacker, *rest):
        seen.append(attacker)
        return real(self, x, y, attacker, *rest)

    monkeypatch.setattr(DistributedBackdoor, "poison", spy)
    sc = point(tmp_path, BACKDOOR, ["attack={name: backdoor_dba, parts: 4, size: 2}"])
    Engine(sc, InlineBackend()).run()
    assert set(seen) == {0, 1, 2, 3}


def test_fltrust_trains_its_root_set_and_holds_against_noise_and_the_backdoor(tmp_path):
    """FLTrust's server trains server.root_samples clean samples each round: under Gaussian
    rows (4 of 20, sigma 100) it keeps FedAvg's clean accuracy where the mean collapses (0.91
    against 0.07 measured), and it keeps the backdoor out; refused with an attack that
    simulates the aggregation."""
    noise = ["attack={name: gaussian, sigma: 100.0}"]
    mean = _last(tmp_path, *noise)
    trust = _last(tmp_path, *noise, "aggregator={name: fltrust}", "server.root_samples=100")
    assert trust["test_accuracy"] > 0.85 > mean["test_accuracy"] + 0.2
    backdoor = _last(tmp_path, "aggregator={name: fltrust}")
    assert backdoor["attack_success_rate"] < 0.1 and backdoor["test_accuracy"] > 0.85
    from simulator.config import ScenarioError

    with pytest.raises(ScenarioError) as e:
        point(tmp_path, BACKDOOR, ["aggregator={name: fltrust}", "attack={name: optimal_alie}"])
    assert "needs the server's own update" in e.value.lines[0]
