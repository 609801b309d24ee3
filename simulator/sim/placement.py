"""The ClientWorker pool of a run: the workers' resources and whether they fit, starting
them, which worker trains which client, the clients of a lost worker, the vectorise-or-loop
probe, and the per-client state the workers hold (for checkpoints)."""

from __future__ import annotations

import heapq
import logging
from typing import Any

import numpy as np

from simulator import data as fdata
from simulator.config.plan import Plan
from simulator.errors import ClientStateLost, DeviceUnavailable, UsageError, WorkerLost
from simulator.messages import (
    ClientRows,
    EvalData,
    EvalScores,
    PersonalScores,
    Ref,
    TrainRequest,
)
from simulator.pinning import strict_options
from simulator.runtime import backend as backend_module
from simulator.runtime.backend import PING_TIMEOUT, Backend, gpu_share
from simulator.runtime.common import eval_shares
from simulator.runtime.handles import WorkerHandle
from simulator.runtime.worker import ClientWorker
from simulator.sim.sampling import sample_clients

LOG = logging.getLogger("fedray.engine")

SERVER_GPU = 0.1  # the share of a GPU the server takes when it aggregates on one
PROBE_STEPS = 2  # the minibatch steps a client takes in the vectorise-or-loop probe


class WorkerPool:
    """``n`` ClientWorkers; client k lives on worker k % n unless moved off a lost one."""

    def __init__(self, plan: Plan, backend: Backend, data: fdata.FederatedData, n: int,
                 local_steps: np.ndarray) -> None:
        self.plan, self.backend, self.data, self.n = plan, backend, data, n
        self.local_steps = local_steps  # each client's local work in minibatch steps
        self.workers: list[WorkerHandle] = []
        self.owner: dict[int, int] = {}  # clients moved off a lost worker -> their new worker
        self.live: list[int] = list(range(n))  # indices of the live workers
        self.trained: set[int] = set()  # clients that have trained (and may hold state)
        # clients keep state in the worker that owns them (set again once the model's
        # buffers are known: server.buffers local)
        self.stateful = plan.stateful_clients(False)

    # ------------------------------------------------------------------ resources

    def actor_options(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Ray options of (each ClientWorker, the server) from ``runtime``: a worker's
        ``num_cpus`` and ``num_gpus`` (null: none on cpu, else the cluster's GPUs shared out
        among the workers, at most one each); the server a tenth of a GPU when it
        aggregates on one; under ``deterministic: strict`` both start pinned
        (``strict_options``). A cuda device with no GPU to give is refused in one line."""
        rt = self.plan.scenario.runtime
        have = self.backend.gpus()
        server_gpu = SERVER_GPU if rt.server_device != "cpu" and have > 0 else 0.0
        if rt.server_device == "cuda" and not server_gpu:
            raise DeviceUnavailable("runtime.server_device: cuda, but the cluster has no GPU; "
                                    "use server_device: auto or cpu")
        gpus = gpu_share(rt.num_gpus, rt.device != "cpu", have - server_gpu, self.n)
        if rt.device == "cuda" and gpus <= 0:
            raise DeviceUnavailable(
                f"runtime.device: cuda, but workers get no GPU (the cluster has {have:g}; "
                f"runtime.num_gpus: {rt.num_gpus}); use device: auto or cpu, or give num_gpus")
        pinned = strict_options(rt.strict)
        worker = {"num_cpus": rt.num_cpus, **({"num_gpus": gpus} if gpus > 0 else {}), **pinned}
        return worker, {**({"num_gpus": server_gpu} if server_gpu else {}), **pinned}

    def check_fits(self) -> None:
        """On a Ray instance whose resources cannot grow (a local one this run started),
        workers that cannot all be placed are refused before any starts, in one line; on a
        cluster the engine waits for them (``await_workers``), since nodes may join."""
        b = self.backend
        if not b.fixed:
            return
        n, w, s = self.n, self.worker_options, self.server_options
        for key, have, what in (("num_cpus", float(b.default_workers()), "CPU"),
                                ("num_gpus", b.gpus(), "GPU")):
            each = float(w.get(key, 0.0))
            need = n * each + float(s.get(key, 0.0))
            if need > have + 1e-9:
                fit = int((have - float(s.get(key, 0.0))) // each + 1e-9) if each else 0
                fewer = f"--workers {fit} or fewer, " if fit >= 1 else ""
                raise UsageError(
                    f"runtime.workers: {n} ClientWorkers need {need:g} {what}s ({each:g} each, "
                    f"runtime.{key}), and this machine's Ray instance has {have:g}; use "
                    f"{fewer}a smaller runtime.{key}, or --address a cluster")

    def spawn(self) -> None:
        """The ClientWorker pool; the data's client source (the partition table, or the
        population a worker reads a cohort at a time from) goes into the object store once. The
        workers start (each imports torch and builds its model) while the caller spawns the
        other actors; ``await_workers`` waits for them."""
        b, data = self.backend, self.data
        self.worker_options, self.server_options = self.actor_options()
        self.check_fits()
        source_ref = b.put_data(data.source)
        self.workers = [
            WorkerHandle(b, b.spawn(ClientWorker, source_ref, data.input_shape,
                                    data.num_classes, self.plan, data.vocabulary, role="worker",
                                    options=self.worker_options))
            for _ in range(self.n)
        ]

    def await_workers(self) -> None:
        """Wait until every ClientWorker has started; one that finds no resources within
        PLACE_TIMEOUT stops the run in one line."""
        b, timeout = self.backend, backend_module.PLACE_TIMEOUT
        placed = b.ready(self.actors(), timeout)
        if not all(placed):
            raise WorkerLost(
                f"{placed.count(False)} of {self.n} ClientWorkers did not start within "
                f"{timeout:.0f} s (each needs {resources_text(self.worker_options)}; the "
                f"cluster has {resources_text({'num_cpus': b.default_workers(), 'num_gpus': b.gpus()})}"
                "); use fewer workers (--workers, runtime.workers) or smaller "
                "runtime.num_cpus / num_gpus")

    def actors(self) -> list[Any]:
        return [w.actor for w in self.workers]

    # ------------------------------------------------------------------ who trains whom

    def worker_of(self, client: int) -> int:
        """The index of the worker that owns ``client`` (k % W, unless moved off a lost one)."""
        return self.owner.get(client, client % self.n)

    def by_owner(self, clients: list[int]) -> list[tuple[int, list[int]]]:
        """(worker index, its clients) by owner."""
        per: dict[int, list[int]] = {}
        for c in clients:
            per.setdefault(self.worker_of(c), []).append(c)
        return sorted(per.items())

    def assign(self, clients: list[int]) -> list[tuple[int, list[int]]]:
        """(worker index, its clients) of the workers that train some of ``clients``.

        A client with per-client state trains on the worker that holds it. Stateless
        clients are spread afresh each round over the live workers, the most local steps
        first (ties: the lower id), each to the least loaded worker (ties: the lower index),
        since a round waits for its slowest worker: with k % W, 20 of 200 clients sampled on
        2 workers give the busier one 11.4 clients a round on average instead of 10. A
        client's numbers are a pure function of (seed, round, client), whichever worker
        computes them."""
        if self.stateful:
            return self.by_owner(clients)
        heap = [(0.0, w) for w in self.live]
        mine: dict[int, list[int]] = {}
        for c in sorted(clients, key=lambda c: (-self.local_steps[c], c)):
            load, w = heapq.heappop(heap)
            mine.setdefault(w, []).append(c)
            heapq.heappush(heap, (load + float(self.local_steps[c]), w))
        return sorted(mine.items())

    def train(self, round_: int, clients: list[int], params: Ref[np.ndarray],
              buffers: Ref[np.ndarray] | None, poison: dict[str, Any] | None = None,
              shared: Ref[np.ndarray] | None = None, partial: dict[int, int] | None = None,
              attackers: dict[int, int] | None = None) -> list[Ref[ClientRows]]:
        """One train call per worker that trains some of ``clients`` (``assign``), with the
        server's broadcast state ``shared``, the stragglers' ``partial`` work (client ->
        steps) and, with ``poison``, each poisoned client's index among the Byzantine
        clients (``attackers``)."""
        calls = []
        partial, attackers = partial or {}, attackers or {}
        for w, ids in self.assign(clients):
            expect = tuple(c for c in ids if c in self.trained) if self.stateful else ()
            caps = tuple((c, partial[c]) for c in ids if c in partial)
            ranks = tuple((c, attackers[c]) for c in ids if c in attackers)
            request = TrainRequest(round_, tuple(ids), poison, expect, caps, ranks)
            calls.append(self.workers[w].train(request, params, buffers, shared))
        self.trained.update(clients)
        return calls

    def move_clients(self, round_: int, error: WorkerLost, redo_round: bool = True) -> None:
        """Find the dead workers and give their clients to the live ones (client k to the
        (k mod L)-th live worker); per-client state that died with them raises
        ClientStateLost. ``redo_round``: the round is computed again (else it is done)."""
        live = [self.workers[w].actor for w in self.live]
        dead = [w for w, ok in zip(self.live, self.backend.ready(live, PING_TIMEOUT)) if not ok]
        if not dead:
            raise error  # a loss that is not a worker's
        self.live = [w for w in self.live if w not in dead]
        total = self.plan.scenario.clients.total
        moved = [c for c in range(total) if self.worker_of(c) in dead]
        if not self.live:
            raise WorkerLost(f"every ClientWorker was lost in round {round_ + 1} ({error}); "
                             "resume the run from its last checkpoint")
        for c in moved:
            self.owner[c] = self.live[c % len(self.live)]
        lost = sorted(c for c in moved if c in self.trained) if self.stateful else []
        # a round computed again would advance the live workers' per-client state twice
        if lost or (self.stateful and redo_round):
            raise ClientStateLost(
                f"ClientWorker(s) {dead} lost in round {round_ + 1} with per-client state (a "
                "node went away, or a worker was killed; "
                + (f"the state of clients {lost[:5]}{' ...' if len(lost) > 5 else ''} died with "
                   "it; " if lost else "")
                + f"{len(moved)} clients moved to {len(self.live)} live worker(s))")
        LOG.warning("fedray: round %d: ClientWorker(s) %s lost (%s); their %d clients moved to "
                    "%d live worker(s)%s", round_ + 1, dead, error, len(moved), len(self.live),
                    ", the round is computed again" if redo_round else "")

    # ------------------------------------------------------------------ trainers, state

    def keep_faster_trainer(self, params: Ref[np.ndarray]) -> dict[str, str]:
        """``runtime.vectorize`` asks for a batched trainer, whose numbers equal its loop
        twin's to 1e-5 (``Plan.loop_trainer``); where the loop is faster (a model whose
        per-example arithmetic outweighs the per-step overhead that batching saves, such as
        an MLP of 1,024 hidden units on a CPU), the run keeps the loop and says so. Before
        the first round the first worker times both (``ClientWorker.probe``) on its share of
        that round's clients (at most the trainer's ``chunk``: as many as it stacks at
        once), ``PROBE_STEPS`` steps each. Returns the run params that record the choice
        (``vectorized``, ``vectorized.probe``; {} without a probe)."""
        from simulator import registry

        plan, b = self.plan, self.backend
        loop = plan.loop_trainer
        if loop is None:
            return {}
        spec, c = plan.trainer, plan.scenario.clients
        first = sample_clients(plan.seed, 0, c.total, c.sampled).tolist()
        prober, ids = self.assign(first)[0]
        chunk = spec.get("chunk", registry.keys("trainers", spec["name"]).get("chunk"))
        ids = ids[:chunk] if chunk else ids
        vec, loop_s = b.get(self.workers[prober].probe([spec, loop], ids, params, PROBE_STEPS))
        derived = {"vectorized": str(vec <= loop_s).lower(),
                   "vectorized.probe": f"a client of {PROBE_STEPS} steps: vectorised "
                                       f"{vec:.5f} s, loop {loop_s:.5f} s"}
        if vec > loop_s:
            LOG.warning("fedray: runtime.vectorize: clients train one at a time, which is faster "
                        "for this model here (%.2f ms against %.2f ms vectorised a client of %d "
                        "steps); the numbers are the same to 1e-5", 1e3 * loop_s, 1e3 * vec,
                        PROBE_STEPS)
            b.get([w.use_trainer(loop) for w in self.workers])
        return derived

    def client_states(self) -> dict[int, dict[str, Any]]:
        """The per-client state every live worker keeps."""
        out: dict[int, dict[str, Any]] = {}
        for states in self.backend.get([self.workers[w].client_states() for w in self.live]):
            out.update(states)
        return out

    def evaluate_personal(self, exclude: list[int], eval_data: Ref[EvalData],
                          buffers: Ref[np.ndarray] | None, params: Ref[np.ndarray] | None
                          ) -> list[Ref[PersonalScores]]:
        """Every live worker's personal models on their clients' own test samples (calls,
        not yet waited for); ``exclude``: the Byzantine clients; ``params``: the global
        model (fedbn's personal models are it with each client's BatchNorm weights)."""
        return [self.workers[w].evaluate_personal(tuple(exclude), eval_data, buffers, params)
                for w in self.live]

    def evaluate_spans(self, params: Ref[np.ndarray], buffers: Ref[np.ndarray] | None,
                       eval_data: Ref[EvalData], n_test: int, n_train: int
                       ) -> list[Ref[list[EvalScores]]]:
        """The global model's evaluation dealt out over the live workers, contiguous runs of
        its spans each (``eval_shares``; calls, not yet waited for)."""
        shares = eval_shares(n_test, n_train, len(self.live))
        return [self.workers[w].evaluate_spans(params, buffers, eval_data, share)
                for w, share in zip(self.live, shares, strict=True) if share]

    def load_client_states(self, states: dict[int, dict[str, Any]]) -> list[Ref[None]]:
        """Give each live worker the states of its clients (calls, not yet waited for)."""
        self.trained = {int(c) for c in states}
        calls = []
        for w in self.live:
            mine = {c: st for c, st in states.items() if self.worker_of(int(c)) == w}
            calls.append(self.workers[w].load_client_states(mine))
        return calls


def resources_text(options: dict[str, float]) -> str:
    """``1 CPU``, ``2 CPUs and 0.5 GPU``: Ray resources in words."""
    words = []
    for key, unit in (("num_cpus", "CPU"), ("num_gpus", "GPU")):
        n = float(options.get(key, 0))
        if n or key == "num_cpus":
            words.append(f"{n:g} {unit}{'s' if n > 1 else ''}")
    return " and ".join(words)
