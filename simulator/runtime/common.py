"""What every actor shares: one thread per process, the results layout, evaluation."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import nn

from simulator.data.datasets import unit_pixels
from simulator.messages import EvalScores, PersonalScores
from simulator.runtime.kernels import pin_kernels
from strategies.protocols import Task

EVAL_BATCH = 4096  # samples whose losses are summed together (float64) into the mean
# samples one forward pass of an evaluation takes on the CPU: activations of a few MB stay in
# the caches, where a pass over 4,096 images does not (simple_cnn, resnet20: 2.3x faster at
# 64; MLP [1024]: 4x). Every built-in model gives each sample the same outputs whatever
# the batch (tests/simulator/test_evaluation.py), and the losses are still summed per
# EVAL_BATCH, so the numbers do not move. A chunk is never shorter than this (the block's rest
# joins the chunk before it; a block shorter than this is one pass): batches of fewer than 16
# samples take other kernels here, and their outputs differ in the last bit from a long one's.
EVAL_CHUNK = 64


def single_thread(threads: int = 1) -> None:
    """Same arithmetic in every process (driver, actors) whatever the core count: BLAS
    results can differ in the last bits between thread counts (``runtime.threads``, 1 by
    default, gives a worker more)."""
    torch.set_num_threads(threads)


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch runs ``threads`` threads inside the block, then as many as before."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` (refused in one line where this process sees no GPU) or ``auto``
    (cuda when there is one)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        from simulator.errors import DeviceUnavailable

        raise DeviceUnavailable("runtime.device: cuda, but this process sees no GPU (torch "
                                f"{torch.__version__}, CUDA {torch.version.cuda}); use "
                                "device: auto or cpu, or give workers num_gpus")
    return torch.device(name)


def deterministic_mode(mode: bool | str) -> None:
    """``runtime.deterministic`` in this process: torch's deterministic algorithms, cuDNN's
    included (``true``: bit-identical reruns on one machine, a GPU included); ``strict`` adds
    the kernels pinned to the portable ones (bit-identical on any x86-64 machine,
    ``simulator.runtime.kernels``)."""
    if mode == "strict":
        pin_kernels()
    if mode:
        import os

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts
    # both ways: a warm pool's actor may have run a point of the other mode before. Only
    # when it changes: the call imports torch._inductor and torch._dynamo (1-2 s here)
    if torch.are_deterministic_algorithms_enabled() != bool(mode):
        torch.use_deterministic_algorithms(bool(mode))
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = bool(mode)


def model_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The model's persistent buffers (BatchNorm's running statistics and batch counter), in
    ``state_dict`` order: the model state that is not a parameter."""
    keep = set(model.state_dict(keep_vars=True))
    return [b for name, b in model.named_buffers() if name in keep]


def buffers_to_vector(model: nn.Module) -> torch.Tensor:
    """The model's buffers as one float32 vector (empty for a model without any)."""
    bufs = model_buffers(model)
    if not bufs:
        return torch.zeros(0)
    return torch.cat([b.detach().reshape(-1).to(torch.float32) for b in bufs])


def norm_parameter_mask(model: nn.Module) -> torch.Tensor:
    """Which entries of the flat parameters (``parameters_to_vector``) are BatchNorm layers'
    affine weights and biases (what FedBN keeps local)."""
    norm = {id(p) for m in model.modules()
            if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm))
            for p in m.parameters(recurse=False)}
    return torch.cat([torch.full((p.numel(),), id(p) in norm) for p in model.parameters()])


def float_buffer_mask(model: nn.Module) -> torch.Tensor:
    """Which entries of :func:`buffers_to_vector` are statistics (float buffers), not
    counters (BatchNorm's ``num_batches_tracked``)."""
    bufs = model_buffers(model)
    if not bufs:
        return torch.zeros(0, dtype=torch.bool)
    return torch.cat([torch.full((b.numel(),), b.dtype.is_floating_point) for b in bufs])


def vector_to_buffers(vec: torch.Tensor, model: nn.Module) -> None:
    """Write ``vec`` (from :func:`buffers_to_vector`) into the model's buffers; integer
    buffers (BatchNorm's batch counter) are rounded."""
    lo = 0
    with torch.no_grad():
        for b in model_buffers(model):
            part = vec[lo : lo + b.numel()].view(b.shape)
            b.copy_(part.round() if not b.dtype.is_floating_point else part)
            lo += b.numel()


def combine_buffers(rows: torch.Tensor, rule: str) -> torch.Tensor:
    """The clients' buffer rows ``(n, d_b)`` combined: ``mean``, or ``median``
    (coordinate-wise, non-finite rows ignored where a finite value exists)."""
    if rule == "median":
        finite = torch.where(torch.isfinite(rows), rows, torch.nan)
        return torch.nanmedian(finite, dim=0).values
    return rows.mean(dim=0)


def model_input(x: np.ndarray) -> torch.Tensor:
    """A batch of samples as the model takes it: a writable float32 tensor; uint8 images
    (stored compactly in the partition table) scaled to [0, 1]; int32 token ids as int64."""
    if x.dtype == np.int32:
        return torch.from_numpy(np.asarray(x, dtype=np.int64))
    if x.dtype == np.uint8:
        return torch.from_numpy(unit_pixels(x))
    return torch.from_numpy(np.array(x, dtype=np.float32))  # a copy: ray views are read-only


