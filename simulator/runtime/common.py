"""What every actor shares: one thread per process, the results layout, evaluation."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

EVAL_BATCH = 4096


def single_thread() -> None:
    """Same arithmetic in every process (driver, actors) whatever the core count: BLAS
    results can differ in the last bits between thread counts."""
    torch.set_num_threads(1)


def model_input(x: np.ndarray) -> torch.Tensor:
    """A batch of samples as the model takes it: a writable float32 tensor; uint8 images
    (stored compactly in the partition table) scaled to [0, 1]; int32 token ids as int64."""
    if x.dtype == np.int32:
        return torch.from_numpy(np.asarray(x, dtype=np.int64))
    if x.dtype == np.uint8:
        return torch.from_numpy(np.asarray(x, dtype=np.float32) / np.float32(255.0))
    return torch.from_numpy(np.array(x, dtype=np.float32))  # a copy: ray views are read-only


def evaluate_model(model: nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on ``(x, y)``."""
    if len(y) == 0:
        return float("nan"), float("nan")
    correct, loss = 0, 0.0
    model.eval()
    with torch.no_grad():
        for lo in range(0, len(y), EVAL_BATCH):
            xb = model_input(x[lo : lo + EVAL_BATCH])
            yb = torch.from_numpy(np.array(y[lo : lo + EVAL_BATCH]))
            out = model(xb)
            loss += float(nn.functional.cross_entropy(out, yb, reduction="sum"))
            correct += int((out.argmax(1) == yb).sum())
    return correct / len(y), loss / len(y)


def stack_updates(
    order: list[int] | np.ndarray, results: tuple[dict, ...], d: int, key: str = "updates"
) -> np.ndarray:
    """The results' rows of ``key`` (``(len(order), d)`` updates, or per-client values when
    ``d == 0``) in ``order`` of client ids, whichever worker computed them: the layout, and so
    every floating-point sum over it, does not depend on the number of workers."""
    order = np.asarray(order, dtype=np.int64)
    shape = (len(order), d) if d else (len(order),)
    out = np.empty(shape, dtype=np.float32 if d else np.float64)
    if len(order) == 0:
        return out
    pos = {int(c): i for i, c in enumerate(order)}
    for r in results:
        if len(r["clients"]):
            out[[pos[int(c)] for c in r["clients"]]] = r[key]
    return out
