"""A run's work, estimated before its backend is chosen (``runtime.backend: auto``;
``simulator.runtime.backend.choose_backend`` decides from it).

In this process, one ClientWorker of the point times a client's local training with the
probe the engine uses to keep the faster of two trainers (``ClientWorker.probe``: a warm-up,
then one timing, of a client of the first round taking as many minibatch steps as a client
takes on average, from ``PROBE_STEPS`` to ``PROBE_MAX_STEPS``; the loop trainer where the
run may vectorise, which is never slower than its loop), and the global
model's evaluation on up to ``EVAL_PROBE_SAMPLES`` test samples (the spans a worker
evaluates; a warm-up, then one timing), each in this thread's CPU seconds: MLflow opens on
a thread beside it, and the wall clock would count its share of the GIL, as it would
another process's load. The estimate is
those times the run's client steps (its rounds x the clients its round protocol trains a
round, ``RoundProtocol.trainings_per_round``, x a client's mean steps) and its evaluated
samples, in one process: what the inline backend takes for the rounds. Points whose
training differs in nothing the probe times (the model, the data, the local training, the
task, privacy, the runtime) share one probe: a sweep of aggregators or seeds is probed
once. It costs at most 16 client steps and two evaluations of 256 samples (the quickstart:
0.05 s of CPU; the data is loaded anyway, and kept for the run).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from simulator.config import Scenario
from simulator.config.plan import resolve
from simulator.pinning import environment_pinned
from simulator.runtime.backend import RAY_ROUND_SECONDS, BackendChoice, choose_backend
from simulator.runtime.common import buffers_to_vector, eval_spans, torch_threads
from simulator.runtime.worker import ClientWorker
from simulator.sim.engine import PROTOCOLS, load_data
from simulator.sim.placement import PROBE_STEPS
from simulator.sim.sampling import sample_clients
from strategies.trainers import step_counts

LOG = logging.getLogger("fedray.engine")

PROBE_CLIENTS = 1  # clients of the first round whose training the estimate times
# the most minibatch steps it takes: a client's fixed cost a round (its model loaded, its
# update made) was half of a two-step probe of benchmarks/vs_flower.py's heavy workload
# (0.45 ms; 0.31 ms a step), which then estimated its 19-step clients 1.4x too slow
PROBE_MAX_STEPS = 8
EVAL_PROBE_SAMPLES = 256  # test samples whose evaluation the estimate times
# the blocks that decide what a client step and an evaluated sample cost
PROBE_KEYS = ("data", "model", "task", "local", "privacy", "runtime")


@dataclass(frozen=True)
class WorkEstimate:
    """The rounds of a run in one process, estimated: ``steps`` client minibatch steps of
    ``step_seconds`` each and ``samples`` evaluated samples of ``sample_seconds`` each."""

    rounds: int
    steps: float
    step_seconds: float
    samples: float
    sample_seconds: float

    @property
    def seconds(self) -> float:
        return self.steps * self.step_seconds + self.samples * self.sample_seconds

    def text(self) -> str:
        return (f"{self.steps:,.0f} client steps x {1e3 * self.step_seconds:.2f} ms + "
                f"{self.samples:,.0f} evaluated samples x {1e6 * self.sample_seconds:.1f} us "
                f"= {self.seconds:.1f} s in one process")


@dataclass(frozen=True)
class _Probe:
    step_seconds: float
    sample_seconds: float
    mean_steps: float  # a client's minibatch steps a round, on average
    eval_samples: int  # samples one evaluation scores (test and train)


def estimate_work(scenarios: Sequence[Scenario], done: Sequence[int] | None = None
                  ) -> WorkEstimate:
    """The work of running ``scenarios`` (single-seed points) one after another in one
    process, rounds ``done[i]`` onwards of the i-th (default: all its rounds)."""
    probes: dict[str, _Probe] = {}
    rounds = 0
    steps = samples = 0.0
    step_time = sample_time = 0.0
    for i, sc in enumerate(scenarios):
        key = json.dumps({k: v for k, v in sc.model_dump(mode="json").items()
                          if k in PROBE_KEYS}, sort_keys=True)
        if key not in probes:
            probes[key] = _probe(sc)
        p = probes[key]
        start = done[i] if done is not None else 0
        rounds += sc.rounds - start
        plan = resolve(sc)
        every = sc.evaluation.every
        evaluations = sum(1 for r in range(start, sc.rounds)
                          if (r + 1) % every == 0 or r + 1 == sc.rounds)
        point_steps = (sc.rounds - start) * PROTOCOLS[plan.protocol].trainings_per_round(plan) \
            * p.mean_steps
        steps += point_steps
        samples += evaluations * p.eval_samples
        step_time += point_steps * p.step_seconds
        sample_time += evaluations * p.eval_samples * p.sample_seconds
    return WorkEstimate(rounds, steps, step_time / steps if steps else 0.0, samples,
                        sample_time / samples if samples else 0.0)


def _probe(sc: Scenario) -> _Probe:
    """A client step's and an evaluated sample's seconds for ``sc``, timed here; this
    process's torch threads are left as they were."""
    plan = resolve(sc)
    data = load_data(sc)
    with torch_threads(torch.get_num_threads()):  # the worker sets runtime.threads
        worker = ClientWorker(data.source, data.input_shape, data.num_classes, plan,
                              data.vocabulary)
        params = torch.nn.utils.parameters_to_vector(
            worker.model.parameters()).detach().cpu().numpy()
        c = sc.clients
        first = sample_clients(plan.seed, 0, c.total, c.sampled).tolist()[:PROBE_CLIENTS]
        mean_steps = float(np.mean(step_counts(data.client_sizes(), sc.local)))
        # a client's steps as it takes them (its fixed cost a round spread as over a real
        # client's), at most PROBE_MAX_STEPS; this thread's CPU seconds: MLflow opens on a
        # thread beside it, sharing the GIL
        steps = int(min(max(round(mean_steps), PROBE_STEPS), PROBE_MAX_STEPS))
        (client_seconds,) = worker.probe([plan.loop_trainer or plan.trainer], first, params,
                                         steps, clock=time.thread_time)
        ev = data.eval_data()
        n = min(EVAL_PROBE_SAMPLES, len(ev.y_test))
        buffers = buffers_to_vector(worker.model).cpu().numpy() if worker.buffer_dim else None
        share = [("test", tuple(eval_spans(n)))]
        sample_seconds = math.inf if n else 0.0
        for _ in range(2 if n else 0):  # a warm-up, then a timing
            t0 = time.thread_time()
            worker.evaluate_spans(params, buffers, ev, share)
            sample_seconds = min(sample_seconds, (time.thread_time() - t0) / n)
    return _Probe(client_seconds / steps, sample_seconds, mean_steps,
                  len(ev.y_test) + len(ev.y_train))


