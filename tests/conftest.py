"""Shared fixtures: one Ray instance per session, one migrated MLflow DB copied per test."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ray_backend():
    """A RayBackend on one local Ray instance shared by the session's tests."""
    import ray

    from simulator.runtime.backend import RayBackend

    backend = RayBackend(num_cpus=2, object_store_memory=256 * 1024**2)
    yield backend
    ray.shutdown()


class SharedRay:
    """The session's RayBackend, with shutdown() a no-op so runs can't stop it."""

    def __init__(self, backend):
        self._b = backend

    def __getattr__(self, name):
        return getattr(self._b, name)

    def shutdown(self):
        return None


@pytest.fixture()
def shared_ray(ray_backend):
    return SharedRay(ray_backend)


@pytest.fixture(scope="session", autouse=True)
def _cache_home(tmp_path_factory):
    """fedray's MLflow store templates (``simulator.run.tracking.store_template``) in a
    folder of the session (XDG_CACHE_HOME, inherited by the commands tests start), not in
    the user's cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        # the commands tests start run in their own process, not on a warm pool the user
        # may have up (tests/simulator/test_pool_daemon.py starts its own)
        mp.setenv("FEDRAY_POOL", "0")
        yield


@pytest.fixture(scope="session")
def _mlflow_template(tmp_path_factory) -> Path:
    # Creating a fresh SQLite store runs every migration (3-4.5 s): once per session, as
    # `fedray run` creates a new store, which also keeps it as the session's store template
    # (every later new store, a command's included, is a copy).
    from simulator.run.tracking import ensure_store

    db = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    ensure_store(f"sqlite:///{db}")
    return db


@pytest.fixture(scope="session")
def new_store(tmp_path_factory, _mlflow_template):
    """``new_store(name) -> (folder, uri)``: a new folder holding a fresh, migrated embedded
    store (a module's fixture that runs scenarios into its own store)."""
    def make(name: str) -> tuple[Path, str]:
        folder = tmp_path_factory.mktemp(name)
        shutil.copy(_mlflow_template, folder / "mlflow.db")
        return folder, f"sqlite:///{folder / 'mlflow.db'}"
    return make


@pytest.fixture()
def mlflow_uri(_mlflow_template, tmp_path, monkeypatch) -> str:
    """A fresh, migrated embedded store in this test's tmp dir (also the cwd)."""
    db = tmp_path / "mlflow.db"
    shutil.copy(_mlflow_template, db)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return f"sqlite:///{db}"


# Ray's log monitor forwards its own processes' error lines (the GCS, the raylets) to every
# driver of the instance, seconds after the event: in this test session, lines about an
# earlier test's actors can land in a later test's captured stderr. They are never a run's
# own message; a run on the inline backend cannot cause them.
_RAY_SYSTEM_LINE = re.compile(r"^(\x1b\[[0-9;]*m)*\((pid=)?(gcs_server|raylet|autoscaler|monitor|"
                              r"dashboard)[^)]*\)")


def own_lines(err: str) -> list[str]:
    """The lines of captured stderr ``err`` less those Ray forwards from its own processes."""
    return [line for line in err.strip().splitlines() if not _RAY_SYSTEM_LINE.match(line)]


def write_scenario(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture()
def terminal(capfd, caplog):
    """``terminal()``: what a run shows on the terminal so far, the process's stderr (Ray's
    lines, the actors' forwarded ones) and fedray's log lines (the library logs them, the
    command line prints them)."""
    caplog.set_level(logging.INFO, logger="fedray")

    def read() -> str:
        logged = [r.getMessage() for r in caplog.records if r.name.startswith("fedray")]
        caplog.clear()
        return capfd.readouterr().err + "\n".join(logged)

    return read
