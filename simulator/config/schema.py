"""The scenario schema: pydantic v2 models of a scenario file, one per block.

Every block forbids unknown keys and refuses non-finite floats unless a field opts in
(``Annotated[float, AllowInfNan(True)]`` where inf means something). Plugin blocks
(``{name: ..., key: value}``) are open mappings here; their keys are validated against the
plugin's constructor (``simulator.config.validate``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from annotated_types import Ge, Gt, Le, Lt
from pydantic import (
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from simulator.errors import brief, brief_text
from simulator.registry import FINITE, PluginSpec, refuse_bool_numbers
from strategies.paths import PathKind

DEFAULT_TRAINER: PluginSpec = {"name": "sgd"}  # local SGD, when nothing asks for another
# the trainers a gradient client rule and sample-level privacy run with when their plugin's
# traits name none (Traits.trainer)
GRADIENT_RULE_TRAINER: PluginSpec = {"name": "gradient_rule"}
SAMPLE_PRIVACY_TRAINER: PluginSpec = {"name": "dp_sgd"}

# Upper bounds of the schema's integers (docs/scenario-files.md, the reference): each far
# above any study, far below what exhausts a machine or overflows a C integer before the
# first round (`Overflow when unpacking long long`)
MAX_ROUNDS = 1_000_000
MAX_CLIENTS = 10_000_000  # a simulated population (1 M clients of 200 samples fill 24 GB)
MAX_EPOCHS = 1_000  # local epochs a round
MAX_STEPS = 100_000  # local minibatch steps a round
MAX_BATCH = 65_536
MAX_GOSSIP_STEPS = 1_000  # gossip steps a D-SGD round (each one mixes every peer's model)
MAX_WORKERS = 10_000  # ClientWorker actors (one per CPU of a cluster)
MAX_THREADS = 1_024  # torch threads of one process
MAX_CPUS = 1_024.0  # CPUs of one worker
MAX_GPUS = 64.0  # GPUs of one worker
MAX_SEEDS = 1_000
# MLflow's limits: an experiment's name (its store's column: 256 characters) and a run's
# name (250)
MAX_EXPERIMENT_NAME = 256
MAX_RUN_NAME = 250


@dataclass(frozen=True)
class PathKey:
    """Marks a schema key that holds a path (``Annotated[str, PathKey("file")]``): resolved
    relative to the scenario file and checked by ``strategies.paths.guard`` before anything
    reads it (``simulator.config.paths`` finds every such key by walking the models)."""

    kind: PathKind = "file"


def check_name(value: str, what: str, limit: int) -> str | None:
    """What is wrong with a name MLflow stores and fedray prints, or None."""
    if not value.strip():
        return f"{what} must not be empty, got {brief(value)}"
    if len(value) > limit:
        return f"{what} must be at most {limit} characters (MLflow's limit), got {len(value):,}"
    if not value.isprintable():
        return (f"{what} must hold no control characters (ESC, BEL, NUL, direction "
                f"overrides such as U+202E: a terminal would act on them), got {brief(value)}")
    return None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, **FINITE)

    _no_bool_numbers = field_validator("*", mode="before")(refuse_bool_numbers)


class Data(Strict):
    """``load``: ``all`` loads the data set once, every client's samples in memory (shared
    through Ray's object store); ``cohort`` keeps only its population (a data set that gives
    one client at a time: generated, or Parquet files with a client column) and each worker
    generates or reads the clients of its call, so memory grows with the round's cohort,
    not with the population; the model is then evaluated on the samples of 1,000 clients
    drawn once (simulator.data.EVAL_CLIENTS). ``auto`` (the default) is ``all`` where the
    data set's estimated size held whole fits comfortably in this machine's memory, else
    ``cohort`` (simulator.config.data_load); validation writes the choice into the resolved
    scenario, and why in ``load_reason``."""

    dataset: PluginSpec
    partitioner: PluginSpec = {"name": "iid"}
    test_fraction: Annotated[float, Gt(0), Lt(1)] = 0.2
    load: Literal["auto", "all", "cohort"] = "auto"
    # why ``auto`` chose ``load`` (None: the scenario gave it); not a key, never dumped
    _load_reason: str | None = PrivateAttr(default=None)

    @property
    def load_reason(self) -> str | None:
        """Why ``load`` is what it is, where ``auto`` chose it (None: as given)."""
        return self._load_reason

    def chosen(self, load: str, reason: str) -> Data:
        """This block with ``auto`` resolved to ``load`` (all or cohort), for ``reason``."""
        out = self.model_copy(update={"load": load})
        out._load_reason = reason
        return out


class BHat(Strict):
    """The trimming parameter ``b_hat`` told to every rule of the aggregation pipeline that
    takes an ``f`` (pre-aggregators, aggregator, meta-aggregator): ``fixed`` (``value``), or
    the smallest ``b_hat`` in [f s / n, s/2) whose per-round probability of being exceeded by
    the sampled Byzantine clients is at most ``level``, from the KL bound of Allouah et al.
    (ICML 2024) (``kl``) or the exact hypergeometric tail (``hypergeometric``). When no
    ``b_hat`` below s/2 reaches the level the scenario is rejected, unless ``clamp`` asks for
    the largest one, ceil(s/2) - 1 (for studies of small samples). The resolved scenario
    carries the computed ``value``."""

    rule: Literal["fixed", "kl", "hypergeometric"] = "fixed"
    level: Annotated[float, Gt(0), Lt(1)] = 0.05
    clamp: bool = False
    value: Annotated[int, Ge(0), Le(MAX_CLIENTS)] | None = None


class Stragglers(Strict):
    """Honest clients that do less than their round's local work, by one of two models
    (``kind``); ``partial`` says what the server does with them: false, they miss the round
    (FedAvg drops them); true, each sends the work it finished (FedProx's systems
    heterogeneity, Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in
    Heterogeneous Networks", MLSys 2020) -- none finished: it misses the round.

    ``deadline`` (the default): simulated compute speed. Client c's time for one local step
    in round r is exp(sigma z_c + jitter e_cr) (z_c fixed per client, e_cr per round,
    standard normal, seeded; median 1); a client whose local work (its number of minibatch
    steps) takes more than ``deadline`` step-times is late. Its finished work: its first
    ``floor(steps * deadline / time)`` minibatch steps (``simulator.sim.sampling.late_work``,
    the deadline rule ``server.mode: deadline`` applies to its devices too).

    ``epochs``: the paper's own straggler model (Section 5.2, Figure 1). In each round,
    ``fraction`` of the sampled honest clients that train (the count the authors' code
    takes, ``m - round(m (1 - fraction))`` of m) are stragglers, each running a number of
    local epochs drawn uniformly from [1, E] (E = ``local.epochs``; one when neither
    ``local.epochs`` nor ``local.steps`` is set) instead of E: its finished work is its
    first x epochs, the same minibatches its full work starts with. With ``local.steps``
    S the unit is one minibatch step: x is uniform in [1, S] steps (our choice; the paper
    counts epochs). Departures: the paper's text says [1, E], which we follow; the authors'
    code draws ``randint(1, E)``, that is [1, E - 1], so there a straggler never does the
    full work (here one that draws E does, and ``partial: false`` still drops it, as the
    paper's FedAvg drops every straggler). Work, not time: this model has no clock of its
    own; with ``speeds`` a straggler's simulated time is its share of its task's, as under
    ``deadline``. The draws come from the run's seed and the round, so every setting of
    ``partial`` and of the client rule (FedAvg, FedProx's mu) sees the same stragglers
    doing the same epochs, as in the paper."""

    kind: Literal["deadline", "epochs"] = "deadline"
    # kind deadline (required there): inf, nobody is late
    deadline: Annotated[float, Gt(0), AllowInfNan(True)] | None = None
    sigma: Annotated[float, Ge(0)] = 0.5
    jitter: Annotated[float, Ge(0)] = 0.1
    # kind epochs (required there): the share of a round's training honest clients that
    # straggle
    fraction: Annotated[float, Ge(0), Le(1)] | None = None
    partial: bool = False

    # the keys each kind reads (the others are refused with it, ``checks``), and the one
    # it requires
    KEYS: ClassVar[dict[str, tuple[str, ...]]] = {
        "deadline": ("deadline", "sigma", "jitter"), "epochs": ("fraction",)}
    REQUIRED: ClassVar[dict[str, str]] = {"deadline": "deadline", "epochs": "fraction"}
    # what the required key of each kind is, for the line that asks for it
    REQUIRED_WHAT: ClassVar[dict[str, str]] = {
        "deadline": "the step-times past which a client is late (.inf: never)",
        "epochs": "the share of each round's training honest clients that straggle, from 0 to 1"}

    @model_serializer(mode="wrap")
    def _read(self, handler: Any) -> Any:
        """The keys its kind reads and ``partial``; ``kind`` only when it is not the
        default, so a ``deadline`` block dumps as it did before ``epochs`` existed (a run's
        identity, ``simulator.run.layout.point_key``, is a digest of the dump)."""
        keep = (*self.KEYS[self.kind], "partial") + (("kind",) if self.kind != "deadline"
                                                     else ())
        return {k: v for k, v in handler(self).items() if k in keep}


class Clients(Strict):
    """``dropout``: the probability that a sampled honest client drops out of a round (seeded
    per round and client); ``stragglers``: honest clients too slow for the round's deadline.
    Byzantine clients never miss a round (the worst case). Both are logged per round."""

    total: Annotated[int, Ge(1), Le(MAX_CLIENTS)]
    per_round: Annotated[int, Ge(1), Le(MAX_CLIENTS)] | None = None
    byzantine: Annotated[int, Ge(0), Le(MAX_CLIENTS)] = 0
    b_hat: BHat | None = None
    dropout: Annotated[float, Ge(0), Lt(1)] = 0.0
    stragglers: Stragglers | None = None
    # dynamic Byzantine identities (Dorfman, Yehya, Levy, ICML 2024): a new set of
    # ``byzantine`` clients every ``byzantine_period`` rounds (server steps); null: one set
    byzantine_period: Annotated[int, Ge(1), Le(MAX_ROUNDS)] | None = None

    @property
    def sampled(self) -> int:
        return self.total if self.per_round is None else self.per_round


class Local(Strict):
    """Local training of each sampled client in a round. ``optimizer`` is the client rule:
    ``sgd`` (default) runs ``epochs`` passes over the client's data or ``steps`` minibatch
    steps (default: one epoch) of SGD with ``lr``, optional ``momentum`` (reset every round)
    and ``weight_decay``; gradient rules (``momentum``: worker momentum) take one minibatch
    gradient per round and keep per-client state across rounds."""

    optimizer: PluginSpec = {"name": "sgd"}
    # the trainer plugin that computes the clients' updates on the workers; by default the
    # one the rest asks for (``simulator.config.plan.choose_trainer``), else DEFAULT_TRAINER
    trainer: PluginSpec | None = None

    epochs: Annotated[int, Ge(1), Le(MAX_EPOCHS)] | None = None
    steps: Annotated[int, Ge(1), Le(MAX_STEPS)] | None = None
    batch_size: Annotated[int, Ge(1), Le(MAX_BATCH)] = 32
    lr: Annotated[float, Gt(0)] = 0.05
    momentum: Annotated[float, Ge(0), Lt(1)] = 0.0
    weight_decay: Annotated[float, Ge(0)] = 0.0


@dataclass(frozen=True)
class ModePlan:
    """What a ``server.mode`` means to the engine, the clock and the actors, resolved here
    once (no other module compares the mode's name)."""

    name: str
    # the round protocol that runs it (a simulator.sim.rounds.RoundProtocol's ``name``)
    protocol: str = "server"
    # the server steps on the simulated clock: model versions are kept while clients train
    # from them, the asynchrony block applies; the clock replaces dropout and stragglers
    clock: bool = False
    # rounds last simulated time: speeds have their defaults when absent, and the devices'
    # speeds decide who is late (clients.stragglers, the other straggler model, is refused)
    timed: bool = False
    # the server.* keys this mode reads (refused with the other modes), and those of them it
    # requires
    keys: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    # when the server steps: each arrival, a buffer of arrivals (asynchrony.buffer_size),
    # or once every asynchrony.buffers buffer has an update (BASGD)
    steps_on: Literal["round", "arrival", "buffer", "buffers"] = "round"
    # FedAsync: a row is the client's model minus the server's, weighted by the mixing rate
    mixing: bool = False
    # every client's latest row is aggregated, not the step's arrivals (Dahan & Levy)
    table: bool = False
    # BASGD: the rows are the means of the asynchrony.buffers buffers
    buffer_means: bool = False

    @property
    def in_rounds(self) -> bool:
        """Whether the server steps once a round on the round's rows, off any clock (sync,
        deadline): what a codec's group, an audit's canaries and a reconstruction's attacked
        round need."""
        return not self.clock and self.steps_on == "round"


MODES: dict[str, ModePlan] = {  # server.mode -> what it means to the engine
    "sync": ModePlan("sync"),
    "fedasync": ModePlan("fedasync", "async", clock=True, timed=True, steps_on="arrival",
                         mixing=True),
    "fedbuff": ModePlan("fedbuff", "async", clock=True, timed=True, steps_on="buffer"),
    "basgd": ModePlan("basgd", "async", clock=True, timed=True, steps_on="buffers",
                      buffer_means=True),
    "latest": ModePlan("latest", "async", clock=True, timed=True, steps_on="arrival",
                       table=True),
    "deadline": ModePlan("deadline", "deadline", timed=True, keys=("deadline", "late"),
                         required=("deadline",)),
}


class ServerSettings(Strict):
    """``optimizer``: the server optimizer (a plugin of ``fedray.optimizers``). ``buffers``:
    what happens to model state that is not a parameter (BatchNorm's running statistics):
    ``mean`` (the participants' statistics averaged, as FedAvg does), ``median``
    (coordinate-wise median: Byzantine clients send poisoned statistics too), ``local``
    (each client keeps its own, SiloBN; the server's evaluation model takes the
    participants' median or mean), ``fedbn`` (FedBN, Li et al., ICLR 2021: as ``local``,
    and each client keeps its BatchNorm layers' affine weights too, which the server never
    aggregates; each client's own model is measured on its own test samples) or ``auto``:
    ``median`` with Byzantine clients, else ``mean``. docs/models.md says what each does
    under attack."""

    optimizer: PluginSpec = {"name": "sgd"}
    buffers: Literal["auto", "mean", "median", "local", "fedbn"] = "auto"
    # the server's clean root set, in training samples, for an aggregator that takes the
    # server's own update (FLTrust: traits.reference); drawn once from the training data
    root_samples: Annotated[int, Ge(1), Le(10_000)] = 100
    # how the server steps: ``sync`` (lock-step rounds), or asynchronously on a simulated
    # clock (the ``asynchrony`` block; docs/async.md): ``fedasync`` (Xie et al. 2019),
    # ``fedbuff`` (Nguyen et al. 2022), ``basgd`` (Yang & Li 2023), ``latest`` (Dahan & Levy
    # 2024: on each update, the latest update of every client that has sent one), or
    # ``deadline``: semi-synchronous rounds closed at ``deadline`` simulated seconds
    # (simulator/sim/rounds/deadline.py)
    mode: Literal["sync", "fedasync", "fedbuff", "basgd", "latest", "deadline"] = "sync"
    # server.mode deadline: when a round closes (simulated seconds after it starts), and
    # what happens to the updates that arrive later: dropped, carried into the next
    # round's step as stale, or cut at the deadline (the steps finished by then are sent;
    # ``drop`` when absent)
    deadline: Annotated[float, Gt(0), Le(1e12)] | None = None
    late: Literal["drop", "carry", "partial"] | None = None

    @property
    def resolved_mode(self) -> ModePlan:
        """What ``mode`` means (``MODES``): the Plan carries it, the rest reads it there."""
        return MODES[self.mode]


class Staleness(Strict):
    """The staleness function s(tau) that scales an update computed from a model ``tau``
    server steps old: ``constant`` 1; ``polynomial`` (1 + tau)^-a (FedBuff's a = 0.5,
    FedScale's 1/(1 + tau) is a = 1); ``hinge`` 1 for tau <= b, else 1 / (a (tau - b) + 1)
    (FedAsync, Xie et al. 2019)."""

    function: Literal["constant", "polynomial", "hinge"] = "polynomial"
    a: Annotated[float, Ge(0), Le(1e6)] = 0.5
    b: Annotated[int, Ge(0), Le(MAX_ROUNDS)] = 4


class Speeds(Strict):
    """Simulated device speeds (the asynchronous modes' clock; a synchronous run with
    ``speeds`` logs the simulated time of its rounds too, each as long as its slowest
    participant's task). A task of client c (its local work
    of ``samples`` samples, from one model to its update) takes
    ``samples * sample_seconds * s_c * exp(jitter * e) + (bits_down + bits_up) /
    bandwidth_c`` simulated seconds (down: the model, its buffers and a server optimizer's
    broadcast state; up: the client's message after the ``codecs``, and its buffers): ``s_c`` a fixed factor per client drawn from ``distribution``
    (``constant`` 1, ``exponential`` of mean 1, ``lognormal`` exp(sigma z), ``zipf`` with
    exponent ``a`` (> 1), ``pareto`` with shape ``a`` and minimum 1; at most ``max_factor``),
    ``e`` a standard normal
    draw per task. ``trace``: a FedScale device-capacity file
    (``{client: {computation, communication}}``: ms per sample, kbit/s; pickle, JSON or
    Parquet) replaces the factors and the bandwidth; ``availability``: a FedScale
    availability file (``{client: {active, inactive, finish_time, duration}}``): a client
    starts a task only while active. ``byzantine_factor`` multiplies the Byzantine clients'
    times (below 1: they arrive more often). Every draw is seeded."""

    distribution: Literal["constant", "exponential", "lognormal", "zipf", "pareto"] = "constant"
    sigma: Annotated[float, Ge(0), Le(100)] = 0.5
    a: Annotated[float, Gt(0), Le(100)] = 1.2
    # the slowest device's factor (heavy tails such as Zipf's draw factors in the millions;
    # Plato rescales its Zipf sleep times into a [min, max] range); null: no cap
    max_factor: Annotated[float, Gt(0), Le(1e12)] | None = None
    jitter: Annotated[float, Ge(0), Le(100)] = 0.0
    sample_seconds: Annotated[float, Gt(0), Le(1e6)] = 0.001
    bandwidth: Annotated[float, Gt(0), AllowInfNan(True)] = float("inf")  # bits/s; inf: none
    trace: Annotated[str, PathKey("file")] | None = None
    availability: Annotated[str, PathKey("file")] | None = None
    byzantine_factor: Annotated[float, Gt(0), Le(1e6)] = 1.0


class Asynchrony(Strict):
    """The asynchronous modes (``server.mode``): ``concurrency`` clients train at once
    (default: ``clients.per_round``), each from the model version it started from; the
    server steps after ``buffer_size`` updates (``fedbuff``; default: ``concurrency``),
    after each one (``fedasync``, mixing ``mixing * s(tau)``; ``latest``, aggregating every
    client's latest update), or once each of ``buffers`` buffers (client id mod
    ``buffers``) holds one (``basgd``). ``draw``: who starts next among the clients that
    may. An update staler than
    ``max_staleness`` steps is dropped. ``weights: updates`` weights each row of the robust
    aggregation by how many updates its client has contributed (Dahan & Levy, NeurIPS
    2024). ``byzantine_staleness: fresh``: the Byzantine clients claim every update is fresh.
    ``rounds`` counts server steps."""

    concurrency: Annotated[int, Ge(1), Le(MAX_CLIENTS)] | None = None
    buffer_size: Annotated[int, Ge(1), Le(MAX_CLIENTS)] | None = None
    buffers: Annotated[int, Ge(1), Le(MAX_CLIENTS)] = 4
    mixing: Annotated[float, Gt(0), Le(1)] = 0.6
    staleness: Staleness = Staleness()
    max_staleness: Annotated[int, Ge(0), Le(MAX_ROUNDS)] | None = None
    weights: Literal["none", "updates"] = "none"
    # what the Byzantine clients report of their updates' model version: the truth, or
    # ``fresh`` (a timing attack: the server, trusting it, neither drops nor discounts them)
    byzantine_staleness: Literal["honest", "fresh"] = "honest"
    # who starts next among the clients that may: uniformly, or with probability
    # proportional to (client id + 1) or its square (Dahan & Levy's arrival models)
    draw: Literal["uniform", "id", "id_squared"] = "uniform"


class DSGD(Strict):
    """Decentralized SGD (used when ``topology`` is set): each round every peer takes
    ``local.steps``/``local.epochs`` of local SGD and ``gossip_steps`` gossip steps with its
    neighbours, in ``order``; ``defense`` against Byzantine peers, a plugin of
    ``fedray.gossip_defenses``: ``none`` (plain gossip), ``clipped_gossip`` (He et al. 2022;
    ``clip_tau`` fixed, or adaptive when null) or ``aggregator`` (the scenario's aggregator
    over each peer's neighbourhood)."""

    order: Literal["local_then_gossip", "gossip_then_local"] = "local_then_gossip"
    gossip_steps: Annotated[int, Ge(1), Le(MAX_GOSSIP_STEPS)] = 1
    defense: str = "none"
    clip_tau: Annotated[float, Gt(0), AllowInfNan(True)] | None = None  # inf: plain gossip


class Evaluation(Strict):
    """When the global model is evaluated on the test (and train-loss) samples: every
    ``every`` rounds, and always after the last."""

    every: Annotated[int, Ge(1), Le(MAX_ROUNDS)] = 1


MAX_CANARIES = 100_000  # canary clients of one audit (each a direction of the model's size)


class Audit(Strict):
    """An empirical privacy audit (docs/privacy.md): ``canaries`` canary clients, each
    inserted into the population with probability ``inserted`` (seeded) and then sampled
    each round as a client is, whose update is a fixed random direction of norm ``norm``
    (client-level DP's clip by default; without it the median norm of the round's honest
    rows); under sample-level DP (dp_sgd) canary examples instead, each held by a client
    and added to its DP-SGD's clipped gradients. Every ``every`` rounds (and at the end) the
    cosine of the model's change since
    the start with each canary gives Andrew et al.'s epsilon estimate (ICLR 2024) and, at
    ``inserted: 0.5``, Steinke et al.'s lower bound (NeurIPS 2023) from ``guesses`` of the
    canaries guessed, at ``confidence``; both at ``delta`` (the privacy plugin's by
    default, else 1e-5)."""

    canaries: Annotated[int, Ge(2), Le(MAX_CANARIES)]
    inserted: Annotated[float, Ge(0), Lt(1)] = 0.5
    every: Annotated[int, Ge(1), Le(MAX_ROUNDS)] | None = None
    norm: Annotated[float, Gt(0)] | None = None
    delta: Annotated[float, Gt(0), Lt(1)] | None = None
    guesses: Annotated[float, Gt(0), Le(1)] = 0.2
    confidence: Annotated[float, Ge(0.5), Lt(1)] = 0.95


class Runtime(Strict):
    """Where a run executes. ``backend``: ``ray`` (actors on a local Ray instance or a
    cluster), ``inline`` (one process) or ``auto`` (the default: inline where the run's
    estimated work ends before Ray could have started its actors, else Ray; Ray whenever the
    run needs it: ``--address``, more than one worker asked, GPU shares;
    ``simulator.runtime.backend.choose_backend``). The numbers are the same on every backend.
    ``checkpoint_every: k`` saves the whole state of the run every k rounds (0: never) so
    that ``fedray resume RUN_ID`` continues it exactly."""

    backend: Literal["auto", "ray", "inline"] = "auto"
    workers: Annotated[int, Ge(1), Le(MAX_WORKERS)] | None = None
    checkpoint_every: Annotated[int, Ge(0), Le(MAX_ROUNDS)] = 0
    # train a worker's clients together (torch.func vmap) when their rule allows: the same
    # numbers as one at a time up to float rounding (not bit for bit across worker counts)
    vectorize: bool = False
    # precision of the per-client state workers keep (worker momentum, mu2-SGD): float16
    # halves its memory; the maths runs in float32
    state_dtype: Literal["float32", "float16"] = "float32"
    # Devices (docs/models.md). ``device``: where each ClientWorker holds its one model and
    # trains its clients (auto: cuda when the worker sees a GPU); ``server_device``: where
    # the server aggregates. Per worker, Ray reserves ``num_cpus`` CPUs and ``num_gpus`` GPUs
    # (fractional packs several workers on a GPU; null: none on cpu, else the cluster's GPUs
    # shared out among the workers, at most 1 each) and torch runs ``threads`` threads.
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    server_device: Literal["cpu", "cuda", "auto"] = "cpu"
    num_cpus: Annotated[float, Gt(0), Le(MAX_CPUS)] = 1.0
    num_gpus: Annotated[float, Ge(0), Le(MAX_GPUS)] | None = None
    threads: Annotated[int, Ge(1), Le(MAX_THREADS)] = 1
    # torch threads of the server's (and D-SGD mixer's) evaluation, which runs while the
    # workers wait: more is faster on a CPU; 1 (the default) gives the same test metrics on
    # any machine, more may move a loss in its last digits (training is not affected)
    eval_threads: Annotated[int, Ge(1), Le(MAX_THREADS)] = 1
    # fp32, or bf16 autocast of the clients' forward passes (updates stay float32)
    precision: Literal["fp32", "bf16"] = "fp32"
    # true: torch's deterministic algorithms (cuDNN included), bit-identical reruns on one
    # machine, a GPU included; strict: also the portable kernels of torch, MKL and numpy, the
    # same bits on any x86-64 machine (CPU only, fp32; slower: docs/performance.md)
    deterministic: bool | Literal["strict"] = False

    @property
    def strict(self) -> bool:
        """``deterministic: strict``: the run's processes start with the pinned kernels."""
        return self.deterministic == "strict"


class Tracking(Strict):
    """What each run logs to MLflow beyond its metrics, params, ``metrics.parquet``, the
    resolved scenario and the final state_dict (``model/model.pt``), which it always logs.
    ``log_model: true`` adds the final model as an MLflow pytorch model in ``model/``
    (torch.export's graph: ``mlflow.pytorch.load_model`` without fedray), which costs about
    2 s a run (``simulator.run.callbacks``)."""

    log_model: bool = False


MAX_TRIALS = 10_000  # trials of one search


class Distribution(Strict):
    """What a searched key takes (``tune.space``): exactly one of ``uniform: [low, high]``,
    ``log_uniform: [low, high]`` (low > 0), ``int: [low, high]`` (both ends included) or
    ``choice: [value, ...]`` (any scenario values, plugin blocks included)."""

    uniform: tuple[float, float] | None = None
    log_uniform: tuple[float, float] | None = None
    int_: Annotated[tuple[int, int] | None, Field(alias="int")] = None
    choice: Annotated[list[Any], Field(min_length=1, max_length=MAX_SEEDS)] | None = None

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True,
                              serialize_by_alias=True, **FINITE)

    @model_validator(mode="after")
    def _one(self) -> Distribution:
        given = [k for k in ("uniform", "log_uniform", "int_", "choice")
                 if getattr(self, k) is not None]
        if len(given) != 1:
            raise PydanticCustomError(
                "distribution", "must give exactly one of uniform: [low, high], log_uniform: "
                "[low, high], int: [low, high] or choice: [values], got {given}",
                {"given": ", ".join(k.rstrip("_") for k in given) or "none"})
        bounds = self.uniform or self.log_uniform or self.int_
        if bounds is not None and not bounds[0] < bounds[1]:
            raise PydanticCustomError("distribution", "low must be < high, got [{lo}, {hi}]",
                                      {"lo": bounds[0], "hi": bounds[1]})
        if self.log_uniform is not None and self.log_uniform[0] <= 0:
            raise PydanticCustomError("distribution", "log_uniform needs low > 0, got {lo}",
                                      {"lo": self.log_uniform[0]})
        return self

    @model_serializer(mode="wrap")
    def _given(self, handler: Any) -> Any:
        """Only the distribution given (``{log_uniform: [0.01, 0.5]}``), not the others'
        nulls."""
        return {k: v for k, v in handler(self).items() if v is not None}

    @property
    def kind(self) -> str:
        return next(k.rstrip("_") for k in ("uniform", "log_uniform", "int_", "choice")
                    if getattr(self, k) is not None)

    @property
    def extremes(self) -> list[Any]:
        """The values validation tries: both ends of a range, every choice."""
        if self.choice is not None:
            return list(self.choice)
        bounds = self.uniform or self.log_uniform or self.int_
        assert bounds is not None
        return list(bounds)


class Tune(Strict):
    """A search (``fedray tune``, docs/tuning.md): ``trials`` settings of the ``space`` keys
    (dotted paths, as ``--set`` takes them), each a *trial* that runs the scenario's sweep
    points x seeds with those values. The trial's score is ``metric`` (``METRIC:HOW`` as
    ``fedray table --metrics`` takes it: ``final``, ``lastK``, ``mean`` or ``time_toX``) of
    each point, averaged over the points, or, with ``worst_over`` (sweep keys, such as
    ``attack``), the worst over those keys' values of the mean over the rest (ByzFL's "best
    setting under the worst attack"). ``per`` (sweep keys, such as ``aggregator.name``) runs
    one search per value. ``mode``: max or min (default: min for a loss, error or
    distance). ``scheduler: asha`` stops trials early at the evaluation rounds (grace
    ``grace`` evaluations, reduction factor ``reduction``); ``search``: random, or Optuna's
    TPE; ``seed``: the search's seed; ``parallel``: trials at once (default: the CPUs)."""

    space: Annotated[dict[str, Distribution], Field(min_length=1, max_length=64)]
    metric: str = "test_accuracy:final"
    mode: Literal["max", "min"] | None = None
    trials: Annotated[int, Ge(1), Le(MAX_TRIALS)] = 10
    scheduler: Literal["asha", "none"] = "asha"
    grace: Annotated[int, Ge(1), Le(MAX_ROUNDS)] = 1
    reduction: Annotated[int, Ge(2), Le(100)] = 3
    search: Literal["random", "optuna"] = "random"
    seed: Annotated[int, Ge(0), Lt(2**32)] = 0
    parallel: Annotated[int, Ge(1), Le(MAX_WORKERS)] | None = None
    worst_over: list[str] = []
    per: list[str] = []


class Scenario(Strict):
    """A whole experiment. ``sweep`` maps dotted paths to value lists (grid product; a key
    ``"a.b, c.d"`` zips paths: its values are lists with one value per path); every point runs
    once per entry of ``seeds``."""

    name: str = ""
    description: str = ""
    rounds: Annotated[int, Gt(0), Le(MAX_ROUNDS)]
    # derived seeds take 32 bits of it: 2**32 would repeat seed 0
    seeds: Annotated[list[Annotated[int, Ge(0), Lt(2**32)]], Field(max_length=MAX_SEEDS)] = [0]
    data: Data
    model: PluginSpec
    # what the model learns: a plugin of fedray.tasks (classification | next_token |
    # regression), its loss and metrics
    task: PluginSpec = {"name": "classification"}
    clients: Clients
    local: Local = Local()
    aggregator: PluginSpec = {"name": "mean"}
    preaggregators: list[PluginSpec] = []
    meta: PluginSpec | None = None
    attack: PluginSpec | None = None
    server: ServerSettings = ServerSettings()
    topology: PluginSpec | None = None
    dsgd: DSGD = DSGD()
    # the asynchronous modes' settings (server.mode other than sync; defaults when absent)
    asynchrony: Asynchrony | None = None
    # simulated device speeds and availability (the asynchronous modes' defaults when absent)
    speeds: Speeds | None = None
    # differential privacy: a plugin of fedray.privacy (dp_sgd | dp_fedavg; docs/privacy.md)
    privacy: PluginSpec | None = None
    # the message path: plugins of fedray.codecs applied to every client's message in order
    # (float16 transport, ...); client-level privacy is one more, after them on the server
    codecs: list[PluginSpec] = []
    # the broadcast's compression: plugins of fedray.codecs applied to the change of the model
    # the server sends each round (its replica of the clients' model is its error feedback)
    downlink: list[PluginSpec] = []
    # an empirical privacy audit with canary clients (docs/privacy.md); none by default
    audit: Audit | None = None
    # attacks on the clients' privacy run against what the server receives: plugins of
    # fedray.privacy_attacks (dlg | inverting_gradients | loss_threshold; docs/privacy.md)
    privacy_attacks: list[PluginSpec] = []
    evaluation: Evaluation = Evaluation()
    runtime: Runtime = Runtime()
    tracking: Tracking = Tracking()
    sweep: dict[str, list[Any]] = {}
    tune: Tune | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        """The experiment's name in MLflow (the file's name by default), printed by every
        command."""
        bad = check_name(value, "the experiment's name", MAX_EXPERIMENT_NAME)
        if bad:
            raise PydanticCustomError("name", bad)
        return value


def default_at(loc: tuple[str | int, ...]) -> Any:
    """The schema's default at a dotted location (``("local", "trainer")``): the one place
    a default plugin block is written (validation fills them in from here)."""
    model: Any = Scenario
    for part in loc[:-1]:
        model = model.model_fields[part].annotation
    return model.model_fields[loc[-1]].default


@dataclass(frozen=True)
class RunPoint:
    values: dict[str, Any]  # the sweep values of this point ({} without a sweep)
    seed: int
    scenario: Scenario  # sweep removed, seeds == [seed]

    @property
    def label(self) -> str:
        """``krum lr=0.1 seed=1``: a name alone, other values under the last part of their
        path (the whole path where two sweep paths end alike), plugin blocks as
        ``name(key=value)``."""
        lasts = [k.split(".")[-1] for k in self.values]
        parts = []
        for k, v in self.values.items():
            last = k.split(".")[-1]
            key = last if lasts.count(last) == 1 else k
            parts.append(short(v) if last == "name" else f"{key}={short(v)}")
        return " ".join([*parts, f"seed={self.seed}"])

    @property
    def run_name(self) -> str:
        """A child run's name in MLflow: the values that differ between points and the seed;
        a scenario without a sweep adds its name (``quickstart seed=0``), not a bare
        ``seed=0``."""
        if self.values or not self.scenario.name:
            return self.label
        return f"{self.scenario.name} {self.label}"


def short(v: Any) -> str:
    """A sweep value in a run name: plugin blocks as ``name(key=value, ...)``."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("name"), str):
        args = ", ".join(f"{k}={short(x)}" for k, x in v.items() if k != "name")
        return f"{v['name']}({args})" if args else v["name"]
    if isinstance(v, list) and all(isinstance(x, dict) for x in v):
        return "[" + ", ".join(short(x) for x in v) + "]"
    return "none" if v is None else brief_text(json.dumps(v), 60)
