"""DP in runs: DP-SGD's per-sample clipping equals the textbook computation, DP-FedAvg's clip
and noise, epsilon per evaluated round, privacy artifacts, and the CLI comparison."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from simulator.config import ScenarioError
from simulator.config.load import load
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine

DP = """\
name: dp
rounds: 6
data:
  dataset: {name: digits}
model: {name: mlp, hidden: [16]}
clients: {total: 10, per_round: 5}
local: {steps: 2, batch_size: 16, lr: 0.2}
privacy: {name: dp_sgd, clip: 1.0, noise_multiplier: 1.0}
evaluation: {every: 3}
"""


def point(tmp_path, *over):
    p = tmp_path / "dp.yaml"
    p.write_text(DP)
    return load(p, list(over)).points[0].scenario


def _manual_dp_step(model, w, x, y, clip, lr):
    """One DP-SGD step without noise on the whole batch, one example at a time."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    total = torch.zeros_like(w)
    for xi, yi in zip(x, y):
        vector_to_parameters(w.clone(), model.parameters())
        model.zero_grad()
        nn.functional.cross_entropy(model(xi[None]), yi[None]).backward()
        g = parameters_to_vector([p.grad for p in model.parameters()])
        total += g * min(1.0, clip / float(g.norm()))
    return w - lr * total / len(y)


@pytest.mark.parametrize("clip", [1e6, 0.05])
def test_dp_sgd_per_sample_clipping_equals_the_textbook_loop(tmp_path, clip):
    # batch_size >= the client's size: q = 1, every example every step; no noise
    sc = point(tmp_path, "local.steps=1", "local.batch_size=1000",
               f"privacy={{name: dp_sgd, clip: {clip}, noise_multiplier: 0.0}}")
    eng = Engine(sc, InlineBackend())
    eng.start()
    worker = eng.pool.workers[0].actor
    x0 = torch.from_numpy(eng.protocol.server.actor.params())
    update = worker.trainer.train(0, [worker.client_data(0, 3)], x0)[0][0]
    xs, ys = worker.source.train([3])[0]
    x, y = torch.from_numpy(np.array(xs)), torch.from_numpy(np.array(ys))
    expect = _manual_dp_step(worker.model, x0, x, y, clip, 0.2)
    torch.testing.assert_close(x0 + update, expect, atol=1e-5, rtol=1e-4)


def test_dp_sgd_run_logs_epsilon_and_privacy_tables(tmp_path):
    res = Engine(point(tmp_path), InlineBackend()).run()
    eps = [m["epsilon"] for m in res.metrics if "epsilon" in m]
    assert len(eps) == 2 and 0 < eps[0] < eps[1]
    assert float(res.params["privacy.epsilon"]) == pytest.approx(eps[-1], rel=1e-6)
    prof, trade = res.tables["privacy_profile"], res.tables["tradeoff"]
    assert prof["delta"][0] > prof["delta"][-1] and len(trade["alpha"]) == 1001
    assert trade["beta"][0] == pytest.approx(1.0) and trade["beta"][-1] == pytest.approx(0.0, abs=1e-9)
    # sample-level DP composes with robust aggregation
    robust = Engine(point(tmp_path, "clients.byzantine=1", "attack={name: sign_flip}",
                          "aggregator={name: median}"), InlineBackend()).run()
    assert np.isfinite(robust.final("test_accuracy"))


def test_client_level_dp_clips_and_noises_the_mean(tmp_path):
    base = ["privacy=null", "local.steps=2"]
    plain = Engine(point(tmp_path, *base), InlineBackend()).run()
    same = Engine(point(tmp_path, "privacy={name: dp_fedavg, clip: 1e6, noise_multiplier: 0.0}"),
                  InlineBackend()).run()
    assert [m["aggregate_norm"] for m in same.metrics] == pytest.approx(
        [m["aggregate_norm"] for m in plain.metrics], rel=1e-6)  # nothing clipped, no noise
    clipped = Engine(point(tmp_path, "privacy={name: dp_fedavg, clip: 0.01, noise_multiplier: 0.0}"),
                     InlineBackend()).run()
    assert all(m["aggregate_norm"] <= 0.01 + 1e-6 for m in clipped.metrics)
    noisy = Engine(point(tmp_path, "privacy={name: dp_fedavg, clip: 0.01, noise_multiplier: 1.0}"),
                   InlineBackend()).run()
    d = noisy.final_params.size
    # the mean of 5 clipped rows plus N(0, (sigma clip / 5)^2) per coordinate
    assert noisy.metrics[0]["aggregate_norm"] > 0.5 * (0.01 / 5) * np.sqrt(d)
    assert [m["epsilon"] for m in noisy.metrics if "epsilon" in m][-1] > 0


