"""Progress of a run: a one-line bar on a terminal, plain lines otherwise (or with --quiet)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, rounds: int, quiet: bool = False, stream: TextIO | None = None) -> None:
        self.label, self.rounds = label, rounds
        self.stream = stream or sys.stderr
        self.bar = not quiet and self.stream.isatty()
        self.quiet = quiet
        self.t0 = time.perf_counter()
        self.acc: float | None = None
        # plain mode: about ten lines per run (every round with --quiet off the terminal is noise)
        self.every = max(1, rounds // 10)

    def update(self, round_: int, metrics: dict[str, float]) -> None:
        if "test_accuracy" in metrics:
            self.acc = metrics["test_accuracy"]
        done = round_ + 1
        acc = "" if self.acc is None else f" acc {self.acc:.4f}"
        if self.bar:
            width = 30
            fill = int(width * done / self.rounds)
            rate = done / max(time.perf_counter() - self.t0, 1e-9)
            self.stream.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] "
                              f"{done}/{self.rounds}{acc} {rate:.1f} rounds/s")
            if done == self.rounds:
                self.stream.write("\n")
            self.stream.flush()
        elif done % self.every == 0 or done == self.rounds:
            print(f"{self.label}: round {done}/{self.rounds}{acc}", file=self.stream, flush=True)
