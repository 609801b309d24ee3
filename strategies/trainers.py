"""Trainers: how the clients of a round compute their messages on a ClientWorker.

A trainer is a class (the plugin, chosen by ``local.trainer`` or by the scenario, see
``Scenario.trainer``) with a pure functional twin, as torch.optim has ``SGD`` and ``sgd``:

* ``sgd`` / :func:`local_sgd`: minibatch SGD with momentum (reset every round) and weight
  decay, the local steps of FedAvg (McMahan et al., AISTATS 2017) and of FedRo (Allouah et
  al., ICML 2024); the message is the model delta;
* ``vectorized_sgd`` / :func:`vectorized_sgd`: the same steps for several clients at once
  (``torch.func``: vmap of grad over the stacked client parameters and their minibatches);
* ``dp_sgd`` / :func:`dp_sgd`: DP-SGD (Abadi et al., CCS 2016) inside each client;
* ``gradient_rule``: the client rule's message from one minibatch (worker momentum,
  mu2-SGD), with its per-client state.

Every trainer draws its minibatches from the client's own generator (seed, round, client),
so a client's message does not depend on the worker or on the other clients.

Devices: the model and ``start`` live on the worker's device; a client's samples and state
stay in host memory and each batch (or vectorised chunk) moves to the device when it is
used, so device memory holds the model and a batch, whatever the number of clients.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import numpy as np
import torch
from annotated_types import Ge, Gt
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.optim.sgd import sgd as sgd_step

from strategies.protocols import (
    ClientData,
    ClientRule,
    Correction,
    LocalSettings,
    Privacy,
    Task,
    Trainer,
    Traits,
)
from strategies.stacked import Grads, stacked_forward, stacked_grads
from strategies.tasks import Classification

CLASSIFICATION = Classification()  # the functional twins' default task

__all__ = ["DPSGD", "SGD", "GradientRule", "VectorizedSGD", "client_batches",
           "dp_sgd", "local_sgd", "minibatches", "step_counts", "vectorized_sgd"]


def minibatches(n: int, local: LocalSettings, generator: torch.Generator,
                max_steps: int | None = None) -> list[torch.Tensor]:
    """The index batches of one client with ``n`` samples in a round: ``local.steps``
    batches of ``batch_size`` (fresh permutations as needed, partial batches dropped), or
    ``local.epochs`` passes (default one) in ``batch_size`` chunks of a permutation each.
    ``max_steps`` (a straggler's partial work): the first that many of them, drawn as the
    whole round's are, so partial work is a prefix of the full work."""
    bs = min(local.batch_size, n)
    out: list[torch.Tensor] = []
    if local.steps is not None:
        while len(out) < local.steps:
            perm = torch.randperm(n, generator=generator)
            out += [perm[i : i + bs] for i in range(0, n - bs + 1, bs)]
        out = out[: local.steps]
    else:
        for _ in range(local.epochs or 1):
            perm = torch.randperm(n, generator=generator)
            out += [perm[i : i + bs] for i in range(0, n, bs)]
    return out if max_steps is None else out[:max_steps]


def client_batches(c: ClientData, local: LocalSettings) -> list[torch.Tensor]:
    """:func:`minibatches` of client ``c`` this round (its partial work, if capped)."""
    return minibatches(len(c.y), local, c.generator, c.max_steps)


def step_counts(sizes: np.ndarray, local: LocalSettings) -> np.ndarray:
    """How many batches :func:`minibatches` gives clients of ``sizes`` samples in a round
    (float64: a client's simulated time at speed 1)."""
    if local.steps:
        return np.full(len(sizes), local.steps, dtype=np.float64)
    return (local.epochs or 1) * np.ceil(np.maximum(sizes, 1) / local.batch_size)


def _flat_loss(model: nn.Module, task: Task = CLASSIFICATION) -> tuple[Callable[[torch.Tensor], dict[str, torch.Tensor]],
                                          Callable[..., torch.Tensor]]:
    """(unflatten, masked mean loss of flat params on a batch) for torch.func over ``model``."""
    from torch.func import functional_call

    names = [name for name, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]

    def unflatten(vec: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: v.view(s) for k, v, s in zip(names, torch.split(vec, sizes), shapes)}

    def masked_loss(vec: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor,
                    mb: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, unflatten(vec), (xb,))
        per = task.losses(out, task.target(xb, yb))
        return (per * mb).sum() / mb.sum().clamp_min(1.0)

    return unflatten, masked_loss


# ---------------------------------------------------------------------------- local SGD


def _sgd_with_state(params: list[nn.Parameter], bufs: list[torch.Tensor | None], lr: float,
                    momentum: float, weight_decay: float) -> None:
    """One torch.optim.SGD step (momentum buffers in ``bufs``) of the parameters that have a
    gradient, as SGD.step takes them."""
    live, grads = [], []
    for i, p in enumerate(params):
        if p.grad is not None:
            live.append(i)
            grads.append(p.grad)
    live_bufs = [bufs[i] for i in live]
    with torch.no_grad():
        sgd_step([params[i] for i in live], grads, live_bufs, weight_decay=weight_decay,
                 momentum=momentum, lr=lr, dampening=0.0, nesterov=False, maximize=False)
    for i, b in zip(live, live_bufs, strict=True):
        bufs[i] = b


def _add_correction(params: list[nn.Parameter], correction: Correction, w: torch.Tensor
                    ) -> None:
    """Add ``correction(w)`` (a flat vector, at the flat parameters ``w``, whose views the
    parameters are: no copy) to the gradients, slice by slice."""
    with torch.no_grad():
        extra = correction(w)
        for p, g in zip(params, torch.split(extra, [p.numel() for p in params]), strict=True):
            if p.grad is None:
                p.grad = g.view_as(p).clone()
            else:
                p.grad.add_(g.view_as(p))


def local_sgd(model: nn.Module, start: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
              batches: Sequence[torch.Tensor], lr: float, momentum: float = 0.0,
              weight_decay: float = 0.0, task: Task = CLASSIFICATION,
              correction: Correction | None = None) -> tuple[torch.Tensor, float]:
    """Minibatch SGD of ``model`` from the flat parameters ``start`` over ``batches`` of
    ``(x, y)`` on the mean of ``task``'s losses (torch.optim.SGD: momentum and weight decay
    as it defines them). ``correction(w)``: a flat vector added to every step's gradient at
    the flat parameters ``w`` (FedProx's proximal term, SCAFFOLD's control variates; see
    strategies.drift); None adds nothing (and costs nothing). Returns
    (update = local - start, mean loss over the batches). ``model``'s parameters are
    overwritten."""
    params = list(model.parameters())
    flat = start.clone()
    vector_to_parameters(flat, params)  # params become views of the copy
    # torch.optim.SGD's own step function, without the optimizer object: building one imports
    # torch._dynamo on its first use (1-3 s of a run's start-up) and costs ~40 us a client
    bufs: list[torch.Tensor | None] = [None] * len(params)
    model.train()
    total = 0.0
    for idx in batches:
        for p in params:
            p.grad = None
        xb, yb = x[idx].to(start.device), y[idx].to(start.device)
        loss = task.losses(model(xb), task.target(xb, yb)).mean()
        loss.backward()
        if correction is not None:
            _add_correction(params, correction, flat)
        if momentum or weight_decay:
            _sgd_with_state(params, bufs, lr, momentum, weight_decay)
        else:  # what SGD's step does then, without its per-call overhead
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-lr)
        total += float(loss.detach())
    with torch.no_grad():
        update = parameters_to_vector(params) - start
    return update, total / max(len(batches), 1)


