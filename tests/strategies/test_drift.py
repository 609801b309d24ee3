"""The client-drift methods (strategies.drift) against their papers' update rules, on a
hand-computed example: two clients, each with one least-squares sample, two local steps of
plain SGD (lr 0.1) from x = (0, 0).

Client 1 has a = (1, 0), b = 1 and client 2 a = (0, 1), b = -1; the loss (a.w - b)^2 has the
gradient 2 a (a.w - b), so each client moves one coordinate only:
FedAvg's client 1 goes 0 -> 0.2 -> 0.36, client 2 0 -> -0.2 -> -0.36.
The engine-level tests check the equivalences the issue names (FedProx mu = 0 is FedAvg bit
for bit, SCAFFOLD's first round is FedAvg's) and the one-line refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from simulator.config import Local, ScenarioError
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine
from simulator.sim.sampling import sample_clients
from strategies.drift import (
    Ditto,
    DriftSGD,
    FedDyn,
    FedNova,
    FedProx,
    Scaffold,
    ScaffoldClient,
    momentum_norm,
)
from strategies.protocols import PERSONAL, ClientData, DriftRule
from strategies.tasks import Regression
from tests.simulator.test_engine import point

A = [torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])]
B = [torch.tensor([1.0]), torch.tensor([-1.0])]
LOCAL = Local(steps=2, batch_size=1, lr=0.1)


def _model() -> nn.Module:
    return nn.Linear(2, 1, bias=False)


def _clients(states: list[dict], shared: torch.Tensor | None = None,
             samples: tuple[int, int] = (1, 1)) -> list[ClientData]:
    """The two clients (client i's sample repeated samples[i] times), with their states."""
    return [ClientData(i, A[i].repeat(k, 1), B[i].repeat(k), torch.Generator().manual_seed(i),
                       states[i], shared) for i, k in enumerate(samples)]


def _round(rule: DriftRule, x: torch.Tensor, states: list[dict],
           shared: torch.Tensor | None = None, local: Local = LOCAL,
           samples: tuple[int, int] = (1, 1)) -> tuple[torch.Tensor, list[dict]]:
    """The two clients' messages (rows) from x, and their new states."""
    trainer = DriftSGD(_model(), local, Regression(), rule, np.array(samples))
    clients = _clients(states, shared, samples)
    rows, _ = trainer.train(0, clients, x)
    return rows, [c.state for c in clients]


def _close(got: torch.Tensor, want: list[float]) -> None:
    torch.testing.assert_close(got, torch.tensor(want), rtol=0, atol=1e-6)


X0 = torch.zeros(2)


def test_fedprox_adds_mu_times_the_distance_to_the_global_model():
    # mu = 1, client 1: w 0 -> 0 - 0.1 (2 (0 - 1) + 0) = 0.2
    #                     -> 0.2 - 0.1 (2 (0.2 - 1) + 1 (0.2 - 0)) = 0.34
    rows, states = _round(FedProx(mu=1.0), X0, [{}, {}])
    _close(rows[0], [0.34, 0.0])
    _close(rows[1], [0.0, -0.34])
    assert states == [{}, {}]  # FedProx keeps no state
    # mu = 0 is FedAvg's local SGD
    plain, _ = _round(FedProx(mu=0.0), X0, [{}, {}])
    _close(plain[0], [0.36, 0.0])


def test_fednova_normalises_each_update_by_its_local_steps():
    # one epoch of batch 1: client 1 (2 samples) takes 2 steps, client 2 (1 sample) 1 step;
    # tau_eff = mean(2, 1) = 1.5; client 1: 0.36 / 2 * 1.5 = 0.27; client 2: -0.2 / 1 * 1.5
    local = Local(epochs=1, batch_size=1, lr=0.1)
    rows, _ = _round(FedNova(), X0, [{}, {}], local=local, samples=(2, 1))
    _close(rows[0], [0.27, 0.0])
    _close(rows[1], [0.0, -0.3])
    # the server's mean is the paper's x - tau_eff sum_i p_i d_i, p_i = 1/2, d_i = -u_i/tau_i
    _close(rows.mean(0), [1.5 * 0.5 * (0.36 / 2), 1.5 * 0.5 * (-0.2 / 1)])
    # equal steps: the update itself (FedAvg)
    same, _ = _round(FedNova(), X0, [{}, {}])
    _close(same[0], [0.36, 0.0])
    # with momentum rho, ||a||_1 = (tau - rho (1 - rho^tau) / (1 - rho)) / (1 - rho)
    assert momentum_norm(2, 0.5) == pytest.approx((2 - 0.5 * 0.75 / 0.5) / 0.5)  # 1 + 1.5
    assert momentum_norm(np.array([3.0]), 0.0).tolist() == [3.0]


def test_scaffold_two_rounds_follow_algorithm_1_option_2():
    server = Scaffold(participation=1.0)
    rule = server.client_rule()
    assert isinstance(rule, ScaffoldClient)
    # round 1: c = c_i = 0, so FedAvg's steps; c_i+ = -(y_i - x) / (K lr) = -(0.36, 0) / 0.2
    rows, states = _round(rule, X0, [{}, {}], server.shared())
    _close(rows[0], [0.36, 0.0, -1.8, 0.0])  # [y_i - x, c_i+ - c_i]
    _close(rows[1], [0.0, -0.36, 0.0, 1.8])
    _close(states[0]["c"], [-1.8, 0.0])
    x = server.step(X0, rows.mean(0))
    _close(x, [0.18, -0.18])
    _close(server.shared(), [-0.9, 0.9])  # c + |S|/N mean(dc)
    # round 2, client 1: each gradient gains c - c_1 = (0.9, 0.9)
    #   w = (0.18, -0.18) - 0.1 ((2 (0.18 - 1), 0) + (0.9, 0.9)) = (0.254, -0.27)
    #   w = (0.254, -0.27) - 0.1 ((2 (0.254 - 1), 0) + (0.9, 0.9)) = (0.3132, -0.36)
    #   c_1+ = c_1 - c + (x - y) / (K lr) = (-1.8, 0) - (-0.9, 0.9) + (-0.1332, 0.18) / 0.2
    rows2, states2 = _round(rule, x, states, server.shared())
    _close(rows2[0], [0.1332, -0.18, -1.566 + 1.8, 0.0])
    _close(states2[0]["c"], [-1.566, 0.0])
    # the server: x + lr_g mean(dy), c + (|S|/N) mean(dc) (half the clients sampled: half dc)
    half = Scaffold(participation=0.5, lr=2.0)
    half.load_state_dict(server.state_dict())
    x2 = half.step(x, rows2.mean(0))
    _close(x2, (x + 2.0 * rows2[:, :2].mean(0)).tolist())
    _close(half.shared(), (torch.tensor([-0.9, 0.9]) + 0.5 * rows2[:, 2:].mean(0)).tolist())


def test_feddyn_two_rounds_follow_algorithm_1():
    alpha = 0.5
    server = FedDyn(participation=1.0, alpha=alpha)
    rule = server.client_rule()
    # round 1, client 1 (g_1 = 0): gradient 2 (w - 1) + alpha (w - 0)
    #   w = 0 - 0.1 (-2) = 0.2; w = 0.2 - 0.1 (-1.6 + 0.1) = 0.35; g_1 = -alpha 0.35
    rows, states = _round(rule, X0, [{}, {}])
    _close(rows[0], [0.35, 0.0])
    _close(states[0]["g"], [-0.175, 0.0])
    _close(states[1]["g"], [0.0, 0.175])
    # server: h = -alpha mean(w_k - x) = (-0.0875, 0.0875); x = mean(w_k) - h / alpha
    x = server.step(X0, rows.mean(0))
    _close(x, [0.175 + 0.175, -0.175 - 0.175])
    # round 2, client 1 from x = (0.35, -0.35): gradient 2 (w1 - 1) - g_1 + alpha (w - x)
    #   w1 = 0.35 - 0.1 (-1.3 + 0.175 + 0) = 0.4625
    #   w1 = 0.4625 - 0.1 (2 (0.4625 - 1) + 0.175 + 0.5 * 0.1125) = 0.546875
    #   w2 stays: its loss has no w2 term, g_1's second coordinate is 0, w2 = x2
    rows2, states2 = _round(rule, x, states)
    _close(rows2[0], [0.196875, 0.0])
    _close(states2[0]["g"], [-0.175 - alpha * 0.196875, 0.0])
    h = torch.tensor([-0.0875, 0.0875]) - alpha * rows2.mean(0)
    _close(server.step(x, rows2.mean(0)), (x + rows2.mean(0) - h / alpha).tolist())


def test_ditto_sends_fedavg_updates_and_keeps_a_personal_model():
    rule = Ditto(lam=1.0)
    # round 1: the global steps are FedAvg's (0.36); the personal model starts at x = 0 and
    # takes as many steps on F_k(v) + lam / 2 ||v - x||^2: v = 0.2, then
    # 0.2 - 0.1 (2 (0.2 - 1) + 1 (0.2 - 0)) = 0.34
    rows, states = _round(rule, X0, [{}, {}])
    _close(rows[0], [0.36, 0.0])
    _close(states[0][PERSONAL], [0.34, 0.0])
    _close(states[1][PERSONAL], [0.0, -0.34])
    # round 2 from x = (0.18, -0.18), client 1's personal model from v = (0.34, 0):
    #   v = (0.34, 0) - 0.1 ((2 (0.34 - 1), 0) + (0.34 - 0.18, 0 + 0.18)) = (0.456, -0.018)
    #   v = (0.456, -0.018) - 0.1 ((2 (0.456 - 1), 0) + (0.276, 0.162)) = (0.5372, -0.0342)
    x = torch.tensor([0.18, -0.18])
    rows2, states2 = _round(rule, x, states)
    # client 1's global steps from x: 0.18 -> 0.18 + 0.2 * 0.82 = 0.344 -> 0.344 + 0.2 * 0.656
    _close(rows2[0], [0.344 + 0.2 * 0.656 - 0.18, 0.0])
    _close(states2[0][PERSONAL], [0.5372, -0.0342])
    # lam = 0: purely local personal models
    _, alone = _round(Ditto(lam=0.0), X0, [{}, {}])
    _close(alone[0][PERSONAL], [0.36, 0.0])


# ---------------------------------------------------------------------------- in the engine


def _run(tmp_path, *over):
    return Engine(point(tmp_path, overrides=list(over)), InlineBackend(), workers=2).run()


def test_fedprox_with_mu_0_and_fednova_with_equal_steps_are_fedavg_bit_for_bit(tmp_path):
    fedavg = _run(tmp_path)
    for over in ("local.optimizer={name: fedprox, mu: 0.0}", "local.optimizer={name: fednova}"):
        same = _run(tmp_path, over)
        assert same.metrics == fedavg.metrics, over
        np.testing.assert_array_equal(same.final_params, fedavg.final_params)
    prox = _run(tmp_path, "local.optimizer={name: fedprox, mu: 0.5}")
    assert not np.array_equal(prox.final_params, fedavg.final_params)


def test_scaffold_first_round_is_fedavg_then_its_control_variates_act(tmp_path):
    one = ["rounds=1"]
    fedavg = _run(tmp_path, *one)
    first = _run(tmp_path, *one, "server.optimizer={name: scaffold}")
    # the same local steps bit for bit; the mean of rows twice as wide (model and control
    # variate blocks) is reduced in another order by torch's vectorised kernel: 1 ulp apart
    np.testing.assert_allclose(first.final_params, fedavg.final_params, rtol=2e-7, atol=0)
    assert first.metrics[0]["test_accuracy"] == fedavg.metrics[0]["test_accuracy"]
    later, fedavg = _run(tmp_path, "server.optimizer={name: scaffold}"), _run(tmp_path)
    assert later.metrics[0]["test_accuracy"] == fedavg.metrics[0]["test_accuracy"]
    assert later.metrics[-1]["test_accuracy"] != fedavg.metrics[-1]["test_accuracy"]


def test_scaffold_rows_go_through_the_robust_pipeline_with_byzantine_clients(tmp_path):
    """Byzantine clients send two-block rows like everyone; median keeps the run finite
    where the mean is pulled far away."""
    over = ["clients.byzantine=2", "attack={name: gaussian, sigma: 100.0}",
            "server.optimizer={name: scaffold}"]
    robust = _run(tmp_path, *over, "aggregator={name: median}")
    plain = _run(tmp_path, *over)
    assert robust.metrics[-1]["test_accuracy"] > plain.metrics[-1]["test_accuracy"] + 0.2


def test_partial_stragglers_send_the_steps_they_finished(tmp_path):
    """clients.stragglers.partial: a straggler's first steps, not a missed round; the same
    clients are late either way, and all of their work, or none, is what differs."""
    late = "clients.stragglers={deadline: 2.5, sigma: 0.5, jitter: 0.0"
    dropped = _run(tmp_path, late + "}", "local.optimizer={name: fedprox, mu: 0.1}")
    partial = _run(tmp_path, late + ", partial: true}", "local.optimizer={name: fedprox, mu: 0.1}")
    for d, p in zip(dropped.metrics, partial.metrics, strict=True):
        assert d["stragglers"] == p["stragglers"]
        assert p["participants"] == d["participants"] + p["partial_work"]
    assert sum(m["partial_work"] for m in partial.metrics) > 0
    assert "partial_work" not in dropped.metrics[0]
    assert partial.final_params.tolist() != dropped.final_params.tolist()


@pytest.mark.parametrize("over, message", [
    (["server.optimizer={name: scaffold}", "server.mode=fedbuff"],
     "server.optimizer: 'scaffold' steps once per round of sampled clients"),
    (["server.optimizer={name: feddyn}", "server.mode=latest"],
     "server.optimizer: 'feddyn' steps once per round of sampled clients"),
    (["local.optimizer={name: fedprox}",
      "privacy={name: dp_sgd, noise_multiplier: 1.0, clip: 1.0}"],
     "privacy.name: 'dp_sgd' does not take 'rule', which client rule 'fedprox'"),
    (["server.optimizer={name: scaffold}", "local.optimizer={name: fednova}"],
     "local.optimizer: server.optimizer 'scaffold' brings its own client half"),
])
def test_combinations_the_maths_does_not_support_are_one_line(tmp_path, over, message):
    with pytest.raises(ScenarioError) as e:
        point(tmp_path, overrides=over)
    assert len(e.value.lines) == 1 and message in e.value.lines[0], e.value.lines


SYNTHETIC = """\
name: syn
rounds: 5
data:
  dataset: {name: synthetic, alpha: 1.0, beta: 1.0}
  partitioner: {name: natural}
model: {name: logreg}
clients: {total: 16, per_round: 6}
local: {steps: 4, batch_size: 10, lr: 0.05}
"""


def test_ditto_keeps_fedavgs_global_model_and_measures_personal_models(tmp_path):
    """The global model is FedAvg's bit for bit (the personal steps come after); the personal
    models, on each client's own test samples, beat the global model there (Synthetic(1, 1)
    clients differ); a large lambda pulls them to the global model (lam lr = 0.95 of the
    way each step)."""
    def run(*over):
        return Engine(point(tmp_path, SYNTHETIC, over), InlineBackend(), workers=2).run()

    fedavg, ditto = run(), run("local.optimizer={name: ditto, lam: 0.1}")
    np.testing.assert_array_equal(ditto.final_params, fedavg.final_params)
    last = ditto.metrics[-1]
    assert {k: v for k, v in last.items() if not k.startswith("personal")} == \
        {k: v for k, v in fedavg.metrics[-1].items()
         if k not in ("round_seconds",) and not k.endswith("_seconds")} | \
        {k: v for k, v in last.items() if k.endswith("_seconds")}
    assert "personal_test_accuracy_mean" not in fedavg.metrics[-1]
    clients = sorted({c for r in range(5) for c in sample_clients(0, r, 16, 6).tolist()})
    assert last["personal_clients"] == len(clients)  # the clients sampled so far
    assert last["personal_test_accuracy_mean"] > last["client_test_accuracy_mean"] + 0.2
    assert last["personal_test_accuracy_p10"] <= last["personal_test_accuracy_mean"]
    pulled = run("local.optimizer={name: ditto, lam: 19.0}").metrics[-1]
    assert pulled["test_accuracy"] == last["test_accuracy"]
    assert pulled["personal_test_accuracy_mean"] < last["personal_test_accuracy_mean"] - 0.1


def test_a_partial_stragglers_simulated_time_is_its_share_of_the_work(tmp_path):
    """With speeds (a simulated clock), a straggler that sends k of its K steps takes k/K of
    its task's time: the round is shorter than when it does all of its work."""
    speeds = "speeds={distribution: constant, sample_seconds: 1.0}"
    full = _run(tmp_path, speeds, "local.optimizer={name: fedprox, mu: 0.1}")
    late = _run(tmp_path, speeds, "local.optimizer={name: fedprox, mu: 0.1}",
                "clients.stragglers={deadline: 2.0, sigma: 0.0, jitter: 0.0, partial: true}")
    # every client has 3 steps of batch 16 (48 samples) and sends 2: 2/3 of each round
    assert all(m["partial_work"] == m["participants"] for m in late.metrics)
    assert late.metrics[-1]["sim_time"] == pytest.approx(full.metrics[-1]["sim_time"] * 2 / 3)