def backend_for(scenarios: list[Scenario], asked: str, address: str | None = None,
                workers: int | None = None, ray_init: dict | None = None,
                done: list[int] | None = None, fetched: bool = True,
                round_seconds: float = RAY_ROUND_SECONDS) -> BackendChoice:
    """The backend that runs ``scenarios`` (a command's points, from round ``done[i]`` of
    the i-th) when ``asked`` (``--backend``, else ``runtime.backend``): ray, inline, or for
    auto the one ``simulator.runtime.backend.choose_backend`` finds to finish first, from
    the work estimated here (``estimate_work``, only when the run need not be on Ray; not
    where a data set is fetched when the run starts, ``download: true``, unless
    ``fetched``, nor for ``deterministic: strict`` points in a process not started pinned);
    logged at debug level. ``fedray run``, ``resume`` and ``show`` choose
    through it."""
    # show probes nothing it cannot here: data fetched when the run starts, or strict points
    # (whose kernels only a pinned process may run; the run's process is pinned by then)
    here = (fetched or not any(s.data.dataset.get("download") for s in scenarios)) and \
        (environment_pinned() or all(s.runtime.deterministic != "strict" for s in scenarios))
    choice = choose_backend(asked, [s.runtime for s in scenarios], address, workers,
                            (ray_init or {}).get("num_cpus"),
                            (lambda: estimate_work(scenarios, done)) if here else None,
                            round_seconds)
    LOG.debug("fedray: backend %s (%s)", choice.name, choice.reason)
    return choice
