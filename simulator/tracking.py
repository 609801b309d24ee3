"""MLflow tracking, in the driver only (actors return metrics; MLflow stays out of them).

One parent run per ``fedray run`` and one child run per sweep point x seed. Per-round metrics
go in one ``log_batch`` per round (single ``log_metric`` calls cost ~12 ms each on SQLite). A
failed MLflow call never loses a number: batches that could not be sent are kept and resent
before the next one and when the run ends, and every run's metrics are also written to a local
Parquet file that is logged as an artifact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

import simulator

PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000
PARAM_VALUE_MAX = 6000


def default_uri(cwd: Path | None = None) -> str:
    """``MLFLOW_TRACKING_URI`` if set, else the embedded store ``sqlite:///<cwd>/mlflow.db``."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{(cwd or Path.cwd()).resolve() / 'mlflow.db'}"


def artifact_root(uri: str) -> str | None:
    """Artifacts of an embedded SQLite store go beside the DB file (``mlartifacts/``)."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").resolve().as_uri()
    return None


def flatten(d: Any, prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}``; lists as JSON."""
    out: dict[str, str] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        if not d and prefix:
            out[prefix[:-1]] = "{}"
        return out
    value = d if isinstance(d, str) else json.dumps(d)
    out[prefix[:-1]] = value[:PARAM_VALUE_MAX]
    return out


def git_commit() -> str:
    """The commit of the fedray source tree, or 'unknown' (installed from a wheel)."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(simulator.__file__).parent, capture_output=True,
            text=True, timeout=5, check=True,
        ).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


class Tracker:
    """Thin layer over ``MlflowClient`` for fedray's parent/child run layout."""

    def __init__(self, uri: str, experiment: str) -> None:
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=artifact_root(uri))
        else:
            self.experiment_id = exp.experiment_id
        self._pending: dict[str, list[Any]] = {}
        self.failures = 0

    @classmethod
    def of_run(cls, uri: str, run_id: str) -> Tracker:
        """The tracker of an existing run's experiment (a missing run: ValueError)."""
        from mlflow.tracking import MlflowClient

        try:
            run = MlflowClient(tracking_uri=uri).get_run(run_id)
        except Exception as e:  # MLflow raises its own exception types
            raise ValueError(f"no run {run_id!r} in {uri}") from e
        return cls(uri, MlflowClient(tracking_uri=uri).get_experiment(run.info.experiment_id).name)

    def create_run(self, name: str, tags: dict[str, str], parent_id: str | None = None,
                   description: str = "") -> str:
        tags = {k: str(v) for k, v in tags.items()}
        tags["mlflow.runName"] = name
        if description:
            tags["mlflow.note.content"] = description
        if parent_id:
            tags["mlflow.parentRunId"] = parent_id
        run = self.client.create_run(self.experiment_id, tags=tags, run_name=name)
        return run.info.run_id

    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k[:250], v) for k, v in params.items()]
        for i in range(0, len(items), PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=items[i : i + PARAMS_PER_BATCH])

    def log_round(self, run_id: str, step: int, metrics: dict[str, float]) -> None:
        """One batch per round; on failure the batch is kept and resent later."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        batch = [Metric(k, float(v), ts, step) for k, v in metrics.items()]
        self._pending.setdefault(run_id, []).extend(batch)
        self.flush(run_id)

    def flush(self, run_id: str) -> bool:
        pending = self._pending.get(run_id, [])
        try:
            while pending:
                self.client.log_batch(run_id, metrics=pending[:METRICS_PER_BATCH])
                del pending[:METRICS_PER_BATCH]
            return True
        except Exception as e:  # noqa: BLE001 - tracking outage: keep the numbers, go on
            self.failures += 1
            if self.failures <= 3:
                print(f"fedray: MLflow log_batch failed ({type(e).__name__}: {e}); "
                      f"{len(pending)} metric values kept for retry", file=sys.stderr)
            return False

    def log_history(self, run_id: str, rows: list[dict[str, float]]) -> None:
        """A whole run's per-round metrics (row i = step i), in batches of up to 1000 values."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self._pending.setdefault(run_id, []).extend(
            Metric(k, float(v), ts, step) for step, row in enumerate(rows) for k, v in row.items())
        self.flush(run_id)

    def find_run(self, tags: dict[str, str]) -> str | None:
        """The most recent run of this experiment carrying every one of ``tags``."""
        query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        runs = self.client.search_runs([self.experiment_id], filter_string=query,
                                       order_by=["attributes.start_time DESC"], max_results=1)
        return runs[0].info.run_id if runs else None

    def children(self, parent_id: str) -> list[Any]:
        """Every child run of ``parent_id``."""
        return self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
            max_results=50_000)

    def reopen(self, run_id: str) -> None:
        """Mark a run RUNNING again (a resumed sweep goes on in the same parent run)."""
        self.client.update_run(run_id, status="RUNNING")

    def log_artifact(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def end(self, run_id: str, status: str = "FINISHED") -> None:
        self.flush(run_id)
        self.client.set_terminated(run_id, status=status)


def write_metrics(rows: list[dict[str, float]], path: Path) -> Path:
    """Per-round metrics as Parquet: one row per round, a ``round`` column first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = ["round"] + sorted({k for r in rows for k in r})
    cols = {k: [float(r.get(k, float("nan"))) if k != "round" else i for i, r in enumerate(rows)]
            for k in keys}
    pq.write_table(pa.table(cols), path)
    return path
