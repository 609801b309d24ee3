"""ProgressLine of a run: a bar on a terminal or in a notebook (tqdm's: ``tqdm.auto`` draws a
widget in Jupyter, never raw carriage returns there), plain lines otherwise (or with
--quiet), with the elapsed time and the time left (from the pace of the rounds after the
first, so start-up does not count)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO


def clock(seconds: float) -> str:
    """``0:07``, ``12:03``, ``1:02:03``."""
    s = round(seconds)
    h, m, s = s // 3600, s // 60 % 60, s % 60
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (where tqdm.auto draws a widget)."""
    shell = sys.modules.get("IPython")
    if shell is None:
        return False
    ip = shell.get_ipython()
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


class ProgressLine:
    """One run's progress: ``update`` after each round. A bar (tqdm, at ``position`` among
    the bars of points run at once) on a terminal or in a notebook unless ``quiet``; plain
    lines, about ten a run, otherwise."""

    def __init__(self, label: str, rounds: int, quiet: bool = False,
                 stream: TextIO | None = None,
                 now: Callable[[], float] = time.perf_counter,
                 start: float | None = None, position: int = 0) -> None:
        self.label, self.rounds = label, rounds
        self.stream = stream or sys.stderr
        self.bar = not quiet and (self.stream.isatty() or in_notebook())
        self.quiet = quiet
        self.now = now
        self.t0 = now() if start is None else start  # elapsed counts from the run's start
        self.first: tuple[int, float] | None = None  # (rounds done, time) at the first update
        self.score = ""
        # plain mode: about ten lines per run (every round with --quiet off the terminal is noise)
        self.every = max(1, rounds // 10)
        self.position = position
        self._tqdm: Any = None

    def _times(self, done: int) -> str:
        """``0:12 elapsed, 0:30 left, 1.4 rounds/s`` (no pace before two rounds)."""
        t = self.now()
        if self.first is None:
            self.first = (done, t)
        out = f"{clock(t - self.t0)} elapsed"
        n0, t1 = self.first
        if done > n0 and t > t1:
            rate = (done - n0) / (t - t1)
            left = (self.rounds - done) / rate
            out += f", {clock(left)} left, {rate:.2f} rounds/s" if done < self.rounds else \
                f", {rate:.2f} rounds/s"
        return out

    def update(self, round_: int, metrics: dict[str, float]) -> None:
        if "test_accuracy" in metrics:
            self.score = f" acc {metrics['test_accuracy']:.4f}"
        elif "test_loss" in metrics:  # a task without accuracy (regression)
            self.score = f" loss {metrics['test_loss']:.4f}"
        done = round_ + 1
        times = self._times(done)
        if self.bar:
            self._draw(done, times)
        elif done % self.every == 0 or done == self.rounds:
            print(f"{self.label}: round {done}/{self.rounds}{self.score} ({times})",
                  file=self.stream, flush=True)

    def _draw(self, done: int, times: str) -> None:
        """The bar at ``done`` rounds, its text the score and our times (the pace after the
        first round, not tqdm's, which would count the start-up)."""
        if self._tqdm is None:
            from tqdm.auto import tqdm

            self._tqdm = tqdm(total=self.rounds, desc=self.label, file=self.stream,
                              position=self.position, leave=True, dynamic_ncols=True,
                              bar_format="{desc} {bar} {n_fmt}/{total_fmt}{postfix}")
        self._tqdm.set_postfix_str(f"{self.score} | {times}".lstrip(), refresh=False)
        self._tqdm.update(done - self._tqdm.n)
        if done == self.rounds:
            self.close()

    def close(self) -> None:
        """End the bar (a run that stopped before its last round leaves it where it is)."""
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None
