"""MLflow tracking, in the driver only (actors return metrics; MLflow stays out of them).

One parent run per ``fedray run`` and one child run per sweep point x seed. Per-round metrics
go in one ``log_batch`` per round (single ``log_metric`` calls cost ~12 ms each on SQLite).

Per-round metrics leave the round loop at once: a background sender thread sends them, so a
slow or hung tracking server costs the simulation no round time. A tracking outage never loses
a number and never stops a run: metrics that could not be sent are kept, written to a local
journal (``.fedray/pending/<run_id>/metrics-<pid>.parquet``) and resent a few seconds later;
artifacts and a run's final status that could not be sent go to the same journal (directly,
without waiting, while the store is known to be down). ``fedray sync`` replays whatever a run
left there (after the process ended, say). Against a tracking server, MLflow's own HTTP retries
are shortened so that a call fails within seconds while the server is down.

The embedded SQLite store is created once, under a file lock: several ``fedray`` processes
started at once in a fresh folder do not race in the migration. A new store is a copy of a
migrated template kept per MLflow version in the user's cache (``store_template``), so
MLflow's migrations run once per MLflow version, not once per store.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

import simulator
from simulator.errors import TrackingUnavailable, UsageError, brief_text, printable, redact
from simulator.log import logger
from simulator.metric_names import mlflow_name
from simulator.run import store_uri
from simulator.run.removed import Needs, store_gone
from simulator.run.store_uri import check_store_uri, sqlite_path

PENDING = Path(".fedray") / "pending"
PARAMS_PER_BATCH = 100
# MLflow's HTTP defaults retry for minutes; a simulation journals and resends with the next
# round instead (set unless the user did)
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
METRICS_PER_BATCH = 1000
# MLflow draws a tqdm bar per artifact download when tqdm is installed (Optuna and Ray Tune
# bring it): fedray reads its own small artifacts (scenario.yaml, checkpoints) and says
# what it does in one line (set unless the user did)
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
class _RaisedAnyway(logging.Filter):
    """Drops MLflow's ERROR record, with its traceback, of an SQLite error it raises anyway
    (``mlflow.store.db.utils``: "SQLAlchemy database error. The following exception is
    caught"): fedray reports that error itself, in one line (an outage journaled, a store
    removed under the run, a store that cannot be opened)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("SQLAlchemy database error.")


_DB_LOG = logging.getLogger("mlflow.store.db.utils")
if not any(isinstance(f, _RaisedAnyway) for f in _DB_LOG.filters):
    _DB_LOG.addFilter(_RaisedAnyway())
PARAM_VALUE_MAX = 6000
RETRY_SECONDS = 5.0  # after a failed call, the store counts as down this long
END_WAIT_SECONDS = 15.0  # what the end of a run waits for metrics still being sent


def default_uri(cwd: Path | None = None) -> str:
    """``MLFLOW_TRACKING_URI`` if set, else the embedded store ``sqlite:///<cwd>/mlflow.db``
    (``simulator.run.store_uri.default_uri``)."""
    return store_uri.default_uri(cwd)


def artifact_root(uri: str) -> str | None:
    """Artifacts of an embedded SQLite store go beside the DB file (``mlartifacts/``)."""
    db = sqlite_path(uri)
    return (db.parent / "mlartifacts").resolve().as_uri() if db is not None else None


def check_uri(uri: str) -> None:
    """The tracking URI checked by its class, without opening the store
    (``simulator.run.store_uri.check_store_uri``; UsageError in one line)."""
    check_store_uri(uri)


check_target = check_uri  # the commands' name for it (nothing is created by the check)


def ensure_store(uri: str) -> None:
    """Make the tracking store usable before anything is logged: an embedded SQLite store is
    created (MLflow's migrations) by one process at a time, under a lock file beside it, and a
    store that an interrupted migration left broken is diagnosed in one line; any store that
    cannot be reached raises TrackingUnavailable."""
    check_target(uri)
    if uri.startswith(("http://", "https://")):  # fail in seconds, journal, resend later
        for k, v in HTTP_DEFAULTS.items():
            os.environ.setdefault(k, v)
    try:
        _open_store(uri)
    except Exception as e:
        # the working directory or the store's folder removed since the checks: said as
        # that (MLflow's FileNotFoundError read "cannot be opened ... pass --tracking-uri")
        removed = Needs(uri).explain(e)
        if removed is None:
            raise
        raise removed from e


