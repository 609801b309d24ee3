"""``clients.stragglers`` of kind ``epochs``: FedProx's own straggler model (Li et al., MLSys
2020, Section 5.2). A fraction of each round's training honest clients run a number of
local epochs uniform in [1, E] instead of E; ``partial: false`` drops them (FedAvg),
``partial: true`` sends the epochs they ran. The numbers below come from the seed (the
draws' streams are named, so they are this rule's alone), and the engine's rounds are
checked against a numpy computation of the same SGD steps."""

from __future__ import annotations

import numpy as np
import pytest

from simulator.config import ScenarioError, Stragglers
from simulator.messages import TrainRequest
from simulator.runtime.backend import InlineBackend
from simulator.runtime.common import model_input
from simulator.seeding import torch_generator
from simulator.sim.engine import Engine
from simulator.sim.sampling import missed_round, sample_clients, straggler_work
from strategies.trainers import minibatches
from tests.simulator.test_engine import point

HALF = Stragglers(kind="epochs", fraction=0.5)
PARTIAL_HALF = "clients.stragglers={kind: epochs, fraction: 0.5, partial: true}"
PARTIAL_ALL = "clients.stragglers={kind: epochs, fraction: 1.0, partial: true}"
# ten clients of 3 epochs each, an epoch of 2, 3, 1 or 4 minibatch steps
STEPS = np.array([6.0, 9.0, 3.0, 12.0, 6.0, 9.0, 3.0, 3.0, 6.0, 6.0])


def test_the_stragglers_and_their_epochs_come_from_the_seed():
    dropped, late = missed_round(0, 0, list(range(10)), STEPS, 0.0, HALF, 3)
    # 5 of 10; client 8 runs 1 of its 3 epochs (2 steps of 6), client 6 one (1 step of 3)
    assert dropped == set() and late == {0: 4, 4: 4, 6: 1, 8: 2, 9: 4}
    assert missed_round(0, 1, list(range(10)), STEPS, 0.0, HALF, 3)[1] == \
        {0: 6, 2: 1, 3: 12, 7: 2, 9: 2}  # client 3: all 3 epochs (12 steps), still a straggler
    assert missed_round(1, 0, list(range(10)), STEPS, 0.0, HALF, 3)[1] != late  # the seed
    # the same draw again, whatever the straggler's fate (partial) or the client rule
    assert missed_round(0, 0, list(range(10)), STEPS, 0.0, HALF.model_copy(
        update={"partial": True}), 3) == (dropped, late)
    # dropouts first: of the 8 that train, 4 straggle; a straggler's epochs are its own draw
    dropped, late = missed_round(0, 0, list(range(10)), STEPS, 0.3, HALF, 3)
    assert dropped == {4, 6} and late == {0: 4, 5: 3, 8: 2, 9: 4}


@pytest.mark.parametrize("m, fraction, count", [
    (10, 0.0, 0), (10, 0.5, 5), (10, 0.9, 9), (10, 1.0, 10), (6, 0.5, 3), (5, 0.5, 3),
    (3, 0.9, 3), (7, 0.1, 1), (7, 0.05, 0)])
def test_the_count_is_the_authors_codes(m, fraction, count):
    """m - round(m (1 - fraction)) of the m training clients (Python's round: 2.5 -> 2)."""
    work = straggler_work(4, 2, np.arange(m), np.full(m, 20.0), fraction, 20)
    assert len(work) == count


