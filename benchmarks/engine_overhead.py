"""The engine's own time per round, outside local training.

100 clients per round, d = 100,000 (logistic regression on 9,999 features x 10 classes),
inline backend. Per round: wall time minus the time the workers spent training, split into
the server step (stacking the (100, d) matrix, aggregating, the optimizer) and the rest
(sampling, broadcast, bookkeeping). Run: ``python benchmarks/engine_overhead.py``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from simulator.config.load import load
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine

SCENARIO = """\
name: engine-overhead
rounds: {rounds}
data:
  dataset: {{name: gaussian-mixture, samples: 2500, dimension: 9999, classes: 10}}
model: {{name: logreg}}
clients: {{total: 200, per_round: 100}}
local: {{steps: 1, batch_size: 4, lr: 0.01}}
aggregator: {{name: {aggregator}}}
evaluation: {{every: 1000}}
runtime: {{backend: inline}}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--aggregator", default="mean")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "s.yaml"
        p.write_text(SCENARIO.format(rounds=args.rounds, aggregator=args.aggregator))
        sc = load(p).points[0].scenario
    engine = Engine(sc, InlineBackend())
    result = engine.run()
    d = len(result.final_params)
    skip = 2  # warm-up rounds
    t = result.timings[skip:-1]  # the last round also evaluates
    overhead = [r["round_seconds"] - r["train_seconds"] for r in t]
    server = [r["server_seconds"] for r in t]
    train = [r["train_seconds"] for r in t]
    print(f"d = {d}, clients/round = {sc.clients.sampled}, aggregator = {args.aggregator}, "
          f"rounds timed = {len(t)}")
    print(f"local training     median {1e3 * statistics.median(train):8.1f} ms/round")
    print(f"engine (not train) median {1e3 * statistics.median(overhead):8.1f} ms/round "
          f"(min {1e3 * min(overhead):.1f}, max {1e3 * max(overhead):.1f})")
    print(f"  of which server  median {1e3 * statistics.median(server):8.1f} ms/round "
          f"(stack {sc.clients.sampled}x{d} rows, aggregate, step)")


if __name__ == "__main__":
    main()