def eval_spans(n: int, chunk: int = 0) -> list[tuple[int, int]]:
    """The forward passes of an evaluation of ``n`` samples, as ``(start, end)`` spans: each
    EVAL_BATCH block cut in chunks of ``chunk`` (EVAL_CHUNK when 0), the block's rest joined
    to the chunk before it. Whoever computes a span (the server, or a ClientWorker in a data-
    parallel evaluation) gives its samples the same outputs."""
    chunk = chunk or EVAL_CHUNK
    spans = []
    for lo in range(0, n, EVAL_BATCH):
        hi = min(lo + EVAL_BATCH, n)
        cuts = list(range(lo, hi, chunk))[1:]
        if cuts and hi - cuts[-1] < chunk:  # no short last chunk: a batch of a few samples
            cuts.pop()  # takes other kernels (another last bit) than a long one
        spans += list(itertools.pairwise([lo, *cuts, hi]))
    return spans


def score_spans(model: nn.Module, x: np.ndarray, y: np.ndarray, task: Task,
                spans: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray | None]:
    """Each sample's loss (float64) and accuracy (None for a task without accuracy) over
    ``spans`` of ``(x, y)`` (one forward pass each), in the spans' order."""
    device = next(model.parameters()).device  # batches go where the model is
    losses, hits, scored = [], [], True
    model.eval()
    with torch.no_grad():
        for a, b in spans:
            xb = model_input(x[a:b]).to(device)
            yb = torch.from_numpy(np.array(y[a:b])).to(device)
            out = model(xb)
            target = task.target(xb, yb)
            losses.append(task.losses(out, target).double().cpu())
            right = task.hits(out, target)
            scored = right is not None
            if right is not None:
                hits.append(right.double().cpu())
    if not losses:
        return np.empty(0), np.empty(0) if scored else None
    return torch.cat(losses).numpy(), torch.cat(hits).numpy() if scored else None


def combine_scores(losses: np.ndarray, hits: np.ndarray | None
                   ) -> tuple[float | None, float, np.ndarray | None]:
    """(accuracy, mean loss, hits) from every sample's loss and accuracy: the losses summed
    per EVAL_BATCH block (float64), as one pass per block would."""
    n = len(losses)
    loss = 0.0
    for lo in range(0, n, EVAL_BATCH):
        loss += float(torch.from_numpy(np.ascontiguousarray(losses[lo:lo + EVAL_BATCH])).sum())
    if hits is None:
        return None, loss / n, None
    return float(hits.mean()), loss / n, hits


def gather_scores(scores: Sequence[EvalScores], part: str
                  ) -> tuple[np.ndarray, np.ndarray | None]:
    """Every sample's loss and accuracy of ``part`` from the shares of a data-parallel
    evaluation, in sample order."""
    mine = sorted((s for s in scores if s.part == part), key=lambda s: s.spans[0][0]
                  if s.spans else 0)
    losses = np.concatenate([s.losses for s in mine])
    hits = [s.hits for s in mine]
    return losses, (None if any(h is None for h in hits) else np.concatenate(
        [h for h in hits if h is not None]))


def eval_shares(n_test: int, n_train: int, workers: int
                ) -> list[list[tuple[str, tuple[tuple[int, int], ...]]]]:
    """The evaluation's spans (test, then train) dealt to ``workers`` in contiguous runs of
    about as many samples each: one list of ``(part, spans)`` per worker."""
    spans = [("test", s) for s in eval_spans(n_test)] + \
        [("train", s) for s in eval_spans(n_train)]
    total = max(n_test + n_train, 1)
    out: list[list[tuple[str, tuple[tuple[int, int], ...]]]] = [[] for _ in range(workers)]
    done = 0
    for part, (a, b) in spans:
        w = min(workers - 1, done * workers // total)  # by the samples before the span
        share = out[w]
        if share and share[-1][0] == part:
            share[-1] = (part, (*share[-1][1], (a, b)))
        else:
            share.append((part, ((a, b),)))
        done += b - a
    return out


def evaluate_model(model: nn.Module, x: np.ndarray, y: np.ndarray, task: Task
                   ) -> tuple[float | None, float, np.ndarray | None]:
    """(accuracy, mean loss, each sample's accuracy) of ``model`` on ``(x, y)`` for
    ``task``; accuracy and hits are None for a task without accuracy (regression)."""
    if len(y) == 0:
        return float("nan"), float("nan"), np.zeros(0, dtype=np.float64)
    device = next(model.parameters()).device
    spans = eval_spans(len(y), EVAL_CHUNK if device.type == "cpu" else EVAL_BATCH)
    return combine_scores(*score_spans(model, x, y, task, spans))


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


def personal_accuracy(scores: Sequence[PersonalScores]) -> dict[str, float]:
    """The workers' personal models (Ditto) on their clients' own test samples: the mean
    over clients, its 10th percentile, and how many clients have one (none: no metric)."""
    if not scores:
        return {}
    ids = np.concatenate([s.clients for s in scores])
    # by client id: the same sums whichever worker holds which client
    acc = np.concatenate([s.accuracy for s in scores])[np.argsort(ids, kind="stable")]
    if not len(acc):
        return {}
    return {"personal_test_accuracy_mean": float(acc.mean()),
            "personal_test_accuracy_p10": float(np.percentile(acc, 10)),
            "personal_clients": float(len(acc))}
