from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from simulator.config import ScenarioError
from simulator.config.load import load
from simulator.messages import TrainRequest
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine
from simulator.sim.sampling import byzantine_clients, sample_clients
from tests.simulator.equivalence import CASES
from tests.simulator.equivalence import scenario as equivalence_scenario

ROOT = Path(__file__).resolve().parents[2]

SMALL = """\
name: small
rounds: 4
data:
  dataset: {name: digits}
model: {name: logreg}
clients: {total: 12, per_round: 6}
local: {steps: 3, batch_size: 16, lr: 0.2}
"""


def point(tmp_path, text=SMALL, overrides=()):
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return load(p, list(overrides)).points[0].scenario


def test_sampling_is_seeded_without_replacement():
    a = sample_clients(0, 3, 100, 10)
    assert len(set(a.tolist())) == 10 and a.tolist() == sample_clients(0, 3, 100, 10).tolist()
    assert a.tolist() != sample_clients(0, 4, 100, 10).tolist()
    assert sample_clients(0, 3, 5, 5).tolist() == [0, 1, 2, 3, 4]
    assert len(byzantine_clients(1, 20, 4)) == 4


def test_same_seed_twice_gives_identical_metrics(tmp_path):
    sc = point(tmp_path)
    a = Engine(sc, InlineBackend()).run()
    b = Engine(sc, InlineBackend()).run()
    assert a.metrics == b.metrics
    np.testing.assert_array_equal(a.final_params, b.final_params)
    c = Engine(point(tmp_path, overrides=["seeds=[1]"]), InlineBackend()).run()
    assert c.metrics != a.metrics


def test_any_number_of_workers_gives_identical_metrics(tmp_path):
    sc = point(tmp_path, overrides=["clients.byzantine=2", "attack={name: gaussian}",
                                    "aggregator={name: median}"])
    one = Engine(sc, InlineBackend(), workers=1).run()
    three = Engine(sc, InlineBackend(), workers=3).run()
    assert one.metrics == three.metrics


def test_inline_and_ray_give_identical_metrics(tmp_path, shared_ray):
    sc = point(tmp_path, overrides=["clients.byzantine=2", "attack={name: sign_flip}",
                                    "aggregator={name: cwtm, f: 2}"])
    inline = Engine(sc, InlineBackend()).run()
    on_ray = Engine(sc, shared_ray, workers=2).run()
    assert inline.metrics == on_ray.metrics
    np.testing.assert_array_equal(inline.final_params, on_ray.final_params)
    assert any(m["byzantine_sampled"] > 0 for m in inline.metrics)


@pytest.mark.parametrize("case", list(CASES))
def test_ray_equals_inline_on_the_equivalence_set(tmp_path, shared_ray, case):
    """Every path of the engine (tests/simulator/equivalence.py) gives the same numbers, to
    the bit, in one process and on Ray actors."""
    sc = equivalence_scenario(case, tmp_path)
    inline = Engine(sc, InlineBackend(), workers=2).run(on_checkpoint=lambda r, s: None)
    on_ray = Engine(sc, shared_ray, workers=2).run(on_checkpoint=lambda r, s: None)
    assert inline.metrics == on_ray.metrics
    np.testing.assert_array_equal(inline.final_params, on_ray.final_params)
    assert len(inline.metrics) == sc.rounds and 0 < inline.final("test_accuracy") <= 1


def test_quickstart_fedavg_reaches_90_percent(tmp_path):
    loaded = load(ROOT / "scenarios" / "quickstart.yaml")
    result = Engine(loaded.points[0].scenario, InlineBackend()).run()
    assert result.final("test_accuracy") >= 0.90
    assert len(result.metrics) == loaded.scenario.rounds
    first, last = result.metrics[0], result.metrics[-1]
    assert last["test_loss"] < first["test_loss"] and last["train_loss"] < first["train_loss"]
    assert all(m["aggregation_error"] == 0.0 for m in result.metrics)  # mean of honest = honest mean


def test_fedavg_with_zero_local_lr_effect_is_exact_mean(tmp_path):
    """With mean aggregation and server lr 1 the global model moves by the mean update."""
    sc = point(tmp_path, overrides=["rounds=1"])
    from simulator.messages import StepLayout, stack_rows
    from simulator.runtime import ClientWorker, Server

    eng = Engine(sc, InlineBackend())
    eng.start()
    x0 = eng.protocol.server.actor.params()
    sampled = sample_clients(0, 0, 12, 6).tolist()
    res = eng.pool.workers[0].actor.train(TrainRequest(0, tuple(sampled)), x0)
    eng.protocol.server.actor.step(0, StepLayout(((0, tuple(sampled), 1),)), None, res)
    np.testing.assert_allclose(eng.protocol.server.actor.params(), x0 + res.updates.mean(0), rtol=0, atol=1e-6)
    assert isinstance(eng.protocol.server.actor, Server) and isinstance(eng.pool.workers[0].actor, ClientWorker)
    np.testing.assert_array_equal(stack_rows(sampled[::-1], (res,), len(x0))[0], res.updates[-1])