def _open_store(uri: str) -> None:
    """Open the store once (``ensure_store``), raising TrackingUnavailable in one line."""
    from mlflow.tracking import MlflowClient

    db = sqlite_path(uri)
    if db is None:
        try:
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
        except Exception as e:  # noqa: BLE001 - MLflow/requests errors, reported in one line
            raise TrackingUnavailable(redact(
                f"tracking store {uri} cannot be reached ({type(e).__name__}: "
                f"{brief_text(str(e).splitlines()[0] if str(e) else '', 160)}); start it, or "
                "leave out --tracking-uri and MLFLOW_TRACKING_URI for the embedded store")) from None
        return
    with open(db.with_name(db.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        _diagnose_sqlite(db)
        new = not db.exists() or db.stat().st_size == 0
        template = store_template() if new else None
        if template is not None:
            _copy_store(template, db, default_artifacts=Path.cwd() / "mlruns" / "0")
        try:
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
        except Exception as e:  # noqa: BLE001 - SQLAlchemy/alembic errors, in one line
            if template is not None:  # not this MLflow's after all: the next run rebuilds it
                template.unlink(missing_ok=True)
            raise TrackingUnavailable(
                f"tracking store {db} cannot be opened ({type(e).__name__}: "
                f"{brief_text(str(e).splitlines()[0] if str(e) else '', 160)}); move it "
                "away and run again, or pass --tracking-uri") from None
        if new and template is None:
            save_template(db)


# A new embedded store is a copy of a migrated template (MLflow's migrations cost 1-4 s a new
# store here): one per MLflow version in fedray's folder of the user's cache
# ($XDG_CACHE_HOME/fedray, else ~/.cache/fedray), named mlflow-VERSION-REVISION.db by the
# schema revision MLflow's migrations left in it. The first new store of an MLflow version
# is migrated by MLflow as before, then copied there. Both copies go through a temporary
# file renamed into place, so concurrent commands see a whole file or none.
TEMPLATE_ENV = "XDG_CACHE_HOME"


def template_folder() -> Path:
    """Where the store templates are kept: ``$XDG_CACHE_HOME/fedray``, else
    ``~/.cache/fedray``."""
    return Path(os.environ.get(TEMPLATE_ENV) or Path.home() / ".cache") / "fedray"


def store_template() -> Path | None:
    """This MLflow version's store template, or None where there is none yet (or it is not a
    pristine store of its schema revision, and is removed: corrupt, written to, another
    revision than its name says)."""
    import mlflow

    for path in sorted(template_folder().glob(f"mlflow-{mlflow.__version__}-*.db")):
        revision = path.stem.rpartition("-")[2]
        if _pristine(path) == revision:
            return path
        logger.debug("fedray: store template %s is not a new store of revision %s; removed",
                     path, revision)
        path.unlink(missing_ok=True)
    return None


def save_template(db: Path) -> None:
    """Keep a copy of ``db``, a store MLflow has just created, as this MLflow version's
    template; where the cache folder cannot be written, nothing is kept."""
    import mlflow

    folder = template_folder()
    revision = _pristine(db)
    if revision is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _copy_store(db, folder / f"mlflow-{mlflow.__version__}-{revision}.db")
    except OSError as e:
        logger.debug("fedray: no store template kept in %s (%s)", folder, e)


def _pristine(db: Path) -> str | None:
    """The schema revision of ``db`` when it is a whole, new MLflow store (its integrity
    checked, no migration left half done, the Default experiment alone and no run), else
    None."""
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
            if conn.execute("PRAGMA quick_check").fetchone() != ("ok",):
                return None
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
            revisions = conn.execute("SELECT version_num FROM alembic_version").fetchall()
            experiments = conn.execute("SELECT experiment_id FROM experiments").fetchall()
            runs = conn.execute("SELECT count(*) FROM runs").fetchone()
    except sqlite3.Error:
        return None
    if any(t.startswith("_alembic_tmp_") for t in tables) or len(revisions) != 1 or \
            experiments != [(0,)] or runs != (0,):
        return None
    return str(revisions[0][0])


def _copy_store(source: Path, target: Path, default_artifacts: Path | None = None) -> None:
    """``source`` copied to ``target`` by SQLite's backup (a consistent copy) into a
    temporary file beside ``target``, renamed over it. ``default_artifacts``: where the
    copy's Default experiment keeps its artifacts, as MLflow sets it for a store it creates
    in the working directory (``./mlruns/0``, resolved)."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with closing(sqlite3.connect(f"file:{source}?mode=ro", uri=True)) as src, \
                closing(sqlite3.connect(tmp)) as dst:
            src.backup(dst)
            if default_artifacts is not None:
                with dst:  # one transaction, committed
                    dst.execute("UPDATE experiments SET artifact_location = ? WHERE "
                                "experiment_id = 0", (str(default_artifacts),))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def require_store(uri: str, what: str) -> None:
    """For a command that reads runs (resume, report): an embedded SQLite store that does not
    exist holds nothing, and is not created by looking (UsageError naming ``what`` is
    missing)."""
    check_uri(uri)
    db = sqlite_path(uri)
    if db is not None and not db.is_file():
        raise UsageError(f"{what} in {redact(uri)}: there is no tracking store there (no "
                         f"{db.name} in {db.parent}); pass --tracking-uri, or run the command where the "
                         "runs were made")


def _diagnose_sqlite(db: Path) -> None:
    if not db.exists() or db.stat().st_size == 0:
        return
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    except sqlite3.DatabaseError as e:
        raise TrackingUnavailable(f"tracking store {db} is not an SQLite database ({e}); move "
                                  "it away and run again") from None
    tmp = [n for n in names if n.startswith("_alembic_tmp_")]
    if tmp:
        raise TrackingUnavailable(
            f"tracking store {db} is broken: an interrupted MLflow migration left table {tmp[0]}; "
            f"move it away (mv {db} {db}.broken) and run again")


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
        from mlflow.tracking import MlflowClient

        ensure_store(uri)
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
        self._lock = threading.Lock()  # guards _pending and the journal files
        self._sending = threading.Lock()  # one sender at a time (thread or end())
        self._wake = threading.Event()
        self._down_until = 0.0  # monotonic time before which the store counts as down
        self._thread: threading.Thread | None = None

    @classmethod
    def of_run(cls, uri: str, run_id: str) -> Tracker:
        """The tracker of an existing run's experiment (a missing run: ValueError)."""
        from mlflow.tracking import MlflowClient

        require_store(uri, f"no run {run_id!r}")
        ensure_store(uri)
        try:
            run = MlflowClient(tracking_uri=uri).get_run(run_id)
        except Exception:  # noqa: BLE001 - MLflow raises its own exception types
            raise UsageError(f"no run {run_id!r} in {redact(uri)}") from None
        return cls(uri, MlflowClient(tracking_uri=uri).get_experiment(run.info.experiment_id).name)

    def create_run(self, name: str, tags: dict[str, str], parent_id: str | None = None,
                   description: str = "") -> str:
        tags = {k: redact(str(v)) for k, v in tags.items()}  # no credential in a tag
        tags["mlflow.runName"] = name
        if description:
            tags["mlflow.note.content"] = redact(description)
        if parent_id:
            tags["mlflow.parentRunId"] = parent_id
        run = self.client.create_run(self.experiment_id, tags=tags, run_name=name)
        return run.info.run_id

    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k[:250], redact(v)) for k, v in params.items()]  # nor in a param
        for i in range(0, len(items), PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=items[i : i + PARAMS_PER_BATCH])

    def log_round(self, run_id: str, step: int, metrics: dict[str, float]) -> None:
        """Queue one round's metrics for the background sender and return at once."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        with self._lock:
            self._pending.setdefault(run_id, []).extend(
                Metric(mlflow_name(k), float(v), ts, step) for k, v in metrics.items())
        if self._thread is None:
            self._thread = threading.Thread(target=self._sender, name="fedray-tracking",
                                            daemon=True)
            self._thread.start()
        self._wake.set()

    def _sender(self) -> None:
        while True:
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            if self.down():
                continue
            with self._lock:
                runs = [r for r, ms in self._pending.items() if ms]
            for run_id in runs:
                self.flush(run_id, wait=None)

    def down(self) -> bool:
        """Whether a call failed in the last RETRY_SECONDS (calls then go to the journal)."""
        return time.monotonic() < self._down_until

    def _journal_file(self, run_id: str) -> Path:
        return self.journal / run_id / f"metrics-{os.getpid()}.parquet"

    def _warn(self, what: str, e: Exception) -> None:
        self.failures += 1
        self._down_until = time.monotonic() + RETRY_SECONDS
        removed = Needs(self.uri).missing()  # no outage: the store's folder was removed
        if removed is not None and removed.what == removed.TRACKING_STORE:
            if self.failures == 1:
                logger.warning("fedray: %s; what the run logs is kept in %s (put the store "
                               "back, then `fedray sync`)", store_gone(Path(str(removed.path))),
                               self.journal)
            return
        if self.failures <= 3:
            logger.warning("fedray: MLflow %s failed (%s: %s); kept in %s and sent later (or "
                           "by `fedray sync`)", what, type(e).__name__, redact(str(e)[:200]),
                           self.journal)

    def _journal_pending(self, run_id: str) -> None:
        with self._lock:  # the sender thread and end() may both write it
            pending = list(self._pending.get(run_id, []))
            if pending:
                _write_journal(self._journal_file(run_id), pending, self.uri)

    def flush(self, run_id: str, wait: float | None = 0.0, force: bool = False) -> bool:
        """Send the run's pending metrics; on failure keep them (memory and journal). While
        another send is in flight, wait at most ``wait`` seconds for it (None: as long as it
        takes); while the store counts as down, journal without trying unless ``force``."""
        if not self._sending.acquire(timeout=-1 if wait is None else wait):
            self._journal_pending(run_id)
            return False
        try:
            if self.down() and not force:
                self._journal_pending(run_id)
                return not self._pending.get(run_id)
            while True:
                with self._lock:
                    batch = list(self._pending.get(run_id, [])[:METRICS_PER_BATCH])
                if not batch:
                    break
                try:
                    self.client.log_batch(run_id, metrics=batch)
                except Exception as e:  # noqa: BLE001 - tracking outage: keep the numbers, go on
                    self._warn("log_batch", e)
                    self._journal_pending(run_id)
                    return False
                with self._lock:
                    del self._pending[run_id][: len(batch)]
            with self._lock:
                self._journal_file(run_id).unlink(missing_ok=True)
            return True
        finally:
            self._sending.release()

    def log_history(self, run_id: str, rows: list[dict[str, float]]) -> None:
        """A whole run's per-round metrics (row i = step i), in batches of up to 1000 values."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        with self._lock:
            self._pending.setdefault(run_id, []).extend(
                Metric(mlflow_name(k), float(v), ts, step) for step, row in enumerate(rows)
                for k, v in row.items())
        self.flush(run_id, wait=None)

    def find_run(self, tags: dict[str, str]) -> str | None:
        """The most recent run of this experiment carrying every one of ``tags``."""
        query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        runs = self.client.search_runs([self.experiment_id], filter_string=query,
                                       order_by=["attributes.start_time DESC"], max_results=1)
        return runs[0].info.run_id if runs else None

    def children(self, parent_id: str) -> list[Any]:
        """Every child run of ``parent_id``."""
        return child_runs(self.client, self.experiment_id, parent_id, oldest_first=False)

    def reopen(self, run_id: str) -> None:
        """Mark a run RUNNING again (a resumed sweep goes on in the same parent run)."""
        self.client.update_run(run_id, status="RUNNING")

    def log_artifact(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        """Log a file; while the tracking store is unreachable, keep a copy in the journal."""
        try:
            if self.down():
                raise ConnectionError("the tracking store failed a call moments ago")
            self.client.log_artifact(run_id, str(path), artifact_path)
        except Exception as e:  # noqa: BLE001 - tracking outage
            self._warn("log_artifact", e)
            dest = self.journal / run_id / "artifacts" / (artifact_path or "") / Path(path).name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)
            _keep_uri(self.journal / run_id, self.uri)

    def end(self, run_id: str, status: str = "FINISHED") -> None:
        """Flush (waiting at most END_WAIT_SECONDS for a send in flight) and set the final
        status; what cannot be sent stays in the journal for ``fedray sync``."""
        sent = self.flush(run_id, wait=END_WAIT_SECONDS)
        try:
            if not sent:
                raise ConnectionError("metrics still pending")
            if self.down():
                raise ConnectionError("the tracking store failed a call moments ago")
            self.client.set_terminated(run_id, status=status)
        except Exception as e:  # noqa: BLE001 - tracking outage
            self._warn("set_terminated", e)
            d = self.journal / run_id
            d.mkdir(parents=True, exist_ok=True)
            (d / "status").write_text(status)
            _keep_uri(d, self.uri)
            return
        _remove_if_empty(self.journal / run_id)


