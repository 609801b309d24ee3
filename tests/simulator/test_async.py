"""Asynchronous server modes on the simulated clock (``server.mode``; simulator/sim/clock.py,
simulator/sim/rounds/asynchronous.py): the schedule by hand, FedAsync's mixed model by hand,
FedBuff reducing to synchronous FedAvg, inline = Ray, resume, and what validation refuses."""

from __future__ import annotations

import numpy as np
import pytest

from simulator.config import ScenarioError
from simulator.config.load import load
from simulator.messages import TrainRequest
from simulator.runtime.backend import InlineBackend
from simulator.sim.clock import Rule, Schedule, staleness_scale
from simulator.sim.engine import Engine
from tests.simulator.test_checkpoint import _roundtrip
from tests.simulator.test_engine import point as engine_point

BASE = """\
name: async-small
rounds: 6
data:
  dataset: {name: digits}
model: {name: logreg}
clients: {total: 12, per_round: 6}
local: {steps: 2, batch_size: 8, lr: 0.2}
"""


def point(tmp_path, extra: str = "", overrides=()):
    return engine_point(tmp_path, BASE + extra, overrides)


def schedule(durations, rule, concurrency=None, max_staleness=None, seed=0):
    return Schedule(len(durations), concurrency or len(durations), rule, max_staleness,
                    lambda c, k: durations[c], seed)


def steps(s, n):
    return [s.next_step() for _ in range(n)]


def by_hand(sc, n: int):
    """(the first ``n`` step plans of ``sc``'s clock, its run on 2 workers, a ClientWorker to
    train clients by hand, [the initial parameters])."""
    eng = Engine(sc, InlineBackend(), workers=1)
    eng.start()
    plans = [eng.protocol._schedule.next_step() for _ in range(n)]
    res = Engine(sc, InlineBackend(), workers=2).run()
    x0 = np.asarray(eng.protocol.server.actor.params(), dtype=np.float32)
    return plans, res, eng.pool.workers[0].actor, [x0]


def test_a_three_client_fedasync_schedule_by_hand():
    """Clients 0, 1, 2 take 1, 2 and 3.5 s a task, all three in flight, a step per update:
    t=1 client 0 (from v0, tau 0) -> v1, it restarts from v1; t=2 client 0 (v1, tau 0)
    before client 1 (v0, tau 2: the tie goes to the lower id); t=3 client 0 (v2, tau 1);
    t=3.5 client 2 (v0, tau 4); t=4 client 0 (v4, tau 1), then client 1 (v3, tau 3)."""
    got = [(p.time, p.arrivals[0].client, p.arrivals[0].version, p.index - p.arrivals[0].version)
           for p in steps(schedule([1.0, 2.0, 3.5], Rule(1)), 7)]
    assert got == [(1.0, 0, 0, 0), (2.0, 0, 1, 0), (2.0, 1, 0, 2), (3.0, 0, 2, 1),
                   (3.5, 2, 0, 4), (4.0, 0, 4, 1), (4.0, 1, 3, 3)]


def test_buffered_steps_count_staleness_drops_and_contributions():
    """K = 2 of 3 clients (1, 1.5, 4 s); updates more than 1 step stale are dropped."""
    s = schedule([1.0, 1.5, 4.0], Rule(2), max_staleness=1)
    plans = steps(s, 4)
    # t=1.5: clients 0 and 1 from v0 -> step 0; t=2.5 client 0 (v1), t=3 client 1 (v1) ->
    # step 1; t=4 client 0 (v2), then client 2 (v0, tau 2 > 1: dropped); t=4.5 client 1
    # (v2) -> step 2
    assert [(p.time, [(a.client, a.version) for a in p.arrivals]) for p in plans[:3]] == [
        (1.5, [(0, 0), (1, 0)]), (3.0, [(0, 1), (1, 1)]), (4.5, [(0, 2), (1, 2)])]
    assert plans[2].dropped == 1 and plans[0].contributed == (1, 1)
    assert plans[1].contributed == (2, 2) and plans[3].clients_applied == 2
    # the versions kept after step 0 are those in flight: client 2's v0 and the new v1
    assert plans[0].in_flight == (0, 1)


