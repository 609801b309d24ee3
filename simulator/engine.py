"""The round loop, shared by every backend.

Per round: sample clients (seeded, without replacement), broadcast the global model once
(one object-store put), train the sampled clients on the ClientWorker pool, let the Adversary
replace the Byzantine clients' rows, aggregate on the Server (pre-aggregators -> aggregator ->
meta-aggregator), step the server optimizer, evaluate every ``evaluation.every`` rounds.
"""

from __future__ import annotations

import copy
import heapq
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simulator import data as fdata
from simulator import registry
from simulator.config import Scenario
from simulator.errors import ClientStateLost, DeviceUnavailable, UsageError, WorkerLost
from simulator.registry import instantiate
from simulator.runtime.actors import Adversary, Mixer, Server
from simulator.runtime.backend import PING_TIMEOUT, PLACE_TIMEOUT, Backend, gpu_share
from simulator.runtime.common import stack_updates
from simulator.runtime.worker import ClientWorker
from simulator.sampling import byzantine_clients, missed_round, sample_clients
from strategies.protocols import Privacy
from strategies.trainers import step_counts

RoundCallback = Callable[[int, dict[str, float]], None]
CheckpointCallback = Callable[[int, dict[str, Any]], None]


@dataclass
class RunResult:
    metrics: list[dict[str, float]]  # one row per round, deterministic values only
    final_params: np.ndarray
    model_state: dict[str, Any]
    timings: list[dict[str, float]] = field(default_factory=list)  # wall-clock, per round
    params: dict[str, str] = field(default_factory=dict)  # run params the engine derives
    tables: dict[str, dict[str, list]] = field(default_factory=dict)  # artifacts, by name
    # what the model takes (input_shape, num_classes, vocabulary, tokens): to rebuild it
    model_info: dict[str, Any] = field(default_factory=dict)

    def final(self, key: str) -> float:
        for row in reversed(self.metrics):
            if key in row:
                return row[key]
        return float("nan")


@dataclass
class _Training:
    """A round's submitted training: who was sampled, and the workers' result refs."""

    round_: int
    t0: float  # when it was submitted
    sampled: list[int]
    byz: list[int]
    dropped: set[int]
    late: set[int]
    honest: list[int]
    honest_refs: list[Any]
    seen: tuple[list[int], list[Any]] | None  # the rows the attack sees: (clients, refs)


_data_cache: dict[tuple, fdata.FederatedData] = {}


def load_data(sc: Scenario) -> fdata.FederatedData:
    """The scenario's federated data (cached per dataset/partition/seed within a process)."""
    seed = sc.seeds[0]
    key = (repr(sc.data.model_dump()), sc.clients.total, seed)
    if key not in _data_cache:
        _data_cache.clear()
        _data_cache[key] = fdata.build(
            sc.data.dataset, sc.data.partitioner, sc.clients.total, seed, sc.data.test_fraction
        )
    return _data_cache[key]


