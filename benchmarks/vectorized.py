"""Local training of many small clients: one at a time (the loop) against vectorised
(runtime.vectorize: torch.func vmap), measured in the same run on the inline backend.

    python benchmarks/vectorized.py
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import torch

from simulator.config.load import load
from simulator.messages import TrainRequest
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine

SCENARIO = """\
name: vec-bench
rounds: 1
data: {data}
model: {model}
clients: {{total: {total}, per_round: 100}}
local: {{epochs: 1, batch_size: 16, lr: 0.05}}
"""


SYNTHETIC = "{dataset: {name: synthetic}, partitioner: {name: natural}}"
DIGITS = "{dataset: {name: digits}, partitioner: {name: dirichlet, alpha: 1.0}}"


def time_round(sc, clients: list[int], vectorize: bool, repeat: int = 3) -> float:
    """Median seconds of one worker's train call, with the sgd or the vectorized_sgd trainer."""
    sc = sc.model_copy(update={"runtime": sc.runtime.model_copy(update={"vectorize": vectorize})})
    eng = Engine(sc, InlineBackend())
    eng.start()
    worker = eng.pool.workers[0].actor
    x0 = torch.from_numpy(eng.protocol.server.actor.params())
    times = []
    for r in range(repeat):
        t0 = time.perf_counter()
        worker.train(TrainRequest(r, tuple(clients)), x0.numpy())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    print("1000 Synthetic clients (natural sizes) or 100 digits clients (Dirichlet 1), 100 per round, "
          "one local epoch (batch 16), 1 thread, inline backend")
    print(f"{'model':28s} {'loop s/round':>13s} {'vectorised':>11s} {'speed-up':>9s}")
    for label, model, data, total in [
            ("logreg", "{name: logreg}", SYNTHETIC, 1000),
            ("mlp [64]", "{name: mlp, hidden: [64]}", SYNTHETIC, 1000),
            ("mlp [1024]", "{name: mlp, hidden: [1024]}", SYNTHETIC, 1000),
            ("cnn [8, 16] (digits)", "{name: cnn, channels: [8, 16], hidden: 32}", DIGITS, 100)]:
        with TemporaryDirectory() as tmp:
            p = Path(tmp) / "s.yaml"
            p.write_text(SCENARIO.format(model=model, data=data, total=total))
            sc = load(p).points[0].scenario
            clients = list(range(0, total, total // 100))
            loop = time_round(sc, clients, False)
            vec = time_round(sc, clients, True)
            print(f"{label:28s} {loop:13.3f} {vec:11.3f} {loop / vec:8.1f}x")


if __name__ == "__main__":
    main()