def test_basgd_steps_when_every_buffer_holds_an_update():
    """B = 2 buffers (client id mod 2): the even clients arrive at t=1, the server waits for
    an odd one (t=5; client 3's update, at the same time, goes to the next step)."""
    plans = steps(schedule([1.0, 5.0, 1.0, 5.0], Rule(buffers=2), concurrency=4), 2)
    assert plans[0].time == 5.0 and [a.client for a in plans[0].arrivals] == [0, 2, 1]
    assert plans[1].arrivals[0].client == 3


def test_the_schedule_is_a_function_of_the_seed():
    rng = np.random.default_rng(3)
    durations = rng.exponential(1.0, 50)
    a = [[(t.client, t.version) for t in p.arrivals]
         for p in steps(schedule(durations, Rule(5), concurrency=10), 20)]
    b = [[(t.client, t.version) for t in p.arrivals]
         for p in steps(schedule(durations, Rule(5), concurrency=10), 20)]
    c = [[(t.client, t.version) for t in p.arrivals]
         for p in steps(schedule(durations, Rule(5), concurrency=10, seed=1), 20)]
    assert a == b and a != c


def test_staleness_functions():
    tau = np.array([0.0, 1.0, 3.0, 8.0])
    np.testing.assert_allclose(staleness_scale("polynomial", 0.5, 0, tau),
                               [1.0, 2 ** -0.5, 0.5, 1 / 3])
    np.testing.assert_allclose(staleness_scale("hinge", 2.0, 3, tau), [1, 1, 1, 1 / 11])
    assert staleness_scale("constant", 0.5, 0, tau).tolist() == [1.0] * 4


def test_fedasync_mixes_each_clients_model_as_computed_by_hand(tmp_path):
    """Three clients of equal speed: they arrive together, in id order, with staleness 0, 1,
    2, then 2 every step; the server's model after each step is
    x + alpha (1 + tau)^-a (x_v + update - x), the client's update computed from the model
    version x_v it started from."""
    sc = point(tmp_path, "server: {mode: fedasync}\nasynchrony: {mixing: 0.5, "
               "staleness: {function: polynomial, a: 0.5}}\n",
               ["clients={total: 3}", "rounds=5", "local.steps=1"])
    eng = Engine(sc, InlineBackend(), workers=1)
    res = eng.run()
    worker = Engine(sc, InlineBackend(), workers=1)
    worker.start()
    w = worker.pool.workers[0].actor
    xs = [np.asarray(worker.protocol.server.actor.params(), dtype=np.float32)]
    order = [(0, 0), (1, 0), (2, 0), (0, 1), (1, 2)]  # (client, version) of steps 0..4
    for k, (c, v) in enumerate(order):
        update = w.train(TrainRequest(v, (c,)), xs[v], None).updates[0]
        tau = k - v
        mix = np.float32(0.5 * (1 + tau) ** -0.5)
        xs.append(xs[k] + mix * (xs[v] + update - xs[k]))
    np.testing.assert_allclose(res.final_params, xs[-1], rtol=0, atol=2e-6)
    assert [m["staleness_max"] for m in res.metrics] == [0, 1, 2, 2, 2]
    assert [m["sim_time"] for m in res.metrics][:3] == [0.008] * 3
    assert res.metrics[3]["sim_time"] == pytest.approx(0.016)


def test_fedbuff_with_every_client_in_each_step_is_synchronous_fedavg(tmp_path):
    """K = C = every client, equal speeds: each step holds every client's update from the
    current model, so FedBuff is FedAvg, to the bit."""
    sync = Engine(point(tmp_path, overrides=["clients.per_round=12"]), InlineBackend()).run()
    fedbuff = Engine(point(tmp_path, "server: {mode: fedbuff}\n",
                           ["clients.per_round=12"]), InlineBackend()).run()
    np.testing.assert_array_equal(sync.final_params, fedbuff.final_params)
    assert [m["test_accuracy"] for m in sync.metrics] == \
        [m["test_accuracy"] for m in fedbuff.metrics]
    assert all(m["staleness_max"] == 0 and m["participants"] == 12 for m in fedbuff.metrics)


