"""Load time and partition-table size of the file-backed data sets, on files in their real
formats written at a given size (generated pixels: the formats' parsing costs are what is
measured, not the pictures). The figures of docs/datasets.md.

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


if __name__ == "__main__":
    main()
