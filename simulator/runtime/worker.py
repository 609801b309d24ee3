"""The ClientWorker actor: it hosts many virtual clients (their data slices, their state), one
model instance and the scenario's trainer, and knows no training algorithm.

Across the Ray boundary parameters and updates travel as float32 NumPy arrays (zero-copy
reads from the object store); ``ray.get`` gives read-only views, so nothing here updates an
argument in place.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from simulator.config.plan import Plan, build_client_rule, build_codecs, build_privacy
from simulator.data import ClientSource
from simulator.errors import ClientStateLost, guarded
from simulator.messages import ClientRows, Encoded, TrainRequest
from simulator.models import build_model
from simulator.registry import PluginSpec, instantiate
from simulator.runtime.audit import CanaryAudit
from simulator.runtime.common import (
    buffers_to_vector,
    deterministic_mode,
    model_input,
    norm_parameter_mask,
    resolve_device,
    single_thread,
    vector_to_buffers,
)
from simulator.runtime.jobs import EvaluationJobs, PeerModels
from simulator.runtime.payloads import CodecStates, encode_payload
from simulator.runtime.pool import Reusable
from simulator.runtime.state import ClientStateStore
from simulator.seeding import torch_generator
from strategies.codecs import message_shape
from strategies.protocols import Attack, ClientData, Trainer


class ClientWorker(EvaluationJobs, PeerModels, Reusable):
    """Trains many virtual clients, one call per round, on one model instance.

    A client is its samples (a slice of the partition table, or generated or read from its
    population when a call needs it) plus its random stream ``(seed, round, client)`` and
    its state; its computation in a round is a pure function of those and the global model,
    which makes a retry after a fault exact.
    """

    def __init__(self, source: ClientSource, input_shape: tuple[int, ...],
                 num_classes: int, plan: Plan, vocabulary: int | None = None) -> None:
        scenario = plan.scenario
        rt = scenario.runtime
        single_thread(rt.threads)
        deterministic_mode(rt.deterministic)
        # one model on the worker's device, trained in place for every client: device
        # memory is one model and one batch (or one vectorised chunk), whatever the clients
        self.device = resolve_device(rt.device)
        self.bf16 = rt.precision == "bf16"
        self.source = source
        self.sizes = np.asarray(source.sizes)
        self.cohort: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # this call's samples
        self.seed = plan.seed
        self.num_classes = num_classes
        self.model = build_model(scenario.model, input_shape, num_classes, self.seed,
                                 vocabulary).to(self.device)
        self.scenario = scenario
        self.plan = plan
        self.codecs = build_codecs(plan)  # the message path's client halves
        self.codec_states = CodecStates(self.codecs)  # their per-client state (residuals)
        self.d = sum(p.numel() for p in self.model.parameters())
        self.shape = message_shape(self.model, plan.message.width(self.d))
        # an audit of sample-level DP: the canary examples the clients hold
        self.canaries = CanaryAudit(plan) \
            if scenario.audit is not None and plan.privacy_level == "sample" else None
        self.use_trainer(plan.trainer)
        self.state_dtype = {"float32": torch.float32,
                            "float16": torch.float16}[scenario.runtime.state_dtype]
        self.client_state = ClientStateStore(self.state_dtype)  # per-client state
        self.stateful = plan.client_state
        # model buffers (BatchNorm statistics): from the server each round, or (server.buffers
        # local) each client's own after its first round
        self.buffer_dim = int(buffers_to_vector(self.model).numel())
        self.local_buffers = plan.local_buffers and self.buffer_dim > 0
        self.client_buffers = ClientStateStore(torch.float32)
        # server.buffers fedbn: each client's own BatchNorm weights (client_buffers "norm")
        self.norm_mask = norm_parameter_mask(self.model).cpu() \
            if plan.local_norm and self.buffer_dim else None
        self.peer_x: dict[int, torch.Tensor] = {}  # D-SGD: the models of this worker's peers

    def _trainer(self, spec: PluginSpec, local: Any = None) -> Trainer:
        sc, plan = self.scenario, self.plan
        privacy = build_privacy(plan)
        return instantiate("trainers", spec, model=self.model, local=local or sc.local,
                           task=instantiate("tasks", sc.task), rule=build_client_rule(plan),
                           privacy=privacy, client_sizes=self.sizes)

    def use_trainer(self, spec: PluginSpec) -> None:
        """Train with the trainer plugin ``spec`` from now on."""
        self.trainer = self._trainer(spec)
        self.train_clients = guarded("local.trainer", spec["name"], self.trainer.train)

    PROBE_FIRST = 8  # the clients of the probe's first, cheap comparison

    def _autocast(self) -> Any:
        """bf16 autocast of the forward passes when ``runtime.precision`` asks for it. No
        weight cache: a trainer changes the weights between the forward passes of one call,
        and autocast's cache would keep casting the first ones."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16,
                              cache_enabled=False)

    def probe(self, specs: list[PluginSpec], clients: list[int], global_params: np.ndarray,
              steps: int = 2, repeat: int = 2,
              clock: Callable[[], float] | None = None) -> list[float]:
        """Seconds per client each trainer of ``specs`` takes (``steps`` minibatch steps a
        client) from ``global_params``: what the engine compares to keep the faster of two
        trainers that give the same numbers. First on ``PROBE_FIRST`` of ``clients``, one
        timing after a warm-up; where one trainer is more than twice as fast that decides
        it (a model that batches badly, such as a large CNN, would otherwise spend a minute
        here). Otherwise on all of ``clients`` (a trainer that stacks clients costs more per
        client for a large model as the stack grows), the fastest of ``repeat`` timings
        taken in turns (a machine whose speed drifts moves both alike). ``clock``: the
        seconds counted (default ``time.perf_counter``; ``time.thread_time``: this thread's
        CPU, for a probe that runs beside other threads of the driver)."""
        tick = clock or time.perf_counter
        local = self.scenario.local.model_copy(update={"steps": steps, "epochs": None})
        start = torch.from_numpy(np.array(global_params, dtype=np.float32)).to(self.device)
        trains = [self._trainer(spec, local).train for spec in specs]

        def fastest(ids: list[int], times: int) -> list[float]:
            self.read(ids)
            data = [self.client_data(0, c) for c in ids]
            best = [math.inf] * len(trains)
            with self._autocast():
                for train in trains:
                    train(0, data, start)
                for _ in range(times):
                    for i, train in enumerate(trains):
                        t0 = tick()
                        train(0, data, start)
                        best[i] = min(best[i], (tick() - t0) / len(ids))
            return best

        first = fastest(clients[: self.PROBE_FIRST], 1)
        if len(clients) <= self.PROBE_FIRST or max(first) > 2 * min(first):
            return first
        return fastest(clients, repeat)

    def client_data(self, round_: int, client: int, poison: Attack | None = None,
                    shared: torch.Tensor | None = None, max_steps: int | None = None,
                    attacker: int = 0) -> ClientData:
        """Client ``client``'s samples (writable copies; poisoned by a data-poisoning
        attack), random stream and state in round ``round_``, with the server's broadcast
        state ``shared``, its cap on local steps ``max_steps`` (None: none) and, poisoned,
        its index among the Byzantine clients ``attacker``."""
        xs, ys = self.cohort.pop(client) if client in self.cohort else \
            self.source.train([client])[0]
        x = model_input(xs)
        y = torch.from_numpy(np.array(ys))
        if poison is not None:  # a stream of its own: the training stream is unchanged
            x, y = poison.poison(x, y, attacker, round_, self.num_classes,
                                 torch_generator(self.seed, "poison", round_, client))
        canaries = gen = None
        if self.canaries is not None and poison is None:  # an audit's canary examples
            held = self.canaries.held_by(int(client))
            if len(held):
                canaries = self.canaries.directions(held, self.d)
                gen = torch_generator(self.seed, "audit", "examples", round_, client)
        # samples and state stay in host memory: the trainer moves each batch to the device
        return ClientData(int(client), x, y, torch_generator(self.seed, "local", round_, client),
                          self.client_state.get(client), shared, max_steps, canaries, gen)

    def _run(self, round_: int, clients: list[ClientData], start: torch.Tensor
             ) -> tuple[np.ndarray, np.ndarray]:
        """The trainer on ``clients``; the state it leaves is kept (in ``state_dtype``)."""
        with self._autocast():
            updates, losses = self.train_clients(round_, clients, start.to(self.device))
        for c in clients:
            if c.state:
                self.client_state.set(c.client, {k: v.detach() for k, v in c.state.items()})
        # updates travel as float32 host arrays, whatever the device and precision
        return (np.asarray(updates.detach().to(torch.float32).cpu().numpy()),
                np.asarray(losses.detach().to(torch.float64).cpu().numpy()))

    def _run_buffers(self, round_: int, clients: list[ClientData], start: torch.Tensor,
                     global_buffers: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The trainer on one client at a time, each from its starting buffers (the
        server's, or its own under ``server.buffers: local``; under ``fedbn`` its own
        BatchNorm weights too, whose update entries it does not send); the buffers each
        client ends with are its third result, rows following ``clients``."""
        b0 = torch.from_numpy(np.array(global_buffers, dtype=np.float32))
        d = start.numel()
        updates = np.empty((len(clients), self.plan.message.width(d)), dtype=np.float32)
        losses = np.empty(len(clients))
        rows = np.empty((len(clients), self.buffer_dim), dtype=np.float32)
        mask = self.norm_mask
        for i, c in enumerate(clients):
            own = self.client_buffers.get(c.client) if self.local_buffers else {}
            vector_to_buffers(own.get("buffers", b0), self.model)
            begin = start
            if mask is not None and "norm" in own:
                begin = start.clone()
                begin[mask] = own["norm"]
            u, loss = self._run(round_, [c], begin)
            updates[i], losses[i] = u[0], loss[0]
            rows[i] = buffers_to_vector(self.model).cpu().numpy()
            if self.local_buffers:
                kept = {"buffers": torch.from_numpy(rows[i])}
                if mask is not None:  # its own weights go on; the server never sees them
                    step = torch.from_numpy(updates[i, :d])
                    kept["norm"] = begin[mask] + step[mask]
                    updates[i, :d][mask.numpy()] = 0.0
                self.client_buffers.set(c.client, kept)
        return updates, losses, rows

    def _holds(self, client: int) -> bool:
        """Whether this worker holds what ``client`` left here (rule state, own buffers)."""
        return ((not self.stateful or client in self.client_state)
                and (not self.local_buffers or client in self.client_buffers)
                and (not self.codec_states.keeping or client in self.codec_states))

    def read(self, clients: Sequence[int]) -> None:
        """The samples of the clients of a call, read at once (a population on files reads
        a cohort in one scan); ``client_data`` takes each client's from there."""
        ids = [int(c) for c in clients]
        self.cohort = dict(zip(ids, self.source.train(ids), strict=True))

    def train(self, request: TrainRequest, global_params: np.ndarray,
              buffers: np.ndarray | None = None, shared: np.ndarray | None = None
              ) -> ClientRows:
        """Train the request's clients from ``global_params`` (and the model's ``buffers``,
        when it has any; the server optimizer's broadcast ``shared``, when its client half
        reads it); rows of ``updates`` (and ``buffers``: the statistics each client ends
        with) follow the clients (``TrainRequest`` says what else it holds)."""
        round_, clients, poison = request.round, request.clients, request.poison
        lost = [c for c in request.expect_state if not self._holds(int(c))]
        if lost:
            raise ClientStateLost(
                f"ClientWorker lost the state of clients {lost[:5]} (the worker was restarted "
                "after a fault); this run's clients keep state (their client rule's: momentum, "
                "control variates, personal models; or their own buffers): resume the run "
                "from its last checkpoint (fedray resume RUN_ID)")
        t0 = time.perf_counter()
        attack = instantiate("attacks", poison) if poison else None
        start = torch.from_numpy(np.array(global_params, dtype=np.float32))
        common = torch.from_numpy(np.array(shared, dtype=np.float32)) \
            if shared is not None and len(shared) else None
        caps, ranks = dict(request.partial), dict(request.attackers)
        self.read(clients)
        data = [self.client_data(round_, int(c), attack, common, caps.get(int(c)),
                                 ranks.get(int(c), 0)) for c in clients]
        ids = np.asarray(clients, dtype=np.int64)
        if self.buffer_dim:
            assert buffers is not None, "a model with buffers needs the server's buffers"
            updates, losses, rows = self._run_buffers(round_, data, start, buffers)
            return ClientRows(ids, self._encode(round_, ids, updates), losses,
                              time.perf_counter() - t0, rows)
        updates, losses = (self._run(round_, data, start) if data else
                           (np.empty((0, self.plan.message.width(start.numel())), np.float32),
                            np.empty(0)))
        return ClientRows(ids, self._encode(round_, ids, updates), losses,
                          time.perf_counter() - t0)

    def _encode(self, round_: int, ids: np.ndarray, updates: np.ndarray
                ) -> np.ndarray | Encoded:
        """The clients' messages as they travel (the codec chain's payload)."""
        return encode_payload(self.codecs, updates, round_, self.shape, self.seed,
                              ids.tolist(), self.codec_states)

    BUFFERS = "model.buffers"  # a client's own buffers in its checkpointed state
    NORM = "model.norm"  # its own BatchNorm weights (server.buffers fedbn)

    def client_states(self) -> dict[int, dict[str, torch.Tensor]]:
        """The per-client state this worker keeps (gradient rules' momenta, local buffers),
        for checkpoints."""
        out = {c: {k: v.clone() for k, v in st.items()} for c, st in self.client_state.items()}
        for c, st in self.codec_states.items():
            out.setdefault(c, {}).update(st)
        for c, st in self.client_buffers.items():
            out.setdefault(c, {})[self.BUFFERS] = st["buffers"].clone()
            if "norm" in st:
                out[c][self.NORM] = st["norm"].clone()
        return out

    def load_client_states(self, states: dict[int, dict[str, torch.Tensor]]) -> None:
        """Restore the states of this worker's clients (a checkpoint's, all clients' mixed)."""
        self.client_state = ClientStateStore(self.state_dtype)
        self.client_buffers = ClientStateStore(torch.float32)
        self.codec_states.load(states)
        for c, st in states.items():
            rule = {k: v for k, v in st.items() if k not in (self.BUFFERS, self.NORM)
                    and not k.startswith(CodecStates.PREFIX)}
            if rule:
                self.client_state.set(int(c), rule)
            if self.BUFFERS in st:
                own = {"buffers": st[self.BUFFERS]}
                if self.NORM in st:
                    own["norm"] = st[self.NORM]
                self.client_buffers.set(int(c), own)

    def node(self) -> str | None:
        """The Ray node this worker runs on (None in-process)."""
        try:
            import ray

            return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        except ImportError:
            return None

    def resources(self) -> dict[str, Any]:
        """The Ray resources this worker holds (``{}`` in-process) and its torch device."""
        out: dict[str, Any] = {"device": str(self.device), "threads": torch.get_num_threads()}
        try:
            import ray

            if ray.is_initialized():
                out.update(ray.get_runtime_context().get_assigned_resources())
        except ImportError:
            pass
        return out

    def peak_memory(self) -> int:
        """The most bytes of device memory this worker's torch has held (0 on the CPU)."""
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.max_memory_allocated(self.device))
