"""Faults that used to lose or block runs (issue: hardening): a Ray cluster left on the machine,
concurrent first runs on a fresh store, interrupts, a hung tracking store, resume after an
outage, a plugin that raises, a checkpoint that does not load."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from fedray.cli import main
from simulator.config.load import load
from simulator.metric_names import mlflow_name
from simulator.run import tracking
from simulator.run.resume import resume_run
from simulator.run.runner import run_loaded
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
FEDRAY = [sys.executable, "-m", "fedray"]
QUICK = str(ROOT / "scenarios" / "quickstart.yaml")

TWO_POINTS = """\
name: two
rounds: 6
data:
  dataset: {name: digits}
model: {name: logreg}
clients: {total: 8, per_round: 5}
local: {steps: 2, batch_size: 16, lr: 0.2}
runtime: {backend: inline, checkpoint_every: 2}
sweep:
  aggregator.name: [mean, median]
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _statuses(uri: str, experiment: str) -> dict[str, str]:
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return {r.info.run_id: r.info.status for r in client.search_runs([exp.experiment_id])}


# ----------------------------------------------------------------------------- 1. Ray default


@pytest.mark.cluster
def test_run_starts_its_own_ray_beside_a_ray_start_cluster_live_or_dead(tmp_path):
    """`ray start --head` records its address on the machine; a bare ray.init() joined it
    (and hung once its head was dead). fedray starts a local instance unless --address is
    given; an --address it cannot join (token auth without the token, or a head that is
    gone: ray.init retried that for 15 minutes) is one line."""
    ray_tmp = tempfile.mkdtemp(prefix="fr", dir="/tmp")  # short: Ray's socket paths
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    port = _free_port()
    ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
    head = subprocess.Popen(
        [ray_bin, "start", "--head", "--block", "--port", str(port), "--node-ip-address",
         "127.0.0.1", "--num-cpus", "1", "--disable-usage-stats"],
        env={**env, "RAY_AUTH_MODE": "token"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        record = Path(ray_tmp) / "ray" / "ray_current_cluster"
        while not record.exists() and time.monotonic() < deadline:
            time.sleep(0.3)
        assert record.exists(), "ray start did not record its cluster"
        run = ["run", QUICK, "--set", "rounds=1", "--quiet", "--workers", "1"]
        live = subprocess.run([*FEDRAY, *run, "--backend", "ray"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300, check=False)
        assert live.returncode == 0, live.stderr[-2000:]
        assert "Started a local Ray instance" in live.stderr
        assert "Connecting to existing Ray cluster" not in live.stderr
        # runtime.backend: auto runs this one-round, one-worker run inline, Ray untouched
        live = subprocess.run([*FEDRAY, *run], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300, check=False)
        assert live.returncode == 0, live.stderr[-2000:]
        assert "Ray" not in live.stderr

        joined = subprocess.run([*FEDRAY, *run, "--address", f"127.0.0.1:{port}"], cwd=tmp_path,
                                env={**env, "RAY_AUTH_MODE": "disabled"}, capture_output=True,
                                text=True, timeout=300, check=False)
        assert joined.returncode == 2  # an address to fix: a user error
        ours = [line for line in joined.stderr.splitlines() if line.startswith("fedray")]
        assert len(ours) == 1 and "cannot connect to the Ray cluster" in ours[0]
        assert "RAY_AUTH_MODE=token" in ours[0] and "Traceback" not in joined.stderr
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # the head dies as a crashed one does
        head.wait(timeout=60)
    # the record of a dead head stays: the backend still starts its own instance (it hung)
    probe = ("from simulator.runtime.backend import RayBackend; b = RayBackend(num_cpus=1); "
             "print('nodes', b.num_nodes(), b.ray.get_runtime_context().gcs_address); b.shutdown()")
    dead = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert dead.returncode == 0, dead.stderr[-2000:]
    assert dead.stdout.startswith("nodes 1 ") and f":{port}" not in dead.stdout
    gone = subprocess.run([*FEDRAY, *run, "--address", f"127.0.0.1:{port}"], cwd=tmp_path,
                          env={**env, "RAY_AUTH_MODE": "disabled"}, capture_output=True,
                          text=True, timeout=120, check=False)
    assert gone.returncode == 2  # the address the user gave, checked before anything runs
    ours = [line for line in gone.stderr.splitlines() if line.startswith("fedray")]
    assert len(ours) == 1 and f"--address 127.0.0.1:{port}: nothing answers there" in ours[0]
    assert "(Connection refused)" in ours[0] and "Traceback" not in gone.stderr
    shutil.rmtree(ray_tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- 3. the store


def test_concurrent_first_runs_share_a_fresh_store(tmp_path):
    """Three `fedray run` at once in a folder without mlflow.db: one creates the store, under
    a lock; the others wait, and all three finish."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    procs = [subprocess.Popen([*FEDRAY, "run", QUICK, "--backend", "inline", "--set", "rounds=1",
                               "--set", f"seeds=[{i}]", "--quiet"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(3)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    statuses = _statuses(uri, "quickstart")
    assert len(statuses) == 6 and set(statuses.values()) == {"FINISHED"}


def test_a_store_broken_by_an_interrupted_migration_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with sqlite3.connect(tmp_path / "mlflow.db") as conn:
        conn.execute("CREATE TABLE _alembic_tmp_runs (x INTEGER)")
    assert main(["run", QUICK, "--backend", "inline", "--set", "rounds=1", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is broken" in err[0] and "_alembic_tmp_runs" in err[0]


def test_a_tracking_server_down_at_start_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    uri = f"http://127.0.0.1:{_free_port()}"
    assert main(["run", QUICK, "--set", "rounds=1", "--quiet", "--tracking-uri", uri]) == 2
    # MLflow opens while Ray starts (start-up overlapped): Ray's own start line may come first
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if "Started a local Ray instance" not in line]
    assert len(err) == 1 and f"tracking store {uri} cannot be reached" in err[0]


# ----------------------------------------------------------------------------- 6. signals


@pytest.mark.parametrize("sig,backend", [(signal.SIGINT, "inline"), (signal.SIGTERM, "ray")],
                         ids=["sigint-inline", "sigterm-ray"])
def test_a_signal_marks_the_runs_killed_and_prints_how_to_resume(tmp_path, mlflow_uri, sig,
                                                                  backend):
    # the default SIGINT disposition in the child: a shell's background job (a CI script run
    # with &) ignores SIGINT, which its children inherit, and Python then installs no
    # KeyboardInterrupt handler (the run went on to its end)
    proc = subprocess.Popen([*FEDRAY, "run", QUICK, "--backend", backend, "--set", "rounds=400",
                             "--quiet"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            # one signal() call before exec: safe beside threads
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    client = MlflowClient(mlflow_uri)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        exp = client.get_experiment_by_name("quickstart")
        runs = client.search_runs([exp.experiment_id], "tags.`fedray.kind` = 'point'") if exp \
            else []
        if runs and client.get_metric_history(runs[0].info.run_id, mlflow_name("test_accuracy")):
            break
        time.sleep(0.3)
    assert proc.poll() is None, "the run ended before the signal"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig
    assert "Traceback" not in err
    # Ray's notice that a local instance has token authentication on, its default, is gone
    assert "Token authentication is enabled" not in err and " ERROR " not in err
    ours = [line for line in err.splitlines() if line.startswith("fedray run:")]
    assert len(ours) == 1 and f"interrupted by {signal.Signals(sig).name}" in ours[0]
    statuses = _statuses(mlflow_uri, "quickstart")
    assert sorted(statuses.values()) == ["KILLED", "KILLED"]
    child = next(r for r in statuses if f"`fedray resume {r}`" in ours[0])
    assert f"({child}) marked KILLED" in ours[0]


# ----------------------------------------------------------------------------- 7. plugin bugs


def test_an_aggregator_that_raises_fails_the_run_naming_it(tmp_path, mlflow_uri, capsys,
                                                           monkeypatch):
    """Server.step took every ValueError of the pipeline for "too few rows": an aggregator that
    always raised gave a FINISHED run whose model never moved."""
    import strategies.aggregators as aggs

    def broken(self, x, generator=None, weights=None):  # the weighted signature
        raise ValueError("boom in the rule")

    monkeypatch.setattr(aggs.CoordinateWiseMedian, "__call__", broken)
    code = main(["run", QUICK, "--backend", "inline", "--set", "rounds=2", "--set",
                 "aggregator={name: median}", "--quiet"])
    assert code == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fedray")]
    assert len(err) == 1
    assert "aggregator 'median' raised ValueError: boom in the rule" in err[0]
    assert "marked FAILED" in err[0]
    assert sorted(_statuses(mlflow_uri, "quickstart").values()) == ["FAILED", "FAILED"]


def test_too_few_rows_still_skips_the_round(tmp_path):
    """Dropouts that leave a round fewer rows than the rule takes skip that round only."""
    p = tmp_path / "s.yaml"
    p.write_text(TWO_POINTS.replace("sweep:\n  aggregator.name: [mean, median]\n", "")
                 .replace("clients: {total: 8, per_round: 5}",
                          "clients: {total: 8, per_round: 8, dropout: 0.45}")
                 + "aggregator: {name: cwtm, f: 2}\n")
    result = Engine(load(p).points[0].scenario, InlineBackend()).run()
    skipped = [m["aggregation_skipped"] for m in result.metrics]
    assert 0 < sum(skipped) < len(skipped)


# ----------------------------------------------------------------------------- 4, 5. resume


def _interrupt_at(monkeypatch, label: str, round_: int) -> None:
    """Ctrl-C (KeyboardInterrupt) in the round loop of point ``label`` after ``round_``."""
    from simulator.run import progress

    real = progress.ProgressLine.update

    def update(self, r, metrics):
        real(self, r, metrics)
        if self.label == label and r == round_:
            raise KeyboardInterrupt

    monkeypatch.setattr(progress.ProgressLine, "update", update)


def _interrupted(monkeypatch, tmp_path, loaded, label: str, round_: int, uri: str):
    """Run ``loaded``, Ctrl-C after ``round_`` of point ``label``; (client, its point run)."""
    _interrupt_at(monkeypatch, label, round_)
    with pytest.raises(KeyboardInterrupt):
        run_loaded(loaded, quiet=True)
    monkeypatch.undo()  # also the fixture's chdir: back into the test's folder
    monkeypatch.chdir(tmp_path)
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(loaded.scenario.name)
    (child,) = client.search_runs([exp.experiment_id], "tags.`fedray.kind` = 'point'")
    return client, child


def test_resume_of_one_point_finishes_the_parent_and_refuses_a_finished_run(
        tmp_path, mlflow_uri, monkeypatch):
    p = tmp_path / "two.yaml"
    p.write_text(TWO_POINTS)
    loaded = load(p)
    client, child = _interrupted(monkeypatch, tmp_path, loaded, "mean seed=0", 3, mlflow_uri)
    exp = client.get_experiment_by_name("two")
    parent = child.data.tags["mlflow.parentRunId"]
    assert child.info.status == "KILLED" and client.get_run(parent).info.status == "KILLED"

    out = resume_run(child.info.run_id)
    assert [r["label"] for r in out.runs] == ["mean seed=0", "median seed=0"]
    assert client.get_run(parent).info.status == "FINISHED"
    children = client.search_runs([exp.experiment_id], "tags.`fedray.kind` = 'point'")
    assert sorted(c.info.status for c in children) == ["FINISHED", "FINISHED"]
    for point in loaded.points:  # every round exactly once, the uninterrupted numbers
        run = next(c for c in children if c.info.run_name == point.label)
        full = Engine(point.scenario, InlineBackend()).run()
        hist = sorted(client.get_metric_history(run.info.run_id, mlflow_name("test_accuracy")),
                      key=lambda m: m.step)
        assert [m.step for m in hist] == list(range(6))
        assert [m.value for m in hist] == [row["test_accuracy"] for row in full.metrics]

    assert main(["resume", child.info.run_id]) == 2  # FINISHED: refused in one line
    for run_id in (child.info.run_id, parent):
        from simulator.run.resume import ResumeRefused

        with pytest.raises(ResumeRefused, match="is FINISHED: nothing to resume"):
            resume_run(run_id)


@pytest.mark.parametrize("slow_sender", [False, True], ids=["sender-keeps-up", "sender-behind"])
def test_resume_sends_the_journal_first_so_every_step_is_logged_once(
        tmp_path, mlflow_uri, monkeypatch, slow_sender):
    """An outage journals rounds 3.. (the store refuses every batch holding one), the driver
    dies after round 5 with a checkpoint after round 4; resume before `fedray sync` first
    sends the journal, then logs only the rounds nobody holds. A background sender that
    falls behind the rounds (a loaded machine) leaves rounds 1-5 to one batch, which the
    store refuses whole: then the journal holds them all (this once failed the test, not
    the run; reproduced with a sender held back by 1 s)."""
    p = tmp_path / "one.yaml"
    p.write_text(TWO_POINTS.replace("sweep:\n  aggregator.name: [mean, median]\n", ""))
    loaded = load(p)
    real = MlflowClient.log_batch

    def outage(self, run_id, metrics=(), params=(), tags=(), synchronous=None):
        if any(m.step >= 3 for m in metrics):  # the store goes away during round 4
            raise ConnectionError("tracking server down")
        return real(self, run_id, metrics=metrics, params=params, tags=tags)

    monkeypatch.setattr(MlflowClient, "log_batch", outage)
    if slow_sender:  # the background sender never gets to send: the end sends it all
        real_flush = tracking.Tracker.flush

        def behind(self, run_id, wait=0.0, force=False):
            return False if wait is None else real_flush(self, run_id, wait, force)

        monkeypatch.setattr(tracking.Tracker, "flush", behind)
    client, child = _interrupted(monkeypatch, tmp_path, loaded, "seed=0", 4, mlflow_uri)
    run_id = child.info.run_id
    sent = {m.step for m in client.get_metric_history(run_id, mlflow_name("test_accuracy"))}
    journaled = tracking.journaled_steps(run_id)
    assert sent <= {0, 1, 2} and journaled >= {3, 4} and sent | journaled == set(range(5))
    if slow_sender:
        assert sent == set()

    resume_run(run_id)
    full = Engine(loaded.points[0].scenario, InlineBackend()).run()
    for key in ("test_accuracy", "sampled"):
        hist = sorted(client.get_metric_history(run_id, mlflow_name(key)), key=lambda m: m.step)
        assert [m.step for m in hist] == list(range(6)), key
        assert [m.value for m in hist] == [row[key] for row in full.metrics]
    assert tracking.pending() == {}
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_hung_store_does_not_hold_the_round_loop(tmp_path, mlflow_uri, monkeypatch, capsys):
    """log_batch blocks until the test lets it go, as against a SIGSTOPped server: the run
    still finishes (the rounds never wait for it), says what is pending and how to send it,
    and after `fedray sync` every round is in MLflow once."""
    release = threading.Event()
    real = MlflowClient.log_batch

    def hung(self, run_id, metrics=(), params=(), tags=(), synchronous=None):
        if metrics:
            release.wait(120)
            raise ConnectionError("read timed out")
        return real(self, run_id, metrics=metrics, params=params, tags=tags)

    monkeypatch.setattr(MlflowClient, "log_batch", hung)
    monkeypatch.setattr(tracking, "END_WAIT_SECONDS", 1.0)
    done: list[int] = []
    runner = threading.Thread(target=lambda: done.append(main(
        ["run", QUICK, "--backend", "inline", "--set", "rounds=5", "--quiet"])), daemon=True)
    runner.start()
    runner.join(timeout=110)  # well before log_batch would give up by itself
    assert not runner.is_alive() and done == [0], "the run waited for the hung store"
    t_release = time.time_ns()
    release.set()
    # the sender's blocked call fails and journals again (the same rows): sync after that,
    # not while the journal file is being rewritten
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(
            f.stat().st_mtime_ns >= t_release
            for f in (tmp_path / ".fedray" / "pending").glob("*/metrics-*.parquet")):
        time.sleep(0.05)
    err = capsys.readouterr().err
    assert "not yet in MLflow" in err and "fedray sync" in err
    monkeypatch.setattr(MlflowClient, "log_batch", real)
    client = MlflowClient(mlflow_uri)
    exp = client.get_experiment_by_name("quickstart")
    (child,) = client.search_runs([exp.experiment_id], "tags.`fedray.kind` = 'point'")
    assert main(["sync"]) == 0
    hist = client.get_metric_history(child.info.run_id, mlflow_name("test_accuracy"))
    assert sorted(m.step for m in hist) == list(range(5))
    assert client.get_run(child.info.run_id).info.status == "FINISHED"


def test_a_checkpoint_that_does_not_load_is_one_line(tmp_path, mlflow_uri, monkeypatch, capsys):
    p = tmp_path / "one.yaml"
    p.write_text(TWO_POINTS.replace("sweep:\n  aggregator.name: [mean, median]\n", ""))
    _interrupt_at(monkeypatch, "seed=0", 2)
    with pytest.raises(KeyboardInterrupt):
        run_loaded(load(p), quiet=True)
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    (ckpt,) = tmp_path.glob(".fedray/checkpoints/*/round_*.pt")
    ckpt.write_bytes(b"not a checkpoint")
    capsys.readouterr()
    assert main(["resume", ckpt.parent.name]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "cannot be read" in err[0] and "weights_only" not in err[0]
    np.testing.assert_equal(ckpt.exists(), True)  # nothing was removed


def test_an_interrupt_in_a_run_points_end_marks_it_killed(tmp_path, mlflow_uri):
    """`fedray run`: Ctrl-C while a finished point's end is logged marks it KILLED (an end
    that raises an error marks it FAILED), and the command names it."""
    from simulator.run.callbacks import Callback
    from simulator.run.interrupts import unfinished_of

    class Ends(Callback):
        def __init__(self, error):
            self.error = error

        def on_end(self, run, result, status):
            raise self.error

    p = tmp_path / "one.yaml"
    p.write_text(TWO_POINTS.replace("sweep:\n  aggregator.name: [mean, median]\n", ""))
    client = MlflowClient(mlflow_uri)
    for error, status in ((KeyboardInterrupt(), "KILLED"), (RuntimeError("end"), "FAILED")):
        with pytest.raises(type(error)) as e:
            run_loaded(load(p), tracking_uri=mlflow_uri, quiet=True, callbacks=[Ends(error)])
        (run_id, label, said), *_ = unfinished_of(e.value)
        assert (label, said) == ("seed=0", status)
        assert client.get_run(run_id).info.status == status