ATTACKED = """\
server: {mode: fedbuff}
asynchrony:
  concurrency: 6
  buffer_size: 4
  max_staleness: 3
speeds: {distribution: lognormal, sigma: 1.0, jitter: 0.2, byzantine_factor: 0.5}
"""


@pytest.mark.parametrize("over", [
    [], ["server.mode=latest", "asynchrony={concurrency: 4, draw: id, weights: updates}",
         "aggregator={name: geomed}", "meta={name: ctma, f: 2}", "attack={name: alie}"],
], ids=["fedbuff", "latest"])
def test_under_attack_the_numbers_are_the_same_on_any_worker_count_and_on_ray(
        tmp_path, shared_ray, over):
    sc = point(tmp_path, ATTACKED, ["clients.byzantine=2", "attack={name: sign_flip}",
                                    "aggregator={name: cwtm, f: 1}", "rounds=8", *over])
    one = Engine(sc, InlineBackend(), workers=1).run()
    three = Engine(sc, InlineBackend(), workers=3).run()
    on_ray = Engine(sc, shared_ray, workers=2).run()
    np.testing.assert_equal(one.metrics, three.metrics)
    np.testing.assert_equal(one.metrics, on_ray.metrics)
    np.testing.assert_array_equal(one.final_params, on_ray.final_params)
    assert max(m["staleness_max"] for m in one.metrics) > 0
    assert sum(m["byzantine_sampled"] for m in one.metrics) > 0
    times = [m["sim_time"] for m in one.metrics]
    assert times == sorted(times) and times[0] > 0


@pytest.mark.parametrize("over", [
    [],
    ["local={steps: 1, batch_size: 8, lr: 0.2, optimizer: {name: momentum, beta: 0.9}}"],
    ["model={name: cnn, channels: [4], hidden: 8, norm: batch}"],
    ["server.mode=fedasync", "asynchrony.buffer_size=null", "aggregator={name: mean}",
     "clients.byzantine=0", "attack=null"],
    ["server.mode=latest", "asynchrony={concurrency: 3, draw: id_squared, weights: updates}",
     "aggregator={name: median}", "attack={name: alie}"],
], ids=["fedbuff", "worker-momentum", "batchnorm", "fedasync", "latest"])
def test_a_resumed_asynchronous_run_is_identical(tmp_path, over):
    """The checkpoint (through torch.load(weights_only=True), as a resume reads it) holds
    the server's model versions that clients still train from; the schedule is simulated
    again up to the checkpoint's step."""
    sc = point(tmp_path, ATTACKED, ["clients.byzantine=2", "attack={name: sign_flip}",
                                    "aggregator={name: cwtm, f: 1}", "rounds=8",
                                    "runtime.checkpoint_every=3", *over])
    saved = {}
    full = Engine(sc, InlineBackend(), workers=2).run(
        on_checkpoint=lambda r, s: saved.__setitem__(r, _roundtrip(s)))
    assert sorted(saved) == [2, 5]
    assert saved[2]["server"]["version"] == 3 and saved[2]["server"]["versions"]
    for r in (2, 5):
        resumed = Engine(sc, InlineBackend(), workers=2).run(resume={**saved[r], "round": r})
        np.testing.assert_equal(resumed.metrics, full.metrics)  # NaN == NaN (client_loss of
        # a step whose only update is Byzantine)
        np.testing.assert_array_equal(resumed.final_params, full.final_params)