class Engine:
    """Runs one single-seed scenario (a sweep point) on a backend."""

    def __init__(self, scenario: Scenario, backend: Backend, workers: int | None = None) -> None:
        if len(scenario.seeds) != 1 or scenario.sweep:
            raise ValueError("Engine runs one point: expand the sweep and seeds first")
        if workers is not None and workers < 1:  # the CLI refuses it; here for the API
            raise UsageError(f"workers: must be an integer >= 1, got {workers}")
        self.sc = scenario
        self.backend = backend
        self.seed = scenario.seeds[0]
        self.n_workers = workers or scenario.runtime.workers or backend.default_workers()
        self.data = load_data(scenario)
        self.byzantine = set(byzantine_clients(self.seed, scenario.clients.total, scenario.clients.byzantine).tolist())
        # the aggregator's trimming parameter, to which each round's Byzantine count is compared
        b = scenario.clients.b_hat
        self.b_hat = int(b.value if b is not None and b.value is not None
                         else scenario.aggregator.get("f", 0) or 0)
        # each client's local work in minibatch steps (its simulated time at speed 1)
        self.local_steps = step_counts(self.data.client_sizes(), scenario.local)
        self._handles: list[Any] = []
        self._trained: set[int] = set()  # clients that have trained (and may hold state)
        # a gradient rule keeps per-client state in the worker that owns the client
        # (or, under server.buffers: local, each client's own model buffers)
        self.stateful_clients = scenario.client_rule().traits.gradient_rule
        self.owner: dict[int, int] = {}  # clients moved off a lost worker -> their new worker
        self.live: list[int] = list(range(self.n_workers))  # indices of the live workers
        self.privacy: Privacy | None = (instantiate("privacy", scenario.privacy)
                                        if scenario.privacy else None)
        self._mechanism: tuple[int, Any] = (-1, None)  # (rounds, mechanism) last composed
        self.derived: dict[str, str] = {}  # params the engine chose (logged with the run's)
        self._next: _Training | None = None  # the next round's training, when prefetched
        self._round_end = 0.0  # when the last round ended (perf_counter)

    SERVER_GPU = 0.1  # the share of a GPU the server takes when it aggregates on one

    def actor_options(self) -> tuple[dict[str, float], dict[str, float]]:
        """Ray resources of (each ClientWorker, the server) from ``runtime``: a worker's
        ``num_cpus`` and ``num_gpus`` (null: none on cpu, else the cluster's GPUs shared out
        among the workers, at most one each); the server a tenth of a GPU when it
        aggregates on one. A cuda device with no GPU to give is refused in one line."""
        rt = self.sc.runtime
        have = self.backend.gpus()
        server_gpu = self.SERVER_GPU if rt.server_device != "cpu" and have > 0 else 0.0
        if rt.server_device == "cuda" and not server_gpu:
            raise DeviceUnavailable("runtime.server_device: cuda, but the cluster has no GPU; "
                                    "use server_device: auto or cpu")
        gpus = gpu_share(rt.num_gpus, rt.device != "cpu", have - server_gpu, self.n_workers)
        if rt.device == "cuda" and gpus <= 0:
            raise DeviceUnavailable(
                f"runtime.device: cuda, but workers get no GPU (the cluster has {have:g}; "
                f"runtime.num_gpus: {rt.num_gpus}); use device: auto or cpu, or give num_gpus")
        worker = {"num_cpus": rt.num_cpus, **({"num_gpus": gpus} if gpus > 0 else {})}
        return worker, ({"num_gpus": server_gpu} if server_gpu else {})

    def _spawn_workers(self) -> None:
        """The ClientWorker pool; the partition table goes into the object store once. The
        workers start (each imports torch and builds its model) while the caller spawns the
        other actors; ``_await_workers`` waits for them."""
        b, sc, data = self.backend, self.sc, self.data
        self.worker_options, self.server_options = self.actor_options()
        self._check_fits()
        table_ref = b.put(data.table)
        self.workers = [
            b.spawn(ClientWorker, table_ref, data.offsets, data.input_shape, data.num_classes,
                    sc, data.vocabulary, role="worker", options=self.worker_options)
            for _ in range(self.n_workers)
        ]
        self._handles = list(self.workers)

    def _check_fits(self) -> None:
        """On a Ray instance whose resources cannot grow (a local one this run started),
        workers that cannot all be placed are refused before any starts, in one line; on a
        cluster the engine waits for them (``_await_workers``), since nodes may join."""
        b = self.backend
        if not b.fixed:
            return
        n, w, s = self.n_workers, self.worker_options, self.server_options
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

    def _await_workers(self) -> None:
        """Wait until every ClientWorker has started; one that finds no resources within
        PLACE_TIMEOUT stops the run in one line."""
        b = self.backend
        placed = b.ready(self.workers, PLACE_TIMEOUT)
        if not all(placed):
            raise WorkerLost(
                f"{placed.count(False)} of {self.n_workers} ClientWorkers did not start within "
                f"{PLACE_TIMEOUT:.0f} s (each needs {_resources(self.worker_options)}; the "
                f"cluster has {_resources({'num_cpus': b.default_workers(), 'num_gpus': b.gpus()})}"
                "); use fewer workers (--workers, runtime.workers) or smaller "
                "runtime.num_cpus / num_gpus")

    def worker_of(self, client: int) -> int:
        """The index of the worker that owns ``client`` (k % W, unless moved off a lost one)."""
        return self.owner.get(client, client % self.n_workers)

    def _spawn(self) -> None:
        b, sc, data = self.backend, self.sc, self.data
        self._spawn_workers()
        eval_ref = b.put(data.eval_data())
        self.server = b.spawn(Server, sc, data.input_shape, data.num_classes, eval_ref,
                              data.vocabulary, role="server", options=self.server_options)
        self.adversary = b.spawn(Adversary, sc, role="adversary") if sc.attack else None
        traits = registry.get("attacks", sc.attack["name"]).traits if sc.attack else None
        self.omniscient = traits is not None and traits.omniscient
        self.poison = sc.attack if traits is not None and traits.data_poisoning else None
        self._handles = [*self.workers, self.server] + ([self.adversary] if self.adversary else [])
        self._await_workers()
        params_ref = self.backend.call(self.server, "params")
        self._keep_faster_trainer(params_ref)
        self.dim = len(self.backend.get(params_ref))
        self.d_buffers = len(self.backend.get(self.backend.call(self.server, "buffers")))
        if self.d_buffers and self.sc.server.buffers == "local":
            self.stateful_clients = True

    PREFETCH = True  # whether a round's training may be submitted before the last one ends

    PROBE_STEPS = 2  # the minibatch steps a client takes in the vectorise-or-loop probe

    def _keep_faster_trainer(self, params_ref: Any) -> None:
        """``runtime.vectorize`` asks for the vectorised trainer, whose numbers equal the loop's
        to 1e-5; where the loop is faster (a model whose per-example arithmetic outweighs
        the per-step overhead that batching saves, such as an MLP of 1,024 hidden units on
        a CPU), the run keeps the loop and says so. Before the first round the first worker
        times both (``ClientWorker.probe``) on its share of that round's clients (at most
        the trainer's ``chunk``: as many as it stacks at once), ``PROBE_STEPS`` steps each;
        the choice is in the run's params (``vectorized``, ``vectorized.probe``)."""
        sc, b = self.sc, self.backend
        spec = sc.trainer()
        if not sc.runtime.vectorize or spec["name"] != "vectorized_sgd":
            return
        first = sample_clients(self.seed, 0, sc.clients.total, sc.clients.sampled).tolist()
        prober, ids = self._assign(first)[0]
        ids = ids[: spec.get("chunk", registry.keys("trainers", spec["name"])["chunk"])]
        steps = self.PROBE_STEPS
        vec, loop = b.get(b.call(self.workers[prober], "probe", [spec, {"name": "sgd"}], ids,
                                 params_ref, steps))
        self.derived["vectorized"] = str(vec <= loop).lower()
        self.derived["vectorized.probe"] = (f"a client of {steps} steps: vectorised "
                                            f"{vec:.5f} s, loop {loop:.5f} s")
        if vec > loop:
            print(f"fedray: runtime.vectorize: clients train one at a time, which is faster for "
                  f"this model here ({1e3 * loop:.2f} ms against {1e3 * vec:.2f} ms vectorised "
                  f"a client of {steps} steps); the numbers are the same to 1e-5",
                  file=sys.stderr)
            b.get([b.call(w, "use_trainer", {"name": "sgd"}) for w in self.workers])

    def _by_owner(self, clients: list[int]) -> list[tuple[int, list[int]]]:
        """(worker index, its clients) by owner: client k on worker k % W, unless moved off
        a lost one."""
        per: dict[int, list[int]] = {}
        for c in clients:
            per.setdefault(self.worker_of(c), []).append(c)
        return sorted(per.items())

    def _assign(self, clients: list[int]) -> list[tuple[int, list[int]]]:
        """(worker index, its clients) of the workers that train some of ``clients``.

        A client with per-client state trains on the worker that holds it (client k on
        worker k % W, unless moved off a lost one). Stateless clients are spread afresh each
        round over the live workers, the most local steps first (ties: the lower id), each
        to the least loaded worker (ties: the lower index), since a round waits for its
        slowest worker: with k % W, 20 of 200 clients sampled on 2 workers give the busier
        one 11.4 clients a round on average instead of 10. A client's numbers are a pure
        function of (seed, round, client), whichever worker computes them."""
        if self.stateful_clients:
            return self._by_owner(clients)
        heap = [(0.0, w) for w in self.live]
        mine: dict[int, list[int]] = {}
        for c in sorted(clients, key=lambda c: (-self.local_steps[c], c)):
            load, w = heapq.heappop(heap)
            mine.setdefault(w, []).append(c)
            heapq.heappush(heap, (load + float(self.local_steps[c]), w))
        return sorted(mine.items())

    def _train(self, round_: int, clients: list[int], params_ref: Any, buffers_ref: Any,
               poison: dict | None = None) -> list[Any]:
        """One train call per worker that trains some of ``clients`` (``_assign``)."""
        calls = [self.backend.call(self.workers[w], "train", round_, ids, params_ref, poison,
                                   [c for c in ids if c in self._trained]
                                   if self.stateful_clients else [], buffers_ref)
                 for w, ids in self._assign(clients)]
        self._trained.update(clients)
        return calls

    def _submit_training(self, round_: int) -> _Training:
        """Round ``round_``'s sampling and its training calls (the workers start as soon as
        the server's parameters are there); nothing in it changes the server."""
        b, sc = self.backend, self.sc
        t0 = time.perf_counter()
        sampled = sample_clients(self.seed, round_, sc.clients.total, sc.clients.sampled).tolist()
        byz = [c for c in sampled if c in self.byzantine]
        dropped, late = missed_round(self.seed, round_, [c for c in sampled if c not in self.byzantine],
                                     self.local_steps, sc.clients.dropout, sc.clients.stragglers)
        honest = [c for c in sampled if c not in self.byzantine and c not in dropped | late]
        params_ref = b.call(self.server, "params")  # stored once, read by every worker
        buffers_ref = b.call(self.server, "buffers") if self.d_buffers else None
        honest_refs = self._train(round_, honest, params_ref, buffers_ref)
        seen: tuple[list[int], list[Any]] | None = None
        if byz:
            seen = (honest, honest_refs) if self.omniscient else \
                (byz, self._train(round_, byz, params_ref, buffers_ref, self.poison))
        return _Training(round_, t0, sampled, byz, dropped, late, honest, honest_refs, seen)

    def run_round(self, round_: int, prefetch: bool = False
                  ) -> tuple[dict[str, float], dict[str, float]]:
        """Round ``round_``: its training (submitted already when the round before
        prefetched it), the Byzantine rows, the server's step, the evaluation when due.
        ``prefetch``: the next round's training is submitted right after this round's step,
        so the workers start it as soon as the step is done, while this round's metrics come
        back to the driver; only for a run whose clients keep no state, since a round that
        fails is computed again and the prefetched training is then dropped."""
        b, sc = self.backend, self.sc
        tr, self._next = self._next, None
        if tr is None or tr.round_ != round_:
            tr = self._submit_training(round_)
        byz_ref = None
        if tr.seen is not None:
            byz_ref = b.call(self.adversary, "attack_rows", round_, len(tr.byz), tr.seen[0],
                             self.dim, self.d_buffers, *tr.seen[1])
        step_ref = b.call(self.server, "step", round_, tr.honest, byz_ref, *tr.honest_refs)
        if prefetch:  # its params call comes before the evaluation in the server's queue
            self._next = self._submit_training(round_ + 1)
        evaluate = (round_ + 1) % sc.evaluation.every == 0 or round_ + 1 == sc.rounds
        eval_ref = b.call(self.server, "evaluate") if evaluate else None
        metrics = dict(b.get(step_ref))
        if eval_ref is not None:
            metrics.update(b.get(eval_ref))
            metrics.update(self._spent(round_ + 1))
        timings = {k: metrics.pop(k) for k in list(metrics) if k.endswith("_seconds")}
        end = time.perf_counter()
        # from the later of its submission and the previous round's end
        timings["round_seconds"] = end - max(tr.t0, self._round_end)
        self._round_end = end
        metrics = {"sampled": float(len(tr.sampled)), "byzantine_sampled": float(len(tr.byz)),
                   "dropped": float(len(tr.dropped)), "stragglers": float(len(tr.late)),
                   "participants": float(len(tr.honest) + len(tr.byz)),
                   "b_hat": float(self.b_hat),
                   "byzantine_exceeded": float(len(tr.byz) > self.b_hat), **metrics}
        return metrics, timings

    def run(self, on_round: RoundCallback | None = None,
            on_checkpoint: CheckpointCallback | None = None,
            resume: dict[str, Any] | None = None) -> RunResult:
        """Every round (from the one after ``resume["round"]`` when resuming a checkpoint),
        then the final model; every ``runtime.checkpoint_every`` rounds ``on_checkpoint``
        gets the run's whole state. The actors are released whatever happens.

        Per-client state that dies with a worker (worker momentum, mu2-SGD) is not lost for
        the run: it goes back to the newest state it holds in memory (the last checkpoint
        round, or the start) and computes the rounds since then again, on the live workers,
        with the same numbers; ``on_round`` is not called again for rounds it has seen."""
        try:
            self._spawn()
            rows: list[dict[str, float]] = []
            timings: list[dict[str, float]] = []
            start = 0
            if resume is not None:
                self._restore(resume)
                rows = [dict(m) for m in resume["metrics"]]
                start = int(resume["round"]) + 1
            every = self.sc.runtime.checkpoint_every
            # (round, state) to go back to when per-client state is lost
            rewind = (start - 1, self._snapshot(rows)) if self.stateful_clients else None
            reported = start - 1  # the last round on_round has seen
            r = start
            while r < self.sc.rounds:
                due = bool(every) and (r + 1) % every == 0 and r + 1 < self.sc.rounds and \
                    (on_checkpoint is not None or rewind is not None)
                # the next round's training goes out before this round's results come back,
                # unless a checkpoint is due (it must see the workers between rounds) or the
                # clients keep state (a round computed again would advance it twice)
                prefetch = (self.backend.pipelined and self.PREFETCH
                            and not self.stateful_clients and not due
                            and r + 1 < self.sc.rounds)
                try:
                    m, t = self._round_surviving_losses(r, prefetch)
                    saved = self._checkpoint_surviving_losses(r) if due else None
                except ClientStateLost as e:
                    if rewind is None:
                        raise
                    r0, state = rewind
                    where = "its start" if r0 < 0 else f"its state after round {r0 + 1}"
                    print(f"fedray: {e}; the run goes back to {where} and computes rounds "
                          f"{r0 + 2}-{r + 1} again", file=sys.stderr)
                    self._restore(copy.deepcopy(state))
                    rows = [dict(x) for x in state["metrics"]]
                    del timings[len(timings) - (r - r0 - 1):]
                    r = r0 + 1
                    continue
                rows.append(m)
                timings.append(t)
                if on_round is not None and r > reported:
                    on_round(r, m)
                    reported = r
                if saved is not None:
                    state = {**saved, "metrics": rows}
                    if on_checkpoint is not None:
                        on_checkpoint(r, state)
                    if rewind is not None:
                        rewind = (r, self._snapshot(rows, state))
                r += 1
            final, state, params = self._final()
            privacy_params, tables = self._privacy_outputs()
            d = self.data
            info = {"input_shape": tuple(d.input_shape), "num_classes": d.num_classes,
                    "vocabulary": d.vocabulary, "tokens": d.vocabulary is not None}
            return RunResult(rows, final, state, timings,
                             {**params, **privacy_params, **self.derived}, tables, info)
        finally:
            self.backend.release(self._handles)

    def _snapshot(self, rows: list[dict[str, float]],
                  state: dict[str, Any] | None = None) -> dict[str, Any]:
        """A private copy of the run's state (``state``, or the current one) and ``rows``."""
        return copy.deepcopy({**(state or self._checkpoint()), "metrics": rows})

    def _round_surviving_losses(self, round_: int, prefetch: bool = False
                                ) -> tuple[dict[str, float], dict[str, float]]:
        """``run_round``; when a ClientWorker is lost, its clients move to the live workers
        and the round is computed again: the same numbers, since a client's computation is
        a pure function of (seed, round, client) and the round's server step never ran."""
        while True:
            trained = set(self._trained)
            try:
                return self.run_round(round_, prefetch)
            except WorkerLost as e:
                self._trained = trained  # the round's training did not happen
                self._next = None  # nor the next round's, if it was submitted
                self._move_clients(round_, e)

    def _checkpoint_surviving_losses(self, round_: int) -> dict[str, Any]:
        """``_checkpoint`` after ``round_``; a worker lost meanwhile has its clients moved
        (its per-client state, if any, raises ClientStateLost: the run goes back)."""
        while True:
            try:
                return self._checkpoint()
            except WorkerLost as e:
                self._move_clients(round_, e, redo_round=False)

    def _move_clients(self, round_: int, error: WorkerLost, redo_round: bool = True) -> None:
        """Find the dead workers and give their clients to the live ones (client k to the
        (k mod L)-th live worker); per-client state that died with them raises
        ClientStateLost. ``redo_round``: the round is computed again (else it is done)."""
        live = [self.workers[w] for w in self.live]
        dead = [w for w, ok in zip(self.live, self.backend.ready(live, PING_TIMEOUT)) if not ok]
        if not dead:
            raise error  # a loss that is not a worker's
        self.live = [w for w in self.live if w not in dead]
        moved = [c for c in range(self.sc.clients.total) if self.worker_of(c) in dead]
        if not self.live:
            raise WorkerLost(f"every ClientWorker was lost in round {round_ + 1} ({error}); "
                             "resume the run from its last checkpoint")
        for c in moved:
            self.owner[c] = self.live[c % len(self.live)]
        lost = sorted(c for c in moved if c in self._trained) if self.stateful_clients else []
        # a round computed again would advance the live workers' per-client state twice
        if lost or (self.stateful_clients and redo_round):
            raise ClientStateLost(
                f"ClientWorker(s) {dead} lost in round {round_ + 1} with per-client state (a "
                "node went away, or a worker was killed; "
                + (f"the state of clients {lost[:5]}{' ...' if len(lost) > 5 else ''} died with "
                   "it; " if lost else "")
                + f"{len(moved)} clients moved to {len(self.live)} live worker(s))")
        print(f"fedray: round {round_ + 1}: ClientWorker(s) {dead} lost ({error}); their "
              f"{len(moved)} clients moved to {len(self.live)} live worker(s)"
              + (", the round is computed again" if redo_round else ""), file=sys.stderr)

    def privacy_mechanism(self, rounds: int) -> Any:
        """The run's DP mechanism after ``rounds`` rounds, as a composition of subsampled
        Gaussians (None without privacy); the plugin says what is composed, from the
        client-sampling rate, the largest per-example rate batch_size / size over the clients
        and the most local steps any client takes in a round."""
        if self.privacy is None:
            return None
        if self._mechanism[0] != rounds:  # the last one is kept: the final round's epsilon
            c = self.sc.clients  # and the run's privacy outputs share one composition
            sizes = np.maximum(self.data.client_sizes(), 1)
            self._mechanism = (rounds, self.privacy.mechanism(
                rounds, min(1.0, c.sampled / c.total),
                float(min(1.0, self.sc.local.batch_size / sizes.min())),
                int(self.local_steps.max())))
        return self._mechanism[1]

    def _spent(self, rounds: int) -> dict[str, float]:
        """``{"epsilon": ...}``: the privacy spent after ``rounds`` rounds at the scenario's
        delta ({} without privacy)."""
        if self.privacy is None:
            return {}
        return {"epsilon": self.privacy_mechanism(rounds).epsilon(self.privacy.delta,
                                                                  self.privacy.accountant)}

    def _privacy_outputs(self) -> tuple[dict[str, str], dict[str, dict[str, list]]]:
        """Final epsilon as a param, the privacy profile and trade-off curve as tables."""
        mech = self.privacy_mechanism(self.sc.rounds)
        if mech is None:
            return {}, {}
        p = self.privacy
        assert p is not None  # a mechanism comes from the privacy plugin
        eps = mech.epsilon(p.delta, p.accountant)
        grid = np.linspace(0.0, max(2 * eps, 1.0) if math.isfinite(eps) else 10.0, 101)
        alpha = np.linspace(0.0, 1.0, 1001)
        return ({"privacy.epsilon": f"{eps:.6g}", "privacy.steps": str(mech.steps),
                 "privacy.sampling_rate": f"{mech.q:.6g}"},
                {"privacy_profile": {"epsilon": grid.tolist(), "delta": mech.profile(grid).tolist()},
                 "tradeoff": {"alpha": alpha.tolist(), "beta": mech.tradeoff(alpha).tolist()}})

    def _owned(self, worker: int) -> list[int]:
        return [c for c in range(self.sc.clients.total) if self.worker_of(c) == worker]

    def _checkpoint(self) -> dict[str, Any]:
        """The server's state and every live worker's client states (after a round)."""
        b = self.backend
        clients: dict[int, dict] = {}
        for states in b.get([b.call(self.workers[w], "client_states") for w in self.live]):
            clients.update(states)
        return {"server": b.get(b.call(self.server, "checkpoint")), "clients": clients}

    def _restore(self, state: dict[str, Any]) -> None:
        b = self.backend
        self._trained = {int(c) for c in state["clients"]}
        calls = [b.call(self.server, "restore", state["server"])]
        for w in self.live:
            mine = {c: st for c, st in state["clients"].items() if int(c) in set(self._owned(w))}
            calls.append(b.call(self.workers[w], "load_client_states", mine))
        b.get(calls)

    def _final(self) -> tuple[np.ndarray, dict[str, Any], dict[str, str]]:
        """(final flat parameters, model state_dict, run params the engine derived)."""
        final = np.asarray(self.backend.get(self.backend.call(self.server, "params")))
        return final, self.backend.get(self.backend.call(self.server, "state_dict")), {}


