"""The steady-state round of ``make bench-flower``'s two workloads (benchmarks/vs_flower.py's
scenarios: ``light``, 1,000 clients / 100 a round, MLP [64]; ``heavy``, 200 clients / 20 a
round, MLP [1024]) on fedray's Engine with the ray backend and 2 workers, for this tree and
a base commit, alternated run by run in fresh processes (so drift on the machine falls on
both): the cost of a change to the message path (the codec chain's indirection) is the
ratio of the two medians.

    python benchmarks/message_path.py [--base REV] [--rounds 12] [--repeats 3]

The base commit is checked out with ``git worktree`` into a temporary folder and imported
from there (PYTHONPATH); the round time is the median of each run's rounds after the first
two (start-up and the first-touch of the round's buffers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from vs_flower import SCENARIO, WORKLOADS

CHILD = """
import json, sys, tempfile
from pathlib import Path
from simulator.config.load import load
from simulator.runtime.backend import RayBackend
try:
    from simulator.sim.engine import Engine
except ImportError:  # a base commit from before simulator/ had sub-packages
    from simulator.engine import Engine
text, skip = sys.argv[1], int(sys.argv[2])
p = Path(tempfile.mkdtemp()) / "s.yaml"
p.write_text(text)
sc = load(p).points[0].scenario
backend = RayBackend(num_cpus=2)
try:
    res = Engine(sc, backend).run()
finally:
    backend.shutdown()
print(json.dumps([t["round_seconds"] for t in res.timings[skip:]]))
"""


def one(tree: Path, text: str, skip: int) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(tree), "RAY_ADDRESS": "local"}
    out = subprocess.run([sys.executable, "-c", CHILD, text, str(skip)], cwd=tree, env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="HEAD~1")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp()) / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(base),
                    args.base], check=True)
    try:
        for name, (samples, part, hidden, clients, per_round) in WORKLOADS.items():
            text = SCENARIO.format(rounds=args.rounds, samples=samples, partitioner=part,
                                   hidden=hidden, clients=clients, per_round=per_round,
                                   vectorize="false")
            got: dict[str, list[float]] = {"base": [], "this": []}
            for _ in range(args.repeats):
                for label, tree in (("base", base), ("this", ROOT)):
                    got[label] += one(tree, text, 2)
            med = {k: statistics.median(v) for k, v in got.items()}
            print(f"{name}: round {med['this'] * 1e3:.1f} ms (this) vs {med['base'] * 1e3:.1f} "
                  f"ms ({args.base}): ratio {med['this'] / med['base']:.3f} "
                  f"({len(got['this'])} rounds each)", flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                       check=True)


if __name__ == "__main__":
    main()
