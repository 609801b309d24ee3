"""The GPU check of the models/devices work, one prepared run (under 8 minutes on one GPU):
CIFAR-shaped data (generated, written as a Parquet file of uint8 images), ResNet-18 with
BatchNorm, 100 clients of 50 images, 20 per round, one local epoch (batch 32), 3 rounds,
on the Ray backend; the workers' device cuda and cpu, precision fp32 and bf16 (the server
aggregates and evaluates on the GPU in every row: ``server_device: auto``). For each: the
seconds of round 2 (round 1 includes start-up and cuDNN's warm-up, round 3 the evaluation),
final test accuracy and loss, and the peak device memory of a worker; then the same cuda
fp32 run with 1,000 clients, to show that device memory does not grow with the clients.

    python benchmarks/gpu.py [--workers-gpu 4] [--workers-cpu N] [--out results.md]
                             [--model resnet20]

Prints a Markdown table (docs/performance.md takes it) and writes it to --out.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SCENARIO = """\
name: gpu-check
rounds: 3
data:
  dataset: {{name: parquet, path: {path}, shape: [3, 32, 32]}}
  partitioner: {{name: iid}}
model: {{name: {model}, norm: batch}}
clients: {{total: {clients}, per_round: 20}}
local: {{epochs: 1, batch_size: 32, lr: 0.05, momentum: 0.9}}
evaluation: {{every: 3}}
runtime: {{backend: ray, workers: {workers}, device: {device}, precision: {precision},
           server_device: auto}}
"""


def write_images(path: Path, n: int, seed: int = 0) -> None:
    """``n`` CIFAR-shaped uint8 images whose class shifts the mean colour: learnable."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n)
    tint = rng.integers(0, 256, (10, 3, 1, 1))
    x = np.clip(rng.normal(tint[labels], 60.0, (n, 3, 32, 32)), 0, 255).astype(np.uint8)
    col = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 3 * 32 * 32)
    pq.write_table(pa.table({"x": col, "label": labels.astype(np.int64)}), path)


def run(path: Path, clients: int, workers: int, device: str, precision: str,
        model: str = "resnet18") -> dict:
    from simulator.config.load import load
    from simulator.runtime.backend import RayBackend
    from simulator.sim.engine import Engine

    text = SCENARIO.format(path=path, clients=clients, workers=workers, device=device,
                           precision=precision, model=model)
    spec = path.parent / f"{device}-{precision}-{clients}.yaml"
    spec.write_text(text)
    eng = Engine(load(spec).points[0].scenario, RayBackend())
    peaks: list[int] = []
    original = eng.protocol.final

    def final_with_memory():  # read the workers' peak memory before they are released
        peaks.extend(eng.backend.get([w.peak_memory() for w in eng.pool.workers]))
        return original()

    eng.protocol.final = final_with_memory  # type: ignore[method-assign]
    t0 = time.perf_counter()
    res = eng.run()
    rounds = [t["round_seconds"] for t in res.timings]
    return {"device": device, "precision": precision, "clients": clients, "workers": workers,
            "round_s": rounds[1], "first_round_s": rounds[0], "last_round_s": rounds[2],
            "total_s": time.perf_counter() - t0, "accuracy": res.final("test_accuracy"),
            "loss": res.final("test_loss"), "peak_mib": max(peaks) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers-gpu", type=int, default=4)
    ap.add_argument("--workers-cpu", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--model", default="resnet18", help="resnet20 for a quick try on a CPU")
    a = ap.parse_args()
    import torch

    rows = []
    with TemporaryDirectory() as tmp:
        plan = [("cuda", "fp32", 100), ("cuda", "bf16", 100), ("cpu", "fp32", 100),
                ("cpu", "bf16", 100), ("cuda", "fp32", 1000)]
        if not torch.cuda.is_available():
            print("no GPU here: the cpu rows only")
            plan = [p for p in plan if p[0] == "cpu"]
        files = {}
        for clients in sorted({c for _, _, c in plan}):  # 50 images a client, 20% test
            files[clients] = Path(tmp) / f"cifar_shaped_{clients}.parquet"
            write_images(files[clients], clients * 50 * 5 // 4)
        header = ("| device | precision | clients | workers | round 2 s | first round s | "
                  "last round s (with evaluation) | test accuracy | test loss | "
                  "peak worker memory |")
        lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
              f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}")
        print("\n".join(lines), flush=True)
        for device, precision, clients in plan:
            workers = a.workers_gpu if device == "cuda" else a.workers_cpu
            r = run(files[clients], clients, workers, device, precision, a.model)
            rows.append(r)
            line = (f"| {device} | {precision} | {clients} | {workers} | {r['round_s']:.2f} | "
                    f"{r['first_round_s']:.2f} | {r['last_round_s']:.2f} | "
                    f"{r['accuracy']:.3f} | {r['loss']:.3f} | "
                    f"{r['peak_mib']:.0f} MiB |")
            lines.append(line)
            print(line, flush=True)
    if a.out is not None:
        a.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
