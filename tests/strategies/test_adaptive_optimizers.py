"""FedYogi and FedAdagrad (Reddi et al., "Adaptive Federated Optimization", ICLR 2021,
Algorithm 2): two steps against numbers worked by hand, the state round trip of a checkpoint,
the scenario's bounds, and short engine runs through the public API."""

from __future__ import annotations

import io
import math
import pickle

import numpy as np
import pytest
import torch

from simulator.config import ScenarioError
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine
from strategies.optimizers import FedAdagrad, FedAdam, FedYogi, adagrad_step, adam_step, yogi_step
from tests.simulator.test_engine import point

LR, BETA1, BETA2, TAU = 0.1, 0.5, 0.75, 0.01
X0 = [0.0, 1.0, -1.0]
D1 = [1.0, -2.0, 0.0]
D2 = [3.0, 0.1, -1.0]
# m_t = beta1 m_{t-1} + (1 - beta1) delta_t, m_{-1} = 0
M1 = [0.5, -1.0, 0.0]
M2 = [0.25 + 1.5, -0.5 + 0.05, 0.0 - 0.5]
# FedYogi, v_{-1} = tau^2 = 1e-4, v_t = v_{t-1} - (1 - beta2) delta^2 sign(v_{t-1} - delta^2):
# step 1 raises v where delta^2 > 1e-4 and keeps it where delta = 0 (sign +1, delta^2 = 0);
# step 2 lowers coordinate 1 (v = 1.0001 > 0.01 = delta^2) by 0.25 * 0.01, raises the others.
YOGI_V1 = [1e-4 + 0.25 * 1.0, 1e-4 + 0.25 * 4.0, 1e-4]
YOGI_V2 = [0.2501 + 0.25 * 9.0, 1.0001 - 0.25 * 0.01, 1e-4 + 0.25 * 1.0]
# FedAdagrad, v_{-1} = tau^2, v_t = v_{t-1} + delta^2
ADAGRAD_V1 = [1e-4 + 1.0, 1e-4 + 4.0, 1e-4]
ADAGRAD_V2 = [1.0001 + 9.0, 4.0001 + 0.01, 1e-4 + 1.0]


def t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def next_x(x: list[float], m: list[float], v: list[float]) -> list[float]:
    """x_{t+1} = x_t + lr m_t / (sqrt(v_t) + tau), coordinate by coordinate."""
    return [xi + LR * mi / (math.sqrt(vi) + TAU) for xi, mi, vi in zip(x, m, v, strict=True)]


@pytest.mark.parametrize("make, v1, v2", [
    (lambda: FedYogi(lr=LR, beta1=BETA1, beta2=BETA2, tau=TAU), YOGI_V1, YOGI_V2),
    (lambda: FedAdagrad(lr=LR, beta1=BETA1, tau=TAU), ADAGRAD_V1, ADAGRAD_V2),
], ids=["fedyogi", "fedadagrad"])
def test_two_steps_match_the_hand_computed_numbers(make, v1, v2):
    opt = make()
    x0 = t(X0)
    x1 = opt.step(x0, t(D1))
    torch.testing.assert_close(x0, t(X0))  # never in place
    torch.testing.assert_close(opt.m, t(M1))
    torch.testing.assert_close(opt.v, t(v1))
    torch.testing.assert_close(x1, t(next_x(X0, M1, v1)))
    x2 = opt.step(x1, t(D2))
    torch.testing.assert_close(opt.m, t(M2))
    torch.testing.assert_close(opt.v, t(v2))
    torch.testing.assert_close(x2, t(next_x(next_x(X0, M1, v1), M2, v2)))


def test_the_functional_twins_give_the_same_numbers():
    v0 = torch.full((3,), TAU**2)
    x, m, v = yogi_step(t(X0), t(D1), torch.zeros(3), v0, LR, BETA1, BETA2, TAU)
    x, m, v = yogi_step(x, t(D2), m, v, LR, BETA1, BETA2, TAU)
    torch.testing.assert_close((m, v), (t(M2), t(YOGI_V2)))
    torch.testing.assert_close(x, t(next_x(next_x(X0, M1, YOGI_V1), M2, YOGI_V2)))
    x, m, v = adagrad_step(t(X0), t(D1), torch.zeros(3), v0, LR, BETA1, TAU)
    x, m, v = adagrad_step(x, t(D2), m, v, LR, BETA1, TAU)
    torch.testing.assert_close((m, v), (t(M2), t(ADAGRAD_V2)))
    torch.testing.assert_close(x, t(next_x(next_x(X0, M1, ADAGRAD_V1), M2, ADAGRAD_V2)))