def test_gaussian_attack_breaks_mean_but_not_median(tmp_path):
    over = ["rounds=8", "clients.byzantine=2", "attack={name: gaussian, sigma: 100}",
            "clients.per_round=12", "local.steps=5"]
    mean = Engine(point(tmp_path, overrides=over + ["aggregator={name: mean}"]), InlineBackend()).run()
    med = Engine(point(tmp_path, overrides=over + ["aggregator={name: median}"]), InlineBackend()).run()
    assert mean.final("test_accuracy") < 0.3
    assert med.final("test_accuracy") > 0.8
    assert mean.metrics[-1]["aggregation_error"] > 10 * med.metrics[-1]["aggregation_error"]
    assert all(m["byzantine_sampled"] == 2 for m in mean.metrics)


def test_nonfinite_aggregate_is_reported_and_model_kept(tmp_path):
    # a NaN attack: mean's aggregate is NaN, the step is skipped and the metric says so
    sc = point(tmp_path, overrides=["rounds=2", "clients.byzantine=1",
                                    "attack={name: gaussian, mu: .nan}", "clients.per_round=12"])
    res = Engine(sc, InlineBackend()).run()
    assert [m["nonfinite_aggregate"] for m in res.metrics] == [1.0, 1.0]
    assert np.isfinite(res.final_params).all()
    assert res.metrics[-1]["test_accuracy"] == res.metrics[0]["test_accuracy"]


def test_eval_every_k_rounds_and_last(tmp_path):
    res = Engine(point(tmp_path, overrides=["rounds=5", "evaluation.every=2"]), InlineBackend()).run()
    assert ["test_accuracy" in m for m in res.metrics] == [False, True, False, True, True]


def test_b_hat_and_exceeded_are_logged_per_round(tmp_path):
    sc = point(tmp_path, overrides=["rounds=12", "clients.byzantine=3", "clients.per_round=5",
                                    "attack={name: sign_flip}", "aggregator={name: cwtm}",
                                    "clients.b_hat={rule: fixed, value: 1}"])
    res = Engine(sc, InlineBackend()).run()
    assert all(m["b_hat"] == 1.0 for m in res.metrics)
    assert [m["byzantine_exceeded"] for m in res.metrics] == \
        [float(m["byzantine_sampled"] > 1) for m in res.metrics]
    counts = {m["byzantine_sampled"] for m in res.metrics}
    assert len(counts) > 1 and max(counts) >= 2  # hypergeometric: the count varies by round


def test_worker_momentum_state_stays_with_its_client(tmp_path):
    """Per-client momentum lives in the worker owning the client, so the number of workers
    does not change a number; and it is not reset between rounds."""
    over = ["rounds=4", "clients.per_round=12", "local.steps=1",
            "local.optimizer={name: momentum, beta: 0.9}"]
    one = Engine(point(tmp_path, overrides=over), InlineBackend(), workers=1).run()
    three = Engine(point(tmp_path, overrides=over), InlineBackend(), workers=3).run()
    assert one.metrics == three.metrics
    # beta = 0 is plain SGD on one minibatch: the runs part after the first round
    zero = Engine(point(tmp_path, overrides=over[:3] + ["local.optimizer={name: momentum, beta: 0}"]),
                  InlineBackend()).run()
    eng = Engine(point(tmp_path, overrides=over), InlineBackend())
    eng.start()
    x0 = eng.protocol.server.actor.params()
    res = eng.pool.workers[0].actor.train(TrainRequest(0, (0,)), x0)
    # first round: m_1 = (1 - beta) g, message -lr m_1 = -0.2 * 0.1 * g
    from strategies.trainers import minibatch_gradient

    g, _ = minibatch_gradient(eng.pool.workers[0].actor.model, torch.from_numpy(x0), *_first_batch(eng, 0, 0), 0.0)
    np.testing.assert_allclose(res.updates[0], -0.2 * 0.1 * g.numpy(), rtol=1e-5, atol=1e-7)
    assert zero.metrics[0]["aggregate_norm"] == pytest.approx(10 * one.metrics[0]["aggregate_norm"], rel=1e-5)
    assert zero.metrics[1]["aggregate_norm"] != pytest.approx(10 * one.metrics[1]["aggregate_norm"], rel=1e-3)


