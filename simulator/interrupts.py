"""The signals that end a command and what it leaves unfinished: the state the CLI reports in
one line. Kept apart from the runner so that commands that run nothing (``validate``,
``list``, ``show``) import neither it nor MLflow's tracking modules.

What is unfinished travels with the command: in its result (``ExperimentResult.unfinished``)
or, when it raises, on the exception it raises (``unfinished_of``)."""

from __future__ import annotations

import signal
import threading
from typing import Any, NamedTuple

from simulator.errors import Terminated

SIGNALS: list[int] = []  # the signals received (Ray's get re-raises a bare KeyboardInterrupt)


class Unfinished(NamedTuple):
    """A run a command ended without finishing it."""

    run_id: str
    label: str
    status: str


def unfinished_of(error: BaseException) -> list[Unfinished]:
    """The runs the experiment that raised ``error`` ended unfinished, in the order it ended
    them (none for an error raised before any run opened)."""
    return list(getattr(error, "fedray_unfinished", ()))


def carry_unfinished(error: BaseException, unfinished: list[Unfinished]) -> None:
    """``error`` carries ``unfinished`` (the same list: runs ended after this are on it)."""
    error.fedray_unfinished = unfinished  # type: ignore[attr-defined]


def _raise_terminated(signum: int, frame: Any) -> None:
    SIGNALS.append(signum)
    raise Terminated(signum)


def trap_sigterm() -> None:
    """SIGTERM ends a run like Ctrl-C: runs marked KILLED, the resume command printed. Called
    again after ray.init, which installs its own SIGTERM handler. Only the main thread can."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


def end_status(status: str, error: BaseException | None) -> str:
    return "KILLED" if isinstance(error, KeyboardInterrupt) else status
