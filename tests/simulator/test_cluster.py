"""Faults on a real multi-node Ray cluster and on restarted actors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from simulator.config.load import load
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine

HERE = Path(__file__).resolve().parent

SCENARIO = """\
name: cluster
rounds: 5
data:
  dataset: {name: digits}
model: {name: mlp, hidden: [32]}
clients: {total: 10, per_round: 6, byzantine: 1}
attack: {name: sign_flip}
aggregator: {name: median}
local: {steps: 3, batch_size: 16, lr: 0.1}
"""


@pytest.mark.cluster
def test_worker_node_lost_mid_run_changes_no_number(tmp_path):
    """A head and two worker nodes of one CPU each (ray.cluster_utils.Cluster, in its own
    process: the test session has its Ray instance): ClientWorkers on both worker nodes;
    removing one worker node after round 2 leaves no CPU for a restart (Ray's restart waited
    forever here, then died with ReferenceCountingAssertionError): its clients move to the
    live worker, the round is computed again, and every metric equals the uninterrupted run's."""
    p = tmp_path / "cluster.yaml"
    p.write_text(SCENARIO)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run([sys.executable, str(HERE / "cluster_script.py"), str(p)], env=env,
                       capture_output=True, text=True, timeout=540, check=False, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["placed"] == out["worker_nodes"]  # one ClientWorker on each worker node
    assert len(out["killed"]) == 1 and out["alive_nodes"] == 2
    assert out["rounds"] == 5 and out["same_metrics"] and out["final_equal"]
    assert out["live_workers"] == 1
    assert "ClientWorker(s) [0] lost" in r.stderr and "moved to 1 live worker(s)" in r.stderr


class KillDuringTrain:
    """The shared Ray backend, except that right after submitting a worker's ``train`` call of
    round 3 (index 2) it kills that worker: the call is in flight when its actor dies. On Ray
    that call goes out while round 2 is still being finished (the prefetched round):
    ``after_step`` first waits for round 2's step, so the loss is found in round 3; without
    it the actor may die with round 2's training still running, found in round 2."""

    def __init__(self, backend, after_step: bool = False) -> None:
        self._b = backend
        self.killed = 0
        self.after_step = after_step
        self.last_step = None

    def __getattr__(self, name):
        return getattr(self._b, name)

    def call(self, handle, method, *args):
        import ray

        target = method.__name__ == "train" and args[0].round == 2 and not self.killed
        if target:
            if self.after_step:
                ray.wait([self.last_step], timeout=60)
            # ray.kill is asynchronous: an idle worker could finish the few ms of training
            # before the kill lands (the loss then shows in round 4; seen once in CI). Queued
            # behind a call that sleeps, the train call is surely still in flight.
            handle.__ray_call__.remote(_sleep)
        ref = self._b.call(handle, method, *args)
        if method.__name__ == "step":
            self.last_step = ref
        if target:
            ray.kill(handle, no_restart=False)
            self.killed += 1
        return ref


def _sleep(actor) -> None:
    time.sleep(30)


@pytest.mark.parametrize("after_step", [True, False], ids=["prefetched-call", "both-rounds"])
def test_worker_actor_killed_mid_round_its_clients_move_to_a_live_worker(tmp_path, shared_ray,
                                                                         terminal, after_step):
    p = tmp_path / "s.yaml"
    p.write_text(SCENARIO)
    sc = load(p).points[0].scenario
    reference = Engine(sc, InlineBackend()).run()
    backend = KillDuringTrain(shared_ray, after_step)
    faulty = Engine(sc, backend, workers=2).run()
    assert backend.killed == 1
    assert faulty.metrics == reference.metrics
    np.testing.assert_array_equal(faulty.final_params, reference.final_params)
    err = terminal()
    found = "round 3" if after_step else r"round [23]"
    assert re.search(found + r": ClientWorker\(s\) \[0\] lost", err), err
    assert "moved to 1 live worker(s)" in err
    assert "constructor arguments in the object store and max_restarts > 0" not in err


def test_a_worker_lost_in_a_deadline_round_with_carried_updates_changes_no_number(
        tmp_path, shared_ray, terminal):
    """server.mode deadline with late: carry: the round with the lost worker is computed
    again, and it applies the late updates of the round before it once, as the run without
    a fault does."""
    p = tmp_path / "s.yaml"
    p.write_text(SCENARIO + "speeds: {distribution: exponential, sample_seconds: 0.01}\n"
                 "server: {mode: deadline, deadline: 0.6, late: carry}\n")
    sc = load(p).points[0].scenario
    reference = Engine(sc, InlineBackend()).run()
    assert sum(m["carried"] for m in reference.metrics) > 0  # late updates were carried
    backend = KillDuringTrain(shared_ray, True)
    faulty = Engine(sc, backend, workers=2).run()
    assert backend.killed == 1
    assert faulty.metrics == reference.metrics
    np.testing.assert_array_equal(faulty.final_params, reference.final_params)
    assert "moved to 1 live worker(s)" in terminal()


def _wait_dead(handle, timeout: float = 60.0) -> None:
    """Until the killed actor no longer answers (a loaded machine can take a round)."""
    import time

    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=5)
        except RayActorError:
            return
        except GetTimeoutError:
            continue
        time.sleep(0.1)
    raise AssertionError("the killed worker still answers")


