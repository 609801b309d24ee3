"""A sweep of short points: how long ``fedray sweep`` takes against the time of its rounds.

The sweep: the quickstart at ``--rounds`` rounds (5) over ``--seeds`` seeds (12), through the
CLI in a fresh process with a new tracking store (``python -m fedray sweep ...``), its
defaults (``runtime.backend: auto``) and ``--backend ray`` (Ray tasks, as every sweep ran
before auto). Its rounds: the same points' engines run one after another in one warm process
(the inline backend, data loaded, torch imported, one point run first as a warm-up), the
rounds' seconds summed over the points; on ``P`` parallel slots (``--parallel``, default
the machine's cores) they would take at least that sum over ``P``, and at most the sum
(one after another): both are printed, and the sweep's time as a ratio to each.

    python benchmarks/sweep_cost.py [--rounds 5] [--seeds 12] [--repeat 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "scenarios" / "quickstart.yaml"


def sweep_seconds(rounds: int, seeds: int, backend: str | None) -> float:
    """A fresh ``fedray sweep`` of the quickstart's ``seeds`` seeds, new store."""
    with tempfile.TemporaryDirectory(prefix="fedray-sweep-") as tmp:
        cmd = [sys.executable, "-m", "fedray", "sweep", str(QUICKSTART),
               "--set", f"rounds={rounds}", "--set", f"seeds={list(range(seeds))}",
               "--tracking-uri", f"sqlite:///{tmp}/mlflow.db"]
        if backend:
            cmd += ["--set", f"runtime.backend={backend}"]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, check=False)
        took = time.perf_counter() - t0
        if done.returncode != 0:
            raise RuntimeError(f"fedray sweep failed: {done.stderr.strip()[-600:]}")
        return took


def rounds_seconds(rounds: int, seeds: int) -> float:
    """The points' rounds, one after another in this warm process (inline)."""
    from simulator.config.load import load
    from simulator.runtime.backend import InlineBackend
    from simulator.sim.engine import Engine

    loaded = load(QUICKSTART, [f"rounds={rounds}", f"seeds={list(range(seeds))}"])
    Engine(loaded.points[0].scenario, InlineBackend()).run()  # warm-up
    total = 0.0
    for point in loaded.points:
        engine = Engine(point.scenario, InlineBackend())
        t0 = time.perf_counter()
        engine.run()
        total += time.perf_counter() - t0
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=12)
    ap.add_argument("--parallel", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    work = statistics.median(rounds_seconds(args.rounds, args.seeds)
                             for _ in range(args.repeat))
    slots = min(args.parallel, args.seeds)
    print(f"the rounds of {args.seeds} quickstart points of {args.rounds} rounds: {work:.2f} s "
          f"one after another, {work / slots:.2f} s on {slots} slots")
    print("\n| fedray sweep | seconds | / rounds on the slots | / rounds one after another |\n"
          "|---|---:|---:|---:|")
    for backend in (None, "ray"):
        took = statistics.median(sweep_seconds(args.rounds, args.seeds, backend)
                                 for _ in range(args.repeat))
        name = f"runtime.backend {backend}" if backend else "defaults"
        print(f"| {name} | {took:.2f} | {took / (work / slots):.1f}x | {took / work:.1f}x |",
              flush=True)
    print(f"\n(load average at the end: {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