@pytest.mark.parametrize(("extra", "overrides", "message"), [
    ("asynchrony: {buffer_size: 2}\n", [],
     ("asynchrony: used by the asynchronous modes only; set server.mode to one of fedasync, "
     "fedbuff, basgd, latest, or remove it")),
    ("server: {mode: fedbuff}\nasynchrony: {buffer_size: 13}\n", [],
     ("asynchrony.buffer_size: must be <= clients.total (12): a client sends at most one "
     "update from each model version, got 13")),
    ("server: {mode: fedasync}\nasynchrony: {buffer_size: 3}\n", [],
     "asynchrony.buffer_size: fedasync steps on every update; remove it (or use fedbuff), got 3"),
    ("server: {mode: fedbuff}\nasynchrony: {concurrency: 13}\n", [],
     "asynchrony.concurrency: clients in flight must be <= clients.total (12), got 13"),
    ("server: {mode: basgd}\nasynchrony: {buffers: 13}\n", [],
     ("asynchrony.buffers: must be <= clients.total (12): client c goes to buffer c mod B, "
     "got 13")),
    ("server: {mode: fedbuff}\n", ["clients.dropout=0.1"],
     ("clients.dropout: not used by server.mode fedbuff: the simulated clock decides who "
     "arrives when (speeds); remove it")),
    ("server: {mode: fedbuff}\nasynchrony: {buffer_size: 4}\n",
     ["clients.byzantine=2", "attack={name: sign_flip}", "aggregator={name: krum, f: 1}"],
     "aggregator.f: Krum needs n > 2f + 2; n = 4 allows f <= 0, got 1"),
    ("server: {mode: fedbuff}\n", ["topology={name: ring}"],
     ("server.mode: D-SGD (a topology) has no server to run fedbuff; remove server.mode or "
     "the topology")),
])
def test_asynchronous_keys_are_checked_before_anything_runs(tmp_path, extra, overrides,
                                                             message):
    with pytest.raises(ScenarioError) as e:
        point(tmp_path, extra, overrides)
    assert any(line.endswith(message) for line in e.value.lines), e.value.lines


def test_a_synchronous_round_with_speeds_lasts_as_long_as_its_slowest_participant(tmp_path):
    """The same devices in both modes: a sync round's simulated time is its slowest
    participant's task; numbers other than the new sim_time metric do not change."""
    plain = Engine(point(tmp_path), InlineBackend()).run()
    timed = Engine(point(tmp_path, "speeds: {distribution: pareto, a: 1.5, jitter: 0.3}\n"),
                   InlineBackend()).run()
    np.testing.assert_array_equal(plain.final_params, timed.final_params)
    assert "sim_time" not in plain.metrics[0]
    from simulator.sim.sampling import sample_clients
    from simulator.sim.speeds import profiles

    sc = point(tmp_path, "speeds: {distribution: pareto, a: 1.5, jitter: 0.3}\n")
    assert sc.speeds is not None
    prof = profiles(sc.speeds, 12, 0, np.zeros(0, dtype=np.int64))
    d = 64 * 10 + 10  # logreg on 8x8 digits, 10 classes
    clock = 0.0
    for r, m in enumerate(timed.metrics):
        clock += max(prof.task_seconds(c, 2 * 8, 32.0 * d, r)
                     for c in sample_clients(0, r, 12, 6).tolist())
        assert m["sim_time"] == pytest.approx(clock, rel=1e-12)


def test_a_timing_attack_claims_fresh_updates_and_escapes_the_staleness_cap(tmp_path):
    """Slow Byzantine clients (10x) behind max_staleness 1: honest reporting gets most of
    their updates dropped; claiming every update is fresh gets them all applied, at full
    weight."""
    extra = ATTACKED.replace("max_staleness: 3", "max_staleness: 1").replace(
        "byzantine_factor: 0.5", "byzantine_factor: 10")
    over = ["clients.byzantine=2", "attack={name: sign_flip}", "aggregator={name: mean}",
            "rounds=30"]
    honest = Engine(point(tmp_path, extra, over), InlineBackend()).run()
    timing = Engine(point(tmp_path, extra, [*over, "asynchrony.byzantine_staleness=fresh"]),
                    InlineBackend()).run()
    applied = [sum(m["byzantine_sampled"] for m in r.metrics) for r in (honest, timing)]
    assert applied[0] < applied[1]
    assert sum(m["dropped_stale"] for m in honest.metrics) > \
        sum(m["dropped_stale"] for m in timing.metrics)
    # the Byzantine updates the server took as fresh were in truth stale
    assert max(m["staleness_max"] for m in timing.metrics if m["byzantine_sampled"]) > 1