def child_runs(client: Any, experiment_id: str, parent_id: str, finished: bool = False,
               oldest_first: bool = True) -> list[Any]:
    """The child runs of ``parent_id`` (only the FINISHED ones if ``finished``), oldest
    first or in MLflow's default order (newest first)."""
    query = f"tags.mlflow.parentRunId = '{parent_id}'"
    return list(client.search_runs(
        [experiment_id], query + (" and attributes.status = 'FINISHED'" if finished else ""),
        order_by=["attributes.start_time ASC"] if oldest_first else None, max_results=50_000))


def latest_scenario_run(client: Any, experiment_id: str, finished: bool,
                        good: Callable[[list[Any]], bool]
                        ) -> tuple[Any, list[Any], Any | None] | None:
    """(the latest scenario run of the experiment, its children, the latest scenario run whose
    children are ``good``, or None), children as ``child_runs(..., finished)``; None without
    a scenario run. The dashboards name the third when the latest has nothing to show (a
    failed last attempt)."""
    parents = client.search_runs([experiment_id], "tags.`fedray.kind` = 'scenario'",
                                 order_by=["attributes.start_time DESC"], max_results=1000)
    if not parents:
        return None
    latest = child_runs(client, experiment_id, parents[0].info.run_id, finished)
    if good(latest):
        return parents[0], latest, parents[0]
    return parents[0], latest, next(
        (p for p in parents[1:]
         if good(child_runs(client, experiment_id, p.info.run_id, finished))), None)


