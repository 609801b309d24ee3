"""A warm pool (simulator.runtime.pool): Ray and the actors of finished runs kept for the
next runs in one process. A run on reused actors equals a cold run to the bit; an idle
actor that died is replaced; actors of other options, and a sweep's tasks, find the CPUs
the idle actors held."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from simulator.config.load import load
from simulator.errors import UsageError
from simulator.run.runner import run_loaded, run_sweep
from simulator.runtime import backend as backend_module
from simulator.runtime.backend import RayBackend, choose_backend
from simulator.runtime.common import deterministic_mode
from simulator.runtime.pool import WarmPool, current_pool, warm_pool
from simulator.runtime.server import Server
from simulator.runtime.worker import ClientWorker
from tests.conftest import ROOT

QUICKSTART = ROOT / "scenarios" / "quickstart.yaml"
BYZANTINE = ROOT / "scenarios" / "byzantine_digits.yaml"  # a server, workers, an adversary
DSGD = ROOT / "scenarios" / "dsgd_byzantine.yaml"  # a mixer, workers


def _rows(path, sets, uri, workers=2):
    """Every round's metrics of the run of ``path`` with ``sets`` on Ray."""
    from mlflow.tracking import MlflowClient

    result = run_loaded(load(path, sets), "ray", tracking_uri=uri, quiet=True, workers=workers)
    run_id = result.runs[0]["run_id"]
    client = MlflowClient(uri)
    keys = sorted(client.get_run(run_id).data.metrics)
    assert "eval/test_accuracy" in keys
    return {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)]
            for k in keys if not k.startswith("time")}


BYZ = ["rounds=3", "sweep=null", "aggregator={name: cwtm, f: 3}", "attack={name: alie}",
       "evaluation.every=1"]
DS = ["rounds=4", "sweep=null", "seeds=[0]", "dsgd.defense=clipped_gossip", "attack.epsilon=1.0",
      "evaluation.every=2", "runtime.backend=ray"]


def test_runs_on_reused_actors_equal_cold_runs_to_the_bit(ray_backend, mlflow_uri):
    cold = {"byz": _rows(BYZANTINE, BYZ, mlflow_uri), "dsgd": _rows(DSGD, DS, mlflow_uri),
            "quick": _rows(QUICKSTART, ["rounds=3"], mlflow_uri)}
    with warm_pool() as pool:
        assert current_pool() is pool
        first = _rows(BYZANTINE, BYZ, mlflow_uri)
        assert pool.reused == 0 and pool.idle("worker") == 2 and pool.idle("server") == 1
        assert pool.idle("adversary") == 1
        # another kind of run in between: its mixer starts; the workers are reused
        assert _rows(DSGD, DS, mlflow_uri) == cold["dsgd"]
        assert pool.reused == 2
        assert _rows(QUICKSTART, ["rounds=3"], mlflow_uri) == cold["quick"]
        quick_data = pool._data[0]
        assert _rows(QUICKSTART, ["rounds=3"], mlflow_uri) == cold["quick"]
        assert pool._data[0] is quick_data and len(pool._data) == 2  # put once, the last two
        again = _rows(BYZANTINE, BYZ, mlflow_uri)
        # two workers; two workers and the server, twice (a mixer of no CPU ends no idle
        # actor); the four
        assert pool.reused == 2 + 3 + 3 + 4 and pool.idle("server") == 2  # a server, a mixer
    assert current_pool() is None
    assert first == cold["byz"] and again == cold["byz"]
    assert len(cold["byz"]["eval/test_accuracy"]) == 3


def _pid(handle) -> int:
    import ray

    return ray.get(handle.__ray_call__.remote(lambda self: os.getpid()))


def test_an_idle_worker_killed_is_replaced_and_the_next_run_is_unchanged(ray_backend,
                                                                          mlflow_uri, caplog):
    with warm_pool() as pool:
        before = _rows(QUICKSTART, ["rounds=2"], mlflow_uri)
        key = next(k for k in pool._idle if k[0] is ClientWorker)
        victim = pool._idle[key][-1]  # the one the next run takes first
        os.kill(_pid(victim), signal.SIGKILL)
        time.sleep(1.0)
        after = _rows(QUICKSTART, ["rounds=2"], mlflow_uri)
        assert after == before
        assert pool.reused == 2  # the other worker and the server; a new worker started
        assert pool.idle("worker") == 2
        assert "idle ClientWorker of the warm pool is gone" in caplog.text


