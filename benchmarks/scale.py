"""Scale: 10,000 virtual clients with per-client worker-momentum state at d ~ 100,000 on one
machine: seconds per round at 100 and 1,000 clients per round and the process's peak RSS,
with the state kept in float32 and in float16. Inline backend (one process: the RSS is the
whole simulation's).

    python benchmarks/scale.py [--rounds 8]

Each configuration runs in its own subprocess so that its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

SCENARIO = """\
name: scale
rounds: {rounds}
data:
  dataset: {{name: synthetic, max_samples: 200}}
  partitioner: {{name: natural}}
  test_fraction: 0.1
model: {{name: mlp, hidden: [1500]}}
clients: {{total: 10000, per_round: {per_round}}}
local: {{batch_size: 16, lr: 0.05, optimizer: {{name: momentum, beta: 0.9}}}}
evaluation: {{every: {rounds}}}
runtime: {{backend: inline, state_dtype: {dtype}}}
"""


def one(per_round: int, dtype: str, rounds: int) -> dict:
    from simulator.config.load import load
    from simulator.runtime.backend import InlineBackend
    from simulator.sim.engine import Engine

    with TemporaryDirectory() as tmp:
        p = Path(tmp) / "s.yaml"
        p.write_text(SCENARIO.format(rounds=rounds, per_round=per_round, dtype=dtype))
        sc = load(p).points[0].scenario
    t0 = time.perf_counter()
    eng = Engine(sc, InlineBackend())
    setup = time.perf_counter() - t0
    res = eng.run()
    per_round_s = [t["round_seconds"] for t in res.timings]
    worker = eng.pool.workers[0].actor
    holders = len(worker.client_state)
    state_bytes = worker.client_state.nbytes()
    return {"per_round": per_round, "dtype": dtype, "d": int(res.final_params.size),
            "setup_s": setup, "median_round_s": sorted(per_round_s)[len(per_round_s) // 2],
            "clients_with_state": holders, "state_gib": state_bytes / 2**30,
            "state_bytes_per_client": state_bytes / max(holders, 1),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "final_test_accuracy": res.final("test_accuracy")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--one", nargs=2, metavar=("PER_ROUND", "DTYPE"))
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.one[1], args.rounds)))
        return
    print("10,000 clients, worker momentum (state per client), MLP d ~ 100k, inline backend")
    print(f"{'per round':>9s} {'state':>7s} {'s/round':>8s} {'rounds/s':>9s} {'holders':>8s} "
          f"{'state GiB':>9s} {'GiB at 10k':>10s} {'peak RSS GiB':>12s}")
    for per_round, dtype in [(100, "float32"), (1000, "float32"), (1000, "float16")]:
        out = subprocess.run([sys.executable, __file__, "--rounds", str(args.rounds), "--one",
                              str(per_round), dtype], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        full = r["state_bytes_per_client"] * 10_000 / 2**30
        print(f"{per_round:9d} {dtype:>7s} {r['median_round_s']:8.2f} {1 / r['median_round_s']:9.2f} "
              f"{r['clients_with_state']:8d} {r['state_gib']:9.2f} {full:10.2f} "
              f"{r['peak_rss_gib']:12.2f}", flush=True)


if __name__ == "__main__":
    main()
