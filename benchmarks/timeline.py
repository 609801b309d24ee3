"""Where a whole run's time goes: one fedray run on a fresh local Ray instance (or inline),
with the time at which each phase ends, from the process's start: imports, ``ray.init``,
the scenario's validation, the engine's construction (the data), the actors' start, each
round (with its slowest worker's training and the server's step) and the backend's shutdown.

    python benchmarks/timeline.py SCENARIO.yaml [--backend ray|inline]
    python benchmarks/timeline.py --workload pfl [--rounds 20] [--backend inline --workers 1
                                  --bare]

``--workload pfl`` runs benchmarks/vs_pfl.py's scenario on its generated CIFAR-shaped data
(written to a temporary folder). ``--bare`` then trains the same model for the same steps
(50 clients of 50 images, batch 10: forward, cross-entropy, backward, ``p -= lr * g``,
nothing else) in this process, five times, to set the worker's training beside it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def restart_clock() -> None:
    """Phases count from here (after ``--workload``'s data is written)."""
    global T0
    T0 = time.perf_counter()


def mark(what: str) -> None:
    print(f"{time.perf_counter() - T0:8.2f} s  {what}", flush=True)


def bare(model_spec: dict, repeat: int = 5) -> None:
    """The pfl workload's round (50 clients x 5 steps of batch 10) in a bare loop."""
    import torch

    from simulator.models import build_model

    model = build_model(model_spec, (3, 32, 32), 10, 0)
    params = list(model.parameters())
    init = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(0)
    data = [(torch.rand(50, 3, 32, 32, generator=g), torch.randint(0, 10, (50,), generator=g))
            for _ in range(50)]
    for _ in range(repeat):
        t0 = time.perf_counter()
        for x, y in data:
            with torch.no_grad():
                for p, p0 in zip(params, init, strict=True):
                    p.copy_(p0)
            perm = torch.randperm(50, generator=g)
            for i in range(0, 50, 10):
                idx = perm[i : i + 10]
                for p in params:
                    p.grad = None
                torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                with torch.no_grad():
                    for p in params:
                        p -= 0.1 * p.grad
        print(f"bare loop, the same 250 steps: {time.perf_counter() - t0:.3f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", nargs="?")
    ap.add_argument("--workload", choices=["pfl"])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--backend", choices=["ray", "inline"], default="ray")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--bare", action="store_true")
    args = ap.parse_args()
    if (args.scenario is None) == (args.workload is None):
        ap.error("give a SCENARIO or --workload pfl")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.scenario
        if args.workload == "pfl":
            import vs_pfl

            vs_pfl.write_cifar_batches(Path(tmp) / "cifar-10-batches-py",
                                       vs_pfl.USERS * vs_pfl.PER_USER, vs_pfl.TEST)
            path = str(Path(tmp) / "pfl.yaml")
            Path(path).write_text(vs_pfl.SCENARIO.format(
                rounds=args.rounds, path=tmp, users=vs_pfl.USERS, cohort=vs_pfl.COHORT,
                workers=args.workers, threads=1).replace("backend: ray", f"backend: {args.backend}"))
        restart_clock()
        from simulator.config.load import load
        from simulator.runtime.backend import InlineBackend, RayBackend
        from simulator.sim.engine import Engine
        mark("imports")
        backend = (RayBackend(include_dashboard=False, num_cpus=os.cpu_count())
                   if args.backend == "ray" else InlineBackend())
        mark(f"backend ({args.backend})")
        sc = load(path).points[0].scenario
        mark("the scenario validated")
        engine = Engine(sc, backend)
        mark("the engine built (the data loaded)")
        engine.start = _marked(engine.start, "the actors started")
        try:
            res = engine.run(lambda r, m: mark(f"round {r}"))
        finally:
            backend.shutdown()
        mark("backend shut down")
        for r, t in enumerate(res.timings):
            print(f"round {r}: slowest worker {t['slowest_worker_seconds']:.3f} s, "
                  f"server step {t['server_seconds']:.3f} s, round {t['round_seconds']:.3f} s")
        if args.bare:
            bare(sc.model)


def _marked(fn, what):
    def call(*a, **k):
        out = fn(*a, **k)
        mark(what)
        return out
    return call


if __name__ == "__main__":
    main()
