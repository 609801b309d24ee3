"""Against a real MLflow tracking server on 127.0.0.1 that this module starts: an outage in
the middle of a run loses nothing (`fedray sync` sends what was journaled), and several
`fedray run` processes logging at once lose no metric."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from simulator.metric_names import mlflow_name

FEDRAY = [sys.executable, "-m", "fedray"]

SLOW = """\
name: {name}
rounds: {rounds}
data:
  dataset: {{name: digits}}
model: {{name: mlp, hidden: [256, 256]}}
clients: {{total: 12, per_round: 8}}
local: {{epochs: 2, batch_size: 8, lr: 0.05}}
runtime: {{backend: inline}}
"""


class Server:
    """``mlflow server`` on 127.0.0.1 over a SQLite store; stop() and start() keep the data."""

    def __init__(self, root: Path) -> None:
        self.root = root
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
        self.proc = subprocess.Popen(
            [mlflow, "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("mlflow server did not answer /health in 120 s")

    def stop(self) -> None:
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
            self.proc = None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("mlflow-server"))
    srv.start()
    yield srv
    srv.stop()


def _child(client: MlflowClient, experiment: str):
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], "tags.`fedray.kind` = 'point'") if exp else []
    return runs[0] if runs else None


def test_outage_mid_run_loses_nothing_and_sync_sends_it(server, tmp_path):
    p = tmp_path / "outage.yaml"
    # rounds enough that the outage falls mid-run: the rounds that end before the MLflow run
    # is open (MLflow opens on its own thread) arrive together
    p.write_text(SLOW.format(name="outage", rounds=60))
    env = {**os.environ, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
    run = subprocess.Popen([*FEDRAY, "run", str(p), "--quiet", "--tracking-uri", server.uri],
                           cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    client = MlflowClient(server.uri)
    deadline = time.monotonic() + 180
    child = None
    while time.monotonic() < deadline and run.poll() is None:
        child = _child(client, "outage")
        if child and len(client.get_metric_history(child.info.run_id,
                                                   mlflow_name("test_accuracy"))) >= 3:
            break
        time.sleep(0.2)
    assert child is not None and run.poll() is None, "the run ended before the outage"
    server.stop()  # the tracking server goes away in the middle of the run
    _, err = run.communicate(timeout=600)
    assert run.returncode == 0, err[-3000:]  # the run went on and finished
    assert "kept in" in err
    pending = tmp_path / ".fedray" / "pending" / child.info.run_id
    assert (pending / "status").read_text() == "FINISHED"
    assert list(pending.glob("metrics-*.parquet")) and (pending / "artifacts" / "model").is_dir()

    server.start()
    sync = subprocess.run([*FEDRAY, "sync"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, check=False)
    assert sync.returncode == 0, sync.stderr[-3000:]
    assert "still unreachable" not in sync.stdout
    client = MlflowClient(server.uri)
    run_info = client.get_run(child.info.run_id)
    assert run_info.info.status == "FINISHED"
    for key in ("test_accuracy", "train_loss", "client_loss", "sampled"):
        steps = sorted(m.step for m in client.get_metric_history(child.info.run_id,
                                                                 mlflow_name(key)))
        assert steps == list(range(60)), key  # every round, exactly once
    names = {a.path for a in client.list_artifacts(child.info.run_id)}
    assert {"metrics.parquet", "scenario.yaml", "model"} <= names
    assert not pending.exists()  # the journal is emptied
    assert client.get_run(run_info.data.tags["mlflow.parentRunId"]).info.status == "FINISHED"


def test_concurrent_runs_to_one_server_lose_no_metric(server, tmp_path):
    procs = []
    for i in range(3):
        d = tmp_path / f"p{i}"
        d.mkdir()
        (d / "s.yaml").write_text(SLOW.format(name="concurrent", rounds=8).replace(
            "hidden: [256, 256]", "hidden: [32]"))
        procs.append(subprocess.Popen([*FEDRAY, "run", str(d / "s.yaml"), "--quiet",
                                       "--tracking-uri", server.uri, "--set", f"seeds=[{i}]"],
                                      cwd=d, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    client = MlflowClient(server.uri)
    exp = client.get_experiment_by_name("concurrent")
    children = client.search_runs([exp.experiment_id], "tags.`fedray.kind` = 'point'")
    assert sorted(r.data.tags["seed"] for r in children) == ["0", "1", "2"]
    for r in children:
        assert r.info.status == "FINISHED"
        for key in ("test_accuracy", "test_loss", "sampled"):
            assert sorted(m.step for m in client.get_metric_history(r.info.run_id,
                                                                    mlflow_name(key))) == \
                list(range(8))
