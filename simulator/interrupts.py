"""What a command leaves unfinished and the signals that end it: the state the CLI reports
in one line. Kept apart from the runner so that commands that run nothing (``validate``,
``list``, ``show``) import neither it nor MLflow's tracking modules."""

from __future__ import annotations

import signal
import threading
from typing import Any

from simulator.errors import Terminated

# Runs this process ended without finishing them: (run_id, label, status), for the one-line
# report of a failure or an interrupt.
UNFINISHED: list[tuple[str, str, str]] = []

SIGNALS: list[int] = []  # the signals received (Ray's get re-raises a bare KeyboardInterrupt)


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
