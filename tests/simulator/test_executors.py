"""``simulator.run.executors``: the pool executor's last point on a local Ray instance, whose
shutdown runs on a thread while the point's ends are logged."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[2]


def test_a_one_round_run_on_ray_ends_cleanly_while_ray_shuts_down(tmp_path, _mlflow_template):
    """The ends of a run that asks for no MLflow model take milliseconds, so Ray is still
    shutting down on its thread when the command returns: the engine's actor handles must be
    gone by then (one released during the shutdown made Ray's core worker end the process
    with status 1, after everything was logged)."""
    shutil.copy(_mlflow_template, tmp_path / "mlflow.db")
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("MLFLOW_TRACKING_URI", None)
    r = subprocess.run([sys.executable, "-m", "fedray", "run",
                        str(ROOT / "scenarios" / "quickstart.yaml"), "--set", "rounds=1",
                        "--set", "clients.per_round=4", "--backend", "ray", "--workers", "1",
                        "--quiet"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "core worker has already been shutdown" not in r.stderr
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("quickstart")
    (child,) = client.search_runs([exp.experiment_id], "tags.`fedray.kind` = 'point'")
    assert child.info.status == "FINISHED"
    assert [a.path for a in client.list_artifacts(child.info.run_id, "model")] == [
        "model/model.pt"]
    assert [a.path for a in client.list_artifacts(child.info.run_id, "figures")] == [
        "figures/curves.svg"]


def test_the_autoscaler_monitor_is_ended_before_ray_shuts_down():
    """Ray's shutdown waits a second for its autoscaler monitor: a local instance's monitor,
    a child of this process found by its command line, is killed first; other children are
    left alone."""
    from simulator.runtime.backend import MONITOR, stop_autoscaler_monitor

    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    monitor = subprocess.Popen([*sleep, f"/x/ray/{MONITOR.decode()}", "--logs-dir=/x"])
    other = subprocess.Popen([*sleep, "ray/_private/log_monitor.py"])
    try:
        stop_autoscaler_monitor()
        assert monitor.wait(timeout=10) == -9
        assert other.poll() is None
    finally:
        for p in (monitor, other):
            p.kill()
            p.wait()


def _scenario(**sets: object):
    from simulator.config.load import load

    return load(ROOT / "scenarios" / "quickstart.yaml",
                [f"{k}={v}" for k, v in sets.items()]).points[0].scenario


def test_the_data_prefetched_while_ray_starts_is_the_data_the_engine_gets(monkeypatch):
    """``fedray run`` loads the first point's data on a thread while Ray starts: a build
    still running when the engine asks waits, and is done once (the engine gets its very
    object, not a second load)."""
    import threading
    import time

    from simulator.sim import engine

    real, calls, started = engine.fdata.build, [], threading.Event()

    def slow_build(*args, **kwargs):
        calls.append(threading.current_thread().name)
        started.set()
        time.sleep(0.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.fdata, "build", slow_build)
    monkeypatch.setattr(engine, "_data_cache", {})
    sc = _scenario(seeds="[11]")
    engine.prefetch_data(sc)
    assert started.wait(10)
    data = engine.load_data(sc)  # waits for the thread's build instead of starting another
    assert len(calls) == 1 and calls[0].startswith("fedray-data")
    assert engine.load_data(sc) is data
    assert data.num_classes == 10 and len(data.y_test) > 0


def test_a_prefetch_that_fails_leaves_the_error_to_the_engines_own_load(monkeypatch, capfd):
    """A data set that cannot be built fails in the engine's own call, in the run it belongs
    to (the thread's future keeps its copy unread: nothing printed, nothing cached)."""
    import threading

    from simulator.sim import engine

    calls, done = [], threading.Event()

    class Broken(Exception):
        pass

    def broken(*args, **kwargs):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            done.set()
        raise Broken("data.dataset: cannot be read")

    monkeypatch.setattr(engine.fdata, "build", broken)
    monkeypatch.setattr(engine, "_data_cache", {})
    sc = _scenario(seeds="[12]")
    engine.prefetch_data(sc)
    assert done.wait(10)
    with pytest.raises(Broken, match="^data.dataset: cannot be read$"):
        engine.load_data(sc)
    assert len(calls) == 2 and calls[1] == threading.current_thread().name
    assert engine._data_cache == {}
    assert "Traceback" not in capfd.readouterr().err
