"""How a round's cost grows: seconds per round against clients per round (an MLP of 64 hidden
units) and against the model's size d (20 clients per round, MLPs of growing width), on one
local Ray instance with a ClientWorker per core, FedAvg, one local epoch of batch 16 on
clients of 100 samples (a 10-class Gaussian mixture in 60 dimensions). Each point is the
median gap between rounds after the first 3 (no evaluation in between).

Prints two Markdown tables and draws both curves (log-log) into ``--figure``.

    python benchmarks/scaling.py [--rounds 10] [--figure docs/images/scaling.png]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCENARIO = """\
name: scaling
rounds: {rounds}
data:
  dataset: {{name: gaussian-mixture, samples: {samples}, dimension: 60, classes: 10}}
  partitioner: {{name: iid}}
  test_fraction: 0.1
model: {{name: mlp, hidden: [{hidden}]}}
clients: {{total: {total}, per_round: {per_round}}}
local: {{epochs: 1, batch_size: 16, lr: 0.05}}
evaluation: {{every: {rounds}}}
runtime: {{backend: ray, workers: {workers}}}
"""


def per_round(backend, rounds: int, per_round: int, hidden: int) -> tuple[float, int]:
    """(steady-state seconds per round, d) of one configuration on ``backend``."""
    from simulator.config.load import load
    from simulator.sim.engine import Engine

    total = max(2 * per_round, 100)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "s.yaml"
        path.write_text(SCENARIO.format(rounds=rounds, samples=total * 100 * 10 // 9 + 1,
                                        hidden=hidden, total=total, per_round=per_round,
                                        workers=os.cpu_count() or 1))
        sc = load(path).points[0].scenario
    ends: list[float] = []
    eng = Engine(sc, backend)
    eng.run(lambda r, m: ends.append(time.perf_counter()))
    return statistics.median(b - a for a, b in itertools.pairwise(ends[3:-1])), eng.protocol.dim


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--figure", default=None)
    args = ap.parse_args()
    from simulator.runtime.backend import RayBackend

    backend = RayBackend(include_dashboard=False, num_cpus=os.cpu_count())
    try:
        by_clients = [(n, *per_round(backend, args.rounds, n, 64)) for n in (5, 10, 20, 50, 100, 200)]
        by_d = [(h, *per_round(backend, args.rounds, 20, h)) for h in (16, 64, 256, 1024, 4096)]
    finally:
        backend.shutdown()
    print(f"\nMLP [64], {os.cpu_count()} ClientWorkers: seconds per round against clients per "
          "round\n\n| clients per round | s per round | ms per client |\n|---:|---:|---:|")
    for n, s, _ in by_clients:
        print(f"| {n} | {s:.3f} | {1000 * s / n:.1f} |")
    print("\n20 clients per round: seconds per round against d\n\n"
          "| MLP width | d | s per round | us per client and 1,000 parameters |\n|---:|---:|---:|---:|")
    for h, s, d in by_d:
        print(f"| {h} | {d:,} | {s:.3f} | {1e6 * s / 20 / (d / 1000):.1f} |")
    if args.figure:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
        axes[0].loglog([n for n, _, _ in by_clients], [s for _, s, _ in by_clients], "o-")
        axes[0].set(xlabel="clients per round", ylabel="seconds per round",
                    title=f"MLP [64], d = {by_clients[0][2]:,}")
        axes[1].loglog([d for _, _, d in by_d], [s for _, s, _ in by_d], "o-")
        axes[1].set(xlabel="model parameters d", ylabel="seconds per round",
                    title="20 clients per round")
        for ax in axes:
            ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.figure, dpi=120)
        print(f"\nfigure: {args.figure}")


if __name__ == "__main__":
    main()
