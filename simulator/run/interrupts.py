"""The signals that end a command and what it leaves unfinished: the state the CLI reports in
one line. Kept apart from the runner so that commands that run nothing (``validate``,
``list``, ``show``) import neither it nor MLflow's tracking modules.

What is unfinished travels with the command: in its result (``ExperimentResult.unfinished``)
or, when it raises, on the exception it raises (``unfinished_of``)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
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


@contextlib.contextmanager
def stopping_ray_tune() -> Iterator[list[int]]:
    """Inside the block (``Tuner.fit``), Ctrl-C and SIGTERM ask Ray Tune to stop the way its
    own Ctrl-C handler does (SIGUSR1, which Tune always handles: it saves the search's state
    and returns) instead of raising into its loop; the list yields the signals received, and
    the caller raises once Tune has returned (``raise_received``). Without this, Tune's own
    handler stops on Ctrl-C but says nothing to its caller, and SIGTERM would cut it short
    before it saves. Only the main thread can; elsewhere the block changes nothing."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def ask_tune_to_stop(signum: int, frame: Any) -> None:
        received.append(signum)
        SIGNALS.append(signum)
        os.kill(os.getpid(), signal.SIGUSR1)

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    before = os.environ.get("TUNE_DISABLE_SIGINT_HANDLER")
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"  # Tune's handler says nothing of a stop
    for s in saved:
        signal.signal(s, ask_tune_to_stop)
    try:
        yield received
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        if before is None:
            os.environ.pop("TUNE_DISABLE_SIGINT_HANDLER", None)
        else:
            os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = before


def raise_received(received: list[int]) -> None:
    """The first signal ``stopping_ray_tune`` received, raised as the command's interrupt:
    KeyboardInterrupt for Ctrl-C, Terminated for SIGTERM."""
    if received:
        if received[0] == signal.SIGTERM:
            raise Terminated(received[0])
        raise KeyboardInterrupt