def test_the_epochs_are_uniform_on_one_to_e_and_a_prefix_of_whole_epochs():
    """Over 400 rounds of 10 stragglers of E = 4 epochs of 5 steps: every value 1..4 (the
    paper's [1, E], E included), each a quarter of the draws within 4 standard errors."""
    runs = [straggler_work(0, r, np.arange(10), np.full(10, 20.0), 1.0, 4)
            for r in range(400)]
    done = np.array([k for w in runs for k in w.values()])
    assert len(done) == 4000 and set(np.unique(done).tolist()) == {5, 10, 15, 20}
    share = np.bincount(done // 5, minlength=5)[1:] / len(done)
    assert np.all(np.abs(share - 0.25) < 4 * np.sqrt(0.25 * 0.75 / len(done))), share
    # a client's epochs do not depend on who else trained (one draw per client id)
    few = straggler_work(0, 7, np.array([2, 5, 9]), np.full(10, 20.0), 1.0, 4)
    assert few == {c: runs[7][c] for c in (2, 5, 9)}


def test_local_steps_make_the_unit_one_step(tmp_path):
    """With ``local.steps`` S a straggler runs 1..S minibatch steps (the engine passes
    blocks = S); three rounds of the engine's own participants, exactly."""
    sc = point(tmp_path, overrides=[PARTIAL_HALF])  # 12 clients, 6 a round, 3 steps
    eng = Engine(sc, InlineBackend())
    eng.start()
    got = [eng.protocol.participants(r, sample_clients(0, r, 12, 6).tolist()).partial
           for r in range(3)]
    assert got == [{0: 2, 4: 1, 6: 1}, {0: 2, 9: 2, 10: 3}, {3: 1, 8: 2, 11: 3}]


def _run(tmp_path, *over):
    return Engine(point(tmp_path, overrides=["rounds=3", *over]), InlineBackend(),
                  workers=2).run()


@pytest.mark.parametrize("partial", ["false", "true"])
def test_fraction_zero_is_the_run_without_stragglers_to_the_bit(tmp_path, partial):
    plain = _run(tmp_path)
    none = _run(tmp_path, f"clients.stragglers={{kind: epochs, fraction: 0.0, partial: {partial}}}")
    np.testing.assert_array_equal(none.final_params, plain.final_params)
    for a, b in zip(none.metrics, plain.metrics, strict=True):
        assert {k: v for k, v in a.items() if not k.endswith("_seconds") and k != "partial_work"} \
            == {k: v for k, v in b.items() if not k.endswith("_seconds")}
        assert a["stragglers"] == 0.0 and a.get("partial_work", 0.0) == 0.0


def test_dropping_the_stragglers_is_the_round_without_them(tmp_path):
    """partial: false (FedAvg): the step is the mean of the other clients' updates, each
    computed from the same model as if the stragglers had not been sampled."""
    sc = point(tmp_path, overrides=["rounds=1", "clients.stragglers={kind: epochs, fraction: 0.5}"])
    eng = Engine(sc, InlineBackend())
    eng.start()
    x0 = eng.protocol.server.actor.params()
    sampled = sample_clients(0, 0, 12, 6).tolist()
    who = eng.protocol.participants(0, sampled)
    assert who.late == {0, 4, 6} and who.partial == {} and who.honest == [5, 7, 11]
    res = eng.pool.workers[0].actor.train(TrainRequest(0, tuple(who.honest)), x0)
    ran = Engine(sc, InlineBackend()).run()
    np.testing.assert_allclose(ran.final_params, x0 + res.updates.mean(0), rtol=0, atol=1e-6)
    assert ran.metrics[0]["stragglers"] == 3 and ran.metrics[0]["participants"] == 3
    everyone = eng.pool.workers[0].actor.train(TrainRequest(0, tuple(sampled)), x0)
    assert np.abs(ran.final_params - (x0 + everyone.updates.mean(0))).max() > 1e-3


def _numpy_round(eng, sampled: list[int], caps: dict[int, int], local) -> np.ndarray:
    """One FedAvg round of multinomial logistic regression (W: 10 x 64, then b) in float64
    numpy: each client's minibatch SGD on the mean cross-entropy, from its seeded batches
    (the first ``caps[c]`` of them for a straggler), then the mean of the deltas."""
    x0 = eng.protocol.server.actor.params().astype(np.float64)
    source = eng.pool.workers[0].actor.source
    deltas = []
    for c in sampled:
        xs, ys = source.train([c])[0]
        x = model_input(xs).numpy().reshape(len(ys), -1).astype(np.float64)
        y = np.eye(10)[np.asarray(ys)]
        w, b = x0[:640].reshape(10, 64).copy(), x0[640:].copy()
        for idx in minibatches(len(ys), local, torch_generator(0, "local", 0, c), caps.get(c)):
            i = idx.numpy()
            z = x[i] @ w.T + b
            p = np.exp(z - z.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            g = (p - y[i]) / len(i)
            w -= local.lr * g.T @ x[i]
            b -= local.lr * g.sum(0)
        deltas.append(np.concatenate([w.ravel(), b]) - x0)
    return x0 + np.mean(deltas, axis=0)


@pytest.mark.parametrize("rule", [
    ["local.optimizer={name: fedprox, mu: 0.0}"],  # FedProx's own trainer, drift_sgd
    ["local.trainer={name: sgd}"],
    ["local.trainer={name: vectorized_sgd}"],  # the stacked trainer: rows of unequal steps
])
def test_partial_work_with_mu_zero_is_fedavg_of_the_epochs_each_ran(tmp_path, rule):
    """3 epochs of 3 minibatches (batch 48, 119 or 120 samples a client: the last batch
    is smaller), half of the 6 sampled clients straggling: the engine's round equals
    numpy's with each straggler's first x epochs (3 or 6 of its 9 steps), and differs from
    the round where everyone runs 3."""
    sc = point(tmp_path, overrides=[
        "rounds=1", "local={epochs: 3, batch_size: 48, lr: 0.5}",
        PARTIAL_HALF, *rule])
    eng = Engine(sc, InlineBackend())
    eng.start()
    sampled = sample_clients(0, 0, 12, 6).tolist()
    steps = eng.pool.local_steps
    who = eng.protocol.participants(0, sampled)
    # the stragglers and the minibatch steps each ran: x epochs of steps / 3
    assert who.partial == {0: 6, 4: 3, 6: 3} and who.honest == sampled
    assert [int(steps[c]) for c in (0, 4, 6)] == [9, 9, 9]
    got = Engine(sc, InlineBackend()).run().final_params
    want = _numpy_round(eng, sampled, who.partial, sc.local)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)  # float32 against float64
    full = _numpy_round(eng, sampled, {}, sc.local)
    assert np.abs(got - full).max() > 0.05  # the stragglers' missing epochs: 0.07


@pytest.mark.parametrize("stragglers, line", [
    ("{kind: epochs}", "clients.stragglers.fraction: required with kind epochs"),
    ("{kind: epochs, fraction: 1.5}", "clients.stragglers.fraction: must be <= 1"),
    ("{kind: epochs, fraction: -0.1}", "clients.stragglers.fraction: must be >= 0"),
    ("{kind: epochs, fraction: .inf}", "clients.stragglers.fraction: must be a finite number"),
    ("{kind: epochs, fraction: 0.5, deadline: 3}",
     ("clients.stragglers.deadline: used by kind deadline only; remove it, or set "
      "clients.stragglers.kind: deadline")),
    ("{kind: epochs, fraction: 0.5, jitter: 0.2}",
     "clients.stragglers.jitter: used by kind deadline only"),
    ("{fraction: 0.5}", ("clients.stragglers.fraction: used by kind epochs only; remove "
                         "it, or set clients.stragglers.kind: epochs")),
    ("{deadline: 2.0, fraction: 0.0}", "clients.stragglers.fraction: used by kind epochs only"),
    ("{sigma: 0.5}", "clients.stragglers.deadline: required with kind deadline"),
    ("{kind: epoch, fraction: 0.5}",
     "clients.stragglers.kind: must be one of 'deadline' or 'epochs', got 'epoch'"),
])
def test_a_wrong_straggler_block_is_one_line(tmp_path, stragglers, line):
    with pytest.raises(ScenarioError) as e:
        point(tmp_path, overrides=[f"clients.stragglers={stragglers}"])
    assert len(e.value.lines) == 1 and line in e.value.lines[0], e.value.lines


def test_a_deadline_block_dumps_as_before_and_an_epochs_block_without_the_others():
    """A run's identity is a digest of its dump: a deadline block's is unchanged."""
    assert Stragglers(deadline=3.0).model_dump() == \
        {"deadline": 3.0, "sigma": 0.5, "jitter": 0.1, "partial": False}
    assert HALF.model_dump() == {"kind": "epochs", "fraction": 0.5, "partial": False}
    assert Stragglers.model_validate(HALF.model_dump()) == HALF


def test_with_speeds_a_stragglers_time_is_its_share_of_its_task(tmp_path):
    """No clock of its own: with ``speeds`` every client's task is 3 steps of 16 samples
    (48 s); a round lasts its slowest participant's share, so it is 48 s when a straggler
    ran all 3 steps or someone did not straggle, else its longest straggler's k/3."""
    speeds = "speeds={distribution: constant, sample_seconds: 1.0}"
    one = _run(tmp_path, speeds, PARTIAL_ALL)
    eng = Engine(point(tmp_path, overrides=["rounds=3", speeds, PARTIAL_ALL]), InlineBackend())
    eng.start()
    longest = [max(eng.protocol.participants(r, sample_clients(0, r, 12, 6).tolist())
                   .partial.values()) for r in range(3)]
    assert np.diff([0.0] + [m["sim_time"] for m in one.metrics]).tolist() == \
        pytest.approx([48.0 * k / 3 for k in longest])