def _write_journal(path: Path, metrics: list[Any], uri: str) -> None:
    """The pending metrics of one process for one run, as Parquet (rewritten whole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"key": [m.key for m in metrics], "value": [float(m.value) for m in metrics],
                      "timestamp": [int(m.timestamp) for m in metrics],
                      "step": [int(m.step) for m in metrics]})
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    _keep_uri(path.parent, uri)


def _keep_uri(folder: Path, uri: str) -> None:
    """Where a journal folder's runs are to be sent (``fedray sync`` reads it): the URI whole,
    credentials included, so the file is readable by its owner only."""
    target = folder / "tracking_uri"
    target.touch(mode=0o600, exist_ok=True)
    target.write_text(uri)


def _remove_if_empty(d: Path) -> None:
    if d.is_dir() and not any(p for p in d.rglob("*") if p.is_file() and p.name != "tracking_uri"):
        shutil.rmtree(d, ignore_errors=True)


def pending(base: Path | None = None) -> dict[str, str]:
    """What the journal under ``base`` still holds, per run: ``{run_id: "N metric values,
    K artifacts, final status"}``."""
    root = (base or Path.cwd()) / PENDING
    out = {}
    for d in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        n = sum(pq.read_metadata(f).num_rows for f in d.glob("metrics-*.parquet"))
        art = sum(1 for f in (d / "artifacts").rglob("*") if f.is_file()) \
            if (d / "artifacts").is_dir() else 0
        parts = [f"{n} metric values"] if n else []
        parts += [f"{art} artifact(s)"] if art else []
        parts += ["the final status"] if (d / "status").exists() else []
        if parts:
            out[d.name] = ", ".join(parts)
    return out


def removed_store(run_id: str, base: Path | None = None) -> Path | None:
    """The SQLite store that ``run_id``'s journal is meant for, when its folder was removed
    (nothing can be sent there until it is back); None otherwise."""
    target = (base or Path.cwd()) / PENDING / run_id / "tracking_uri"
    db = sqlite_path(target.read_text().strip()) if target.is_file() else None
    return db if db is not None and not db.parent.is_dir() else None


def journaled_steps(run_id: str, base: Path | None = None) -> set[int]:
    """The steps of ``run_id`` that its journal holds (sent by ``fedray sync`` later)."""
    d = (base or Path.cwd()) / PENDING / run_id
    steps: set[int] = set()
    for f in d.glob("metrics-*.parquet") if d.is_dir() else []:
        steps.update(pq.read_table(f, columns=["step"]).column("step").to_pylist())
    return steps


def sync(base: Path | None = None, uri: str | None = None,
         runs: set[str] | None = None) -> dict[str, int]:
    """Replay the journal under ``base`` (default: the working directory): pending metrics,
    artifacts and final statuses, each to the tracking URI it was meant for (or ``uri``);
    only the runs in ``runs`` when given. What is sent is removed; what still fails stays.
    Returns counts."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    root = (base or Path.cwd()) / PENDING
    out = {"runs": 0, "metrics": 0, "artifacts": 0, "statuses": 0, "failed_runs": 0,
           "skipped": 0}
    for d in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        run_id = d.name
        if runs is not None and run_id not in runs:
            continue
        if not (d / "tracking_uri").is_file():  # not a folder fedray wrote: left alone
            logger.warning("fedray sync: %s is not a run's journal (no tracking_uri file); "
                           "skipped", printable(str(d)))
            out["skipped"] += 1
            continue
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
            logger.warning("fedray sync: run %s: %s: %s", run_id, type(e).__name__,
                           redact(str(e)[:200]))
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