class DecentralizedEngine(Engine):
    """D-SGD on a topology (Le Bars, Bellet, Tommasi, Scaman, Neglia, ICML 2024, study its
    generalization): no server; every honest peer keeps its own model in the ClientWorker
    that owns it, runs local SGD and gossips with its neighbours through the Mixer, in the
    scenario's ``dsgd.order``. Byzantine peers hold no model; the gossip attack makes their
    messages. Every draw is derived from (seed, purpose, round, peer) as in ``Engine``."""

    def _spawn(self) -> None:
        b, sc, data = self.backend, self.sc, self.data
        self.honest = [i for i in range(sc.clients.total) if i not in self.byzantine]
        self._spawn_workers()
        eval_ref = b.put(data.eval_data())
        self.mixer = b.spawn(Mixer, sc, self.honest,
                             sorted(self.byzantine), data.input_shape, data.num_classes, eval_ref,
                             data.vocabulary, role="server")
        self._handles = [*self.workers, self.mixer]
        self._await_workers()
        self._x0 = b.call(self.mixer, "params")
        self._keep_faster_trainer(self._x0)
        self._state: list[Any] | None = None  # result refs holding the peers' current models
        # the peer_step arguments that made _state (None: the Mixer's gossip made it), to
        # make it again when a worker holding part of it is lost
        self._made_by: tuple | None = None
        self._round_start: tuple = (None, None)

    def _move_clients(self, round_: int, error: WorkerLost, redo_round: bool = True) -> None:
        """As for server-based runs; then the peers' models are made again where they lived
        in workers: those of the round before when the round is computed again, else this
        round's."""
        super()._move_clients(round_, error, redo_round)
        if redo_round:
            self._state, self._made_by = self._round_start
        if self._made_by is not None:
            self._state = self._peer_step(*self._made_by)

    def _peer_step(self, round_: int, mixed: Any, train: bool) -> list[Any]:
        return [self.backend.call(self.workers[w], "peer_step", round_, ids, self._x0, mixed, train)
                for w, ids in self._by_owner(self.honest)]

    PREFETCH = False  # a round's training starts from the last round's gossip

    def run_round(self, round_: int, prefetch: bool = False
                  ) -> tuple[dict[str, float], dict[str, float]]:
        b, sc = self.backend, self.sc
        t0 = time.perf_counter()
        self._round_start = (self._state, self._made_by)
        if sc.dsgd.order == "local_then_gossip":
            mixed = self._state[0] if self._state else None
            trained = self._peer_step(round_, mixed, True)
            self._state, self._made_by = [b.call(self.mixer, "gossip", round_, *trained)], None
        else:
            if self._state is None:
                self._made_by = (round_, None, False)
                self._state = self._peer_step(*self._made_by)
            mixed = b.call(self.mixer, "gossip", round_, *self._state)
            self._made_by = (round_, mixed, True)
            self._state = self._peer_step(*self._made_by)
        evaluate = (round_ + 1) % sc.evaluation.every == 0 or round_ + 1 == sc.rounds
        metrics: dict[str, float] = {"byzantine_peers": float(len(self.byzantine))}
        if evaluate:
            metrics.update(b.get(b.call(self.mixer, "evaluate", *self._state)))
            metrics.update(self._spent(round_ + 1))
        else:
            b.get(self._state[0])  # finish the round before timing it
        return metrics, {"round_seconds": time.perf_counter() - t0}

    def _checkpoint(self) -> dict[str, Any]:
        """Every honest peer's model (rows in peer order)."""
        import torch

        assert self._state is not None  # a round has run
        results = self.backend.get(list(self._state))
        x = stack_updates(self.honest, tuple(results), len(results[0]["updates"][0]))
        return {"peers": torch.from_numpy(x), "clients": {}}

    def _restore(self, state: dict[str, Any]) -> None:
        x = state["peers"].numpy()
        self._made_by = None
        self._state = [self.backend.put({"clients": np.asarray(self.honest, dtype=np.int64),
                                         "updates": x, "losses": np.full(len(x), np.nan),
                                         "seconds": 0.0})]

    def _final(self) -> tuple[np.ndarray, dict[str, Any], dict[str, str]]:
        """The honest peers' averaged model, and the topology's spectral gap and degree."""
        from strategies.topologies import topology_summary

        assert self._state is not None and self.sc.topology is not None
        final, state = self.backend.get(self.backend.call(self.mixer, "averaged", *self._state))
        topo = instantiate("topologies", self.sc.topology)
        summary = topology_summary(topo, self.sc.clients.total, self.seed)
        return np.asarray(final), state, {k: f"{v:.6g}" for k, v in summary.items()}


def _resources(options: dict[str, float]) -> str:
    """``1 CPU``, ``2 CPUs and 0.5 GPU``: Ray resources in words."""
    words = []
    for key, unit in (("num_cpus", "CPU"), ("num_gpus", "GPU")):
        n = float(options.get(key, 0))
        if n or key == "num_cpus":
            words.append(f"{n:g} {unit}{'s' if n > 1 else ''}")
    return " and ".join(words)


def make_engine(scenario: Scenario, backend: Backend, workers: int | None = None) -> Engine:
    """The engine a scenario needs: D-SGD with a topology, else server-based FL."""
    cls = DecentralizedEngine if scenario.topology is not None else Engine
    return cls(scenario, backend, workers)