def test_a_worker_killed_during_a_pooled_run_is_replaced_in_the_run(ray_backend, mlflow_uri):
    """A reused worker lost mid-run: its clients move (as without a pool) and the numbers
    stay; the dead actor is not kept, and the next run starts a new one, unchanged."""
    from simulator.run.callbacks import Callback

    class KillAfterFirstRound(Callback):
        def __init__(self, pid):
            self.pid = pid

        def on_round(self, run, round_, metrics):
            if self.pid:
                os.kill(self.pid, signal.SIGKILL)
                self.pid = 0

    with warm_pool() as pool:
        cold = _rows(QUICKSTART, ["rounds=3"], mlflow_uri)
        key = next(k for k in pool._idle if k[0] is ClientWorker)
        pid = _pid(pool._idle[key][0])
        result = run_loaded(load(QUICKSTART, ["rounds=3"]), "ray", tracking_uri=mlflow_uri,
                            quiet=True, workers=2, callbacks=[KillAfterFirstRound(pid)])
        assert result.runs[0]["final_test_accuracy"] == cold["eval/test_accuracy"][-1][1]
        assert pool.idle("worker") == 1  # the dead one was not kept
        assert _rows(QUICKSTART, ["rounds=3"], mlflow_uri) == cold
        assert pool.idle("worker") == 2


def test_actors_of_other_options_end_the_idle_ones_and_a_sweep_gets_the_cpus(ray_backend,
                                                                             mlflow_uri):
    with warm_pool() as pool:
        _rows(QUICKSTART, ["rounds=1"], mlflow_uri)
        keys = {k for k in pool._idle if k[0] is ClientWorker}
        # workers of 1 CPU each hold both of the instance's CPUs: workers of 0.5 CPU need
        # them ended first
        _rows(QUICKSTART, ["rounds=1", "runtime.num_cpus=0.5"], mlflow_uri)
        now = {k for k in pool._idle if k[0] is ClientWorker}
        assert now.isdisjoint(keys) and pool.idle("worker") == 2
        assert any(k[0] is Server for k in pool._idle)  # the server's options did not change
        # a sweep's Ray tasks (1 CPU each) need every idle actor's CPU
        out = run_sweep(load(QUICKSTART, ["rounds=1", "seeds=[0, 1]"]), tracking_uri=mlflow_uri)
        assert len(out.runs) == 2 and not out.failed
        assert pool.idle() == 0


def test_a_pool_on_one_ray_refuses_another_address(ray_backend):
    with warm_pool():
        with pytest.raises(UsageError, match="--address 10.0.0.1:6379: this process's warm "
                                             "pool runs on a local Ray instance"):
            RayBackend("10.0.0.1:6379")
        with warm_pool() as inner, pytest.raises(UsageError):  # the same pool
            inner.check_address("10.0.0.1:6379")


class _Rt:
    workers, num_gpus, device, server_device, num_cpus, threads = None, None, "cpu", "cpu", 1, 1


class _Work:
    rounds, seconds = 30, 8.0

    def text(self):
        return "8 s"


def test_auto_counts_only_the_actors_a_warm_pool_cannot_give(monkeypatch):
    """Ray's start for auto: 2 workers and the server start a process each on a cold
    instance; with 2 idle workers and an idle server none does."""
    monkeypatch.setattr(backend_module, "ray_running", lambda: True)
    cold = choose_backend("auto", [_Rt()], cpus=2, estimate=_Work)
    pool = WarmPool()
    pool._idle = {(ClientWorker, "worker", "[]", True): [1, 2],
                  (Server, "server", "[]", False): [3]}
    monkeypatch.setattr(backend_module, "current_pool", lambda: pool)
    warm = choose_backend("auto", [_Rt()], cpus=2, estimate=_Work)
    # S = 2.4 s x 3 actors over 2 cores = 3.6 s cold; none warm: 8 / 2 + 30 x 0.03 = 4.9 s
    assert "on Ray 8.5 s with its start (3.6 s)" in cold.reason and cold.name == "inline"
    assert "on Ray 4.9 s with its start (0.0 s; 3 warm actor(s))" in warm.reason
    assert warm.name == "ray"


def test_deterministic_mode_is_set_both_ways():
    """An actor a warm pool kept may have run a deterministic point before a
    non-deterministic one: the mode is this run's, not the last one's."""
    before = torch.are_deterministic_algorithms_enabled()
    try:
        deterministic_mode(True)
        assert torch.are_deterministic_algorithms_enabled()
        deterministic_mode(False)
        assert not torch.are_deterministic_algorithms_enabled()
        assert not torch.backends.cudnn.deterministic
    finally:
        torch.use_deterministic_algorithms(before)


def test_the_default_mode_costs_no_import():
    """torch.use_deterministic_algorithms imports torch._inductor and torch._dynamo (1.2 s
    here): a process of the default mode (false) never calls it."""
    import subprocess
    import sys

    code = ("import sys; from simulator.runtime.common import deterministic_mode; "
            "deterministic_mode(False); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"

