"""fedray against Flower's simulation engine on the same workload, in the same run: 1,000
clients holding a Dirichlet(1) split of a 10-class Gaussian mixture in 60 dimensions (60,000
samples; fedray's partition, exported to the Flower side), 100 per round, an MLP with 64 hidden units,
one local epoch of batch 16, 20 rounds, FedAvg, both on Ray with one CPU per client worker.
Reports the wall-time ratio, the peak-memory ratio (the whole process tree's resident set,
sampled every 0.2 s) and both final accuracies. fedray runs three ways: its Engine in a
process with and without ``runtime.vectorize``, and as a user launches it, ``fedray run``
with a fresh SQLite MLflow store (params, every round's metrics, the model and the figures
logged), on Ray with two workers and with the scenario's defaults (``runtime.backend: auto``
chooses the backend).

``--workload heavy``: 200 clients of 300 samples (IID), 20 per round, an MLP with 1,024 hidden
units, where local training dominates a round (run it with ``--rounds 60``).

    make flower-venv                    # .venv-flower: flwr[simulation] (it pins ray 2.55.1)
    python benchmarks/vs_flower.py [--rounds 20] [--workload light|heavy]
                                   [--flower-python .venv-flower/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# (samples, partitioner, hidden units, clients, per round) of each workload
WORKLOADS = {
    # 1,000 clients of a Dirichlet(1) split, 100 per round, MLP [64]
    "light": (60000, "{name: dirichlet, alpha: 1.0}", 64, 1000, 100),
    # 200 clients of 300 samples (IID), 20 per round, MLP [1024]: local training dominates
    "heavy": (66667, "{name: iid}", 1024, 200, 20),
}
SCENARIO = """\
name: vs-flower
rounds: {rounds}
data:
  dataset: {{name: gaussian-mixture, samples: {samples}, dimension: 60, classes: 10,
             separation: 0.5}}
  partitioner: {partitioner}
  test_fraction: 0.1
model: {{name: mlp, hidden: [{hidden}]}}
clients: {{total: {clients}, per_round: {per_round}}}
local: {{epochs: 1, batch_size: 16, lr: 0.05}}
evaluation: {{every: {rounds}}}
runtime: {{backend: ray, workers: 2, vectorize: {vectorize}}}
"""


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (from /proc)."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


def measure(cmd: list[str], env: dict | None = None) -> tuple[dict, float, int]:
    """(the command's result, wall seconds, peak tree RSS bytes): its last line as JSON, or
    for ``fedray run`` the accuracy its "final test accuracy" line prints."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    peak = [0]

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss(proc.pid))
            time.sleep(0.2)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out, err = proc.communicate()
    t.join()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed:\n{err[-3000:]}")
    final = re.search(r"final test accuracy ([0-9.]+)", out)
    if final:
        return {"accuracy": float(final.group(1))}, wall, peak[0]
    return json.loads(out.strip().splitlines()[-1]), wall, peak[0]


def fedray_side(scenario: str) -> None:
    """Run in a subprocess: the fedray simulation; prints one JSON line."""
    from simulator.config.load import load
    from simulator.runtime.backend import RayBackend
    from simulator.sim.engine import Engine

    t0 = time.perf_counter()
    backend = RayBackend(include_dashboard=False, num_cpus=2)
    res = Engine(load(scenario).points[0].scenario, backend).run()
    backend.shutdown()
    print(json.dumps({"seconds": time.perf_counter() - t0, "accuracy": res.final("test_accuracy")}))


def export(scenario: str, path: Path) -> None:
    """fedray's partition and initial weights, for the Flower side."""
    import torch

    from simulator.config.load import load
    from simulator.data import client_arrays
    from simulator.models import build_model
    from simulator.runtime.backend import InlineBackend
    from simulator.sim.engine import Engine

    sc = load(scenario).points[0].scenario
    data = Engine(sc, InlineBackend()).data
    x, y = client_arrays(data.source.table, tuple(data.input_shape))
    model = build_model(sc.model, data.input_shape, data.num_classes, sc.seeds[0])
    weights = {f"w{i}": p.detach().numpy() for i, p in enumerate(model.parameters())}
    np.savez(path, x=np.asarray(x, np.float32).reshape(len(x), -1), y=np.asarray(y),
             offsets=data.source.offsets, x_test=data.x_test.reshape(len(data.x_test), -1),
             y_test=data.y_test, hidden=sc.model["hidden"][0], classes=data.num_classes,
             lr=sc.local.lr,
             batch=sc.local.batch_size, **weights)
    del torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="light")
    ap.add_argument("--flower-python", default=str(ROOT / ".venv-flower" / "bin" / "python"))
    ap.add_argument("--fedray-side", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fedray_side:
        fedray_side(args.fedray_side)
        return
    samples, partitioner, hidden, clients, per_round = WORKLOADS[args.workload]
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for vectorize in ("false", "true"):
            scen = Path(tmp) / f"s-{vectorize}.yaml"
            scen.write_text(SCENARIO.format(rounds=args.rounds, vectorize=vectorize,
                                            samples=samples, partitioner=partitioner,
                                            hidden=hidden, clients=clients,
                                            per_round=per_round))
            out, wall, peak = measure([sys.executable, __file__, "--fedray-side", str(scen)],
                                      {"RAY_ADDRESS": ""})
            rows.append((f"fedray (vectorize: {vectorize})", out["accuracy"], wall, peak))
        # the same run as a user launches it: `fedray run`, an MLflow store (SQLite) included,
        # on Ray with two workers as above, then with the scenario's defaults (runtime.backend:
        # auto, which picks the backend and the workers)
        default = Path(tmp) / "s-default.yaml"
        default.write_text((Path(tmp) / "s-false.yaml").read_text().replace(
            "runtime: {backend: ray, workers: 2, vectorize: false}", "runtime: {}"))
        for name, scen in (("fedray run (CLI, MLflow)", Path(tmp) / "s-false.yaml"),
                           ("fedray run (CLI, defaults)", default)):
            out, wall, peak = measure([sys.executable, "-m", "fedray", "run", str(scen),
                                       "--quiet", "--tracking-uri", f"sqlite:///{tmp}/mlflow.db"],
                                      {"RAY_ADDRESS": ""})
            rows.append((name, out["accuracy"], wall, peak))
        data = Path(tmp) / "data.npz"
        export(str(Path(tmp) / "s-false.yaml"), data)
        out, wall, peak = measure([args.flower_python, str(ROOT / "benchmarks" / "flower_workload.py"),
                                   str(data), str(args.rounds), str(per_round)],
                                  {"RAY_ADDRESS": ""})
        rows.append(("Flower 1.42 simulation", out["accuracy"], wall, peak))
    print(f"{clients:,} clients, {per_round} per round, MLP [{hidden}], 1 local epoch, "
          f"{args.rounds} rounds, {os.cpu_count()} CPUs")
    print(f"{'':28s} {'accuracy':>9s} {'wall s':>8s} {'peak RSS GiB':>13s}")
    for name, acc, wall, peak in rows:
        print(f"{name:28s} {acc:9.4f} {wall:8.1f} {peak / 2**30:13.2f}")
    flower = rows[-1]
    for name, _, wall, peak in rows[:-1]:
        print(f"{name}: {flower[2] / wall:.1f}x faster, {flower[3] / peak:.2f}x less memory than Flower")


if __name__ == "__main__":
    main()
