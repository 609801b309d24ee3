"""The actor classes. Plain Python classes: the ray backend wraps them with ``ray.remote``,
the inline backend calls them in-process, so both run exactly the same code.

Across the Ray boundary parameters and updates travel as float32 NumPy arrays (zero-copy
reads from the object store); ``ray.get`` gives read-only views, so nothing here updates an
argument in place.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from simulator import registry
from simulator.data import client_arrays
from simulator.errors import TooFewRows, guarded
from simulator.models import build_model
from simulator.runtime.pipeline import Pipeline
from simulator.scenario import build_client_rule, instantiate
from simulator.seeding import torch_generator

EVAL_BATCH = 4096
VECTOR_CHUNK = 32  # clients trained together by train_many (bounds the stacked batches' memory)


def _single_thread() -> None:
    # Same arithmetic in every process (driver, actors) whatever the core count:
    # BLAS results can differ in the last bits between thread counts.
    torch.set_num_threads(1)


def evaluate_model(model: nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on ``(x, y)``."""
    if len(y) == 0:
        return float("nan"), float("nan")
    correct, loss = 0, 0.0
    model.eval()
    with torch.no_grad():
        for lo in range(0, len(y), EVAL_BATCH):
            xb = torch.from_numpy(np.array(x[lo : lo + EVAL_BATCH]))  # copy: ray views are read-only
            yb = torch.from_numpy(np.array(y[lo : lo + EVAL_BATCH]))
            out = model(xb)
            loss += float(nn.functional.cross_entropy(out, yb, reduction="sum"))
            correct += int((out.argmax(1) == yb).sum())
    return correct / len(y), loss / len(y)


