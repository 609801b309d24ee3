"""What a synchronous round costs on Ray beyond the workers' training, and which part of it a
round loop driven by the server actor (it calls the workers itself) would save.

Two worker actors each "train" for a fixed time (a busy loop, ``--work`` ms) and return
``rows`` update rows of ``d`` float32 values; a server actor concatenates them and steps.
Two ways to drive it, per round:

* **driver**: as fedray's engine does, the driver submits the step and, before reading its
  result, the next round's ``params`` and ``train`` calls (four messages on the round's
  critical path: a result to the driver, the step to the server, the parameters back to the
  driver, the train calls to the workers);
* **server**: the server actor puts the parameters, calls the workers and waits for them
  itself (two messages).

Prints the median seconds per round of each, minus the training, for a tiny payload and
fedray's floor workload (10 rows of d = 73,000 from each worker: 5.8 MB a round).

    python benchmarks/ray_round_trip.py [--work 30] [--rounds 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np


class Worker:
    def __init__(self, work: float, rows: int) -> None:
        self.work, self.rows = work, rows

    def train(self, params: np.ndarray | None, d: int) -> dict:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < self.work:
            pass
        return {"updates": np.ones((self.rows, d), np.float32)}


class Server:
    def __init__(self, workers: list, d: int) -> None:
        self.workers, self.d, self.x = workers, d, np.zeros(d, np.float32)

    def params(self) -> np.ndarray:
        return self.x.copy()

    def step(self, *results: dict) -> float:
        rows = np.concatenate([r["updates"] for r in results])
        self.x = self.x + 0.0 * rows.mean(axis=0)
        return 1.0

    def drive(self, rounds: int) -> list[float]:
        """The rounds driven from here: put the parameters, call the workers, step."""
        import ray

        ends = []
        for _ in range(rounds):
            params = ray.put(self.x.copy())
            self.step(*ray.get([w.train.remote(params, self.d) for w in self.workers]))
            ends.append(time.perf_counter())
        return ends


def by_driver(server: Any, workers: list, d: int, rounds: int) -> list[float]:
    """The rounds driven from the driver, the next round's calls out before a step's result
    is read (as fedray's engine)."""
    import ray

    ends: list[float] = []
    nxt = [w.train.remote(server.params.remote(), d) for w in workers]
    for r in range(rounds):
        step = server.step.remote(*nxt)
        if r + 1 < rounds:
            nxt = [w.train.remote(server.params.remote(), d)
                   for w in workers]
        ray.get(step)
        ends.append(time.perf_counter())
    return ends


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=float, default=30.0, help="ms of training per worker")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--rows", type=int, default=10)
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    ray.init(address="local", include_dashboard=False, num_cpus=2)
    work = args.work / 1e3
    print(f"2 workers x {args.work:g} ms of training a round, {args.rounds} rounds")
    for d in (100, 73_000):
        workers = [ray.remote(num_cpus=1)(Worker).remote(work, args.rows) for _ in range(2)]
        server = ray.remote(num_cpus=0)(Server).remote(workers, d)
        ray.get([w.train.remote(None, d) for w in workers])
        for _ in range(2):
            driven = statistics.median(np.diff(by_driver(server, workers, d, args.rounds)[5:]))
            served = statistics.median(np.diff(ray.get(server.drive.remote(args.rounds))[5:]))
            mb = 2 * args.rows * d * 4 / 1e6
            print(f"d = {d:>6,} ({mb:4.1f} MB of rows a round): beyond the training, "
                  f"driver-driven {1e3 * (driven - work):5.1f} ms, "
                  f"server-driven {1e3 * (served - work):5.1f} ms")
        for a in [*workers, server]:
            ray.kill(a)
    ray.shutdown()


if __name__ == "__main__":
    main()