def test_fedscale_traces_beside_the_scenario_drive_the_clock(tmp_path, monkeypatch):
    """Device capacity and availability in FedScale's formats (JSON here), given relative to
    the scenario file and read from another directory: client 0 computes at 10 ms a sample
    (3 passes: 0.03 s a sample), client 1 at 20 ms, client 2 at 40 ms; 16 samples a task,
    the model (650 float32 parameters) down and up at 1,000 kbit/s (1,024 bits each).
    Client 0 is active only in [0.5, 1) of every second: the first update to arrive is
    client 1's, at 16 * 0.06 + 2 * 20,800 / 1,024,000 s."""
    import json

    folder = tmp_path / "scenario"
    folder.mkdir()
    (folder / "capacity.json").write_text(json.dumps(
        {str(k + 1): {"computation": ms, "communication": 1000}
         for k, ms in enumerate([10, 20, 40])}))
    (folder / "availability.json").write_text(json.dumps({
        "1": {"active": [0.5], "inactive": [1.0], "finish_time": 1.0, "duration": 0.5},
        "2": {"active": [0.0], "inactive": [100.0], "finish_time": 100.0, "duration": 100},
        "3": {"active": [0.0], "inactive": [100.0], "finish_time": 100.0, "duration": 100}}))
    p = folder / "s.yaml"
    p.write_text(BASE + "server: {mode: fedasync}\nspeeds: {trace: capacity.json, "
                 "availability: availability.json}\n")
    monkeypatch.chdir(tmp_path)
    sc = load(p, ["clients={total: 3}", "rounds=4", "local={steps: 2, batch_size: 8}"]
              ).points[0].scenario
    res = Engine(sc, InlineBackend()).run()
    comm = 2 * 32 * 650 / 1_024_000
    assert res.metrics[0]["sim_time"] == pytest.approx(16 * 0.06 + comm, rel=1e-12)
    # client 0 starts at 0.5 s (its first active time) and arrives at 0.5 + 16 * 0.03 + comm
    assert [m["sim_time"] for m in res.metrics][1] == pytest.approx(0.5 + 0.48 + comm)


def test_a_clock_that_no_client_can_move_is_one_line():
    """Availability that ends: client 0 active in [0, 1) of a 1e9 s cycle, client 1 never;
    a buffer of 2 cannot fill once client 0 has sent its one update of version 0."""
    from simulator.errors import ClockStalled

    s = Schedule(2, 2, Rule(2), None, lambda c, k: 0.5, 0,
                 lambda c, t: t if c == 0 and t < 1 else float("inf"))
    with pytest.raises(ClockStalled, match=r"^server step 1: no client can start a task any "
                       r"more .* with 1 update\(s\) in it; give more clients"):
        s.next_step()


def test_weights_by_updates_reach_the_aggregation(tmp_path):
    """asynchrony.weights: updates: at the first step every client has one update applied
    (equal weights: the unweighted step, to the bit); later, fast clients weigh more and the
    runs part."""
    extra = ATTACKED.replace("max_staleness: 3", "max_staleness: 3\n  weights: WEIGHTS")
    over = ["clients.byzantine=2", "attack={name: sign_flip}", "aggregator={name: median}",
            "rounds=10"]
    plain = Engine(point(tmp_path, extra.replace("WEIGHTS", "none"), over), InlineBackend()).run()
    weighted = Engine(point(tmp_path, extra.replace("WEIGHTS", "updates"), over), InlineBackend()).run()
    assert plain.metrics[0]["aggregate_norm"] == weighted.metrics[0]["aggregate_norm"]
    assert [m["aggregate_norm"] for m in plain.metrics] != \
        [m["aggregate_norm"] for m in weighted.metrics]
    with pytest.raises(ScenarioError) as e:
        point(tmp_path, extra.replace("WEIGHTS", "updates"), [*over, "aggregator={name: meamed, f: 1}"])
    assert any(line.endswith("aggregator: 'meamed' has no weighted definition, which "
                             "asynchrony.weights: updates needs; weighted: cwtm, geomed, krum, "
                             "majority_vote, mean, median, multikrum") for line in e.value.lines
               ), e.value.lines


