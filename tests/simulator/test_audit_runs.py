"""Empirical privacy audits in runs (#47; simulator/runtime/audit.py, strategies/audit.py):
canary clients beside the honest ones, their statistics logged with the accountant's
epsilon, a broken mechanism caught and a correct one passed, the keys checked before
anything runs."""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import pytest
import torch
from torch.nn.utils import parameters_to_vector

from simulator.config import ScenarioError
from simulator.config.plan import resolve
from simulator.models import build_model
from simulator.runtime.audit import CanaryAudit
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine
from strategies.privacy import DPSGD, DPFedAvg, SubsampledGaussian
from tests.entry_points import registered
from tests.simulator.test_engine import point as engine_point

BASE = """\
name: audit
rounds: 3
data:
  dataset: {name: digits}
model: {name: logreg}
clients: {total: 12, per_round: 6}
local: {steps: 2, batch_size: 8, lr: 0.2}
"""
D = 64 * 10 + 10  # logreg on 8x8 digits, 10 classes


def run(tmp_path, extra: str = "", overrides=(), text: str = BASE):
    sc = engine_point(tmp_path, text + extra, overrides)
    return Engine(sc, InlineBackend()).run()


class NoNoiseDPFedAvg(DPFedAvg):
    """A broken DP-FedAvg for the audit to catch: it clips and its accountant counts the
    noise, but it never adds it."""

    def noise(self, aggregate: torch.Tensor, m: int, generator: torch.Generator) -> torch.Tensor:
        return aggregate


def test_canaries_not_inserted_change_nothing(tmp_path):
    """inserted: 0: no canary enters a round, so every number of the run is the run's
    without the audit, to the bit; the statistics of the held-out canaries are logged at
    the end (none inserted: no estimate)."""
    plain = run(tmp_path)
    audited = run(tmp_path, "audit: {canaries: 12, inserted: 0.0}\n")
    np.testing.assert_array_equal(plain.final_params, audited.final_params)
    last = audited.metrics[-1]
    assert last["audit_canaries_inserted"] == 0.0 and math.isnan(last["audit_epsilon"])
    # 12 random directions against the model's change: cosines of about 1/sqrt(650)
    assert abs(last["audit_cosine_out_mean"]) < 3 / math.sqrt(D)
    assert 0.3 / math.sqrt(D) < last["audit_cosine_out_std"] < 3 / math.sqrt(D)
    for a, b in zip(plain.metrics, audited.metrics, strict=True):
        assert {k: v for k, v in b.items() if not k.startswith("audit_")} == a


def test_canary_rows_are_their_directions_at_the_clip_and_enter_the_mean(tmp_path):
    """DP-FedAvg at noise 0, server lr 1, one round: the model's change is the mean of the
    clipped rows, the round's sampled canaries (unit directions at the clip, 0.5) among
    them: x1' - x0 = (6 (x1 - x0) + 0.5 sum(directions)) / (6 + k), with x1 the run's
    model without the audit."""

    one = BASE.replace("rounds: 3", "rounds: 1")
    priv = "privacy: {name: dp_fedavg, clip: 0.5, noise_multiplier: 0.0}\n"
    audit = "audit: {canaries: 12, every: 1}\n"
    audited = run(tmp_path, priv + audit, text=one)
    plain = run(tmp_path, priv, text=one)
    info = audited.model_info
    x0 = parameters_to_vector(build_model({"name": "logreg"}, info["input_shape"],
                                          info["num_classes"], 0).parameters()).detach().numpy()
    canaries = CanaryAudit(resolve(engine_point(tmp_path, one + priv + audit)),
                           torch.from_numpy(x0))
    ids = canaries.sampled(0)
    k = len(ids)
    assert 0 < k < 12 and canaries.inserted[ids].all()
    dirs = canaries.directions(ids, D)
    np.testing.assert_allclose(torch.linalg.vector_norm(dirs, dim=1).numpy(), 1.0, atol=1e-6)
    expected = (6 * (plain.final_params - x0) + 0.5 * dirs.sum(0).numpy()) / (6 + k)
    np.testing.assert_allclose(audited.final_params - x0, expected, atol=1e-6)
    # the logged cosines: every inserted canary's direction against the model's change
    change = audited.final_params - x0
    inserted = np.flatnonzero(canaries.inserted)
    cos = canaries.directions(inserted, D).numpy() @ change / np.linalg.norm(change)
    assert np.isclose(audited.metrics[0]["audit_cosine_in_mean"], cos.mean(), atol=1e-6)
    assert np.isclose(audited.metrics[0]["audit_cosine_in_std"], cos.std(ddof=1), atol=1e-6)


AUDITED = """\
name: audited
rounds: 20
seeds: [SEED]
data:
  dataset: {name: digits}
  partitioner: {name: iid}
model: {name: mlp, hidden: [64]}
clients: {total: 100, per_round: 20}
local: {steps: 2, batch_size: 8, lr: 0.2}
privacy: {name: PRIVACY, clip: 1.0, noise_multiplier: 1.0, delta: 1.0e-5}
audit: {canaries: 100, inserted: 0.5}
evaluation: {every: 20}
"""


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_audit_catches_a_mechanism_that_skips_its_noise(tmp_path, monkeypatch, seed):
    """Audit the audit: a DP-FedAvg that never adds the noise its accountant counts
    (epsilon 6.62 at delta 1e-5: 20 rounds at q = 0.2, z = 1) is caught: Andrew et al.'s
    estimate above 10 x the claim (92-128 on these seeds), Steinke et al.'s lower bound at
    its most for 20 guesses (every guess right: 1.82); the correct one is not flagged (the
    estimate 4.4-5.7, below the claim, the lower bound below it too), on 3 seeds."""
    text = AUDITED.replace("SEED", str(seed))
    with registered(monkeypatch, {"privacy": {
            "no_noise": "tests.simulator.test_audit_runs:NoNoiseDPFedAvg"}}):
        broken = run(tmp_path, text=text.replace("PRIVACY", "no_noise")).metrics[-1]
    good = run(tmp_path, text=text.replace("PRIVACY", "dp_fedavg")).metrics[-1]
    assert broken["epsilon"] == good["epsilon"] == pytest.approx(6.616, abs=1e-3)
    claimed = good["epsilon"]
    assert broken["audit_epsilon"] > 10 * claimed
    # 20 of 100 canaries guessed, all right: p^20 = 0.05 (the delta term adds little)
    p = 0.05 ** (1 / 20)
    assert broken["audit_epsilon_lower"] == pytest.approx(math.log(p / (1 - p)), abs=0.02)
    assert good["audit_epsilon"] < claimed
    assert good["audit_epsilon_lower"] < broken["audit_epsilon_lower"]


