"""fedray against pfl-research 0.6 on pfl's CIFAR-10 benchmark setup, in the same run.

pfl's benchmarks/image_classification/configs/baseline.yaml: 1,000 users of 50 images (IID),
a cohort of 50 a round, its simple CNN (``simple_cnn`` here, without dropout on both sides),
one local epoch of batch 10 at lr 0.1, FedAvg with a server SGD of lr 1. The images are
CIFAR-shaped (3 x 32 x 32 uint8, a class tints the mean colour: learnable), generated and
written in CIFAR-10's own format (five pickled training batches and ``test_batch``, 5,000
test images); fedray reads them with its ``cifar10`` data set (scaled to [0, 1]), partitions
them, and exports its partition and its model's initial weights to the pfl side, so both
train the same users from the same model on the same pixels.

Both use the machine's cores: fedray with ``runtime.workers`` ClientWorkers on a fresh local
Ray instance, each of ``runtime.threads`` threads; pfl with its single-process
``SimulatedBackend`` (pfl runs several processes only under Horovod or torch.distributed)
and as many torch threads as cores. fedray still delivers every client's update row to the
server (robust aggregation needs them); pfl sums the updates as it trains.

Prints both steady-state seconds per round (median gap between rounds after the first 3, the
evaluating last one left out), whole-run seconds, final accuracies, and the ratios.

    make pfl-venv                       # .venv-pfl: pfl[pytorch]==0.6.0 with torch==2.13.0
    python benchmarks/vs_pfl.py [--rounds 20] [--pfl-python .venv-pfl/bin/python]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
USERS, PER_USER, COHORT, TEST = 1000, 50, 50, 5000
SCENARIO = """\
name: vs-pfl
rounds: {rounds}
data:
  dataset: {{name: cifar10, root: {path}}}
  partitioner: {{name: iid}}
model: {{name: simple_cnn}}
clients: {{total: {users}, per_round: {cohort}}}
local: {{epochs: 1, batch_size: 10, lr: 0.1}}
aggregator: {{name: mean}}
server: {{optimizer: {{name: sgd, lr: 1.0}}}}
evaluation: {{every: {rounds}}}
runtime: {{backend: ray, workers: {workers}, threads: {threads}}}
"""


def fedray_side(scenario: str) -> None:
    """Run in a subprocess: the fedray simulation on a fresh local Ray; one JSON line."""
    t0 = time.perf_counter()
    from simulator.config.load import load
    from simulator.runtime.backend import RayBackend
    from simulator.sim.engine import Engine

    backend = RayBackend(include_dashboard=False, num_cpus=os.cpu_count())
    ends: list[float] = []
    try:
        res = Engine(load(scenario).points[0].scenario, backend).run(
            lambda r, m: ends.append(time.perf_counter()))
    finally:
        backend.shutdown()
    gaps = [b - a for a, b in itertools.pairwise(ends[3:-1])]
    print(json.dumps({"seconds": time.perf_counter() - t0, "round": statistics.median(gaps),
                      "accuracy": res.final("test_accuracy")}))


def export(scenario: str, path: Path, threads: int) -> None:
    """fedray's partition, test set and initial weights, for the pfl side."""
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
    np.savez(path, x=np.asarray(x), y=np.asarray(y), offsets=data.source.offsets,
             x_test=np.asarray(data.x_test), y_test=data.y_test, classes=data.num_classes,
             lr=sc.local.lr, server_lr=1.0, batch=sc.local.batch_size, threads=threads,
             **weights)


def write_cifar_batches(folder: Path, n_train: int, n_test: int, seed: int = 0) -> None:
    """CIFAR-shaped uint8 images whose class tints the mean colour (learnable), in
    CIFAR-10's published layout: ``data_batch_1..5`` and ``test_batch``, pickled dicts of
    ``data`` (N x 3072, channel-major) and ``labels``."""
    import pickle

    rng = np.random.default_rng(seed)
    tint = rng.integers(0, 256, (10, 3, 1, 1))
    folder.mkdir(parents=True)

    def batch(n: int) -> dict:
        labels = rng.integers(0, 10, n)
        x = np.clip(rng.normal(tint[labels], 60.0, (n, 3, 32, 32)), 0, 255).astype(np.uint8)
        return {b"data": x.reshape(n, 3072), b"labels": labels.tolist()}

    for i in range(1, 6):
        (folder / f"data_batch_{i}").write_bytes(pickle.dumps(batch(n_train // 5), protocol=2))
    (folder / "test_batch").write_bytes(pickle.dumps(batch(n_test), protocol=2))


def run(cmd: list[str]) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, check=False,
                         env={**os.environ, "RAY_ADDRESS": ""})
    if out.returncode != 0:
        raise RuntimeError(f"{cmd[1]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pfl-python", default=str(ROOT / ".venv-pfl" / "bin" / "python"))
    ap.add_argument("--fedray-side", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fedray_side:
        fedray_side(args.fedray_side)
        return
    with tempfile.TemporaryDirectory() as tmp:
        write_cifar_batches(Path(tmp) / "cifar-10-batches-py", USERS * PER_USER, TEST)
        scen = Path(tmp) / "vs-pfl.yaml"
        scen.write_text(SCENARIO.format(rounds=args.rounds, path=tmp, users=USERS,
                                        cohort=COHORT, workers=args.workers,
                                        threads=args.threads))
        data = Path(tmp) / "data.npz"
        export(str(scen), data, threads=os.cpu_count() or 1)
        fed = run([sys.executable, __file__, "--fedray-side", str(scen)])
        pfl = run([args.pfl_python, str(ROOT / "benchmarks" / "pfl_workload.py"), str(data),
                   str(args.rounds), str(COHORT)])
    print(f"{USERS} users x {PER_USER} images (3x32x32), cohort {COHORT}, simple_cnn, batch 10, "
          f"1 local epoch, {args.rounds} rounds, {os.cpu_count()} cores")
    print(f"{'':40s} {'s/round':>8s} {'users/s':>8s} {'whole s':>8s} {'accuracy':>9s}")
    rows = [(f"fedray ({args.workers} workers x {args.threads} thread(s), Ray)", fed),
            (f"pfl 0.6 (SimulatedBackend, {os.cpu_count()} threads)", pfl)]
    for name, r in rows:
        print(f"{name:40s} {r['round']:8.3f} {COHORT / r['round']:8.1f} {r['seconds']:8.1f} "
              f"{r['accuracy']:9.4f}")
    print(f"fedray / pfl throughput: {pfl['round'] / fed['round']:.2f}x per round, "
          f"{pfl['seconds'] / fed['seconds']:.2f}x whole run")


if __name__ == "__main__":
    main()
