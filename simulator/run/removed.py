"""A file or folder a run still needs, removed while the run went on, reported as that.

What a run needs on disk once its checks have passed (``Needs``): the working directory it
started in (checkpoints, the journal, a relative store), the tracking store's SQLite file,
and every path key of each point's scenario (data files and folders, traces, edge lists;
``simulator.config.paths``). When one of them is removed under a running command (a `ray job
submit --working-dir` folder that Ray removes or extracts again, a data file deleted, the
store's folder cleaned up), what fails next raises its own error from deep inside: MLflow's
``FileNotFoundError`` while it opens the store (reported before as "tracking store ...
cannot be opened ... pass --tracking-uri", although one was passed), pyarrow's while it reads
a cohort, SQLite's "disk I/O error", the guard's "no such file" (reported before as the
user's mistake, exit 2). ``Needs.explain`` turns such an error into one ``Removed`` line that
names what was removed and what to do; the run lifecycle (``Experiment.running``) raises it
in place of the error, with the runs it left unfinished.

Only errors that come from the file system or the store are explained (``OSError``, SQLite's
errors, a data or tracking error of fedray's, anywhere in the error's chain, a Ray task's
cause included), and only while something needed is really gone: any other error keeps its
own report (a bug, its traceback).
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from simulator.config.paths import path_keys
from simulator.errors import CheckpointUnreadable, DataError, Removed, TrackingUnavailable
from simulator.run.store_uri import sqlite_path

WORKING_DIRECTORY = Removed.WORKING_DIRECTORY
TRACKING_STORE = Removed.TRACKING_STORE
# errors that a removed file or folder can be behind (ours: a data set, a store, a
# checkpoint or a path that could not be read)
_FILE_ERRORS = (OSError, sqlite3.Error, DataError, TrackingUnavailable, Removed,
                CheckpointUnreadable)


class WorkingDirectoryGone(Removed):
    """The directory fedray runs from was removed under the running process."""


def working_directory() -> Path | None:
    """This process's working directory; None when it was removed (``os.getcwd`` fails even
    where a folder of the same name was made again: the process is still in the old one)."""
    try:
        return Path(os.getcwd())
    except FileNotFoundError:
        return None


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, its causes and contexts, and a Ray task error's cause, each once."""
    seen: set[int] = set()
    todo = [error]
    while todo and len(seen) < 50:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [c for c in (e.__cause__, e.__context__, getattr(e, "cause", None))
                 if isinstance(c, BaseException)]


def from_the_file_system(error: BaseException) -> bool:
    """Whether ``error`` (an Exception, not an interrupt) has a file-system or store error in
    its chain."""
    return isinstance(error, Exception) and any(isinstance(e, _FILE_ERRORS)
                                                for e in _chain(error))


def working_directory_removed(start: Path | None) -> WorkingDirectoryGone:
    """The line for a working directory (``start``, when known) removed under the command."""
    # here: the runtime package imports torch, which this module's importers may not need
    from simulator.runtime.backend import ray_temporary_folder

    where = f" {start}" if start is not None else ""
    job = ray_temporary_folder(start) if start is not None else None
    why = (f" (a `ray job submit --working-dir` folder, in Ray's temporary folder {job}: Ray "
           "removes it with the job, and so does a second Ray node on this machine started "
           "without its own --temp-dir; docs/cluster.md)" if job is not None else "")
    return WorkingDirectoryGone(f"the working directory{where} was removed while the run went on{why}; "
                   "what the run kept there (.fedray/checkpoints/, .fedray/pending/) went with "
                   "it; run fedray from a folder that lasts", WORKING_DIRECTORY,
                   str(start) if start is not None else None)


def store_gone(db: Path) -> str:
    """``the tracking store DB was removed while the run went on (its folder ... is gone)``."""
    folder = db.parent
    gone = f"its folder {folder} is gone" if not folder.exists() else f"{db.name} is gone"
    return f"the tracking store {db} was removed while the run went on ({gone})"


def store_removed(db: Path) -> Removed:
    """The line for an SQLite tracking store removed under the command."""
    return Removed(f"{store_gone(db)}, and the runs it held with it; run again with "
                   "--tracking-uri a store in a folder that lasts (or put the store back, "
                   "then `fedray sync`)", TRACKING_STORE, str(db))


def path_removed(key: str, path: Path) -> Removed:
    """The line for a path of the scenario (``key``: where the scenario names it) removed
    under the command."""
    return Removed(f"{key}: {path} was removed while the run went on (it was there when the "
                   "scenario was checked); put it back", key, str(path))


class Needs:
    """What a command's runs need on disk: the working directory it started in, the
    tracking store's SQLite file (``uri``), and the path keys of each scenario ``add``-ed
    (each point's, as it starts)."""

    def __init__(self, uri: str | None = None, start: Path | None = None) -> None:
        self.start = start if start is not None else working_directory()
        db = sqlite_path(uri) if uri else None
        if db is not None and not db.is_absolute() and self.start is not None:
            db = self.start / db  # MLflow reads it against the working directory
        self.store = db
        # a store file that is not there yet is made by the run: only one seen is missed
        self._store_existed = db is not None and db.exists()
        self.paths: dict[Path, str] = {}  # path: the scenario key that names it

    def add(self, scenario: Any) -> None:
        """The path keys of ``scenario`` (a resolved Scenario: its paths are absolute)."""
        for at in path_keys(scenario.model_dump(mode="json")):
            value = at.block[at.key]
            if isinstance(value, str) and value:
                self.paths.setdefault(Path(value), ".".join(map(str, at.loc)))

    def missing(self) -> Removed | None:
        """The first needed thing that is gone now (the working directory, the store, a
        scenario's path), as its line; None while everything is there."""
        if working_directory() is None:
            return working_directory_removed(self.start)
        if self.store is not None and (not self.store.parent.is_dir() or (
                self._store_existed and not self.store.exists())):
            return store_removed(self.store)
        for path, key in self.paths.items():
            if not os.path.lexists(path):
                return path_removed(key, path)
        return None

    def explain(self, error: BaseException) -> Removed | None:
        """``error`` as the removal it comes from (see the module's docstring), else None."""
        if not from_the_file_system(error):
            return None
        found = self.missing()
        return error if found is None and isinstance(error, Removed) else found