def _first_batch(eng, round_, client):
    from simulator.seeding import torch_generator

    (x, y), = eng.pool.workers[0].actor.source.train([client])
    idx = torch.randperm(len(y), generator=torch_generator(eng.seed, "local", round_, client))[:16]
    return (torch.from_numpy(np.array(x))[idx], torch.from_numpy(np.array(y))[idx])


def test_mu2sgd_runs_the_same_on_any_number_of_workers_and_learns(tmp_path):
    over = ["rounds=30", "clients.per_round=12", "local.steps=1",
            "server.optimizer={name: mu2sgd, lr: 0.02}",
            "evaluation.every=30"]
    one = Engine(point(tmp_path, overrides=over), InlineBackend(), workers=1).run()
    two = Engine(point(tmp_path, overrides=over), InlineBackend(), workers=2).run()
    assert one.metrics == two.metrics
    assert one.final("test_accuracy") > 0.8
    with pytest.raises(ScenarioError) as e:
        point(tmp_path, overrides=over + ["local.optimizer={name: momentum}"])
    assert "local.optimizer: server.optimizer 'mu2sgd' brings its own client half" in e.value.lines[0]
    with pytest.raises(ScenarioError) as e:
        point(tmp_path, overrides=["local.optimizer={name: momentum}"])  # SMALL: local.steps 3
    assert e.value.lines[0].endswith("local.steps: momentum takes one minibatch gradient per "
                                     "round; remove local.steps, got 3")


def test_dropout_and_stragglers_are_seeded_per_client_and_logged(tmp_path):
    from simulator.config import Stragglers
    from simulator.sim.sampling import missed_round

    steps = np.full(1000, 4.0)
    dropped, late = missed_round(0, 3, list(range(1000)), steps, 0.3, None)
    assert 250 < len(dropped) < 350 and late == {}
    # a client's outcome does not depend on who else was sampled
    sub, _ = missed_round(0, 3, list(range(0, 1000, 7)), steps, 0.3, None)
    assert sub == {c for c in dropped if c % 7 == 0}
    # no spread in speed: late exactly when the work exceeds the deadline
    work = np.array([2.0, 5.0, 3.0, 8.0])
    _, late = missed_round(0, 0, [0, 1, 2, 3], work, 0.0, Stragglers(deadline=4.0, sigma=0, jitter=0))
    assert late == {1: 4, 3: 4}  # the steps each finished by the deadline (4 of 5, 4 of 8)

    over = ["rounds=6", "clients.per_round=8", "clients.byzantine=2", "attack={name: sign_flip}",
            "aggregator={name: median}", "clients.dropout=0.3",
            "clients.stragglers={deadline: 4.0, sigma: 0.5}"]
    one = Engine(point(tmp_path, overrides=over), InlineBackend(), workers=1).run()
    three = Engine(point(tmp_path, overrides=over), InlineBackend(), workers=3).run()
    assert one.metrics == three.metrics
    for m in one.metrics:
        assert m["participants"] == m["sampled"] - m["dropped"] - m["stragglers"]
    assert sum(m["dropped"] for m in one.metrics) > 0 and sum(m["stragglers"] for m in one.metrics) > 0


def test_a_round_with_too_few_clients_is_skipped_and_counted(tmp_path, caplog):
    """A skipped round keeps the model and is counted; the first three are named on the
    terminal, 1-based as the progress lines count (they said round 0 for round 1), also when
    no honest update arrived at all (that said nothing); the run's headline counts them."""
    import re

    from simulator.run.runner import final_text, summary

    over = ["rounds=12", "clients.per_round=3", "clients.dropout=0.95"]
    sc = point(tmp_path, overrides=over)
    res = Engine(sc, InlineBackend()).run()
    skipped = [m["aggregation_skipped"] for m in res.metrics]
    assert sum(skipped) >= 4
    for prev, m in zip([None, *res.metrics], res.metrics):
        if m["aggregation_skipped"] and prev is not None:
            assert m["test_accuracy"] == prev["test_accuracy"]  # the model did not move
    # the server logs them (fedray.server); the command line prints them on stderr
    lines = [r.getMessage() for r in caplog.records if "aggregation skipped" in r.getMessage()]
    first = [i + 1 for i, k in enumerate(skipped) if k][:3]
    assert [int(re.match(r"fedray: round (\d+): ", ln).group(1)) for ln in lines] == first
    assert lines[-1].endswith("further skipped rounds are not printed (the aggregation_skipped "
                              "metric counts them)")
    assert any("no sampled honest client sent an update" in ln for ln in lines)
    head = final_text(summary("r", load(tmp_path / "s.yaml", over).points[0], res))
    assert head.endswith(f"; aggregation skipped in {int(sum(skipped))} of 12 rounds")


