"""Population scale: 1,000,000 and 10,000,000 generated clients, 100 and 1,000 a round
(``data.load: cohort``): seconds a round and the process's peak RSS; beside them, the peer
in the same run: the same data set loaded whole (``data.load: all``) at the largest
population that fits here, 100,000 clients.

Synthetic(1, 1) (FedProx's generator) with 20 features, at most 100 samples a client
(about 93 samples a client on average); logistic regression, one local epoch, batch 10;
evaluation every round on the held-out samples of 1,000 clients. Inline backend: one
process, so its peak RSS is the whole simulation's. Each configuration runs in its own
subprocess so that its peak RSS is its own.

    python benchmarks/population.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

SCENARIO = """\
name: population
rounds: {rounds}
data:
  dataset: {{name: synthetic, alpha: 1.0, beta: 1.0, dimension: 20, max_samples: 100}}
  partitioner: {{name: natural}}
  load: {load}
model: {{name: logreg}}
clients: {{total: {total}, per_round: {per_round}}}
local: {{epochs: 1, batch_size: 10, lr: 0.01}}
evaluation: {{every: 1}}
runtime: {{backend: inline}}
"""

CONFIGS = [(100_000, 100, "all"), (100_000, 100, "cohort"), (1_000_000, 100, "cohort"),
           (1_000_000, 1_000, "cohort"), (10_000_000, 100, "cohort"),
           (10_000_000, 1_000, "cohort")]


def one(total: int, per_round: int, load_: str, rounds: int) -> dict:
    import numpy as np

    from simulator.config.load import load
    from simulator.runtime.backend import InlineBackend
    from simulator.sim.engine import Engine

    with TemporaryDirectory() as tmp:
        p = Path(tmp) / "s.yaml"
        p.write_text(SCENARIO.format(rounds=rounds, total=total, per_round=per_round,
                                     load=load_))
        sc = load(p).points[0].scenario
    t0 = time.perf_counter()
    eng = Engine(sc, InlineBackend(), workers=1)
    setup = time.perf_counter() - t0
    res = eng.run()
    rounds_s = [t["round_seconds"] for t in res.timings]
    samples = int(np.asarray(eng.data.client_sizes()).sum())
    return {"setup_s": setup, "median_round_s": statistics.median(rounds_s[1:] or rounds_s),
            "samples": samples, "data_gib": samples * 21 * 4 / 2**30,  # 20 features + label
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "final_test_accuracy": res.final("test_accuracy")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--one", nargs=3, metavar=("TOTAL", "PER_ROUND", "LOAD"))
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), int(args.one[1]), args.one[2], args.rounds)))
        return
    print(f"Synthetic(1,1), d = 20, logreg, inline backend, {args.rounds} rounds "
          "(median round after the first)")
    print(f"{'clients':>11s} {'a round':>8s} {'load':>7s} {'samples':>12s} {'data GiB':>9s} "
          f"{'setup s':>8s} {'s/round':>8s} {'peak RSS GiB':>12s} {'accuracy':>9s}")
    for total, per_round, load_ in CONFIGS:
        out = subprocess.run([sys.executable, __file__, "--rounds", str(args.rounds), "--one",
                              str(total), str(per_round), load_], capture_output=True,
                             text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{total:11,d} {per_round:8,d} {load_:>7s} {r['samples']:12,d} "
              f"{r['data_gib']:9.2f} {r['setup_s']:8.2f} {r['median_round_s']:8.3f} "
              f"{r['peak_rss_gib']:12.2f} {r['final_test_accuracy']:9.4f}", flush=True)


if __name__ == "__main__":
    main()
