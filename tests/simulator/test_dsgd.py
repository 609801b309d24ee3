"""D-SGD runs: peers' models in the workers, gossip in the Mixer, the same numbers on any
number of workers and backends, and the complete graph equal to centralized minibatch SGD."""

from __future__ import annotations

import numpy as np
import pytest

from simulator.config import ScenarioError
from simulator.config.load import load
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine

DSGD = """\
name: dsgd
rounds: 6
data:
  dataset: {name: digits}
  partitioner: {name: dirichlet, alpha: 0.5}
model: {name: logreg}
clients: {total: 8}
local: {steps: 2, batch_size: 16, lr: 0.1}
topology: {name: ring}
evaluation: {every: 3}
"""


def point(tmp_path, *overrides, text=DSGD):
    p = tmp_path / "d.yaml"
    p.write_text(text)
    return load(p, list(overrides)).points[0].scenario


def test_complete_graph_dsgd_equals_centralized_minibatch_sgd(tmp_path):
    """W = 11^T/n after one local step from a common model: every peer holds
    x - lr * mean_i g_i, exactly FedAvg of one-step clients with every client each round."""
    over = ["local.steps=1", "topology={name: complete}", "evaluation.every=1"]
    dsgd = Engine(point(tmp_path, *over), InlineBackend()).run()
    fl_sc = point(tmp_path, "local.steps=1", "evaluation.every=1",
                  text=DSGD.replace("topology: {name: ring}\n", ""))
    fedavg = Engine(fl_sc, InlineBackend()).run()
    np.testing.assert_allclose(dsgd.final_params, fedavg.final_params, rtol=0, atol=1e-5)
    for a, b in zip(dsgd.metrics, fedavg.metrics):
        assert a["averaged_test_accuracy"] == pytest.approx(b["test_accuracy"], abs=1e-9)
        assert a["consensus_distance"] < 1e-10  # the peers agree
    assert dsgd.params["spectral_gap"] == "1"


def test_same_numbers_on_any_number_of_workers_and_on_ray(tmp_path, shared_ray):
    sc = point(tmp_path)
    one = Engine(sc, InlineBackend(), workers=1).run()
    three = Engine(sc, InlineBackend(), workers=3).run()
    assert one.metrics == three.metrics
    on_ray = Engine(sc, shared_ray, workers=2).run()
    assert on_ray.metrics == one.metrics
    np.testing.assert_array_equal(on_ray.final_params, one.final_params)


def test_metrics_and_orders(tmp_path):
    ring = Engine(point(tmp_path), InlineBackend()).run()
    last = ring.metrics[-1]
    for key in ("test_accuracy", "averaged_test_accuracy", "consensus_distance",
                "generalization_gap", "train_loss", "averaged_test_loss", "min_peer_accuracy"):
        assert np.isfinite(last[key])
    assert last["generalization_gap"] == pytest.approx(last["averaged_test_loss"] - last["train_loss"])
    assert last["consensus_distance"] > 0 and last["min_peer_accuracy"] <= last["test_accuracy"]
    assert ["test_accuracy" in m for m in ring.metrics] == [False, False, True, False, False, True]
    assert float(ring.params["spectral_gap"]) == pytest.approx(1 - (1 + 2 * np.cos(2 * np.pi / 8)) / 3)
    cta = Engine(point(tmp_path, "dsgd.order=gossip_then_local"), InlineBackend()).run()
    assert cta.metrics[-1]["test_accuracy"] != last["test_accuracy"]
    # more gossip steps per round: closer consensus
    more = Engine(point(tmp_path, "dsgd.gossip_steps=4"), InlineBackend()).run()
    assert more.metrics[-1]["consensus_distance"] < 0.5 * last["consensus_distance"]


def test_dissensus_breaks_plain_gossip_and_clipped_gossip_resists(tmp_path):
    over = ["rounds=20", "clients.total=12", "clients.byzantine=2",
            "attack={name: dissensus, epsilon: 5}", "topology={name: erdos_renyi, p: 0.5}",
            "evaluation.every=20"]
    plain = Engine(point(tmp_path, *over), InlineBackend()).run().metrics[-1]
    clipped = Engine(point(tmp_path, *over, "dsgd.defense=clipped_gossip"),
                                  InlineBackend()).run().metrics[-1]
    assert plain["consensus_distance"] > 1e6 * clipped["consensus_distance"]
    assert plain["test_loss"] > 1e3 and clipped["test_loss"] < 3.0
    assert clipped["averaged_test_accuracy"] > plain["averaged_test_accuracy"] + 0.2
    assert clipped["byzantine_peers"] == 2.0


def test_dsgd_validation_errors(tmp_path):
    def error(*over, text=DSGD):
        with pytest.raises(ScenarioError) as e:
            point(tmp_path, *over, text=text)
        return [line.split(": ", 1)[1] for line in e.value.lines]

    assert error("clients.per_round=4") == [
        "clients.per_round: every D-SGD peer takes part in every round; remove it or set 8, got 4"]
    assert error("clients.byzantine=1", "attack={name: sign_flip}") == [
        "attack.name: D-SGD needs an attack on gossip; available: dissensus; got 'sign_flip'"]
    assert error("topology={name: hypercube}", "clients.total=6") == [
        "topology: a hypercube needs a power of 2 peers, got 6"]
    assert error("topology={name: torus, rows: 3}") == [
        "topology.rows: a torus of n = 8 peers needs rows dividing n with n / rows >= 3, got rows = 3"]
    assert error("clients.byzantine=1", "attack={name: dissensus}",
                 text=DSGD.replace("topology: {name: ring}\n", "")) == [
        "attack.name: 'dissensus' attacks gossip: it needs a topology (D-SGD)"]
    # a neighbourhood aggregator is checked against the smallest neighbourhood before running
    assert error("dsgd.defense=aggregator", "aggregator={name: cwtm, f: 2}") == [
        "aggregator.f: must be < n/2 = 1.5, got 2 (the smallest neighbourhood, peer 0's, has 3 models)"]
    point(tmp_path, "dsgd.defense=aggregator", "aggregator={name: cwtm, f: 1}")  # valid
    assert error("clients.byzantine=1")[0].startswith(
        "attack: required when clients.byzantine > 0 (got 1); available: dissensus")
