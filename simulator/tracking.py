"""MLflow tracking, in the driver only (actors return metrics; MLflow stays out of them).

One parent run per ``fedray run`` and one child run per sweep point x seed. Per-round metrics
go in one ``log_batch`` per round (single ``log_metric`` calls cost ~12 ms each on SQLite).

A tracking outage never loses a number and never stops a run: metrics that could not be sent
are kept, written to a local journal (``.fedray/pending/<run_id>/metrics-<pid>.parquet``) and
resent with the next round's batch; artifacts and a run's final status that could not be sent
go to the same journal. ``fedray sync`` replays whatever a run left there (after the process
ended, say). Against a tracking server, MLflow's own HTTP retries are shortened so that a run
goes on within seconds while the server is down.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

import simulator

PENDING = Path(".fedray") / "pending"
PARAMS_PER_BATCH = 100
# MLflow's HTTP defaults retry for minutes; a simulation journals and resends with the next
# round instead (set unless the user did)
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
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

    def __init__(self, uri: str, experiment: str, journal: Path | None = None) -> None:
        if uri.startswith(("http://", "https://")):
            for k, v in HTTP_DEFAULTS.items():
                os.environ.setdefault(k, v)
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.journal = (journal or Path.cwd()) / PENDING
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            try:
                self.experiment_id = self.client.create_experiment(
                    experiment, artifact_location=artifact_root(uri))
            except Exception:
                # another process created it first (several runs starting at once)
                exp = self.client.get_experiment_by_name(experiment)
                if exp is None:
                    raise
                self.experiment_id = exp.experiment_id
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

    def _journal_file(self, run_id: str) -> Path:
        return self.journal / run_id / f"metrics-{os.getpid()}.parquet"

    def _warn(self, what: str, e: Exception) -> None:
        self.failures += 1
        if self.failures <= 3:
            print(f"fedray: MLflow {what} failed ({type(e).__name__}: {str(e)[:200]}); kept in "
                  f"{self.journal} and sent later (or by `fedray sync`)", file=sys.stderr)

    def flush(self, run_id: str) -> bool:
        """Send the run's pending metrics; on failure keep them (memory and journal)."""
        pending = self._pending.get(run_id, [])
        journal = self._journal_file(run_id)
        try:
            while pending:
                self.client.log_batch(run_id, metrics=pending[:METRICS_PER_BATCH])
                del pending[:METRICS_PER_BATCH]
        except Exception as e:  # noqa: BLE001 - tracking outage: keep the numbers, go on
            self._warn("log_batch", e)
            _write_journal(journal, pending, self.uri)
            return False
        journal.unlink(missing_ok=True)
        return True

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
        """Log a file; while the tracking store is unreachable, keep a copy in the journal."""
        try:
            self.client.log_artifact(run_id, str(path), artifact_path)
        except Exception as e:  # noqa: BLE001 - tracking outage
            self._warn("log_artifact", e)
            dest = self.journal / run_id / "artifacts" / (artifact_path or "") / Path(path).name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)
            (self.journal / run_id / "tracking_uri").write_text(self.uri)

    def end(self, run_id: str, status: str = "FINISHED") -> None:
        """Flush and set the final status (kept in the journal while the store is down)."""
        sent = self.flush(run_id)
        try:
            if not sent:
                raise ConnectionError("metrics still pending")
            self.client.set_terminated(run_id, status=status)
        except Exception as e:  # noqa: BLE001 - tracking outage
            self._warn("set_terminated", e)
            d = self.journal / run_id
            d.mkdir(parents=True, exist_ok=True)
            (d / "status").write_text(status)
            (d / "tracking_uri").write_text(self.uri)
            return
        _remove_if_empty(self.journal / run_id)


def _write_journal(path: Path, metrics: list[Any], uri: str) -> None:
    """The pending metrics of one process for one run, as Parquet (rewritten whole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"key": [m.key for m in metrics], "value": [float(m.value) for m in metrics],
                      "timestamp": [int(m.timestamp) for m in metrics],
                      "step": [int(m.step) for m in metrics]})
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    (path.parent / "tracking_uri").write_text(uri)


def _remove_if_empty(d: Path) -> None:
    if d.is_dir() and not any(p for p in d.rglob("*") if p.is_file() and p.name != "tracking_uri"):
        shutil.rmtree(d, ignore_errors=True)


def sync(base: Path | None = None, uri: str | None = None) -> dict[str, int]:
    """Replay the journal under ``base`` (default: the working directory): pending metrics,
    artifacts and final statuses, each to the tracking URI it was meant for (or ``uri``).
    What is sent is removed; what still fails stays. Returns counts."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    root = (base or Path.cwd()) / PENDING
    out = {"runs": 0, "metrics": 0, "artifacts": 0, "statuses": 0, "failed_runs": 0}
    for d in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        run_id = d.name
        target = uri or (d / "tracking_uri").read_text().strip()
        client = MlflowClient(tracking_uri=target)
        try:
            for f in sorted(d.glob("metrics-*.parquet")):
                rows = pq.read_table(f).to_pylist()
                batch = [Metric(r["key"], r["value"], r["timestamp"], r["step"]) for r in rows]
                for i in range(0, len(batch), METRICS_PER_BATCH):
                    client.log_batch(run_id, metrics=batch[i : i + METRICS_PER_BATCH])
                out["metrics"] += len(batch)
                f.unlink()
            art = d / "artifacts"
            for f in sorted(p for p in art.rglob("*") if p.is_file()) if art.is_dir() else []:
                rel = f.parent.relative_to(art).as_posix()
                client.log_artifact(run_id, str(f), None if rel == "." else rel)
                out["artifacts"] += 1
                f.unlink()
            if (d / "status").exists():
                client.set_terminated(run_id, status=(d / "status").read_text().strip())
                out["statuses"] += 1
                (d / "status").unlink()
        except Exception as e:  # noqa: BLE001 - still unreachable: keep it for next time
            print(f"fedray sync: run {run_id}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
            out["failed_runs"] += 1
            continue
        out["runs"] += 1
        _remove_if_empty(d)
    return out


def write_metrics(rows: list[dict[str, float]], path: Path) -> Path:
    """Per-round metrics as Parquet: one row per round, a ``round`` column first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = ["round"] + sorted({k for r in rows for k in r})
    cols = {k: [float(r.get(k, float("nan"))) if k != "round" else i for i, r in enumerate(rows)]
            for k in keys}
    pq.write_table(pa.table(cols), path)
    return path
