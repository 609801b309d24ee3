"""ProgressLine of a run: a one-line bar on a terminal, plain lines otherwise (or with --quiet),
with the elapsed time and the time left (from the pace of the rounds after the first, so
start-up does not count)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


def clock(seconds: float) -> str:
    """``0:07``, ``12:03``, ``1:02:03``."""
    s = round(seconds)
    h, m, s = s // 3600, s // 60 % 60, s % 60
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressLine:
    def __init__(self, label: str, rounds: int, quiet: bool = False,
                 stream: TextIO | None = None,
                 now: Callable[[], float] = time.perf_counter,
                 start: float | None = None) -> None:
        self.label, self.rounds = label, rounds
        self.stream = stream or sys.stderr
        self.bar = not quiet and self.stream.isatty()
        self.quiet = quiet
        self.now = now
        self.t0 = now() if start is None else start  # elapsed counts from the run's start
        self.first: tuple[int, float] | None = None  # (rounds done, time) at the first update
        self.score = ""
        # plain mode: about ten lines per run (every round with --quiet off the terminal is noise)
        self.every = max(1, rounds // 10)

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
            width = 30
            fill = int(width * done / self.rounds)
            self.stream.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] "
                              f"{done}/{self.rounds}{self.score} | {times}\033[K")
            if done == self.rounds:
                self.stream.write("\n")
            self.stream.flush()
        elif done % self.every == 0 or done == self.rounds:
            print(f"{self.label}: round {done}/{self.rounds}{self.score} ({times})",
                  file=self.stream, flush=True)
