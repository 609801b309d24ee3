"""Privacy attacks in runs (#47; simulator/runtime/privacy_attacks.py): what the server
keeps of the attacked round, the metrics at the end beside the bounds DP implies, the
reconstructions as an artifact, the keys checked before anything runs."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import norm

from simulator.config import ScenarioError
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine
from tests.simulator.test_engine import point as engine_point

# one digit a client: FedSGD on one sample is what DLG was shown on
ONE = """\
name: attacks
rounds: 2
data:
  dataset: {name: digits}
  partitioner: {name: iid}
model: {name: logreg}
clients: {total: 1438, per_round: 2}
local: {steps: 1, batch_size: 1, lr: 0.1}
privacy_attacks:
  - {name: dlg, round: 1, iterations: 100, labels: infer}
  - {name: loss_threshold}
"""


def run(tmp_path, text: str = ONE, overrides=()):
    return Engine(engine_point(tmp_path, text, overrides), InlineBackend()).run()


def test_dlg_reconstructs_a_clients_digit_and_dp_sgds_noise_stops_it(tmp_path):
    """Without DP, iDLG recovers round 1's first client's one digit from its update (PSNR
    above 60 dB, its label, and the nearest of 10 candidates); with DP-SGD at sigma 0.5 it
    does not (under 15 dB, success 0), and the bound Hayes et al. give for one 2-GDP step
    and prior 1/10 is 1 - Phi(Phi^-1(0.9) - 2) = 0.764."""
    res = run(tmp_path)
    last = res.metrics[-1]
    assert last["dlg_psnr"] > 60 and last["dlg_label_accuracy"] == 1.0
    assert last["dlg_success"] == 1.0 and last["dlg_success_bound"] == 1.0
    table = res.tables["attack_dlg"]
    truth, rec = np.array(table["truth"][0]), np.array(table["reconstruction"][0])
    assert table["shape"][0] == [1, 8, 8] and np.abs(truth - rec).max() < 1e-3
    noised = run(tmp_path, overrides=["privacy={name: dp_sgd, clip: 1.0, noise_multiplier: 0.5}"])
    last = noised.metrics[-1]
    assert last["dlg_psnr"] < 15 and last["dlg_success"] == 0.0
    assert last["dlg_success_bound"] == pytest.approx(1 - norm.cdf(norm.ppf(0.9) - 2), abs=2e-3)


def test_membership_attack_and_the_advantage_bound(tmp_path):
    """The loss-threshold attack's AUC and held-out advantage are logged; without DP the
    bound on the advantage is 1; with DP-FedAvg it is the run's trade-off curve's
    (max TPR - FPR): 2 rounds at q = 1/1438 and sigma 2 allow almost nothing, and the
    attack's held-out advantage is within 3 standard errors of 0 (359 + 359 queries, half
    of them measured)."""
    last = run(tmp_path).metrics[-1]
    assert 0.0 <= last["loss_threshold_auc"] <= 1.0
    assert last["loss_threshold_advantage_bound"] == 1.0
    dp = run(tmp_path, overrides=["privacy={name: dp_fedavg, clip: 1.0, noise_multiplier: 2.0}",
                                  "privacy_attacks=[{name: loss_threshold}]"]).metrics[-1]
    assert dp["loss_threshold_advantage_bound"] < 0.01
    se = (2 * 0.25 / 180) ** 0.5  # TPR - FPR of two proportions of 180 samples
    assert abs(dp["loss_threshold_advantage"]) < 3 * se


def test_the_release_is_what_client_level_dp_covers(tmp_path):
    """DP-FedAvg: the server sees a client's row in the clear (bound 1); the round's release
    (one client a round: its clipped row plus the noise) is one Gaussian of sigma 2, so the
    bound is 1 - Phi(Phi^-1(0.9) - 0.5)."""
    over = ["privacy={name: dp_fedavg, clip: 1.0, noise_multiplier: 2.0}",
            "clients.per_round=1",
            ("privacy_attacks=[{name: dlg, round: 1, iterations: 50, labels: infer}, "
             "{name: inverting_gradients, round: 2, target: release, iterations: 100}]")]
    last = run(tmp_path, overrides=over).metrics[-1]
    assert last["dlg_success_bound"] == 1.0 and last["dlg_psnr"] > 40
    assert last["inverting_gradients_success_bound"] == pytest.approx(
        1 - norm.cdf(norm.ppf(0.9) - 0.5), abs=2e-3)
    assert last["inverting_gradients_psnr"] < 15


@pytest.mark.parametrize(("over", "where", "says"), [
    (["privacy_attacks=[{name: dlg}, {name: dlg}]"], "privacy_attacks[1]", "listed twice"),
    (["privacy_attacks=[{name: dlg, round: 3}]"], "privacy_attacks[0].round",
     "at most rounds (2)"),
    (["privacy_attacks=[{name: dlg, client: 5000}]"], "privacy_attacks[0].client",
     "at most clients.total - 1 (1437)"),
    (["privacy_attacks=[{name: dlg, client: 0}]"], "privacy_attacks[0].client",
     "is not sampled in round 1 with seed 0"),
    (["clients.byzantine=700", "attack={name: sign_flip}",
      "privacy_attacks=[{name: dlg, client: 0}]"], "privacy_attacks[0].client", "Byzantine"),
    (["server.mode=fedbuff"], "privacy_attacks[0]", "sync or deadline"),
    (["task={name: regression}", "data.dataset={name: linear_regression}",
      "clients.total=20", "local.batch_size=4"], "privacy_attacks[0]", "cross-entropy"),
    (["model={name: cnn, channels: [4], hidden: 8, norm: batch}"], "privacy_attacks",
     "BatchNorm"),
    (["codecs=[{name: secagg, group_size: 2}]"], "privacy_attacks[0].target",
     "target release"),
])
def test_attack_keys_are_checked_before_anything_runs(tmp_path, over, where, says):
    with pytest.raises(ScenarioError) as e:
        engine_point(tmp_path, ONE, over)
    lines = e.value.lines
    assert any(where in ln and says in ln for ln in lines), lines
