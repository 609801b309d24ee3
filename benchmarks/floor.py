"""The floor: fedray's steady-state round against the same local SGD steps in a bare loop.

The workload is the heavier one of docs/performance.md: 200 clients of 300 samples (a
10-class Gaussian mixture in 60 dimensions, IID), 20 per round, an MLP with 1,024 hidden
units, one local epoch of batch 16 at lr 0.05, FedAvg.

* **floor**: ``W`` processes of ``T`` torch threads each, every one training its share of
  the round's 20 clients (19 steps each: forward, cross-entropy, backward, ``p -= lr * g``)
  from the same start, round after round, with nothing else: no aggregation, no evaluation,
  no communication. The best ``W x T`` with ``W * T`` = the machine's cores is the floor.
* **fedray**: the scenario on a fresh local Ray instance with ``runtime.workers = W`` and
  ``runtime.threads = T``; its steady-state round is the median time between round ends
  after the first 3 rounds (evaluation only at the last round, left out).

Prints seconds per round of both and fedray's throughput as a fraction of the floor's.

    python benchmarks/floor.py [--rounds 20] [--workers W --threads T] [--profile]

``--profile`` runs the same rounds on the inline backend under cProfile and prints where a
round's time goes (local training, the server's aggregation and step, the engine).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLIENTS, PER_ROUND, SAMPLES, DIM, CLASSES, HIDDEN, BATCH, LR = 200, 20, 300, 60, 10, 1024, 16, 0.05
SCENARIO = f"""\
name: floor
rounds: {{rounds}}
data:
  dataset: {{{{name: gaussian-mixture, samples: {CLIENTS * SAMPLES * 10 // 9 + 1}, dimension: {DIM},
             classes: {CLASSES}, separation: 0.5}}}}
  partitioner: {{{{name: iid}}}}
  test_fraction: 0.1
model: {{{{name: mlp, hidden: [{HIDDEN}]}}}}
clients: {{{{total: {CLIENTS}, per_round: {PER_ROUND}}}}}
local: {{{{epochs: 1, batch_size: {BATCH}, lr: {LR}}}}}
evaluation: {{{{every: {{rounds}}}}}}
runtime: {{{{backend: ray, workers: {{workers}}, threads: {{threads}}}}}}
"""


def _floor_process(clients: int, rounds: int, threads: int, start: mp.Barrier,
                   out: mp.Queue) -> None:
    import torch
    from torch import nn

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
    params = list(model.parameters())
    init = [p.detach().clone() for p in params]
    data = [(torch.randn(SAMPLES, DIM, generator=g), torch.randint(0, CLASSES, (SAMPLES,),
                                                                   generator=g))
            for _ in range(clients)]
    start.wait()
    t0 = time.perf_counter()
    for _ in range(rounds):
        for x, y in data:
            with torch.no_grad():
                for p, p0 in zip(params, init, strict=True):
                    p.copy_(p0)
            perm = torch.randperm(SAMPLES, generator=g)
            for i in range(0, SAMPLES, BATCH):
                idx = perm[i : i + BATCH]
                for p in params:
                    p.grad = None
                nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                with torch.no_grad():
                    for p in params:
                        p -= LR * p.grad
    out.put(time.perf_counter() - t0)


def floor(workers: int, threads: int, rounds: int) -> float:
    """Seconds per round of the bare loop: ``workers`` processes share the round's clients."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(workers + 1), ctx.Queue()
    share = [PER_ROUND // workers + (i < PER_ROUND % workers) for i in range(workers)]
    procs = [ctx.Process(target=_floor_process, args=(n, rounds, threads, barrier, out))
             for n in share]
    for p in procs:
        p.start()
    barrier.wait()
    t0 = time.perf_counter()
    times = [out.get() for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    del times
    return wall / rounds


def fedray(workers: int, threads: int, rounds: int, backend: str = "ray"
           ) -> tuple[float, float, dict[str, float]]:
    """(steady-state seconds per round, final accuracy, the medians of the engine's round
    timings: the slowest worker's training, the server's step, the whole round)."""
    from simulator.config.load import load
    from simulator.runtime.backend import InlineBackend, RayBackend
    from simulator.sim.engine import Engine

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "floor.yaml"
        path.write_text(SCENARIO.format(rounds=rounds, workers=workers, threads=threads))
        sc = load(path).points[0].scenario
    be = RayBackend(include_dashboard=False, num_cpus=os.cpu_count()) if backend == "ray" \
        else InlineBackend()
    ends: list[float] = []
    try:
        res = Engine(sc, be).run(lambda r, m: ends.append(time.perf_counter()))
    finally:
        be.shutdown()
    gaps = [b - a for a, b in itertools.pairwise(ends[3:-1])]  # no eval, no start
    parts = {k: statistics.median(t[k] for t in res.timings[3:-1])
             for k in ("slowest_worker_seconds", "server_seconds", "round_seconds")}
    return statistics.median(gaps), res.final("test_accuracy"), parts


def profile(rounds: int) -> None:
    """Where a round's time goes, on the inline backend (one process: cProfile sees it all)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    per_round, _, _ = fedray(1, os.cpu_count() or 1, rounds, backend="inline")
    prof.disable()
    print(f"\ninline backend, 1 worker x {os.cpu_count()} threads: {per_round:.3f} s per round")
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(r"(trainers|actors|worker|engine|pipeline|"
                                               r"aggregators|optimizers)\.py", 18)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3,
                    help="alternations of floor and fedray (this machine's speed drifts by "
                         "20-50 %% from minute to minute: each ratio is within one alternation)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    shapes = [(args.workers or cores // (args.threads or 1), args.threads or 1)] \
        if args.workers or args.threads else [(w, cores // w) for w in range(1, cores + 1)
                                               if cores % w == 0]
    print(f"{CLIENTS} clients x {SAMPLES} samples, {PER_ROUND} per round, MLP [{HIDDEN}], "
          f"1 epoch of batch {BATCH}; {cores} cores")
    ratios: dict[tuple[int, int], list[float]] = {s: [] for s in shapes}
    for rep in range(args.repeat):
        print(f"alternation {rep + 1} of {args.repeat}")
        floors = {s: floor(*s, rounds=args.rounds) for s in shapes}
        for (w, t), s in floors.items():
            print(f"  floor  {w} process(es) x {t} thread(s): {s:.4f} s per round")
        best = min(floors.values())
        for w, t in shapes:
            s, acc, parts = fedray(w, t, args.rounds)
            ratios[(w, t)].append(best / s)
            print(f"  fedray {w} worker(s)  x {t} thread(s): {s:.4f} s per round (accuracy "
                  f"{acc:.4f}): {best / s:.2f} of the floor")
            slow, server, whole = (parts[k] for k in ("slowest_worker_seconds",
                                                      "server_seconds", "round_seconds"))
            print(f"    a round: slowest worker trains {slow:.4f} s, server step {server:.4f} "
                  f"s, the rest (Ray calls, transfers, driver) {whole - slow - server:.4f} s")
    for (w, t), rs in ratios.items():
        print(f"fedray {w} worker(s) x {t} thread(s): {statistics.median(rs):.2f} of the floor "
              f"(median of {len(rs)}; {min(rs):.2f}-{max(rs):.2f})")
    if args.profile:
        profile(args.rounds)


if __name__ == "__main__":
    main()