class ClientStateStore:
    """Per-client state (``{name: (d,) tensor}`` per client) in a few large blocks of rows
    instead of one allocation per client and round: 10,000 clients' momenta are 10,000 rows
    of a handful of ``(BLOCK_ROWS, d)`` tensors, written in place, so the allocator does not
    fragment (measured in benchmarks/scale.py). Rows are kept in ``dtype``."""

    BLOCK_ROWS = 256

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.rows: dict[int, int] = {}  # client -> row
        self.blocks: dict[str, list[torch.Tensor]] = {}

    def __contains__(self, client: int) -> bool:
        return int(client) in self.rows

    def __len__(self) -> int:
        return len(self.rows)

    def _row(self, name: str, r: int) -> torch.Tensor:
        return self.blocks[name][r // self.BLOCK_ROWS][r % self.BLOCK_ROWS]

    def get(self, client: int) -> dict[str, torch.Tensor]:
        """The client's state as float32 copies ({} for a client without state)."""
        r = self.rows.get(int(client))
        return {} if r is None else {k: self._row(k, r).float() for k in self.blocks}

    def set(self, client: int, state: dict[str, torch.Tensor]) -> None:
        r = self.rows.setdefault(int(client), len(self.rows))
        for name, value in state.items():
            blocks = self.blocks.setdefault(name, [])
            while len(blocks) * self.BLOCK_ROWS <= r:
                blocks.append(torch.empty((self.BLOCK_ROWS, value.numel()), dtype=self.dtype))
            self._row(name, r).copy_(value.reshape(-1))

    def items(self):
        for c, r in self.rows.items():
            yield c, {k: self._row(k, r) for k in self.blocks}

    def nbytes(self) -> int:
        """Bytes of the rows in use."""
        return sum(self._row(k, 0).numel() * self._row(k, 0).element_size()
                   for k in self.blocks) * len(self.rows)


class ClientWorker:
    """Trains many virtual clients, one after another, on one model instance.

    A client is a slice of the partition table (``offsets[k]:offsets[k+1]``) plus its random
    stream ``(seed, round, client)``; its computation in a round is a pure function of those and
    the global model, which makes a retry after a fault exact.
    """

    def __init__(
        self,
        table: pa.Table,
        offsets: np.ndarray,
        input_shape: tuple[int, ...],
        num_classes: int,
        model_spec: dict,
        local: dict,
        seed: int,
        client_rule: tuple[str, dict] = ("client_optimizers", {"name": "sgd"}),
        dp_sgd: dict | None = None,
    ) -> None:
        _single_thread()
        self.x, self.y = client_arrays(table, tuple(input_shape))
        self._table = table  # keeps the zero-copy buffers alive
        self.offsets = np.asarray(offsets)
        self.model = build_model(model_spec, input_shape, num_classes, seed)
        self.params = list(self.model.parameters())
        self.local = local
        self.seed = seed
        self.num_classes = num_classes
        rule = build_client_rule(*client_rule)
        # a gradient rule computes the message from minibatch gradients (None: local SGD)
        self.rule = rule if getattr(rule, "GRADIENT_RULE", False) else None
        self.state_dtype = getattr(torch, local.get("state_dtype", "float32"))
        self.client_state = ClientStateStore(self.state_dtype)  # the gradient rule's state
        self.dp_sgd = dp_sgd  # sample-level DP: {clip, noise_multiplier, ...} or None

    def _batches(self, n: int, g: torch.Generator) -> list[torch.Tensor]:
        bs = min(self.local["batch_size"], n)
        if self.local.get("steps") is not None:
            out: list[torch.Tensor] = []
            while len(out) < self.local["steps"]:
                perm = torch.randperm(n, generator=g)
                out += [perm[i : i + bs] for i in range(0, n - bs + 1, bs)]
            return out[: self.local["steps"]]
        out = []
        for _ in range(self.local.get("epochs") or 1):
            perm = torch.randperm(n, generator=g)
            out += [perm[i : i + bs] for i in range(0, n, bs)]
        return out

    def train_client(self, round_: int, client: int, start: torch.Tensor,
                     poison: Any = None) -> tuple[torch.Tensor, float]:
        """Local SGD of one client from ``start``; returns (update = local - start, mean loss).
        ``poison`` is a data-poisoning attack whose ``poison_labels`` rewrites the labels."""
        vector_to_parameters(start.clone(), self.params)  # params become views of the copy
        lo, hi = int(self.offsets[client]), int(self.offsets[client + 1])
        x = torch.from_numpy(np.array(self.x[lo:hi]))
        y = torch.from_numpy(np.array(self.y[lo:hi]))
        if poison is not None:
            y = poison.poison_labels(y, self.num_classes)
        g = torch_generator(self.seed, "local", round_, client)
        if self.rule is not None:
            return self._rule_message(round_, client, start, x, y, g)
        if self.dp_sgd is not None:
            return self._dp_sgd(start, x, y, g)
        opt = torch.optim.SGD(
            self.params,
            lr=self.local["lr"],
            momentum=self.local["momentum"],
            weight_decay=self.local["weight_decay"],
        )
        self.model.train()
        total = 0.0
        batches = self._batches(hi - lo, g)
        for idx in batches:
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(self.model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total += float(loss.detach())
        with torch.no_grad():
            update = parameters_to_vector(self.params) - start
        return update, total / max(len(batches), 1)

    def _flat_model(self):
        """(unflatten, loss of flat params on a masked batch) for torch.func over this model."""
        from torch.func import functional_call

        names = [name for name, _ in self.model.named_parameters()]
        shapes = [p.shape for p in self.params]
        sizes = [p.numel() for p in self.params]

        def unflatten(vec: torch.Tensor) -> dict[str, torch.Tensor]:
            return {k: v.view(s) for k, v, s in zip(names, torch.split(vec, sizes), shapes)}

        def masked_loss(vec: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor,
                        mb: torch.Tensor) -> torch.Tensor:
            out = functional_call(self.model, unflatten(vec), (xb,))
            per = nn.functional.cross_entropy(out, yb, reduction="none")
            return (per * mb).sum() / mb.sum().clamp_min(1.0)

        return unflatten, masked_loss

    def train_many(self, round_: int, clients: list[int], start: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Local SGD of several clients at once (torch.func: vmap of grad over the stacked
        client parameters and their minibatches), the same batches and the same SGD rule
        (momentum, weight decay) as ``train_client``: clients with fewer or smaller batches
        are padded and masked, so each client's result equals the loop's up to rounding.
        Returns (updates (k, d), mean losses (k,))."""
        from torch.func import grad_and_value, vmap

        lc = self.local
        plans = []
        for c in clients:
            lo, hi = int(self.offsets[c]), int(self.offsets[c + 1])
            plans.append((lo, self._batches(hi - lo, torch_generator(self.seed, "local", round_, c))))
        k, d = len(clients), start.numel()
        steps = max(len(b) for _, b in plans)
        width = max((len(i) for _, b in plans for i in b), default=1)
        feat = tuple(self.x.shape[1:])
        rows, slots, on = [], [], []
        for j, (lo, batches) in enumerate(plans):  # where each example goes in the stack
            for s, idx in enumerate(batches):
                rows.append(lo + idx.numpy())
                slots.append((s * k + j) * width + np.arange(len(idx)))
                on.append(s * k + j)
        rows_a, slots_t = np.concatenate(rows), torch.from_numpy(np.concatenate(slots))
        xs = torch.zeros((steps * k * width, *feat))
        ys = torch.zeros(steps * k * width, dtype=torch.long)
        ms = torch.zeros(steps * k * width)
        xs[slots_t] = torch.from_numpy(np.array(self.x[rows_a]))  # one gather for the round
        ys[slots_t] = torch.from_numpy(np.array(self.y[rows_a]))
        ms[slots_t] = 1.0
        xs, ys, ms = (xs.view(steps, k, width, *feat), ys.view(steps, k, width),
                      ms.view(steps, k, width))
        active = torch.zeros(steps * k, dtype=torch.bool)
        active[torch.tensor(on)] = True
        active = active.view(steps, k)
        _, masked_loss = self._flat_model()
        step_fn = vmap(grad_and_value(masked_loss))
        w = start.expand(k, d).clone()
        buf = torch.zeros_like(w)
        loss_sum = torch.zeros(k, dtype=torch.float64)
        self.model.train()
        for s in range(steps):
            g, loss = step_fn(w, xs[s], ys[s], ms[s])
            on = active[s][:, None]
            if lc["weight_decay"]:
                g = g + lc["weight_decay"] * w
            if lc["momentum"]:
                buf = torch.where(on, lc["momentum"] * buf + g, buf)
                g = buf
            w = torch.where(on, w - lc["lr"] * g, w)
            loss_sum += torch.where(active[s], loss.double(), torch.zeros_like(loss_sum))
        counts = torch.tensor([len(b) for _, b in plans], dtype=torch.float64).clamp_min(1)
        return (w - start).detach(), loss_sum / counts

    def _dp_sgd(self, start: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                g: torch.Generator) -> tuple[torch.Tensor, float]:
        """DP-SGD (Abadi et al., CCS 2016) from ``start``: each step takes a Poisson sample of
        rate q = batch_size / n, clips every per-sample gradient (torch.func: vmap of grad)
        to ``clip``, adds N(0, (noise_multiplier clip)^2) to their sum and divides by the
        expected batch size q n; then SGD with momentum and weight decay as configured.
        Returns (update, mean loss of the sampled examples)."""
        from torch.func import functional_call, grad, vmap

        lc, dp = self.local, self.dp_sgd
        n = len(y)
        q = min(1.0, lc["batch_size"] / max(n, 1))
        steps = lc["steps"] or (lc.get("epochs") or 1) * math.ceil(max(n, 1) / lc["batch_size"])
        unflatten, _ = self._flat_model()

        def loss_one(vec: torch.Tensor, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            out = functional_call(self.model, unflatten(vec), (xi.unsqueeze(0),))
            return nn.functional.cross_entropy(out, yi.unsqueeze(0))

        per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))
        w = start.clone()
        buf = torch.zeros_like(w)
        losses = []
        self.model.train()
        for _ in range(steps):
            idx = (torch.rand(n, generator=g) < q).nonzero().squeeze(1)
            total = torch.zeros_like(w)
            if len(idx):
                grads = per_sample(w, x[idx], y[idx])
                norms = torch.linalg.vector_norm(grads, dim=1, keepdim=True)
                total = (grads * torch.clamp(dp["clip"] / norms.clamp_min(1e-30), max=1.0)).sum(0)
                with torch.no_grad():
                    losses.append(float(nn.functional.cross_entropy(
                        functional_call(self.model, unflatten(w), (x[idx],)), y[idx])))
            noise = torch.randn(w.shape, generator=g) * (dp["noise_multiplier"] * dp["clip"])
            step = (total + noise) / (q * n) + lc["weight_decay"] * w
            buf = lc["momentum"] * buf + step if lc["momentum"] else step
            w = w - lc["lr"] * buf
        return (w - start).detach(), float(np.mean(losses)) if losses else float("nan")

    def _gradient(self, params: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor
                  ) -> tuple[torch.Tensor, float]:
        """(gradient of the minibatch loss + weight decay, loss) at the flat ``params``."""
        vector_to_parameters(params.clone(), self.params)
        for p in self.params:
            p.grad = None
        loss = nn.functional.cross_entropy(self.model(xb), yb)
        loss.backward()
        grad = torch.cat([p.grad.reshape(-1) for p in self.params])
        if self.local["weight_decay"]:
            grad = grad + self.local["weight_decay"] * params
        return grad, float(loss.detach())

    def _rule_message(self, round_: int, client: int, start: torch.Tensor, x: torch.Tensor,
                      y: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, float]:
        """A gradient rule's message: one minibatch (the first of the round's permutation),
        every gradient the rule asks for taken on it; the client's state advances."""
        idx = torch.randperm(len(y), generator=g)[: self.local["batch_size"]]
        xb, yb = x[idx], y[idx]
        self.model.train()
        message, state, loss = self.rule.client_message(
            round_, start, lambda p: self._gradient(p, xb, yb),
            self.client_state.get(client),
            self.local["lr"])
        # kept in the configured precision (float16 halves the memory of 10,000 clients' state)
        self.client_state.set(client, {k: v.detach() for k, v in state.items()})
        return message.detach(), loss

    def client_states(self) -> dict[int, dict[str, torch.Tensor]]:
        """The per-client state this worker keeps (gradient rules' momenta), for checkpoints."""
        return {c: {k: v.clone() for k, v in st.items()} for c, st in self.client_state.items()}

    def load_client_states(self, states: dict[int, dict[str, torch.Tensor]]) -> None:
        """Restore the states of this worker's clients (a checkpoint's, all clients' mixed)."""
        self.client_state = ClientStateStore(self.state_dtype)
        for c, st in states.items():
            self.client_state.set(int(c), st)

    def node(self) -> str | None:
        """The Ray node this worker runs on (None in-process)."""
        try:
            import ray

            return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        except ImportError:
            return None

    def train(self, round_: int, clients: list[int], global_params: np.ndarray,
              poison: dict | None = None, expect_state: list[int] | None = None) -> dict[str, Any]:
        """Train ``clients`` from ``global_params``; rows of ``updates`` follow ``clients``.
        ``poison``: the spec of a data-poisoning attack these (Byzantine) clients run.
        ``expect_state``: clients whose gradient-rule state this worker must hold (they took
        part before); a restarted worker has lost it and says so rather than go on with
        different numbers."""
        lost = [c for c in expect_state or () if int(c) not in self.client_state]
        if self.rule is not None and lost:
            raise RuntimeError(
                f"ClientWorker lost the state of clients {lost[:5]} (the worker was restarted "
                "after a fault); worker momentum and mu2-SGD keep per-client state: resume the "
                "run from its last checkpoint (fedray resume RUN_ID)")
        t0 = time.perf_counter()
        attack = instantiate("attacks", poison) if poison else None
        start = torch.from_numpy(np.array(global_params, dtype=np.float32))
        updates = np.empty((len(clients), start.numel()), dtype=np.float32)
        losses = np.empty(len(clients), dtype=np.float64)
        if self.local.get("vectorize") and self.rule is None and self.dp_sgd is None \
                and attack is None:
            # clients with alike step counts train together: little padding
            sizes = np.diff(self.offsets)[np.asarray(clients, dtype=np.int64)]
            order = np.argsort(sizes, kind="stable")
            for lo in range(0, len(order), VECTOR_CHUNK):
                pos = order[lo : lo + VECTOR_CHUNK]
                u, ls = self.train_many(round_, [int(clients[i]) for i in pos], start)
                updates[pos] = u.numpy()
                losses[pos] = ls.numpy()
        else:
            for i, c in enumerate(clients):
                u, losses[i] = self.train_client(round_, int(c), start, attack)
                updates[i] = u.numpy()
        return {
            "clients": np.asarray(clients, dtype=np.int64),
            "updates": updates,
            "losses": losses,
            "seconds": time.perf_counter() - t0,
        }


    # ------------------------------------------------------------------ D-SGD peers

    def peer_step(self, round_: int, peers: list[int], start: np.ndarray,
                  mixed: dict | None = None, train: bool = True) -> dict[str, Any]:
        """A D-SGD phase for this worker's ``peers``, whose models live here: take their rows
        from ``mixed`` (a gossip result; ``start`` at first), then (``train``) run local SGD
        from each peer's own model. Returns the peers' models as ``updates`` rows."""
        t0 = time.perf_counter()
        if not hasattr(self, "peer_x"):
            self.peer_x = {}
        x0 = torch.from_numpy(np.array(start, dtype=np.float32))
        for p in peers:  # new here: at the start, or moved off a lost worker
            self.peer_x.setdefault(int(p), x0)
        if mixed is not None:
            pos = {int(c): i for i, c in enumerate(mixed["clients"])}
            for p in peers:
                self.peer_x[int(p)] = torch.from_numpy(np.array(mixed["updates"][pos[int(p)]]))
        rows = np.empty((len(peers), next(iter(self.peer_x.values())).numel()), dtype=np.float32)
        losses = np.full(len(peers), np.nan)
        for i, p in enumerate(peers):
            if train:
                update, losses[i] = self.train_client(round_, int(p), self.peer_x[int(p)])
                self.peer_x[int(p)] = self.peer_x[int(p)] + update
            rows[i] = self.peer_x[int(p)].numpy()
        return {"clients": np.asarray(peers, dtype=np.int64), "updates": rows, "losses": losses,
                "seconds": time.perf_counter() - t0}


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


class Adversary:
    """Produces the Byzantine rows of a round with the scenario's attack plugin."""

    def __init__(self, attack_spec: dict, seed: int, scenario: dict | None = None) -> None:
        _single_thread()
        self.seed = seed
        self._round = 0
        context = {}
        if "aggregate" in getattr(registry.get("attacks", attack_spec["name"]), "CONTEXT", ()):
            # Optimal attacks simulate the scenario's pipeline on a copy (stateful rules from
            # the adversary's own, never-advanced state: it does not see the server's).
            pipeline = Pipeline.from_scenario(scenario)
            context["aggregate"] = lambda x: pipeline.simulate(x, self._round)
        self.attack = instantiate("attacks", attack_spec, **context)
        self.name = attack_spec["name"]
        self.omniscient = bool(getattr(self.attack, "omniscient", False))

    def attack_rows(self, round_: int, f: int, order: list[int], d: int, *results: dict) -> np.ndarray:
        """``f`` Byzantine rows. ``results`` hold the honest updates of the round (omniscient
        attack) or the Byzantine clients' own honest updates, stacked in ``order``."""
        seen = torch.from_numpy(stack_updates(order, results, d))
        self._round = round_
        rows = guarded("attack", self.name, self.attack)(
            seen, f, torch_generator(self.seed, "attack", round_))
        if tuple(rows.shape) != (f, d):
            raise ValueError(f"attack: returned shape {tuple(rows.shape)}, expected {(f, d)}")
        return rows.to(torch.float32).numpy()


class Server:
    """Owns the global model, the aggregation pipeline (pre-aggregators -> aggregator ->
    meta-aggregator), the server optimizer, and evaluation on the held-out data."""

    def __init__(
        self,
        scenario: dict,
        input_shape: tuple[int, ...],
        num_classes: int,
        eval_data: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    ) -> None:
        _single_thread()
        seed = scenario["seeds"][0]
        self.model = build_model(scenario["model"], input_shape, num_classes, seed)
        self.x = parameters_to_vector(self.model.parameters()).detach().clone()
        self.pipeline = Pipeline.from_scenario(scenario)
        self.optimizer = instantiate("optimizers", scenario["server"]["optimizer"])
        self.optimizer_name = scenario["server"]["optimizer"]["name"]
        privacy = scenario.get("privacy")
        self.privacy = instantiate("privacy", privacy) if privacy else None
        self.seed = seed
        self.x_test, self.y_test, self.x_tr, self.y_tr = eval_data

    @property
    def dim(self) -> int:
        return int(self.x.numel())

    def params(self) -> np.ndarray:
        return self.x.numpy().copy()

    def step(
        self, round_: int, honest_order: list[int], byzantine: np.ndarray | None, *results: dict
    ) -> dict[str, float]:
        """Aggregate the round's updates (honest rows in ``honest_order``, then the Byzantine
        rows), step the global model, and return the round's server-side metrics."""
        t0 = time.perf_counter()
        honest = torch.from_numpy(stack_updates(honest_order, results, self.dim))
        rows = honest if byzantine is None or len(byzantine) == 0 else torch.cat(
            [honest, torch.from_numpy(np.asarray(byzantine, dtype=np.float32))]
        )
        losses = stack_updates(honest_order, results, 0, key="losses")
        dp = self.privacy if getattr(self.privacy, "LEVEL", "") == "client" else None
        if dp is not None:  # DP-FedAvg: clip every update; noise on the mean below
            rows = dp.privatize(rows)
        try:
            agg = self.pipeline.aggregate(rows, round_) if len(honest) else None
        except TooFewRows as e:  # too few rows left this round (dropouts, stragglers)
            print(f"fedray: round {round_}: aggregation skipped: {e}", file=sys.stderr)
            agg = None
        if agg is None:  # nothing to aggregate: the model stays, the round is counted
            return {"aggregation_skipped": 1.0,
                    "client_loss": float(losses.mean()) if len(losses) else float("nan"),
                    "server_seconds": time.perf_counter() - t0,
                    "train_seconds": float(sum(r["seconds"] for r in results))}
        if dp is not None:
            agg = dp.noise(agg, rows.shape[0], torch_generator(self.seed, "dp-noise", round_))
        honest_mean = honest.mean(dim=0)
        finite = bool(torch.isfinite(agg).all())
        if finite:
            self.x = guarded("server.optimizer", self.optimizer_name, self.optimizer.step)(
                self.x, agg)
        honest_norm = float(torch.linalg.vector_norm(honest_mean))
        error = float(torch.linalg.vector_norm(agg - honest_mean)) if finite else float("inf")
        return {
            "honest_update_norm": honest_norm,
            "aggregate_norm": float(torch.linalg.vector_norm(agg)) if finite else float("inf"),
            "aggregation_error": error,
            # the error due to Byzantine clients on the scale of the honest step
            "relative_aggregation_error": error / honest_norm if honest_norm > 0 else float("nan"),
            "nonfinite_aggregate": 0.0 if finite else 1.0,
            "aggregation_skipped": 0.0,
            "client_loss": float(losses.mean()) if len(losses) else float("nan"),
            "server_seconds": time.perf_counter() - t0,
            "train_seconds": float(sum(r["seconds"] for r in results)),
        }

    def evaluate(self) -> dict[str, float]:
        vector_to_parameters(self.x.clone(), self.model.parameters())
        acc, loss = evaluate_model(self.model, self.x_test, self.y_test)
        _, train_loss = evaluate_model(self.model, self.x_tr, self.y_tr)
        return {"test_accuracy": acc, "test_loss": loss, "train_loss": train_loss}

    def checkpoint(self) -> dict[str, Any]:
        """Everything the server's future depends on: global model, optimizer state and the
        state of stateful aggregation rules (centered clipping's centre, ...)."""
        opt = self.optimizer.state_dict() if hasattr(self.optimizer, "state_dict") else {}
        return {"x": self.x.clone(), "optimizer": opt, "pipeline": self.pipeline.state_dict()}

    def restore(self, state: dict[str, Any]) -> None:
        self.x = state["x"].clone()
        if hasattr(self.optimizer, "load_state_dict"):
            self.optimizer.load_state_dict(state["optimizer"])
        self.pipeline.load_state_dict(state["pipeline"])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The global model as a torch state_dict (for the final-model artifact)."""
        vector_to_parameters(self.x.clone(), self.model.parameters())
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


class Mixer:
    """D-SGD's gossip and evaluation: the topology's mixing matrices, the Byzantine peers'
    messages (a gossip attack; they depend on each receiver's neighbourhood, so they are made
    where the gossip is computed), the defense, and the evaluation of the honest peers'
    models. Honest peers' models travel as result dicts (``clients``, ``updates`` rows)."""

    def __init__(self, scenario: dict, honest: list[int], byzantine: list[int],
                 input_shape: tuple[int, ...], num_classes: int,
                 eval_data: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]) -> None:
        _single_thread()
        self.seed = scenario["seeds"][0]
        self.n = scenario["clients"]["total"]
        self.honest = np.asarray(honest, dtype=np.int64)
        self.byzantine = np.asarray(byzantine, dtype=np.int64)
        self.topology = instantiate("topologies", scenario["topology"])
        self.cfg = scenario["dsgd"]
        attack = scenario.get("attack")
        self.attack = instantiate("attacks", attack) if attack and len(self.byzantine) else None
        self.aggregator = (instantiate("aggregators", scenario["aggregator"])
                           if self.cfg["defense"] == "aggregator" else None)
        self.model = build_model(scenario["model"], input_shape, num_classes, self.seed)
        self.x0 = parameters_to_vector(self.model.parameters()).detach().clone()
        self.x_test, self.y_test, self.x_tr, self.y_tr = eval_data
        self._blocks_cache: dict[int, tuple] = {}

    def params(self) -> np.ndarray:
        return self.x0.numpy().copy()

    def _blocks(self, step: int) -> tuple:
        """(W_HH dense, W_HH sparse, w_byz, Byzantine neighbour counts) of gossip step ``step``."""
        key = step if getattr(self.topology, "TIME_VARYING", False) else 0
        if key not in self._blocks_cache:
            from strategies.gossip import sparse_rows

            w = self.topology.mixing_matrix(self.n, self.seed, key)
            w_hb = w[np.ix_(self.honest, self.byzantine)]
            w_hh = w[np.ix_(self.honest, self.honest)]
            self._blocks_cache[key] = (w_hh, sparse_rows(w_hh), w_hb.sum(axis=1),
                                       (w_hb > 0).sum(axis=1))
        return self._blocks_cache[key]

    def gossip(self, round_: int, *results: dict) -> dict[str, Any]:
        """``dsgd.gossip_steps`` gossip steps over the honest peers' models in ``results``."""
        from strategies.gossip import clipped_gossip, plain_gossip, robust_gossip

        x = torch.from_numpy(stack_updates(self.honest, results, self.x0.numel()))
        losses = stack_updates(self.honest, results, 0, key="losses")
        steps = self.cfg["gossip_steps"]
        for s in range(steps):
            w_hh, w_sparse, w_byz, byz_count = self._blocks(round_ * steps + s)
            messages = None
            if self.attack is not None and (w_byz > 0).any():
                messages = self.attack.messages(
                    x, torch.from_numpy(w_hh.astype(np.float32)),
                    torch.from_numpy(w_byz.astype(np.float32)),
                    torch_generator(self.seed, "attack", round_, s))
            if self.cfg["defense"] == "clipped_gossip":
                x = clipped_gossip(x, w_hh, w_byz, messages, self.cfg["clip_tau"])
            elif self.cfg["defense"] == "aggregator":
                x = robust_gossip(x, w_hh, byz_count, messages, self.aggregator)
            else:
                x = plain_gossip(x, w_sparse, torch.from_numpy(w_byz.astype(np.float32)), messages)
        return {"clients": self.honest, "updates": x.numpy(), "losses": losses, "seconds": 0.0}

    def _eval_vector(self, x: torch.Tensor, with_train: bool = True) -> tuple[float, float, float]:
        vector_to_parameters(x.clone(), self.model.parameters())
        acc, loss = evaluate_model(self.model, self.x_test, self.y_test)
        train_loss = evaluate_model(self.model, self.x_tr, self.y_tr)[1] if with_train else float("nan")
        return acc, loss, train_loss

    def evaluate(self, *results: dict) -> dict[str, float]:
        """Mean over honest peers of their own models' test accuracy and loss, the averaged
        model's accuracy, test and train loss and generalization gap, consensus distance."""
        from strategies.gossip import consensus_distance

        x = torch.from_numpy(stack_updates(self.honest, results, self.x0.numel()))
        per_peer = [self._eval_vector(row, with_train=False) for row in x]
        avg_acc, avg_loss, avg_train = self._eval_vector(x.mean(dim=0))
        losses = stack_updates(self.honest, results, 0, key="losses")
        return {
            "test_accuracy": float(np.mean([p[0] for p in per_peer])),
            "test_loss": float(np.mean([p[1] for p in per_peer])),
            "min_peer_accuracy": float(min(p[0] for p in per_peer)),
            "averaged_test_accuracy": avg_acc,
            "averaged_test_loss": avg_loss,
            "train_loss": avg_train,
            "generalization_gap": avg_loss - avg_train,
            "consensus_distance": consensus_distance(x),
            "client_loss": float(np.nanmean(losses)) if np.isfinite(losses).any() else float("nan"),
        }

    def averaged(self, *results: dict) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
        """The honest peers' averaged model: flat vector and torch state_dict."""
        x = torch.from_numpy(stack_updates(self.honest, results, self.x0.numel())).mean(dim=0)
        vector_to_parameters(x.clone(), self.model.parameters())
        return x.numpy(), {k: v.detach().clone() for k, v in self.model.state_dict().items()}