def test_basgd_aggregates_its_buffers_means(tmp_path):
    """BASGD with B = 2 buffers and the mean: a step moves the model by the mean of the two
    buffers' means (client id mod 2), each update computed from its start version, by hand."""
    sc = point(tmp_path, "server: {mode: basgd}\nasynchrony: {buffers: 2, staleness: "
               "{function: constant}}\n", ["clients={total: 4}", "rounds=3", "local.steps=1"])
    plans, res, w, xs = by_hand(sc, 3)
    for k, p in enumerate(plans):
        rows = {0: [], 1: []}
        for t in p.arrivals:
            rows[t.client % 2].append(w.train(TrainRequest(t.version, (t.client,)), xs[t.version],
                                              None).updates[0])
        means = [np.mean(rows[b], axis=0) for b in (0, 1)]
        xs.append(xs[k] + np.mean(means, axis=0))
    np.testing.assert_allclose(res.final_params, xs[-1], rtol=0, atol=2e-6)
    assert [m["participants"] for m in res.metrics] == [len(p.arrivals) for p in plans]


def test_byzantine_identities_that_switch(tmp_path):
    """clients.byzantine_period: 2: a new Byzantine set every 2 rounds (Dorfman, Yehya,
    Levy, ICML 2024); each round's Byzantine count is its sample's overlap with its period's
    set. Without it, the one set of today."""
    from simulator.sim.sampling import byzantine_clients, sample_clients

    over = ["clients.byzantine=3", "attack={name: sign_flip}", "aggregator={name: cwtm, f: 2}",
            "rounds=8"]
    res = Engine(point(tmp_path, overrides=[*over, "clients.byzantine_period=2"]),
                 InlineBackend()).run()
    sets = [set(byzantine_clients(0, 12, 3, r // 2).tolist()) for r in range(8)]
    assert sets[0] == set(byzantine_clients(0, 12, 3).tolist()) and sets[2] != sets[0]
    assert [m["byzantine_sampled"] for m in res.metrics] == [
        float(len(sets[r] & set(sample_clients(0, r, 12, 6).tolist()))) for r in range(8)]
    fixed = Engine(point(tmp_path, overrides=over), InlineBackend()).run()
    assert [m["byzantine_sampled"] for m in fixed.metrics] == [
        float(len(sets[0] & set(sample_clients(0, r, 12, 6).tolist()))) for r in range(8)]
    # asynchronously: who is Byzantine is decided when the step comes
    on_clock = Engine(point(tmp_path, ATTACKED, [*over, "clients.byzantine_period=3",
                                                 "aggregator={name: cwtm, f: 1}"]),
                      InlineBackend(), workers=2).run()
    assert sum(m["byzantine_sampled"] for m in on_clock.metrics) > 0
    with pytest.raises(ScenarioError) as e:
        point(tmp_path, overrides=["clients.byzantine_period=2"])
    assert e.value.lines[-1].endswith(
        "clients.byzantine_period: switches the Byzantine clients' identities: it needs "
        "clients.byzantine > 0 and a server (D-SGD's Byzantine peers are fixed); remove it")


def test_latest_aggregates_every_clients_latest_update_as_by_hand(tmp_path):
    """server.mode latest (Dahan & Levy, NeurIPS 2024): one client in flight, drawn with
    probability proportional to its id + 1; on each arrival the server aggregates the latest
    update of every client that has sent one, weighted by how many each has sent."""
    sc = point(tmp_path, "server: {mode: latest}\nasynchrony: {concurrency: 1, draw: id, "
               "weights: updates}\n", ["clients={total: 3}", "rounds=8", "local.steps=1",
                                       "aggregator={name: mean}"])
    plans, res, w, xs = by_hand(sc, 8)
    latest, counts = {}, {}
    for k, p in enumerate(plans):
        (t,) = p.arrivals
        assert t.version == k  # one in flight: every update is fresh
        latest[t.client] = w.train(TrainRequest(k, (t.client,)), xs[k], None).updates[0]
        counts[t.client] = counts.get(t.client, 0) + 1
        ids = sorted(latest)
        c = np.asarray([counts[i] for i in ids], dtype=np.float64)
        xs.append(xs[k] + (np.stack([latest[i] for i in ids]) * (c / c.max())[:, None]
                           ).sum(0) / (c / c.max()).sum())
    np.testing.assert_allclose(res.final_params, xs[-1], rtol=0, atol=2e-6)
    assert sorted(counts) == [0, 1, 2] and counts[2] > counts[0]