def test_yogi_is_adam_from_zero_and_parts_from_it_where_v_exceeds_delta_squared():
    """From v = 0 both add (1 - beta2) delta^2; where v > delta^2 Yogi takes
    (1 - beta2) delta^2 off v, Adam moves v to beta2 v + (1 - beta2) delta^2."""
    d = t([2.0, -1.0])
    _, _, vy = yogi_step(torch.zeros(2), d, torch.zeros(2), torch.zeros(2), LR, BETA1, BETA2, TAU)
    _, _, va = adam_step(torch.zeros(2), d, torch.zeros(2), torch.zeros(2), LR, BETA1, BETA2, TAU)
    torch.testing.assert_close(vy, va)
    v, d = t([4.0]), t([0.5])
    _, _, vy = yogi_step(torch.zeros(1), d, torch.zeros(1), v, LR, BETA1, BETA2, TAU)
    _, _, va = adam_step(torch.zeros(1), d, torch.zeros(1), v, LR, BETA1, BETA2, TAU)
    torch.testing.assert_close(vy, t([4.0 - 0.25 * 0.25]))
    torch.testing.assert_close(va, t([0.75 * 4.0 + 0.25 * 0.25]))


def _through_a_checkpoint(state):
    """Pickled (it crosses Ray) and through ``torch.load(weights_only=True)`` (resume)."""
    buf = io.BytesIO()
    torch.save(pickle.loads(pickle.dumps(state)), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("cls", [FedYogi, FedAdagrad])
def test_state_dict_round_trip_gives_the_identical_next_step(cls):
    a, b = cls(), cls()
    b.load_state_dict(_through_a_checkpoint(a.state_dict()))  # before any step: nothing kept
    x = a.step(t(X0), t(D1))
    x = a.step(x, t(D2))
    b.load_state_dict(_through_a_checkpoint(a.state_dict()))
    d3 = t([-0.5, 0.25, 2.0])
    assert torch.equal(b.step(x, d3), a.step(x, d3))
    assert torch.equal(b.m, a.m) and torch.equal(b.v, a.v)
    fresh = cls()  # and the state is what the step depends on
    assert not torch.equal(fresh.step(x, d3), b.step(x, d3))


def test_paper_defaults():
    yogi, adagrad = FedYogi(), FedAdagrad()
    assert (yogi.lr, yogi.beta1, yogi.beta2, yogi.tau) == (0.01, 0.9, 0.99, 1e-3)
    assert (adagrad.lr, adagrad.beta1, adagrad.tau) == (0.1, 0.9, 1e-3)
    # FedAdagrad's default lr makes its first step FedAdam's, lr 0.01 sign(delta), where tau
    # is negligible (v sums delta^2 where Adam averages it with weight 1 - beta2)
    d, x = t([0.3, -2.0, 1e-2]), torch.zeros(3)
    torch.testing.assert_close(FedAdagrad(tau=1e-7).step(x, d), FedAdam(tau=1e-7).step(x, d))
    torch.testing.assert_close(FedAdam(tau=1e-7).step(x, d), 0.01 * d.sign())


BASE = """\
name: adaptive
rounds: 3
data: {dataset: {name: digits}}
model: {name: logreg}
clients: {total: 12, per_round: 6}
local: {steps: 2, batch_size: 16, lr: 0.2}
"""


def test_engine_runs_fedyogi_and_fedadagrad_apart_from_fedadam(tmp_path):
    runs = {}
    for name in ("fedadam", "fedyogi", "fedadagrad"):
        sc = point(tmp_path, BASE, [f"server.optimizer={{name: {name}, lr: 0.05}}"])
        assert sc.server.optimizer["name"] == name
        runs[name] = Engine(sc, InlineBackend(), workers=2).run()
    for name, res in runs.items():
        acc = res.final("test_accuracy")
        assert isinstance(acc, float) and 0.0 <= acc <= 1.0, (name, acc)
        assert len(res.metrics) == 3
    for name in ("fedyogi", "fedadagrad"):
        assert runs[name].final("test_accuracy") != runs["fedadam"].final("test_accuracy"), name
        assert runs[name].final("test_loss") != runs["fedadam"].final("test_loss"), name
        assert not np.array_equal(runs[name].final_params, runs["fedadam"].final_params), name
    assert not np.array_equal(runs["fedyogi"].final_params, runs["fedadagrad"].final_params)
    # and the run is seeded: the same scenario gives the same numbers
    again = Engine(point(tmp_path, BASE, ["server.optimizer={name: fedyogi, lr: 0.05}"]),
                        InlineBackend(), workers=1).run()
    assert again.metrics == runs["fedyogi"].metrics


@pytest.mark.parametrize("override, message", [
    ("server.optimizer={name: fedyogi, beta2: 1.0}", "server.optimizer.beta2: must be < 1.0"),
    ("server.optimizer={name: fedadagrad, tau: 0}", "server.optimizer.tau: must be > 0"),
    ("server.optimizer={name: fedadagrad, beta2: 0.9}", "server.optimizer.beta2"),
])
def test_scenario_bounds_name_the_key(tmp_path, override, message):
    with pytest.raises(ScenarioError) as e:
        point(tmp_path, BASE, [override])
    assert message in "\n".join(e.value.lines)
