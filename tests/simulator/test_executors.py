"""``simulator.executors``: the pool executor's last point on a local Ray instance, whose
shutdown runs on a thread while the point's ends are logged."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

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
