"""The model zoo's table for docs/models.md: parameters, buffers, FLOPs per sample (forward,
counted by torch.utils.flop_counter on one sample, LSTM layers added by their formula) and the time of one local epoch of SGD
(500 samples, batch 32, as a client of CIFAR-10 split over 100 clients holds) on this
machine, with the worker's settings: one thread, fp32, and bf16 autocast.

    python benchmarks/models.py [--device cuda] [--epoch-samples 500] [--batches 3]

The epoch time is measured on ``--batches`` batches after one warm-up batch and scaled to
the epoch's ceil(500 / 32) = 16 batches.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from simulator.models import build_model
from strategies.tasks import Classification, NextToken

ZOO = [  # (spec, input shape, classes, token vocabulary, the data set it is made for)
    ({"name": "logreg"}, (1, 28, 28), 10, None, "MNIST"),
    ({"name": "mlp", "hidden": [200, 200]}, (1, 28, 28), 10, None, "MNIST"),
    ({"name": "cnn"}, (1, 28, 28), 10, None, "MNIST"),
    ({"name": "cnn", "norm": "batch"}, (1, 28, 28), 10, None, "MNIST"),
    ({"name": "femnist_cnn"}, (1, 28, 28), 62, None, "FEMNIST"),
    ({"name": "resnet20"}, (3, 32, 32), 10, None, "CIFAR-10"),
    ({"name": "resnet20", "norm": "group"}, (3, 32, 32), 10, None, "CIFAR-10"),
    ({"name": "resnet18"}, (3, 32, 32), 10, None, "CIFAR-10"),
    ({"name": "resnet18", "norm": "group"}, (3, 32, 32), 10, None, "CIFAR-10"),
    ({"name": "char_lstm"}, (80,), 80, 80, "Shakespeare"),
    ({"name": "char_lstm", "positions": "all"}, (80,), 80, 80, "Shakespeare (next_token)"),
]


def flops(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Forward FLOPs of one sample: torch's counter, plus the LSTM layers it does not count
    (per step and layer, 4 gates of (input + hidden) x hidden multiply-adds)."""
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(x)
    total = int(counter.get_total_flops())
    steps = x.shape[1] if x.dim() == 2 else 1
    for m in model.modules():
        if isinstance(m, torch.nn.LSTM):
            for layer in range(m.num_layers):
                width = m.input_size if layer == 0 else m.hidden_size
                total += 2 * 4 * (width + m.hidden_size) * m.hidden_size * steps
    return total


def epoch_seconds(model: torch.nn.Module, shape: tuple[int, ...], classes: int,
                  vocabulary: int | None, task, device: str, bf16: bool, batch: int,
                  batches: int, samples: int) -> float:
    g = torch.Generator().manual_seed(0)
    if vocabulary:
        x = torch.randint(0, vocabulary, (batch, *shape), generator=g)
    else:
        x = torch.rand((batch, *shape), generator=g)
    y = torch.randint(0, classes, (batch,), generator=g)
    x, y = x.to(device), y.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
            loss = task.losses(model(x), task.target(x, y)).mean()
        loss.backward()
        opt.step()

    step()  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(batches):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / batches * math.ceil(samples / batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--epoch-samples", type=int, default=500)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"| model | data | parameters | buffers | MFLOPs / sample | epoch fp32 ({a.device}) "
          "| epoch bf16 |")
    print("|---|---|---|---|---|---|---|")
    for spec, shape, classes, vocab, data in ZOO:
        model = build_model(spec, shape, classes, 0, vocab).to(a.device)
        one = (torch.zeros((1, *shape), dtype=torch.int64) if vocab else
               torch.zeros((1, *shape))).to(a.device)
        task = NextToken() if spec.get("positions") == "all" else Classification()
        params = sum(p.numel() for p in model.parameters())
        bufs = sum(b.numel() for b in model.buffers())
        times = [epoch_seconds(model, shape, classes, vocab, task, a.device, bf16, a.batch,
                               a.batches, a.epoch_samples) for bf16 in (False, True)]
        args = ", ".join(f"{k}: {v}" for k, v in spec.items() if k != "name")
        name = f"`{spec['name']}`" + (f" ({args})" if args else "")
        print(f"| {name} | {data} | {params:,} | {bufs:,} | {flops(model, one) / 1e6:,.1f} | "
              f"{times[0]:.2f} s | {times[1]:.2f} s |", flush=True)


if __name__ == "__main__":
    main()