@pytest.mark.parametrize("every, rule", [
    (0, "optimizer: {name: momentum}"), (2, "optimizer: {name: momentum}"),
    (2, "steps: 3}\nserver: {optimizer: {name: scaffold}"),
    (2, "steps: 3, optimizer: {name: ditto, lam: 0.5}"),
    (2, ("steps: 3}\ncodecs: [{name: top_k, fraction: 0.05, error_feedback: true}]\n"
        "server: {optimizer: {name: sgd}"))],
    ids=["from-the-start", "from-a-checkpoint", "scaffold-from-a-checkpoint",
         "ditto-from-a-checkpoint", "error-feedback-from-a-checkpoint"])
def test_lost_client_state_sends_the_run_back_to_a_state_it_holds(tmp_path, shared_ray, terminal,
                                                                   every, rule):
    """Worker momentum (and SCAFFOLD's client control variates, Ditto's personal models, a
    codec's error-feedback residuals) keep per-client state in the workers: when a worker dies with it, the run goes back to the newest state it holds (the
    start, or the last checkpoint round), restores it on the live workers and computes the
    rounds since again: the uninterrupted run's numbers, each round reported once."""
    import ray

    p = tmp_path / "s.yaml"
    p.write_text(SCENARIO.replace("local: {steps: 3, batch_size: 16, lr: 0.1}",
                                  "local: {batch_size: 16, lr: 0.1, " + rule + "}")
                 .replace("dataset: {name: digits}", "dataset: {name: synthetic, alpha: 1.0, "
                          "beta: 1.0}\n  partitioner: {name: natural}" if "ditto" in rule else
                          "dataset: {name: digits}")
                 + f"runtime: {{checkpoint_every: {every}}}\n")
    sc = load(p).points[0].scenario
    reference = Engine(sc, InlineBackend()).run()
    engine = Engine(sc, shared_ray, workers=2)
    seen: list[int] = []

    def kill(r, m):
        seen.append(r)
        if r == 2:
            ray.kill(engine.pool.workers[0].actor, no_restart=False)
            _wait_dead(engine.pool.workers[0].actor)  # ray.kill is asynchronous: dead before round 4

    faulty = engine.run(kill)
    assert seen == [0, 1, 2, 3, 4]
    assert faulty.metrics == reference.metrics
    assert "ditto" not in rule or faulty.metrics[-1]["personal_clients"] > 0
    np.testing.assert_array_equal(faulty.final_params, reference.final_params)
    err = terminal()
    back = "goes back to its start and computes rounds 1-4" if every == 0 else \
        "goes back to its state after round 2 and computes rounds 3-4"
    assert "with per-client state" in err and back in err


class KillDuringPeerStep(KillDuringTrain):
    """Kills a worker right after submitting its D-SGD ``peer_step`` of round 2."""

    def call(self, handle, method, *args):
        import ray

        ref = self._b.call(handle, method, *args)
        if method.__name__ == "peer_step" and args[0] == 2 and not self.killed:
            ray.kill(handle, no_restart=False)
            self.killed += 1
        return ref


@pytest.mark.parametrize("order", ["local_then_gossip", "gossip_then_local"])
def test_dsgd_peers_of_a_lost_worker_move_and_the_round_is_recomputed(tmp_path, shared_ray,
                                                                       order):
    """D-SGD peers live in the workers between rounds (gossip_then_local: the models of the
    round before are results held by the workers): the lost ones are made again from the
    round before's gossip, on the live worker, with the same numbers."""
    p = tmp_path / "s.yaml"
    p.write_text(SCENARIO.replace("clients: {total: 10, per_round: 6, byzantine: 1}\n"
                                  "attack: {name: sign_flip}\naggregator: {name: median}\n",
                                  f"clients: {{total: 8}}\ntopology: {{name: ring}}\n"
                                  f"dsgd: {{order: {order}}}\n"))
    sc = load(p).points[0].scenario
    reference = Engine(sc, InlineBackend()).run()
    backend = KillDuringPeerStep(shared_ray)
    faulty = Engine(sc, backend, workers=2).run()
    assert backend.killed == 1
    assert faulty.metrics == reference.metrics
    np.testing.assert_array_equal(faulty.final_params, reference.final_params)