def test_stateless_clients_are_spread_evenly_and_stateful_ones_stay_with_their_worker(tmp_path):
    """A round waits for its slowest worker: clients without state go, the most local steps
    first, to the least loaded live worker; clients with state stay on worker k % W."""
    over = ["clients.total=40", "clients.per_round=17", "data.partitioner={name: dirichlet, alpha: 0.3}",
            "local.steps=null", "local.epochs=1", "local.batch_size=8"]
    eng = Engine(point(tmp_path, overrides=over), InlineBackend(), workers=3)
    steps = eng.pool.local_steps
    assert len(set(steps.tolist())) > 3  # clients of unequal sizes
    for r in range(10):
        clients = sample_clients(0, r, 40, 17).tolist()
        per = eng.pool.assign(clients)
        assert sorted(c for _, ids in per for c in ids) == sorted(clients)
        loads = [steps[ids].sum() for _, ids in per]
        # longest-processing-time-first: the most loaded exceeds the least by at most one client
        assert max(loads) - min(loads) <= steps[clients].max()
        assert per == eng.pool.assign(list(reversed(clients)))  # the same whatever the order
    eng.pool.live = [0, 2]  # worker 1 was lost: nothing goes to it
    assert {w for w, _ in eng.pool.assign(clients)} == {0, 2}
    even = Engine(point(tmp_path, overrides=["clients.total=40", "clients.per_round=20"]),
                  InlineBackend(), workers=2)
    for r in range(10):  # equal clients: 10 each, where k % 2 gives 11.4 to the busier worker
        per = even.pool.assign(sample_clients(0, r, 40, 20).tolist())
        assert [len(ids) for _, ids in per] == [10, 10]
    momentum = Engine(point(tmp_path, overrides=[*over, "local.steps=1", "local.epochs=null",
                                                 "local.optimizer={name: momentum}"]),
                      InlineBackend(), workers=3)
    per = momentum.pool.assign(clients)
    assert all(c % 3 == w for w, ids in per for c in ids)


class _Pipelined(InlineBackend):
    """Inline calls that record their order, as a backend that may be pipelined."""

    pipelined = True

    def __init__(self):
        self.calls = []

    def call(self, handle, method, *args):
        self.calls.append((method.__name__, args[0].round if method.__name__ == "train" else
                           args[0] if method.__name__ == "step" else None))
        return super().call(handle, method, *args)


def test_the_next_rounds_training_goes_out_before_this_rounds_results(tmp_path):
    """On a pipelined backend round r+1's training is submitted right after round r's step
    (before its evaluation), except before a checkpoint and for clients with state; the
    numbers are those of the plain loop."""
    over = ["rounds=5", "evaluation.every=1", "clients.byzantine=2", "attack={name: gaussian}",
            "aggregator={name: median}"]
    plain = Engine(point(tmp_path, overrides=over), InlineBackend(), workers=2).run()
    backend = _Pipelined()
    piped = Engine(point(tmp_path, overrides=[*over, "runtime.checkpoint_every=2"]), backend,
                   workers=2).run(on_checkpoint=lambda r, s: None)
    assert piped.metrics == plain.metrics
    np.testing.assert_array_equal(piped.final_params, plain.final_params)
    seq = [(m, r) for m, r in backend.calls if m in ("train", "step", "evaluate", "checkpoint")]
    after = {}  # round r -> the call after its step
    for i, (m, r) in enumerate(seq):
        if m == "step":
            after[r] = seq[i + 1]
    # checkpoints after rounds 2 and 4 (indices 1 and 3); round 5 (index 4) is the last
    assert after == {0: ("train", 1), 1: ("evaluate", None), 2: ("train", 3),
                     3: ("evaluate", None), 4: ("evaluate", None)}
    backend = _Pipelined()
    Engine(point(tmp_path, overrides=[*over[:1], "local.steps=1",
                                      "local.optimizer={name: momentum}"]), backend).run()
    seq = [m for m, _ in backend.calls if m in ("train", "step", "evaluate")]
    assert seq == ["train", "step", "evaluate"] * 5
