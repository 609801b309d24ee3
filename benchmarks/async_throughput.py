"""Asynchronous server steps against synchronous rounds on one workload: client updates
applied per second of real time (not simulated time), the same number of updates in each,
evaluation only at the end. Workload: mnist5k (5,000 real MNIST images), 100 clients of
an iid split, an MLP of 64 hidden units, 5 local steps of batch 10; lognormal(1) device
speeds. sync: 20 clients a round; fedbuff: 20 clients in flight, a step every K updates
(K = 20: steps of a round's size; K = 5: four times as many, smaller steps). Each row is
the best of ``--repeat`` runs (the first run of a process also pays torch's warm-up, so
one untimed run goes first).

    python benchmarks/async_throughput.py [--updates 800] [--backend inline|ray]
                                          [--workers 2] [--repeat 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SCENARIO = """\
name: async-throughput
rounds: {rounds}
data: {{dataset: {{name: mnist5k}}, partitioner: {{name: iid}}}}
model: {{name: mlp, hidden: [64]}}
clients: {{total: 100, per_round: 20}}
local: {{steps: 5, batch_size: 10, lr: 0.05}}
speeds: {{distribution: lognormal, sigma: 1.0}}
evaluation: {{every: {rounds}}}
{mode}
"""

MODES = [("sync", 20, ""),
         ("fedbuff K=20", 20, "server: {mode: fedbuff}\nasynchrony: {buffer_size: 20}"),
         ("fedbuff K=5", 5, "server: {mode: fedbuff}\nasynchrony: {buffer_size: 5}")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=800)
    ap.add_argument("--backend", choices=["inline", "ray"], default="inline")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    from simulator.config.load import load
    from simulator.runtime.backend import InlineBackend, RayBackend
    from simulator.sim.engine import Engine

    backend = RayBackend() if a.backend == "ray" else InlineBackend()
    print(f"{a.updates} client updates each, {a.backend} backend, {a.workers} workers")
    print("| mode | updates a step | steps | seconds | updates / s | vs sync |")
    print("|---|---|---|---|---|---|")
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, k, mode) in enumerate(MODES):
            rounds = a.updates // k
            p = Path(tmp) / f"s{i}.yaml"
            p.write_text(SCENARIO.format(rounds=rounds, mode=mode))
            sc = load(p).points[0].scenario
            if i == 0:
                Engine(sc, backend, workers=a.workers).run()  # warm-up, untimed
            best = float("inf")
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                Engine(sc, backend, workers=a.workers).run()
                best = min(best, time.perf_counter() - t0)
            rate = a.updates / best
            base = base or rate
            print(f"| {label} | {k} | {rounds} | {best:.2f} | {rate:.0f} | "
                  f"{rate / base:.2f}x |", flush=True)
    backend.shutdown()


if __name__ == "__main__":
    main()