def test_client_level_dp_needs_the_mean(tmp_path):
    with pytest.raises(ScenarioError) as e:
        point(tmp_path, "privacy={name: dp_fedavg}", "aggregator={name: median}")
    assert e.value.lines[0].endswith(
        "privacy.name: client-level DP adds noise calibrated to the mean's sensitivity: it needs "
        "aggregator mean and no pre- or meta-aggregator (got median); dp_sgd (sample level) "
        "composes with robust aggregation")


def test_privacy_blocks_are_validated_plugins(tmp_path):
    with pytest.raises(ScenarioError) as e:
        point(tmp_path, "privacy={name: dp_sgd, clp: 1.0}")
    assert e.value.lines[0].endswith("privacy.clp: unknown key for privacy 'dp_sgd'; did you "
                                     "mean 'clip'?")
    with pytest.raises(ScenarioError) as e:
        point(tmp_path, "privacy={name: dp_sgd, noise_multiplier: -1}")
    assert e.value.lines[0].endswith("privacy.noise_multiplier: must be >= 0.0, got -1")
    with pytest.raises(ScenarioError) as e:
        point(tmp_path, "privacy={name: laplace}")
    assert "privacy.name: unknown privacy 'laplace'; available: dp_fedavg, dp_sgd" in e.value.lines[0]


def test_privacy_compare_cli(tmp_path, capsys):
    from fedray.cli import main

    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(DP)
    b.write_text(DP.replace("noise_multiplier: 1.0", "noise_multiplier: 2.0"))
    assert main(["privacy", "compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out.splitlines()
    eps_a = float(out[0].split("epsilon ")[1].split()[0])
    eps_b = float(out[1].split("epsilon ")[1].split()[0])
    assert eps_b < eps_a
    adv_a = float(out[0].split("advantage ")[1].split()[0])
    adv_b = float(out[1].split("advantage ")[1].split()[0])
    assert 0 < adv_b < adv_a < 1
    forward = float(out[2].split("= ")[1].split()[0])  # Delta(a || b): b is more private: 0
    backward = float(out[3].split("= ")[1].split()[0])
    assert forward == 0.0 and backward > 0.02
    # at prior 1/2 the attacker's error is (1 - advantage) / 2, so Delta is at least half the
    # gap in advantage; here it binds close to 1/2 (0.493: 0.04682 against 0.04660)
    assert abs(float(out[3].rsplit("at prior ", 1)[1].rstrip(")")) - 0.5) <= 0.02
    assert (adv_a - adv_b) / 2 - 1e-4 <= backward <= (adv_a - adv_b) / 2 + 5e-4
    # one calibration point for both
    assert main(["privacy", "compare", str(a), str(b), "--delta", "1e-3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "at delta 0.001," in out[0] and "at delta 0.001," in out[1]
    assert float(out[0].split("epsilon ")[1].split()[0]) < eps_a
    assert main(["privacy", "compare", str(a), "--delta", "0"]) == 2
    assert capsys.readouterr().err.strip() == "--delta: must be in (0, 1), got 0"


def test_privacy_compare_takes_every_mechanism_of_a_sweep(tmp_path, capsys):
    """A sweep over the noise multiplier and the aggregator holds two mechanisms (the
    aggregator is post-processing): each listed once, named by its noise multiplier."""
    from fedray.cli import main

    a = tmp_path / "sweep.yaml"
    a.write_text(DP + "sweep:\n  privacy.noise_multiplier: [1.0, 2.0]\n"
                 "  aggregator.name: [mean, median]\n")
    assert main(["privacy", "compare", str(a)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4  # two mechanisms, Delta both ways
    assert out[0].startswith(f"{a} [noise_multiplier=1.0]: epsilon 3.311 at delta 1e-05")
    assert out[1].startswith(f"{a} [noise_multiplier=2.0]: epsilon 0.9679 at delta 1e-05")
    assert out[2].startswith(f"Delta({a} [noise_multiplier=1.0] || {a} [noise_multiplier=2.0]) "
                             "= 0.0000")
    assert float(out[3].split("= ")[1].split()[0]) > 0.04
