"""What a client-drift method costs over FedAvg's local SGD: the workers' training time a
round (the median over rounds, the fastest of 5 round-robin repeats), each method against
plain ``sgd`` in the same process (the ratio is the figure).

MNIST-sized MLP (784 -> 200 -> 200 -> 10, d = 199,210) on gaussian-mixture data, 20 clients a
round, 10 local steps of batch 32, inline backend, one worker. FedProx adds mu (w - x) to
every step's gradient, SCAFFOLD the constant c - c_i, FedDyn both kinds of term, Ditto runs
the local work twice (the global model's steps, then the personal model's).
Run: ``python benchmarks/drift_overhead.py [--rounds N]``.
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
name: drift-overhead
rounds: {rounds}
data:
  dataset: {{name: gaussian-mixture, samples: 8000, dimension: 784, classes: 10}}
model: {{name: mlp, hidden: [200, 200]}}
clients: {{total: 40, per_round: 20}}
local: {{steps: 10, batch_size: 32, lr: 0.05, momentum: 0.0}}
evaluation: {{every: 1000}}
runtime: {{backend: inline}}
"""

METHODS = {
    "sgd (FedAvg)": [],
    "fedprox": ["local.optimizer={name: fedprox, mu: 0.01}"],
    "fednova": ["local.optimizer={name: fednova}"],
    "scaffold": ["server.optimizer={name: scaffold}"],
    "feddyn": ["server.optimizer={name: feddyn}"],
    "ditto": ["local.optimizer={name: ditto, lam: 0.1}"],
}


def train_seconds(path: Path, over: list[str], rounds: int) -> float:
    """The median over rounds (the first left out: warm-up) of the workers' training time."""
    res = Engine(load(path, over).points[0].scenario, InlineBackend(), workers=1).run()
    return statistics.median(t["train_seconds"] for t in res.timings[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "s.yaml"
        p.write_text(SCENARIO.format(rounds=args.rounds))
        # round-robin over the methods, the fastest repeat of each: a slow spell of the
        # machine hits every method alike
        times = {name: float("inf") for name in METHODS}
        for _ in range(args.repeats):
            for name, over in METHODS.items():
                times[name] = min(times[name], train_seconds(p, over, args.rounds))
        base = times["sgd (FedAvg)"]
        print("| method | training s / round | vs sgd |")
        print("|---|---|---|")
        for name, t in times.items():
            print(f"| {name} | {t:.3f} | {t / base:.2f}x |")


if __name__ == "__main__":
    main()