class KillAtCheckpoint(KillDuringTrain):
    """Kills worker 0 just before the engine asks the workers for their client states after
    round 2 (a loss found while checkpointing, not while training)."""

    def __init__(self, backend, engine_box) -> None:
        super().__init__(backend)
        self.calls = 0
        self.engine_box = engine_box

    def call(self, handle, method, *args):
        import ray

        if method.__name__ == "client_states":
            self.calls += 1
            if self.calls == 3 and not self.killed:  # 1, 2: the start's snapshot
                victim = self.engine_box[0].pool.workers[0].actor
                ray.kill(victim, no_restart=False)
                self.killed += 1
                deadline = time.monotonic() + 60  # dead before the call goes out
                while time.monotonic() < deadline:
                    try:
                        ray.get(victim.__ray_ready__.remote(), timeout=10)
                    except ray.exceptions.RayActorError:
                        break
                    time.sleep(0.05)
                else:
                    raise AssertionError("the killed worker still answers after 60 s")
        return self._b.call(handle, method, *args)


def test_a_worker_lost_while_checkpointing_sends_the_run_back(tmp_path, shared_ray, terminal):
    p = tmp_path / "s.yaml"
    p.write_text(SCENARIO.replace("local: {steps: 3, batch_size: 16, lr: 0.1}",
                                  "local: {batch_size: 16, lr: 0.1, optimizer: {name: momentum}}")
                 + "runtime: {checkpoint_every: 2}\n")
    sc = load(p).points[0].scenario
    reference = Engine(sc, InlineBackend()).run()
    box: list = []
    backend = KillAtCheckpoint(shared_ray, box)
    engine = Engine(sc, backend, workers=2)
    box.append(engine)
    saved: list[int] = []
    faulty = engine.run(on_checkpoint=lambda r, st: saved.append(r))
    assert backend.killed == 1 and faulty.metrics == reference.metrics
    np.testing.assert_array_equal(faulty.final_params, reference.final_params)
    assert set(saved) == {1, 3}  # after rounds 2 and 4 (round 2's written again, the same)
    assert "goes back to its start and computes rounds 1-2" in terminal()


class _Cluster:
    """The shared local instance as a cluster joined by --address looks: nodes may join, so
    workers that do not fit yet are waited for."""

    fixed = False

    def __init__(self, backend) -> None:
        self._b = backend

    def __getattr__(self, name):
        return getattr(self._b, name)


def test_workers_that_cannot_start_stop_the_run_in_one_line(tmp_path, shared_ray, monkeypatch):
    """More workers than CPUs: on a local instance (its CPUs are all it will have) refused
    before any worker starts; on a cluster Ray queues the extra actors for ever, so the
    engine waits a bounded time, releases what it started and says why."""
    import simulator.runtime.backend as backend_module
    from simulator.errors import UsageError, WorkerLost

    p = tmp_path / "s.yaml"
    p.write_text(SCENARIO)
    sc = load(p).points[0].scenario
    with pytest.raises(UsageError, match=r"^runtime.workers: 4 ClientWorkers need 4 CPUs \(1 "
                       r"each, runtime.num_cpus\), and this machine's Ray instance has 2; use "
                       r"--workers 2 or fewer, a smaller runtime.num_cpus, or --address"):
        Engine(sc, shared_ray, workers=4).run()
    three = sc.model_copy(update={"runtime": sc.runtime.model_copy(update={"num_cpus": 3.0})})
    with pytest.raises(UsageError, match=r"need 3 CPUs \(3 each.*has 2; use a smaller "
                       r"runtime.num_cpus, or"):
        Engine(three, shared_ray, workers=1).run()

    # long enough for the two that fit to start beside the server and the adversary (four
    # processes importing torch on two cores)
    monkeypatch.setattr(backend_module, "PLACE_TIMEOUT", 20.0)
    engine = Engine(sc, _Cluster(shared_ray), workers=4)  # the session has 2 CPUs
    with pytest.raises(WorkerLost, match=r"2 of 4 ClientWorkers did not start within 20 s \(each "
                       r"needs 1 CPU; the cluster has 2 CPUs\); use fewer workers"):
        engine.run()
    import ray

    deadline = time.monotonic() + 60  # every actor it started was released: both CPUs free
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2


def test_fedray_errors_raised_in_actors_reach_the_driver_as_themselves(shared_ray):
    """A PluginError raised in the Server actor arrives as that PluginError (its one line),
    not as Ray's multi-line RayTaskError; any other exception keeps Ray's wrapping."""
    from ray.exceptions import RayTaskError

    from simulator.errors import PluginError

    class Raiser:  # defined here: pickled by value into the actor
        def plugin(self):
            raise PluginError("aggregator", "median", ValueError("boom"))

        def bug(self):
            return {}["missing"]

    actor = shared_ray.spawn(Raiser, role="server")
    try:
        with pytest.raises(PluginError) as e:
            shared_ray.get(shared_ray.call(actor, Raiser.plugin))
        assert str(e.value) == "aggregator 'median' raised ValueError: boom"
        with pytest.raises(RayTaskError):
            shared_ray.get(shared_ray.call(actor, Raiser.bug))
    finally:
        shared_ray.release([actor])