class SGD(Trainer):
    """Local SGD, one client after another (:func:`local_sgd`)."""

    traits = Traits(context=("model", "local", "task"), buffers=True, batched="vectorized_sgd")

    def __init__(self, model: nn.Module, local: LocalSettings, task: Task) -> None:
        self.model, self.local, self.task = model, local, task

    def train(self, round_: int, clients: Sequence[ClientData], start: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        updates = torch.empty((len(clients), start.numel()))  # host memory
        losses = torch.empty(len(clients), dtype=torch.float64)
        lc = self.local
        for i, c in enumerate(clients):
            batches = client_batches(c, lc)
            updates[i], losses[i] = local_sgd(self.model, start, c.x, c.y, batches, lc.lr,
                                              lc.momentum, lc.weight_decay, self.task)
        return updates, losses


# ---------------------------------------------------------------------------- vectorised


def _suffix_sgd(grads: Grads, w: torch.Tensor, xs: torch.Tensor, ys: torch.Tensor,
                ms: torch.Tensor, first: np.ndarray, offsets: np.ndarray, local: LocalSettings
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The SGD steps (weight decay, momentum, as torch.optim.SGD) of the stacked clients
    ``w`` (k, d), ordered by their number of batches: step ``s`` moves the clients
    ``first[s]:`` (those that still have a batch), on the batches in rows
    ``offsets[s]:offsets[s + 1]`` of ``xs``, ``ys`` and the mask ``ms`` (as many examples
    for each client: the widest batch's). The moving clients are a slice, so a step reads
    and writes views: clients that ran out of batches cost nothing. Returns the final ``w``
    and each client's summed batch losses."""
    k = len(w)
    buf = torch.zeros_like(w) if local.momentum else None
    loss_sum = torch.zeros(k, dtype=torch.float64, device=w.device)
    for s in range(len(first)):
        a, lo, hi = int(first[s]), int(offsets[s]), int(offsets[s + 1])
        w_on = w[a:]
        width = (hi - lo) // (k - a)
        g, loss = grads(w_on, xs[lo:hi].view(k - a, width, *xs.shape[1:]),
                        ys[lo:hi].view(k - a, width, *ys.shape[1:]), ms[lo:hi].view(k - a, width))
        with torch.no_grad():
            if local.weight_decay:
                g = g.add(w_on, alpha=local.weight_decay)
            if buf is not None:
                g = buf[a:].mul_(local.momentum).add_(g)
            w_on.add_(g, alpha=-local.lr)
            loss_sum[a:] += loss.detach().double()
    return w, loss_sum


def vectorized_sgd(model: nn.Module, start: torch.Tensor, clients: Sequence[ClientData],
                   local: LocalSettings, task: Task = CLASSIFICATION
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`local_sgd` of several clients at once, the same batches and the same SGD rule
    (momentum, weight decay): a batch smaller than the widest is padded and masked, so each
    client's result equals the loop's up to rounding. The clients are stacked by their
    number of batches, so step ``s`` computes only the ones that have an ``s``-th batch (a
    suffix: no padded steps). Returns (updates (k, d), mean losses (k,)), rows following
    ``clients``."""
    from torch.func import grad_and_value, vmap

    k, d = len(clients), start.numel()
    if not k:
        return torch.empty((0, d), device=start.device), torch.empty(0, dtype=torch.float64)
    plans = [client_batches(c, local) for c in clients]
    n_batches = np.array([len(b) for b in plans], dtype=np.int64)
    order = np.argsort(n_batches, kind="stable")  # fewest batches first
    # step s moves the clients first[s]: (of the order), on rows offsets[s]:offsets[s + 1]
    first = np.searchsorted(n_batches[order], np.arange(n_batches.max()), side="right")
    width = max((len(i) for b in plans for i in b), default=1)
    offsets = np.concatenate([[0], np.cumsum((k - first) * width)])
    feat = tuple(clients[0].x.shape[1:])
    # where each example goes, (step, client, position), computed for all batches at once
    batches = [b for i in order for b in plans[i]]  # by client (in order), then step
    lens = np.fromiter((b.numel() for b in batches), dtype=np.int64, count=len(batches))
    per = n_batches[order]
    client_of = np.repeat(np.arange(k), per)
    step_of = np.arange(len(batches)) - np.repeat(np.cumsum(per) - per, per)
    base = offsets[step_of] + (client_of - first[step_of]) * width
    slots = np.repeat(base, lens) + np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)
    held = [i for i in order if plans[i]]  # the clients with a batch, in order
    idx = [torch.cat(plans[i]) for i in held]  # one gather per client
    xs_parts = [clients[i].x[j] for i, j in zip(held, idx, strict=True)]
    ys_parts = [clients[i].y[j] for i, j in zip(held, idx, strict=True)]
    dev = start.device
    rows = int(offsets[-1])
    xs = torch.zeros((rows, *feat), dtype=clients[0].x.dtype, device=dev)
    ys = torch.zeros((rows, *clients[0].y.shape[1:]), dtype=clients[0].y.dtype, device=dev)
    ms = torch.zeros(rows, device=dev)
    if len(slots):
        slots_t = torch.from_numpy(slots).to(dev)
        xs[slots_t] = torch.cat(xs_parts).to(dev)
        ys[slots_t] = torch.cat(ys_parts).to(dev)
        ms[slots_t] = 1.0
    model.train()
    forward = stacked_forward(model)
    if forward is not None:  # batched kernels
        grads = stacked_grads(model, forward, task)
    else:  # any other model: vmap of grad
        grads = vmap(grad_and_value(_flat_loss(model, task)[1]))
    w, loss_sum = _suffix_sgd(grads, start.expand(k, d).clone(), xs, ys, ms, first, offsets,
                              local)
    back = torch.from_numpy(np.argsort(order)).to(dev)  # the rows in the callers' order
    counts = torch.from_numpy(np.maximum(n_batches, 1)).to(dev, torch.float64)
    return (w - start).detach()[back], loss_sum[back] / counts


class VectorizedSGD(Trainer):
    """:func:`vectorized_sgd` over chunks of clients of alike sizes (sorted by size: little
    padding), at most ``chunk`` clients and ``memory_mib`` MiB of padded batches each. The
    same numbers as ``sgd`` up to float rounding (not bit for bit across worker counts)."""

    traits = Traits(context=("model", "local", "task"), loop="sgd")

    def __init__(self, model: nn.Module, local: LocalSettings, task: Task,
                 chunk: Annotated[int, Ge(1)] = 128,
                 memory_mib: Annotated[float, Gt(0)] = 64.0) -> None:
        self.model, self.local, self.task, self.chunk = model, local, task, chunk
        self.memory_mib = memory_mib

    def chunks(self, clients: Sequence[ClientData]) -> list[np.ndarray]:
        """Positions of ``clients`` in chunks: by size, each within both bounds (a client
        alone may exceed the memory one)."""
        sizes = np.array([len(c.y) for c in clients])
        order = np.argsort(sizes, kind="stable")
        bs = np.minimum(self.local.batch_size, np.maximum(sizes, 1))
        steps = step_counts(sizes, self.local)
        sample = 4 * math.prod(clients[0].x.shape[1:]) if clients else 4
        budget = self.memory_mib * 2**20
        out: list[list[int]] = []
        for i in order:  # ascending sizes: the newest client sets the chunk's steps and width
            cur = out[-1] if out else None
            if cur is not None and len(cur) < self.chunk and \
                    (len(cur) + 1) * steps[i] * bs[i] * sample <= budget:
                cur.append(int(i))
            else:
                out.append([int(i)])
        return [np.array(c) for c in out]

    def train(self, round_: int, clients: Sequence[ClientData], start: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        updates = torch.empty((len(clients), start.numel()))  # host memory
        losses = torch.empty(len(clients), dtype=torch.float64)
        for chunk in self.chunks(clients):
            pos = torch.from_numpy(chunk)
            u, ls = vectorized_sgd(self.model, start, [clients[i] for i in pos], self.local,
                                   self.task)
            updates[pos], losses[pos] = u.cpu(), ls.cpu()
        return updates, losses


# ---------------------------------------------------------------------------- DP-SGD


def dp_sgd(model: nn.Module, start: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
           generator: torch.Generator, local: LocalSettings, clip: float,
           noise_multiplier: float, task: Task = CLASSIFICATION, max_steps: int | None = None,
           canaries: torch.Tensor | None = None,
           canary_generator: torch.Generator | None = None) -> tuple[torch.Tensor, float]:
    """DP-SGD (Abadi et al., CCS 2016) from ``start``: each step takes a Poisson sample of
    rate q = batch_size / n, clips every per-sample gradient (torch.func: vmap of grad) to
    ``clip``, adds N(0, (noise_multiplier clip)^2) to their sum and divides by the expected
    batch size q n; then SGD with momentum and weight decay as configured. The number of
    steps is ``local.steps``, or ``local.epochs`` (default one) times ceil(n / batch_size),
    at most ``max_steps`` (a straggler's partial work; the accountant counts the full work,
    an upper bound). ``canaries`` (k, d): an audit's canary examples (Steinke, Nasr,
    Jagielski 2023's gradient canaries), each sampled at rate q from ``canary_generator``
    (the examples' own stream is unchanged) and adding the per-example gradient
    ``-clip * direction`` to the clipped sum. Returns (update, mean loss of the sampled
    examples)."""
    from torch.func import functional_call, grad, vmap

    n = len(y)
    q = min(1.0, local.batch_size / max(n, 1))
    steps = local.steps or (local.epochs or 1) * math.ceil(max(n, 1) / local.batch_size)
    if max_steps is not None:
        steps = min(steps, max_steps)
    unflatten, _ = _flat_loss(model, task)

    def loss_one(vec: torch.Tensor, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        xb = xi.unsqueeze(0)
        out = functional_call(model, unflatten(vec), (xb,))
        return task.losses(out, task.target(xb, yi.unsqueeze(0))).mean()

    per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))
    w = start.clone()
    buf = torch.zeros_like(w)
    losses = []
    model.train()
    for _ in range(steps):
        idx = (torch.rand(n, generator=generator) < q).nonzero().squeeze(1)
        total = torch.zeros_like(w)
        if len(idx):
            xb, yb = x[idx].to(w.device), y[idx].to(w.device)
            grads = per_sample(w, xb, yb)
            norms = torch.linalg.vector_norm(grads, dim=1, keepdim=True)
            total = (grads * torch.clamp(clip / norms.clamp_min(1e-30), max=1.0)).sum(0)
            with torch.no_grad():
                out = functional_call(model, unflatten(w), (xb,))
                losses.append(float(task.losses(out, task.target(xb, yb)).mean()))
        if canaries is not None and len(canaries):
            drawn = torch.rand(len(canaries), generator=canary_generator) < q
            total = total - clip * canaries[drawn].to(w.device).sum(0)
        noise = torch.randn(w.shape, generator=generator).to(w.device) * (noise_multiplier * clip)
        step = (total + noise) / (q * n) + local.weight_decay * w
        buf = local.momentum * buf + step if local.momentum else step
        w = w - local.lr * buf
    return (w - start).detach(), float(np.mean(losses)) if losses else float("nan")


class DPSGD(Trainer):
    """:func:`dp_sgd` for each client, with the clip and noise multiplier of the scenario's
    sample-level privacy plugin (which also accounts for it)."""

    traits = Traits(context=("model", "local", "task", "privacy"), canaries=True)

    def __init__(self, model: nn.Module, local: LocalSettings, task: Task,
                 privacy: Privacy) -> None:
        self.model, self.local, self.task = model, local, task
        self.clip, self.noise_multiplier = privacy.clip, privacy.noise_multiplier

    def train(self, round_: int, clients: Sequence[ClientData], start: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        updates = torch.empty((len(clients), start.numel()))  # host memory
        losses = torch.empty(len(clients), dtype=torch.float64)
        for i, c in enumerate(clients):
            updates[i], losses[i] = dp_sgd(self.model, start, c.x, c.y, c.generator,
                                           self.local, self.clip, self.noise_multiplier,
                                           self.task, c.max_steps, c.canaries,
                                           c.canary_generator)
        return updates, losses


# ---------------------------------------------------------------------------- gradient rules


def minibatch_gradient(model: nn.Module, params: torch.Tensor, xb: torch.Tensor,
                       yb: torch.Tensor, weight_decay: float, task: Task = CLASSIFICATION
                       ) -> tuple[torch.Tensor, float]:
    """(gradient of the minibatch loss + weight decay, loss) at the flat ``params``."""
    ps = list(model.parameters())
    vector_to_parameters(params.clone(), ps)
    for p in ps:
        p.grad = None
    loss = task.losses(model(xb), task.target(xb, yb)).mean()
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in ps if p.grad is not None])
    if weight_decay:
        grad = grad + weight_decay * params
    return grad, float(loss.detach())


class GradientRule(Trainer):
    """A gradient client rule's message (worker momentum, mu2-SGD): one minibatch, the first
    ``batch_size`` of the round's permutation, every gradient the rule asks for taken on it;
    the client's state advances."""

    traits = Traits(context=("model", "local", "task", "rule"), buffers=True)

    def __init__(self, model: nn.Module, local: LocalSettings, task: Task,
                 rule: ClientRule) -> None:
        self.model, self.local, self.task, self.rule = model, local, task, rule

    def train(self, round_: int, clients: Sequence[ClientData], start: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        updates = torch.empty((len(clients), start.numel()))  # host memory
        losses = torch.empty(len(clients), dtype=torch.float64)
        lc = self.local
        self.model.train()
        for i, c in enumerate(clients):
            idx = torch.randperm(len(c.y), generator=c.generator)[: lc.batch_size]
            xb, yb = c.x[idx].to(start.device), c.y[idx].to(start.device)

            def grad(p: torch.Tensor, xb: Any = xb, yb: Any = yb) -> tuple[torch.Tensor, float]:
                return minibatch_gradient(self.model, p, xb, yb, lc.weight_decay, self.task)

            own = {k: v.to(start.device) for k, v in c.state.items()}  # host -> device
            message, state, losses[i] = self.rule.client_message(round_, start, grad, own, lc.lr)
            updates[i] = message.detach()
            c.state = {k: v.detach() for k, v in state.items()}
        return updates, losses
