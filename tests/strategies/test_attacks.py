"""Attacks on hand-computed cases and their defining constraints; attacks inside the engine."""

from __future__ import annotations

import math

import pytest
import torch

from simulator.config.load import load
from simulator.runtime.backend import InlineBackend
from simulator.runtime.pipeline import Pipeline
from simulator.sim.engine import Engine
from strategies import aggregators as A
from strategies import attacks as K

G = torch.Generator()


def honest(seed=0, n=8, d=12):
    return torch.randn((n, d), generator=torch.Generator().manual_seed(seed)) + 1.0


def test_sign_flip_ipm_foe_scale_the_honest_mean():
    h = honest()
    mu = h.mean(0)
    torch.testing.assert_close(K.SignFlip()(h, 2, G)[1], -mu)
    torch.testing.assert_close(K.InnerProductManipulation()(h, 2, G)[0], -0.1 * mu)
    torch.testing.assert_close(K.FallOfEmpires()(h, 3, G)[2], -10.0 * mu)


def test_alie_z_from_n_and_f_as_in_the_paper():
    # n = 10, f = 2: s = floor(10/2 + 1) - 2 = 4, z = Phi^-1(6/10)
    assert K.alie_z(10, 2) == pytest.approx(0.2533471, abs=1e-6)
    # n = 50, f = 12 (24%): s = 14, z = Phi^-1(36/50)
    assert K.alie_z(50, 12) == pytest.approx(0.5828415, abs=1e-6)
    h = honest(1)
    rows = K.ALittleIsEnough()(h, 2, G)
    sigma = ((h - h.mean(0)) ** 2).mean(0).sqrt()  # the paper's 1/n standard deviation
    torch.testing.assert_close(rows[0], h.mean(0) - K.alie_z(10, 2) * sigma)


def test_min_max_meets_its_constraint_with_equality():
    h = honest(2)
    for p in ("unit_vec", "std", "sign"):
        m = K.MinMax(p)(h, 2, G)[0].double()
        r = float(torch.cdist(h.double(), h.double()).max())
        assert float((m - h.double()).norm(dim=1).max()) == pytest.approx(r, rel=1e-6)


def test_min_sum_meets_its_constraint_with_equality():
    h = honest(3)
    m = K.MinSum("std")(h, 2, G)[0].double()
    d = torch.cdist(h.double(), h.double()) ** 2
    assert float(((m - h.double()) ** 2).sum()) == pytest.approx(float(d.sum(1).max()), rel=1e-6)


def test_optimal_ipm_beats_fixed_ipm_against_the_pipeline():
    h = honest(4, n=9)
    agg = A.CoordinateWiseTrimmedMean(3)
    opt = K.OptimalIPM(agg)
    scale = opt.best_scale(h, 3)
    assert opt.distance(h, 3, scale) >= opt.distance(h, 3, 0.1) > 0
    assert opt.distance(h, 3, scale) >= opt.distance(h, 3, 0.0)


def test_label_flip_poisons_labels_and_sends_its_own_updates():
    y = torch.tensor([0, 1, 9, 4])
    assert K.LabelFlip().poison_labels(y, 10).tolist() == [9, 8, 0, 5]
    own = honest(5, n=2)
    assert torch.equal(K.LabelFlip()(own, 2, G), own)


def test_nonfinite_attacks():
    h = honest()
    assert torch.isposinf(K.Infinity()(h, 2, G)).all()
    assert torch.isnan(K.NotANumber()(h, 2, G)).all()


# ---------------------------------------------------------------- in the engine

SMALL = """\
name: attacked
rounds: 3
data:
  dataset: {name: digits}
model: {name: logreg}
clients: {total: 12, per_round: 12, byzantine: 3}
attack: {name: ipm}
aggregator: {name: cwtm, f: 3}
local: {steps: 3, batch_size: 16, lr: 0.2}
"""


def run(tmp_path, *overrides, workers=None):
    p = tmp_path / "s.yaml"
    p.write_text(SMALL)
    return Engine(load(p, list(overrides)).points[0].scenario, InlineBackend(), workers=workers).run()


def test_optimal_attacks_search_the_scenarios_own_pipeline(tmp_path):
    fixed = run(tmp_path)
    optimal = run(tmp_path, "attack={name: optimal_ipm}")
    # round 0 has the same honest updates in both runs; the searched scale hurts more
    assert optimal.metrics[0]["honest_update_norm"] == fixed.metrics[0]["honest_update_norm"]
    assert optimal.metrics[0]["aggregation_error"] > fixed.metrics[0]["aggregation_error"]
    alie = run(tmp_path, "attack={name: optimal_alie}", "preaggregators=[{name: nnm, f: 3}]")
    assert math.isfinite(alie.metrics[-1]["aggregation_error"])


def test_label_flip_trains_the_byzantine_clients_on_flipped_labels(tmp_path):
    base = ["aggregator={name: mean}", "clients.byzantine=6", "rounds=6"]
    flipped = run(tmp_path, *base, "attack={name: label_flip}")
    clean = run(tmp_path, "aggregator={name: mean}", "clients.byzantine=0", "attack=null",
                "rounds=6")
    assert flipped.final("test_accuracy") < clean.final("test_accuracy") - 0.1
    # the Byzantine rows are real trained updates, so the aggregate stays finite and close
    assert all(m["nonfinite_aggregate"] == 0 for m in flipped.metrics)


def test_random_rules_are_seeded_per_round_and_worker_count_free(tmp_path):
    o = ["aggregator={name: dnc, f: 3, subsample_dim: 500}", "preaggregators=[{name: bucketing, s: 2}]"]
    a = run(tmp_path, *o, workers=1)
    b = run(tmp_path, *o, workers=3)
    assert a.metrics == b.metrics
    c = run(tmp_path, *o, "seeds=[1]")
    assert c.metrics != a.metrics


def test_pipeline_state_round_trips_for_stateful_rules():
    p = Pipeline([], {"name": "cc", "tau": 0.5, "iterations": 1}, {"name": "ctma", "f": 1}, seed=0)
    xs = [honest(s, n=6) for s in range(4)]
    for r in range(2):
        p.aggregate(xs[r], r)
    saved = p.state_dict()
    rest = [p.aggregate(xs[r], r) for r in (2, 3)]
    q = Pipeline([], {"name": "cc", "tau": 0.5, "iterations": 1}, {"name": "ctma", "f": 1}, seed=0)
    q.load_state_dict(saved)
    assert all(torch.equal(a, q.aggregate(xs[r], r)) for a, r in zip(rest, (2, 3)))
    assert set(saved) == {"aggregator"} and saved["aggregator"]["centre"].shape == (12,)
    # simulate() leaves the state where it was
    before = p.state_dict()["aggregator"]["centre"].clone()
    p.simulate(xs[0], 9)
    assert torch.equal(p.state_dict()["aggregator"]["centre"], before)
