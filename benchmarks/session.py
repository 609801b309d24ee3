"""Runs in one Python session: how soon the second, third, ... run reaches its first round.

In one process, ``--runs`` runs of the quickstart at ``--rounds`` rounds one after another
(``simulator.run.runner.run_loaded``, the MLflow store existing), for each way a session
may run them:

* ``auto``: the scenario's defaults (``runtime.backend: auto``: inline for the quickstart);
* ``ray``: ``--backend ray --workers 2``, each run starting and ending its own Ray instance
  and actors (a session without a pool);
* ``ray, warm pool``: the same inside ``simulator.runtime.pool.warm_pool()``: Ray starts
  once, the actors of a finished run are rebuilt for the next one;

and prints the seconds from the call to its first round and to its return, first run and
the median of the later ones, with ``import torch`` (a fresh process) beside them.

    python benchmarks/session.py [--runs 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "scenarios" / "quickstart.yaml"


def import_torch() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - t0


def series(runs: int, rounds: int, uri: str, backend: str | None, pooled: bool
           ) -> list[tuple[float, float, float]]:
    """(seconds to the first round, to the return, final accuracy) of each run."""
    from simulator.config.load import load
    from simulator.run.callbacks import Callback
    from simulator.run.runner import run_loaded
    from simulator.runtime.pool import warm_pool

    class FirstRound(Callback):
        at: float | None = None

        def on_round(self, run: object, round_: int, metrics: dict[str, float]) -> None:
            if self.at is None:
                self.at = time.perf_counter()

    out = []
    with warm_pool() if pooled else contextlib.nullcontext():
        for _ in range(runs):
            seen = FirstRound()
            t0 = time.perf_counter()
            result = run_loaded(load(QUICKSTART, [f"rounds={rounds}"]), backend, tracking_uri=uri,
                                quiet=True, workers=2 if backend == "ray" else None,
                                callbacks=[seen])
            end = time.perf_counter()
            assert seen.at is not None
            out.append((seen.at - t0, end - t0, result.runs[0]["final_test_accuracy"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch_s = statistics.median(import_torch() for _ in range(3))
    print(f"import torch: {torch_s:.2f} s (median of 3 fresh processes)")
    print(f"\n| {args.runs} runs of the quickstart at {args.rounds} rounds, one session | "
          "first run: first round | finished | later runs (median): first round | finished "
          "| accuracy |\n|---|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory(prefix="fedray-session-") as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        series(1, 1, uri, "inline", False)  # the store, the imports: every series finds them
        for name, backend, pooled in (("auto", None, False), ("ray", "ray", False),
                                      ("ray, warm pool", "ray", True)):
            runs = series(args.runs, args.rounds, uri, backend, pooled)
            later = runs[1:]
            accs = {round(r[2], 6) for r in runs}
            print(f"| {name} | {runs[0][0]:.2f} s | {runs[0][1]:.2f} s | "
                  f"{statistics.median(r[0] for r in later):.2f} s | "
                  f"{statistics.median(r[1] for r in later):.2f} s | "
                  f"{', '.join(f'{a:.4f}' for a in sorted(accs))} |", flush=True)
    print(f"\n(load average at the end: {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
