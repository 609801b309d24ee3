"""What an empirical privacy audit (``audit:``) costs: a run with the audit against the same
run without it, and the audit's own parts at larger models.

    python benchmarks/audit_cost.py [--repeats 3] [--dims 100000,1000000] [--canaries 500,1000]

1. Whole runs: scenarios/audit_dp_fedavg.yaml at noise multiplier 1, seed 0 (mnist5k,
   500 clients, 50 a round, logistic regression, d = 7,850, 30 rounds, 500 canaries,
   inline backend), with ``audit`` and with ``audit: null``; wall seconds of
   ``Engine.run``, best of ``--repeats`` (the data set's load is outside the timing only in
   that both pay it).
2. The audit's parts on a model of ``d`` parameters (simulator/runtime/audit.py): a round's
   canary rows for an inserted half sampled at q = 0.1 (directions drawn once and kept up to
   2^26 floats, drawn again each round beyond), and one scoring (every canary's direction
   drawn again, chunk by chunk, against the model's change, then the two estimates).
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


def run_seconds(audit: bool, repeats: int) -> tuple[float, dict[str, float]]:
    from simulator.config.load import load
    from simulator.runtime.backend import InlineBackend
    from simulator.sim.engine import Engine

    sets = ["sweep={}", "seeds=[0]", "privacy.noise_multiplier=1.0"]
    if not audit:
        sets.append("audit=null")
    sc = load(ROOT / "scenarios" / "audit_dp_fedavg.yaml", sets).points[0].scenario
    best, last = float("inf"), {}
    for _ in range(repeats):
        t = time.perf_counter()
        res = Engine(sc, InlineBackend()).run()
        best = min(best, time.perf_counter() - t)
        last = res.metrics[-1]
    return best, last


def parts_seconds(d: int, canaries: int, repeats: int) -> tuple[float, float]:
    """(a round's canary rows, one scoring) in seconds on a d-parameter model."""
    import torch

    from simulator.config.load import load
    from simulator.config.plan import resolve
    from simulator.runtime.audit import CanaryAudit

    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "s.yaml"
        p.write_text(f"""name: cost
rounds: 2
data: {{dataset: {{name: digits}}}}
model: {{name: logreg}}
clients: {{total: {canaries}, per_round: {canaries // 10}}}
audit: {{canaries: {canaries}}}
""")
        plan = resolve(load(p).points[0].scenario)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(d, generator=g)
    audit = CanaryAudit(plan, x0)
    honest = torch.randn(50, d, generator=g)
    audit.rows(0, honest)  # the first round draws the directions it keeps
    rows = score = float("inf")
    for r in range(1, repeats + 1):
        t = time.perf_counter()
        audit.rows(r, honest)
        rows = min(rows, time.perf_counter() - t)
        x = x0 + torch.randn(d, generator=g)
        t = time.perf_counter()
        audit.statistics(x)
        score = min(score, time.perf_counter() - t)
    return rows, score


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dims", default="100000,1000000")
    ap.add_argument("--canaries", default="500,1000")
    args = ap.parse_args()
    with_audit, m = run_seconds(True, args.repeats)
    without, _ = run_seconds(False, args.repeats)
    print("| run (scenarios/audit_dp_fedavg.yaml, sigma 1, seed 0) | seconds |")
    print("|---|---:|")
    print(f"| without audit | {without:.2f} |")
    print(f"| with audit (500 canaries, scored once, after round 30) | {with_audit:.2f} |")
    print(f"| ratio | {with_audit / without:.2f} |")
    print(f"\n(audit_epsilon {m['audit_epsilon']:.3f}, epsilon {m['epsilon']:.3f})\n")
    print("| d | canaries | a round's canary rows (s) | one scoring (s) |")
    print("|---:|---:|---:|---:|")
    for d in (int(v) for v in args.dims.split(",")):
        for c in (int(v) for v in args.canaries.split(",")):
            rows, score = parts_seconds(d, c, args.repeats)
            print(f"| {d:,} | {c} | {rows:.4f} | {score:.2f} |")


if __name__ == "__main__":
    main()
