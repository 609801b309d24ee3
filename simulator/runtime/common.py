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


def evaluate_model(model: nn.Module, x: np.ndarray, y: np.ndarray
                   ) -> tuple[float, float, np.ndarray]:
    """(accuracy, mean cross-entropy, per-sample correctness) of ``model`` on ``(x, y)``."""
    hits = np.zeros(len(y), dtype=bool)
    if len(y) == 0:
        return float("nan"), float("nan"), hits
    correct, loss = 0, 0.0
    model.eval()
    with torch.no_grad():
        for lo in range(0, len(y), EVAL_BATCH):
            xb = model_input(x[lo : lo + EVAL_BATCH])
            yb = torch.from_numpy(np.array(y[lo : lo + EVAL_BATCH]))
            out = model(xb)
            loss += float(nn.functional.cross_entropy(out, yb, reduction="sum"))
            right = (out.argmax(1) == yb).numpy()
            hits[lo : lo + EVAL_BATCH] = right
            correct += int(right.sum())
    return correct / len(y), loss / len(y), hits


def client_accuracy(hits: np.ndarray, clients: np.ndarray) -> dict[str, float]:
    """Accuracy over each client's own test samples (clients -1 left out): their mean over
    clients (each client counts once, whatever its size) and its 10th percentile (how the
    worst-served clients fare: fairness, as LEAF reports it)."""
    mine = clients >= 0
    counts = np.bincount(clients[mine])
    has = counts > 0
    if not has.any():
        return {}
    acc = np.bincount(clients[mine], weights=hits[mine].astype(np.float64))[has] / counts[has]
    return {"client_test_accuracy_mean": float(acc.mean()),
            "client_test_accuracy_p10": float(np.percentile(acc, 10))}


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
