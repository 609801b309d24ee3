"""Load time and partition-table size of the file-backed data sets, on files in their real
formats written at a given size (generated pixels: the formats' parsing costs are what is
measured, not the pictures); then FEMNIST converted once to Parquet sorted by writer
(``fedray data convert``): the conversion, a whole load of the Parquet files, and a
``data.load: cohort`` read of 100 writers. The figures of docs/datasets.md.

    python benchmarks/datasets.py [--samples 100000] [--leaf-samples 10000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulator.data import build
from tests import formats


def measure(name: str, root: Path, clients: int, partitioner: str) -> tuple[float, int, int]:
    """(seconds to load and partition, table bytes, training samples)."""
    t0 = time.perf_counter()
    data = build({"name": name, "root": str(root)}, {"name": partitioner}, clients, 0, 0.2)
    return time.perf_counter() - t0, data.source.table.nbytes, len(data.source.table)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--leaf-samples", type=int, default=10_000,
                    help="FEMNIST's JSON holds every pixel as a decimal: its files are large")
    args = ap.parse_args()
    n = args.samples
    print(f"{'data set':10s} {'train samples':>13s} {'load s':>8s} {'s / 100k':>9s} "
          f"{'table MB':>9s} {'bytes / sample':>15s}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        formats.write_mnist(root / "mnist", n_train=n, n_test=n // 6, gz=True)
        formats.write_cifar10(root / "cifar", per_batch=n // 5, n_test=n // 5)
        writers = max(4, args.leaf_samples // 200)  # FEMNIST's writers: about 230 images each
        formats.write_leaf(root / "leaf", writers=writers, per_writer=266, files=4)
        for name, sub, clients, part in (("mnist", "mnist", 100, "iid"),
                                         ("cifar10", "cifar", 100, "iid"),
                                         ("femnist", "leaf", writers, "natural")):
            secs, nbytes, rows = measure(name, root / sub, clients, part)
            print(f"{name:10s} {rows:13,d} {secs:8.2f} {secs * 100_000 / rows:9.2f} "
                  f"{nbytes / 2**20:9.1f} {nbytes / rows:15.0f}")
        converted(root / "leaf", writers)


def converted(leaf: Path, writers: int) -> None:
    """FEMNIST's JSON converted once, then read back whole and a cohort at a time."""
    import numpy as np

    from simulator.data.convert import convert

    t0 = time.perf_counter()
    out = convert({"name": "femnist", "root": str(leaf)}, {"name": "natural"}, writers, 0, 0.2,
                  leaf.parent / "femnist-parquet")
    secs = time.perf_counter() - t0
    spec = {"name": "parquet", "path": str(out.train), "test_path": str(out.test),
            "client": "client", "features": ["x"], "shape": [1, 28, 28], "classes": 62}
    t0 = time.perf_counter()
    whole = build(spec, {"name": "natural"}, writers, 0, 0.2)
    load_s = time.perf_counter() - t0
    cohort = build(spec, {"name": "natural"}, writers, 0, 0.2, load="cohort")
    rng = np.random.default_rng(0)
    reads: dict[int, list[float]] = {10: [], 100: []}
    rows = dict.fromkeys(reads, 0)
    for k, times in reads.items():
        for _ in range(5):
            ids = np.sort(rng.choice(writers, min(k, writers), replace=False)).tolist()
            t0 = time.perf_counter()
            rows[k] = sum(len(y) for _, y in cohort.source.train(ids))
            times.append(time.perf_counter() - t0)
    n = out.train_samples
    print(f"\nFEMNIST converted to Parquet ({writers} writers, {n:,d} train samples)")
    print(f"  convert: {secs:.2f} s ({secs * 100_000 / n:.1f} s / 100k, once)")
    print(f"  load all from Parquet: {load_s:.2f} s ({load_s * 100_000 / n:.2f} s / 100k); "
          f"table {whole.source.table.nbytes / 2**20:.1f} MB")
    for k, times in reads.items():
        print(f"  load cohort, {k} writers (about {rows[k]:,d} samples): "
              f"{sorted(times)[2] * 1000:.0f} ms a read (median of 5)")


if __name__ == "__main__":
    main()