@pytest.mark.parametrize(("extra", "where", "says"), [
    ("audit: {canaries: 13}\n", "audit.canaries", "at most clients.total (12)"),
    ("audit: {canaries: 12, every: 4}\n", "audit.every", "at most rounds (3)"),
    ("audit: {canaries: 1}\n", "audit.canaries", "must be >= 2"),
    ("audit: {canaries: 12, inserted: 1.0}\n", "audit.inserted", "must be < 1"),
    ("audit: {canaries: 12, norm: 1.0}\nprivacy: {name: dp_sgd}\n", "audit.norm",
     "DP-SGD's clip"),
    ("audit: {canaries: 12}\ncodecs: [{name: float16}]\n", "audit", "codecs"),
    ("audit: {canaries: 12}\ntopology: {name: ring}\nclients: {total: 12}\n", "audit",
     "D-SGD"),
    ("audit: {canaries: 12}\nserver: {mode: fedbuff}\n", "server.mode", "sync or deadline"),
    ("audit: {canaries: 12}\nserver: {optimizer: {name: scaffold}}\n", "audit",
     "parts beside it"),
])
def test_audit_keys_are_checked_before_anything_runs(tmp_path, extra, where, says):
    with pytest.raises(ScenarioError) as e:
        engine_point(tmp_path, BASE.replace("clients: {total: 12, per_round: 6}\n", "")
                     + ("" if "clients:" in extra else "clients: {total: 12, per_round: 6}\n")
                     + extra)
    lines = e.value.lines
    assert len(lines) == 1 and where in lines[0] and says in lines[0], lines


class NoNoiseDPSGD(DPSGD):
    """A broken DP-SGD for the audit to catch: its accountant counts the noise multiplier
    it was given, its trainer adds none."""

    def __init__(self, clip: float = 1.0, noise_multiplier: float = 1.0, delta: float = 1e-5,
                 accountant: Literal["pld", "rdp"] = "pld") -> None:
        super().__init__(clip, 0.0, delta, accountant)
        self.claimed = noise_multiplier

    def mechanism(self, rounds: int, client_rate: float, sample_rate: float,
                  steps_per_round: int) -> SubsampledGaussian:
        return SubsampledGaussian(sample_rate, self.claimed, rounds * steps_per_round)


SAMPLE = """\
name: sample-level
rounds: 10
seeds: [SEED]
data:
  dataset: {name: digits}
  partitioner: {name: iid}
model: {name: mlp, hidden: [256]}
clients: {total: 10, per_round: 10}
local: {epochs: 1, batch_size: 4, lr: 0.1}
privacy: {name: PRIVACY, clip: 1.0, noise_multiplier: 1.0, delta: 1.0e-5}
audit: {canaries: 500}
evaluation: {every: 10}
"""


def test_canary_examples_catch_a_dp_sgd_without_noise(tmp_path, monkeypatch, seed=0):
    """Sample-level DP: 500 canary examples among 10 clients' digits (half inserted). A
    DP-SGD whose accountant counts sigma 1 (epsilon 3.40) but whose trainer adds no noise
    gives an estimate above the claim (5.35; seeds 1 and 2 gave 5.68 and 5.65); the correct
    one stays below it (0.91; 1.15 and 0.44). One seed here (15 s a pair of runs); the
    three-seed audit of the audit is the client-level test above."""
    text = SAMPLE.replace("SEED", str(seed))
    with registered(monkeypatch, {"privacy": {
            "no_noise_sgd": "tests.simulator.test_audit_runs:NoNoiseDPSGD"}}):
        broken = run(tmp_path, text=text.replace("PRIVACY", "no_noise_sgd")).metrics[-1]
    good = run(tmp_path, text=text.replace("PRIVACY", "dp_sgd")).metrics[-1]
    assert broken["epsilon"] == good["epsilon"] == pytest.approx(3.40, abs=0.01)
    assert broken["audit_epsilon"] > good["epsilon"] > good["audit_epsilon"]
    assert good["audit_epsilon_lower"] < broken["audit_epsilon_lower"] < good["epsilon"]


def test_canary_examples_not_inserted_change_nothing(tmp_path):
    """inserted: 0 under DP-SGD: no client holds a canary, every number is the run's
    without the audit, to the bit."""
    text = SAMPLE.replace("SEED", "0").replace("PRIVACY", "dp_sgd").replace("rounds: 10",
                                                                            "rounds: 2")
    plain = run(tmp_path, text=text.replace("audit: {canaries: 500}\n", ""))
    audited = run(tmp_path, text=text.replace("canaries: 500", "canaries: 20, inserted: 0.0"))
    np.testing.assert_array_equal(plain.final_params, audited.final_params)
