"""The plugin contracts: one base class per plugin kind, with every hook documented.

A plugin author reads this file and nothing else. A plugin is a class that subclasses the
base of its kind (the registry refuses one that does not, in one line, when it is looked up),
registered as an entry point in the group ``fedray.<kind>``. The kinds are the table of
``strategies.kinds`` (``CONTRACTS`` maps each to its base class):

=================  =========================  ==============================================
kind               base                       what it computes
=================  =========================  ==============================================
aggregators        :class:`Aggregator`        ``(n, d)`` updates -> ``(d,)`` aggregate
preaggregators     :class:`PreAggregator`     ``(n, d)`` -> ``(m, d)`` (clipping, NNM, ...)
meta               :class:`MetaAggregator`    ``(n, d)`` and an aggregator -> ``(d,)``
attacks            :class:`Attack`            the ``(f, d)`` Byzantine rows of a round
                   :class:`GossipAttack`      the Byzantine peers' gossip messages (D-SGD);
                                              both subclass :class:`BaseAttack`
topologies         :class:`Topology`          the ``(n, n)`` gossip matrix of a step
gossip_defenses    :class:`GossipDefense`     one gossip step of the honest peers (D-SGD)
optimizers         :class:`ServerOptimizer`   the server's step from the aggregate
client_optimizers  :class:`ClientRule`        what a client sends (local SGD, momentum)
trainers           :class:`Trainer`           the clients' updates of a round on a worker
privacy            :class:`Privacy`           a DP mechanism and its accounting
datasets           :class:`Dataset`           arrays of samples and labels
partitioners       :class:`Partitioner`       sample indices per client
models             :class:`Model`             a torch module from ``input_shape``, classes
tasks              :class:`Task`              the loss and the metrics of what is learnt
codecs             :class:`Codec`             a message's payload and back (compression)
=================  =========================  ==============================================

The rules every kind shares:

* **Constructor arguments are the scenario keys.** ``aggregator: {name: cwtm, f: 2}`` builds
  ``CoordinateWiseTrimmedMean(f=2)``. Type hints with ``annotated_types`` constraints
  (``Annotated[int, Ge(0)]``) are checked before anything runs. Arguments the engine supplies
  instead (a model's ``input_shape``) are listed in ``traits.context``; they are not keys.
* **Traits are declared, never probed.** A class states what the engine must know of it in
  one :class:`Traits` object (``traits = Traits(random=True)``); the base's default says
  "none of these".
* **One ``check(n)`` rule.** Every plugin has ``check(n)``: ``n`` is what it will be given
  (rows of a step for aggregation rules and codecs, peers for a topology, clients for a
  dataset or a partitioner, the number of Byzantine rows for an attack). It raises ``ValueError`` with a
  message that starts with the offending key (``"f: must be < n/2 = 5, got 7"``) when the
  plugin cannot work with ``n``; validation runs it before anything runs, the engine again
  every round for aggregation rules (dropouts change ``n``). The default accepts every ``n``.
* **Pure.** Inputs are never modified in place; randomness comes in as a ``torch.Generator``
  (or a NumPy generator for data plugins), never from global state; a plugin is picklable (it
  crosses Ray). Stateful rules expose ``state_dict()`` / ``load_state_dict()`` as torch.optim
  does (the defaults hold no state), so checkpoints restore them exactly.

``fedray.testing.check_plugin(kind, cls)`` runs the conformance checks of a kind on a class;
the built-ins pass the same checks.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

import numpy as np
import torch
from torch import nn

from strategies.kinds import KINDS
from strategies.paths import PathKind

__all__ = [
    "CONTRACTS",
    "DELTA",
    "PERSONAL",
    "ROWS",
    "Aggregator",
    "Attack",
    "AttackResult",
    "AttackView",
    "BaseAttack",
    "ClientData",
    "ClientRule",
    "Codec",
    "CodecBatch",
    "Correction",
    "Dataset",
    "DatasetInfo",
    "DatasetSplit",
    "DriftRule",
    "FetchedFile",
    "GossipAttack",
    "GossipDefense",
    "GossipStep",
    "LocalSettings",
    "MessageLayout",
    "MessageShape",
    "MetaAggregator",
    "Model",
    "Part",
    "PartSpec",
    "Partitioner",
    "Parts",
    "Plugin",
    "Population",
    "PopulationDataset",
    "PreAggregator",
    "Privacy",
    "PrivacyAttack",
    "ServerOptimizer",
    "Stateful",
    "Task",
    "Topology",
    "Trainer",
    "Traits",
    "check_weights",
    "gather",
    "payload_bytes",
    "require_generator",
    "stray_traits",
]


# the name of every message's first part: the model delta (or the negative gradient a
# gradient rule sends), as many entries as the model has parameters
DELTA = "delta"


@dataclass(frozen=True)
class Part:
    """One named part of a client's message: ``size`` entries (None: the model's size d)
    and its ``role``: ``row``, aggregated by the robust pipeline as one row with the other
    row parts (a rule that keeps a client keeps all of them); ``mean``, averaged over the
    step's rows beside it (weighted as the rows are), for the server optimizer (q-FedAvg's
    ``h``). Differential privacy covers the row parts only."""

    name: str
    size: int | None = None
    role: Literal["row", "mean"] = "row"

    def width(self, d: int) -> int:
        """Its entries for a model of ``d`` parameters."""
        return d if self.size is None else self.size


@dataclass(frozen=True)
class MessageLayout:
    """The named parts of a client's message, in the order they travel: the model delta
    (:data:`DELTA`, model-sized, a row part) first, the other row parts, then the parts
    averaged beside the pipeline. A row of the step's matrix is the whole message; the
    robust pipeline aggregates its first ``row_width(d)`` columns."""

    parts: tuple[Part, ...] = (Part(DELTA),)

    def __post_init__(self) -> None:
        names = [p.name for p in self.parts]
        if not self.parts or self.parts[0] != Part(DELTA):
            raise ValueError(f"message: the first part must be Part({DELTA!r}), got {names}")
        if len(set(names)) != len(names):
            raise ValueError(f"message: part names must differ, got {names}")
        roles = [p.role for p in self.parts]
        if roles != sorted(roles, key=lambda r: r != "row"):
            raise ValueError(f"message: the row parts come first, got {names} as {roles}")
        if any(p.size is not None and p.size < 1 for p in self.parts):
            raise ValueError(f"message: a part's size must be >= 1 (None: the model's), "
                             f"got {[p.size for p in self.parts]}")

    def width(self, d: int) -> int:
        """A whole message's entries for a model of ``d`` parameters."""
        return sum(p.width(d) for p in self.parts)

    def row_width(self, d: int) -> int:
        """The entries the robust pipeline aggregates (the row parts)."""
        return sum(p.width(d) for p in self.parts if p.role == "row")

    @property
    def multipart(self) -> bool:
        """Whether the message is more than the model delta."""
        return len(self.parts) > 1

    def split(self, x: torch.Tensor, d: int) -> dict[str, torch.Tensor]:
        """The parts of ``x`` (a message, or anything with a message's entries along its
        last dimension) by name: views, no copy."""
        out, at = {}, 0
        for p in self.parts:
            w = p.width(d)
            out[p.name] = x[..., at:at + w]
            at += w
        return out


@dataclass(frozen=True)
class Traits:
    """What the engine must know of a plugin class, declared once on the class.

    ``random``: draws from the ``generator`` it is called with (aggregation rules, which all
    take one; a rule without this trait ignores it).
    ``omniscient``: an attack that sees the honest updates of the round (else it sees the
    Byzantine clients' own honestly computed updates).
    ``data_poisoning``: an attack that rewrites the Byzantine clients' labels
    (``Attack.poison_labels``) and sends the updates trained on them.
    ``gossip``: an attack on D-SGD's gossip (a :class:`GossipAttack`).
    ``time_varying``: a topology whose matrix changes with the gossip step.
    ``gradient_rule``: a client rule that sends a message built from minibatch gradients and
    keeps per-client state across rounds (worker momentum, mu2-SGD).
    ``privacy_level``: ``sample`` (DP-SGD inside each client) or ``client`` (the server
    clips and noises the mean).
    ``context``: constructor arguments the engine supplies (not scenario keys).
    ``path_params``: keys holding file paths, resolved relative to the scenario file and
    checked before anything reads them (``strategies.paths.guard``): a regular file, unless
    the key is also in ``folder_params`` (a folder) or ``file_or_folder_params`` (either);
    see :meth:`path_kind`. A key in ``created_params`` may name a path that does not
    exist yet (a download's root, created by the plugin), under an existing folder.
    ``by_label``: a partitioner that splits by class label (refused for value targets).
    ``natural``: a partitioner that keeps the data set's own clients, client ``k`` the
    ``k``-th (what ``data.load: cohort`` reads a :class:`Population` by).
    ``buffers``: a trainer that runs a model with buffers (BatchNorm) in train mode, one
    client at a time, so its statistics update as torch defines (the worker loads each
    client's starting buffers and reads them back); others are refused such models.
    ``trainer``: the trainer a privacy plugin or a client rule runs with (DP-SGD's per-sample
    clipping, a gradient rule's one-gradient round), chosen unless ``local.trainer`` is given.
    ``batched``: a trainer's twin that trains many clients at once with the same numbers (to
    float rounding), chosen by ``runtime.vectorize``; ``loop``: a batched trainer's twin that
    trains one client at a time, which the engine times against it to keep the faster.
    ``client_state``: a client rule that keeps per-client state across rounds (in
    ``ClientData.state``; a gradient rule does too): its clients train on the worker that
    holds it, and checkpoints carry it.
    ``averaging``: an aggregator that is the plain mean of its rows (one row moves it by at
    most its norm / n: the sensitivity client-level DP calibrates its noise to).
    ``tokens``: a model that takes integer token ids (an embedding), not values; it lists
    ``vocabulary`` in ``context`` to receive the data's number of token ids.
    ``targets``: the labels a task needs, ``classes`` (int64 ids) or ``values`` (float32).
    ``message``: a client rule's :class:`MessageLayout`, the named parts of what a client
    sends (the model delta alone by default; SCAFFOLD: the delta and its control-variate
    delta, both in the robust row; q-FedAvg: the delta and the scalar ``h``, averaged
    beside it); the server optimizer receives the aggregated parts by name.
    ``reference``: an aggregator that takes the server's own update of the round, trained on
    its clean root set (FLTrust): called ``rule(x, generator=None, reference=...)``.
    ``targeted``: an attack with a goal of its own, a backdoor: it builds the test set of
    its success (``Attack.triggered``), measured at every evaluation.
    ``crafts_payload``: an attack whose Byzantine clients build their payloads themselves
    instead of passing their rows through the codecs' client halves: the server decodes
    the worst case within each codec's range (:meth:`Codec.reach`; secure aggregation:
    words beyond the clients' clip).
    ``personal``: a client rule that keeps a personal model per client (Ditto): a flat
    parameter vector in its state under :data:`PERSONAL`, trained beside the global model's
    local steps (:meth:`DriftRule.personal_correction`) and measured on each client's own
    test samples (``personal_test_accuracy_mean`` and ``_p10``).
    ``shared_state``: a client rule that reads the server optimizer's broadcast state each
    round (``ServerOptimizer.shared``, in ``ClientData.shared``; SCAFFOLD's server control
    variate): it needs a server that steps once per round of all its clients (synchronous
    server rounds).
    ``canaries``: a trainer that adds the canary examples a client holds under an audit of
    sample-level DP (``ClientData.canaries``) to its clipped per-example gradients.
    ``reconstructs``: a privacy attack that reconstructs a client's training samples from
    the message the server receives from it in one round (:class:`PrivacyAttack`); without
    it, a membership attack that scores examples against the run's final model.
    ``weighted``: an aggregation rule (aggregator or meta-aggregator) that takes ``weights``,
    one positive weight per row (an asynchronous server weighs its updates); it is called
    ``rule(x, generator=None, weights=None)`` (see :class:`Aggregator`). A rule without it
    has no weighted definition and is refused weights.
    """

    random: bool = False
    omniscient: bool = False
    data_poisoning: bool = False
    gossip: bool = False
    time_varying: bool = False
    gradient_rule: bool = False
    privacy_level: Literal["none", "sample", "client"] = "none"
    context: tuple[str, ...] = ()
    path_params: tuple[str, ...] = ()
    folder_params: tuple[str, ...] = ()
    file_or_folder_params: tuple[str, ...] = ()
    created_params: tuple[str, ...] = ()
    buffers: bool = False
    by_label: bool = False
    natural: bool = False
    trainer: str | None = None
    batched: str | None = None
    loop: str | None = None
    averaging: bool = False
    tokens: bool = False
    client_state: bool = False
    targets: Literal["classes", "values"] = "classes"
    weighted: bool = False
    message: MessageLayout = MessageLayout()
    shared_state: bool = False
    personal: bool = False
    targeted: bool = False
    crafts_payload: bool = False
    reference: bool = False
    reconstructs: bool = False
    canaries: bool = False

    def path_kind(self, key: str) -> PathKind:
        """What the path key ``key`` (one of ``path_params``) names: ``file``, ``folder``
        or ``either``."""
        if key in self.folder_params:
            return "folder"
        return "either" if key in self.file_or_folder_params else "file"


# the traits a plugin of each kind may declare: what the engine reads of that kind (any kind
# may declare ``context`` and the keys holding paths, ``ANY_KIND_TRAITS``); the registry
# refuses a class that declares another, which would mean nothing (as scikit-learn's tags
# are per estimator kind)
KIND_TRAITS: dict[str, frozenset[str]] = {kind: frozenset(names) for kind, names in {
    "aggregators": ("random", "averaging", "reference", "weighted"),
    "preaggregators": ("random", "weighted"),
    "meta": ("random", "weighted"),
    "attacks": ("omniscient", "data_poisoning", "gossip", "targeted", "crafts_payload"),
    "topologies": ("time_varying",),
    "gossip_defenses": (),
    "datasets": (),
    "models": ("tokens",),
    "optimizers": (),
    "client_optimizers": ("client_state", "gradient_rule", "personal", "trainer",
                          "shared_state", "message"),
    "trainers": ("batched", "buffers", "loop", "canaries"),
    "partitioners": ("by_label", "natural"),
    "privacy": ("privacy_level", "trainer"),
    "privacy_attacks": ("reconstructs",),
    "tasks": ("targets",),
    "codecs": (),
}.items()}


ANY_KIND_TRAITS = frozenset({"context", "path_params", "folder_params",
                             "file_or_folder_params", "created_params"})


def stray_traits(kind: str, traits: Traits) -> list[str]:
    """The traits ``traits`` sets away from their defaults that mean nothing to a plugin of
    ``kind`` (``KIND_TRAITS``)."""
    default = Traits()
    allowed = KIND_TRAITS[kind] | ANY_KIND_TRAITS
    return [f.name for f in fields(Traits) if f.name not in allowed
            and getattr(traits, f.name) != getattr(default, f.name)]


class Plugin:
    """What every plugin has: declared traits and ``check(n)``."""

    traits: ClassVar[Traits] = Traits()

    def check(self, n: int) -> None:
        """Raise ``ValueError("key: ...")`` when the plugin cannot work with ``n`` (see the
        module docstring for what ``n`` is per kind). The default accepts every ``n``."""
        return


class Stateful:
    """torch.optim's checkpoint hooks; the defaults hold no state."""

    def state_dict(self) -> dict[str, Any]:
        """Everything the rule's future outputs depend on besides its arguments."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        return


# ---------------------------------------------------------------------------- aggregation


def require_generator(generator: torch.Generator | None, rule: object) -> torch.Generator:
    """``generator``, which a random rule (``traits.random``) draws from; a TypeError naming
    ``rule`` when it is None (a plugin never draws from torch's global generator)."""
    if generator is None:
        raise TypeError(f"{type(rule).__name__} is random (traits.random): call it with "
                        "generator=torch.Generator")
    return generator


def check_weights(weights: torch.Tensor, n: int) -> None:
    """Raise ``ValueError("weights: ...")`` unless ``weights`` is what a weighted rule
    (``traits.weighted``) is called with for ``n`` rows: a float64 or float32 tensor of
    shape ``(n,)``, every entry finite and > 0."""
    if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (n,):
        got = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
        raise ValueError(f"weights: must be a tensor of shape ({n},), one weight per row, "
                         f"got {got}")
    if weights.dtype not in (torch.float64, torch.float32):
        raise ValueError(f"weights: must be float64 or float32, got {weights.dtype}")
    ok = torch.isfinite(weights) & (weights > 0)
    if not bool(ok.all()):
        bad = int(torch.nonzero(~ok)[0, 0])
        raise ValueError(f"weights: every entry must be finite and > 0, got {float(weights[bad])} "
                         f"at row {bad}")


class Aggregator(Plugin, Stateful, ABC):
    """``(n, d)`` float32 updates -> ``(d,)`` aggregate. Non-finite rows must not break it
    while at most ``f`` rows are Byzantine.

    A rule with ``traits.weighted`` also takes ``weights``: ``rule(x, generator=None,
    weights=None)``. ``weights`` is None (the unweighted rule, the same numbers bit for bit as
    a call without it) or a float64 or float32 tensor of shape ``(n,)``, every entry > 0
    (:func:`check_weights`), not normalised: the rule divides by their total, so scaling
    every weight by one constant leaves its output unchanged, and equal weights give the
    unweighted rule. The rule never modifies ``weights``. A rule without the trait is never
    given weights (the pipeline refuses them in one line)."""

    @abstractmethod
    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        """The aggregate of the rows ``x``. Every caller may pass ``generator``: a rule with
        ``traits.random`` draws from it (and needs it), any other ignores it. A weighted rule
        (``traits.weighted``) adds ``weights: torch.Tensor | None = None``."""


class PreAggregator(Plugin, Stateful, ABC):
    """``(n, d)`` -> ``(output_rows(n), d)``, applied before the aggregator in the order of
    the scenario's ``preaggregators`` list. Pre-aggregators take no weights."""

    @abstractmethod
    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        """The ``(output_rows(n), d)`` rows from ``x``; ``generator`` as for
        :meth:`Aggregator.__call__`."""

    def output_rows(self, n: int) -> int:
        """How many rows come out of ``n`` rows in (the default: as many)."""
        return n


class MetaAggregator(Plugin, Stateful, ABC):
    """Wraps the scenario's aggregator: ``meta(x, aggregator) -> (d,)``; ``aggregator`` maps
    ``(m, d)`` to ``(d,)`` (a random aggregator comes with its generator bound) and is called
    on ``output_rows(n)`` rows at most.

    A meta-aggregator with ``traits.weighted`` is called ``meta(x, aggregator,
    generator=None, weights=None)``, ``weights`` as for :class:`Aggregator` (None: the
    unweighted rule, bit for bit). Given weights, it calls ``aggregator(rows, weights=...)``
    with the weights of the rows it passes (the engine then hands it a weighted aggregator);
    without, ``aggregator(rows)`` as an unweighted meta-aggregator does."""

    @abstractmethod
    def __call__(self, x: torch.Tensor, aggregator: Callable[[torch.Tensor], torch.Tensor],
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """The aggregate of ``x`` through ``aggregator``; ``generator`` as for
        :meth:`Aggregator.__call__`; a weighted meta-aggregator adds ``weights``."""

    def output_rows(self, n: int) -> int:
        """How many rows the wrapped aggregator receives at most from ``n`` rows."""
        return n


# ---------------------------------------------------------------------------- attacks


class BaseAttack(Plugin, ABC):
    """The base of the ``attacks`` kind, which holds two contracts: an :class:`Attack` makes
    the Byzantine rows of a server round, a :class:`GossipAttack` (``traits.gossip``) the
    messages the Byzantine peers of D-SGD send. A plugin subclasses one of the two.

    ``check_data(info)``: the attack against the data it will poison or measure, before
    the data loads (validation calls it when the data set can describe itself)."""

    def check_data(self, info: DatasetInfo) -> None:
        """Raise ``ValueError("key: ...")`` when the attack cannot work on the data ``info``
        describes: a trigger or pattern that does not fit its samples' shape, an image
        attack on features or tokens, a class key beyond its classes. By default, nothing
        to check."""


class Attack(BaseAttack):
    """``attack(seen, f, generator) -> (f, d)``: the Byzantine rows of a round. ``seen`` is
    the ``(h, d)`` honest updates of the round (``traits.omniscient``) or the Byzantine
    clients' own honestly computed updates. An attack that needs the scenario's aggregation
    pipeline lists ``aggregate`` in ``traits.context``: it receives a pure function
    ``(n, d) -> (d,)`` that runs the scenario's pre-aggregators, aggregator and meta.
    ``check(n)``: ``n`` is the number of Byzantine rows it makes."""

    @abstractmethod
    def __call__(self, seen: torch.Tensor, f: int, generator: torch.Generator) -> torch.Tensor: ...

    def poison_labels(self, y: torch.Tensor, num_classes: int) -> torch.Tensor:
        """A data-poisoning attack's labels for the Byzantine clients' training (what the
        default :meth:`poison` calls)."""
        raise NotImplementedError(f"{type(self).__name__} declares no data poisoning")

    def poison(self, x: torch.Tensor, y: torch.Tensor, attacker: int, round_: int,
               num_classes: int, generator: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """A data-poisoning attack (``traits.data_poisoning``): the training samples and
        labels in round ``round_`` of the ``attacker``-th Byzantine client (its index among
        the Byzantine clients, by id: a distributed trigger is split by it) (``x`` float32 as the model takes
        it, ``y`` int64); new tensors, never the inputs or views of them; draws only from
        ``generator`` (a stream of its own). By default the samples as they are and
        :meth:`poison_labels`'s labels; a backdoor stamps a trigger on samples too."""
        return x, self.poison_labels(y, num_classes)

    def triggered(self, x_test: torch.Tensor, y_test: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """A targeted attack (``traits.targeted``): the attack-success test set from the
        clean test set (same layout as :meth:`poison`'s inputs): the samples the attack
        should move, as it would present them, labelled with the class it wants. The server
        reports the global model's accuracy on it, ``attack_success_rate``, at every
        evaluation. Pure and deterministic."""
        raise NotImplementedError(f"{type(self).__name__} declares no targeted test set")


class GossipAttack(BaseAttack):
    """An attack on D-SGD (``traits.gossip``): the Byzantine neighbours of honest peer i all
    send it ``messages(...)[i]``. It makes no rows: a server round cannot run it (validation
    refuses it without a topology). ``check(n)``: ``n`` is the number of Byzantine peers."""

    traits = Traits(gossip=True, omniscient=True)

    @abstractmethod
    def messages(self, x: torch.Tensor, w_hh: torch.Tensor, w_byz: torch.Tensor,
                 generator: torch.Generator) -> torch.Tensor:
        """``(h, d)`` messages, row i for honest peer i; ``x`` the honest models ``(h, d)``,
        ``w_hh`` the honest block of W (dense), ``w_byz[i]`` the weight i gives its
        Byzantine neighbours."""


# ---------------------------------------------------------------------------- D-SGD


class Topology(Plugin, ABC):
    """The communication graph of D-SGD. ``check(n)``: ``n`` peers."""

    @abstractmethod
    def mixing_matrix(self, n: int, seed: int, step: int = 0) -> np.ndarray:
        """The ``(n, n)`` float64 gossip matrix of gossip step ``step`` (only
        ``traits.time_varying`` topologies depend on it): symmetric, doubly stochastic."""


@dataclass(frozen=True)
class GossipStep:
    """One gossip step's matrices, restricted to the honest peers (rows in their order):
    ``w_hh`` dense ``(h, h)`` float64 and ``w_sparse`` the same as a float32 sparse tensor,
    ``w_byz[i]`` the total weight peer i gives its Byzantine neighbours, ``byz_count[i]``
    how many it has."""

    w_hh: np.ndarray
    w_sparse: torch.Tensor
    w_byz: np.ndarray
    byz_count: np.ndarray


class GossipDefense(Plugin, ABC):
    """One gossip step of the honest peers' models ``x`` ``(h, d)`` given the step's matrices
    and the Byzantine messages (``None`` when no Byzantine neighbour speaks); returns the new
    ``(h, d)`` models. Chosen by ``dsgd.defense``; what it needs from the scenario
    (``clip_tau``, the scenario's ``aggregator``) it lists in ``traits.context``."""

    @abstractmethod
    def __call__(self, x: torch.Tensor, step: GossipStep,
                 messages: torch.Tensor | None) -> torch.Tensor: ...


# ---------------------------------------------------------------------------- optimizers


class ClientRule(Plugin, ABC):
    """What a client sends (``local.optimizer``). A rule without ``traits.gradient_rule``
    is the model delta of the trainer's local SGD; a gradient rule builds its message from
    minibatch gradients and keeps per-client state across rounds, in the worker that owns
    the client. A rule with ``traits.client_state`` keeps state too, with a trainer of its
    own (``traits.trainer``) that reads and writes ``ClientData.state``."""

    def client_message(self, round_: int, x: torch.Tensor,
                       grad: Callable[[torch.Tensor], tuple[torch.Tensor, float]],
                       state: dict[str, torch.Tensor], lr: float
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
        """(message, new state, loss) of one client from the global model ``x``; ``grad(p)``
        is (minibatch gradient at ``p``, loss), the same minibatch every call."""
        raise NotImplementedError(f"{type(self).__name__} is not a gradient rule")


# A correction of each local step's gradient: flat parameters -> a flat vector added to it
Correction = Callable[[torch.Tensor], torch.Tensor]
# where a client rule with ``traits.personal`` keeps the client's personal model in its state
PERSONAL = "personal"


class DriftRule(ClientRule):
    """A client rule that runs inside local SGD (the ``drift_sgd`` trainer,
    strategies.drift): ``correction`` gives the term added to each local step's gradient,
    ``message`` turns the local update into what the client sends (and its new state). The
    base class itself is plain local SGD: no correction, the update as the message."""

    traits = Traits(trainer="drift_sgd")

    def prepare(self, steps: np.ndarray, local: LocalSettings) -> None:
        """Told once, before any round, every client's number of local steps (a rule that
        normalises by them, FedNova)."""

    def correction(self, start: torch.Tensor, state: dict[str, torch.Tensor],
                   shared: torch.Tensor | None) -> Correction | None:
        """The term added to each local step's gradient at the flat parameters ``w``
        (``start``: the global model; ``state``: the client's; ``shared``: the server's
        broadcast), or None (no correction: exactly ``sgd``'s steps)."""
        return None

    def message(self, update: torch.Tensor, steps: int, state: dict[str, torch.Tensor],
                shared: torch.Tensor | None, local: LocalSettings
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(what the client sends, the parts of ``traits.message`` side by side; its new
        state) from its local ``update`` after ``steps`` minibatch steps."""
        return update, state

    def personal_correction(self, start: torch.Tensor) -> Correction | None:
        """With ``traits.personal``: the term added to each gradient step of the client's
        personal model (from ``state[PERSONAL]``, the global model ``start`` at first),
        which runs after the global model's steps, over a fresh draw of the same local work;
        None otherwise."""
        return None


class ServerOptimizer(Plugin, Stateful, ABC):
    """The server's update of the global model from the round's aggregate (a model delta
    or a negative gradient, as the clients' rule sends). A rule whose client half sends a
    message of several parts (``Traits.message``) overrides :meth:`step_parts`, which
    receives them by name; the others override :meth:`step`."""

    def step(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The next global model from ``x`` and the aggregate ``delta``; never in place."""
        raise NotImplementedError(f"{type(self).__name__} overrides neither step nor "
                                  "step_parts")

    def step_parts(self, x: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The next global model from ``x`` and the step's aggregated message parts by name
        (the robust pipeline's aggregate of the row parts, the mean of the others); the
        default steps on the model delta (:data:`DELTA`) alone."""
        return self.step(x, parts[DELTA])

    def client_rule(self) -> ClientRule | None:
        """The clients' half of a method that spans both sides (mu2-SGD, SCAFFOLD, FedDyn),
        else None."""
        return None

    def shared(self) -> torch.Tensor | None:
        """The state the server broadcasts to the clients beside the model each round (a
        flat tensor: SCAFFOLD's control variate), read by a client half with
        ``traits.shared_state``; None when there is none (yet)."""
        return None


# ---------------------------------------------------------------------------- codecs


# the dense part of a payload: one float row ``(k, w)`` a message (what the chain starts
# with on the client and what decoding ends with on the server)
ROWS = "rows"

Parts = dict[str, torch.Tensor]  # a payload: named tensors, one leading row a message


@dataclass(frozen=True)
class PartSpec:
    """One part of a payload, per message: ``entries`` values of ``dtype`` (a torch dtype's
    name: ``float32``, ``float16``, ``bfloat16``, ``int32``, ``int8``, ``uint8``). Its bytes
    are ``entries * itemsize``: what the payload costs is declared by the codec and equals
    what crosses the object store (a test compares them)."""

    entries: int
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.entries * torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()


@dataclass(frozen=True)
class MessageShape:
    """What a codec may know of the message it encodes: its ``width`` (entries a row) and
    the model parameters' ``shapes`` (the row's first ``sum(prod(shape))`` entries are the
    parameters in that order, as ``parameters_to_vector`` lays them out), for a codec that
    compresses each layer as a matrix (PowerSGD)."""

    width: int
    shapes: tuple[tuple[int, ...], ...] = ()


@dataclass
class CodecBatch:
    """The clients whose messages one ``encode`` call carries, row by row: the ``round``,
    one seeded ``generators`` entry a row (``(seed, "codec", position in the chain, round,
    client)``: a client's payload does not depend on which worker encodes it or with whom),
    the message's ``shape``, and ``states``: this codec's per-client state a row (``{}`` the first time; the codec
    replaces the entries in place, the worker keeps them between rounds, checkpoints carry
    them), or None where no state is kept (a Byzantine client's crafted row: error feedback
    has nothing to correct there)."""

    round: int
    generators: list[torch.Generator]
    shape: MessageShape
    states: list[dict[str, torch.Tensor]] | None = None


def payload_bytes(layout: dict[str, PartSpec]) -> int:
    """The bytes of one message's payload of ``layout``."""
    return sum(p.nbytes for p in layout.values())


class Codec(Plugin):
    """A stage of the message path (the scenario's ``codecs:`` list, in order; client-level
    differential privacy is one too, from the ``privacy`` block): a client half and a server
    half, as pfl-research's postprocessors pair a client transform with its server inverse.
    A payload is :data:`Parts`: named tensors, one leading row a message; the chain starts
    from ``{ROWS: (k, w) float32}``.

    * :meth:`encode` (client half, on the worker, and on the Adversary: Byzantine clients
      speak the protocol): a round's payload -> the payload that travels (any parts, any
      dtypes, any widths: top-k sends indices and values). Randomness comes from the batch's
      per-client generators, per-client state (an error-feedback residual) from its
      ``states``;
    * :meth:`decode` (server half, per row, where the payload arrives): the payload -> the
      payload it encoded (the chain, in reverse, ends with ``{ROWS: (n, w) float32}``);
    * :meth:`screen` (server half, on the step's dense rows, honest and Byzantine, before
      the robust pipeline: DP-FedAvg clips there);
    * :meth:`finish` (server half, after the pipeline): the aggregate of ``m`` rows;
    * :meth:`layout`: the parts one message's payload has, from the parts of the payload it
      encodes (``inner``); their bytes (:func:`payload_bytes`) are counted per round
      (``bytes_up``) and the simulated clock charges them at each client's bandwidth;
    * :meth:`needs_rows`: whether :meth:`encode` takes the dense rows (a compressor) rather
      than any payload (a precision change of its float parts), so a chain that gives it
      another codec's payload is refused before anything runs; :meth:`dense`: whether its
      payload is still the dense rows;
    * :meth:`keeps_state`: whether it keeps per-client state (error feedback): the clients
      then train where their state is, and a lost worker or a resumed run restores it;
      :meth:`server_keeps_state`: whether the server keeps some too (EF21), which
      :meth:`decode_kept` reads and checkpoints carry;
    * :meth:`hides_rows`: whether its server sees sums, not rows (secure aggregation): then
      :meth:`combine` gives the rows the robust pipeline aggregates (``output_rows(n)`` of
      them, the group means), and :meth:`extra_bytes` what its protocol costs a client
      beside the payload.

    The chain encodes in order and decodes in reverse; the identity (no codec) changes no
    number. The defaults are the identity."""

    def encode(self, parts: Parts, batch: CodecBatch) -> Parts:
        """The payload of ``parts`` (one message a row); never in place."""
        return parts

    def decode(self, parts: Parts, shape: MessageShape) -> Parts:
        """The payload ``parts`` encodes (stacked rows of many clients, each a message of
        ``shape``); never in place."""
        return parts

    def screen(self, rows: torch.Tensor) -> torch.Tensor:
        """The step's dense rows ``(n, w)`` as the robust pipeline receives them."""
        return rows

    def finish(self, aggregate: torch.Tensor, m: int, generator: torch.Generator
               ) -> torch.Tensor:
        """The pipeline's ``aggregate`` of ``m`` rows as the server steps on it."""
        return aggregate

    def layout(self, inner: dict[str, PartSpec], shape: MessageShape) -> dict[str, PartSpec]:
        """The parts of one message's payload after this codec, from ``inner``'s."""
        return inner

    def needs_rows(self) -> bool:
        """Whether :meth:`encode` needs the dense float rows (``{ROWS: ...}``) as input."""
        return False

    def dense(self) -> bool:
        """Whether its payload is the dense rows (one ``ROWS`` part of ``width`` entries)."""
        return True

    def keeps_state(self) -> bool:
        """Whether it keeps per-client state between rounds (``CodecBatch.states``)."""
        return False

    def server_keeps_state(self) -> bool:
        """Whether its server half keeps per-client state (EF21's estimates): then
        :meth:`decode_kept` decodes a client's payload with it."""
        return False

    def decode_kept(self, parts: Parts, shape: MessageShape,
                    states: list[dict[str, torch.Tensor]]) -> Parts:
        """:meth:`decode` with the server's state of each row's client (replaced in place);
        only called where :meth:`server_keeps_state`."""
        return self.decode(parts, shape)

    def hides_rows(self) -> bool:
        """Whether its server sees only sums of rows (secure aggregation)."""
        return False

    def output_rows(self, n: int) -> int:
        """The rows the robust pipeline receives from a step of ``n`` rows."""
        return n

    def combine(self, rows: torch.Tensor, round_: int, seed: int, crafted: int = 0
                ) -> tuple[torch.Tensor, dict[str, float]]:
        """A codec that hides rows: the rows the pipeline aggregates, from the step's dense
        ``rows`` (the clients' messages, which its server never sees; the last ``crafted``
        of them Byzantine rows sent as payloads their clients built, see :meth:`reach`),
        and the step's protocol metrics; the default hides nothing."""
        return rows, {}

    def reach(self, rows: torch.Tensor, shape: MessageShape) -> torch.Tensor:
        """The rows the server decodes when Byzantine clients build their payloads
        themselves to send ``rows`` (``traits.crafts_payload``): the nearest the payload can
        carry, the worst case within the codec's range. The default: what the client half
        makes of them (its encode with fixed draws, then its decode)."""
        gens = [torch.Generator().manual_seed(0) for _ in range(len(rows))]
        parts = self.encode({ROWS: rows}, CodecBatch(0, gens, shape))
        return self.decode(parts, shape)[ROWS].to(torch.float32)

    def extra_bytes(self, shape: MessageShape, n: int) -> int:
        """Bytes a client sends beside its payload in a step of ``n`` rows (keys, shares)."""
        return 0


# ---------------------------------------------------------------------------- trainers


class LocalSettings(Protocol):
    """The scenario's ``local`` block, as a trainer reads it."""

    @property
    def epochs(self) -> int | None: ...
    @property
    def steps(self) -> int | None: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def lr(self) -> float: ...
    @property
    def momentum(self) -> float: ...
    @property
    def weight_decay(self) -> float: ...


@dataclass
class ClientData:
    """One virtual client in one round, as a worker hands it to its trainer: its samples
    (writable float32 features and int64 labels, poisoned already for a data-poisoning
    Byzantine client), its random stream (seed, round, client) and its state (``{}`` until a
    client rule with state has stored some; the trainer replaces it, the worker keeps it).
    ``shared``: the server optimizer's broadcast state of the round (``ServerOptimizer.shared``;
    None without). ``max_steps``: the most minibatch steps the client completes this round
    (a straggler that sends partial work, ``clients.stragglers.partial``); None: all of its
    local work. ``canaries``: under an audit of sample-level DP (``audit:``), the unit
    directions ``(k, d)`` of the canary examples this client holds, each a per-example
    gradient of norm ``clip`` pointing against its direction, Poisson-sampled at the
    client's rate from ``canary_generator`` (a trainer with ``traits.canaries`` adds them;
    None: no canary)."""

    client: int
    x: torch.Tensor
    y: torch.Tensor
    generator: torch.Generator
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    shared: torch.Tensor | None = None
    max_steps: int | None = None
    canaries: torch.Tensor | None = None
    canary_generator: torch.Generator | None = None


class Trainer(Plugin, ABC):
    """Computes the clients' messages of a round on a ClientWorker, which hosts the data,
    the model and the per-client state and knows no algorithm. The worker builds it with
    its ``model`` (one instance, reused for every client) and the scenario's ``local``
    block; ``traits.context`` lists what else it needs (the scenario's ``task``, whose
    ``losses`` it minimises, the client ``rule``, the ``privacy`` plugin). ``train`` must not depend on which other clients are in
    ``clients`` beyond rounding (results are compared across worker counts)."""

    traits = Traits(context=("model", "local"))

    @abstractmethod
    def train(self, round_: int, clients: Sequence[ClientData], start: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(updates (k, d) float32, mean losses (k,) float64)`` of ``clients`` from the
        flat global model ``start``; writes each client's new ``state``."""


# ---------------------------------------------------------------------------- privacy


class Privacy(Plugin, ABC):
    """A differential-privacy mechanism (``traits.privacy_level`` says where it acts) and
    its accounting. Keys every privacy plugin has: ``clip``, ``noise_multiplier``,
    ``delta`` (at which epsilon is reported) and ``accountant``."""

    clip: float
    noise_multiplier: float
    delta: float
    accountant: str

    @abstractmethod
    def mechanism(self, rounds: int, client_rate: float, sample_rate: float,
                  steps_per_round: int) -> Any:
        """The composed mechanism after ``rounds`` rounds (``epsilon(delta, accountant)``,
        ``profile``, ``tradeoff``, ``steps``, ``q``)."""

    def privatize(self, rows: torch.Tensor) -> torch.Tensor:
        """Client level: the rows as the server aggregates them (clipped)."""
        return rows

    def noise(self, aggregate: torch.Tensor, m: int, generator: torch.Generator) -> torch.Tensor:
        """Client level: the aggregate of ``m`` rows with its noise."""
        return aggregate

    def noise_share(self, rows: torch.Tensor, m: int, generators: Sequence[torch.Generator]
                    ) -> torch.Tensor:
        """Client level under secure aggregation (distributed DP): each client's row as it
        masks it, clipped (:meth:`privatize`) and with its share of the noise, one Gaussian
        of std ``noise_multiplier * clip / sqrt(m)`` a row (its generator's): the shares of
        ``m`` rows sum to the noise of std ``noise_multiplier * clip`` that the central
        mechanism adds to their sum (:meth:`noise` on the mean)."""
        out = self.privatize(rows)
        if self.noise_multiplier == 0 or not len(rows):
            return out
        std = self.noise_multiplier * self.clip / math.sqrt(m)
        draws = torch.stack([torch.randn(rows.shape[1], generator=g) for g in generators])
        return out + std * draws.to(out.dtype)


@dataclass(frozen=True)
class AttackView:
    """What a privacy attack sees (the server's view; never the target's data).

    ``model``: the model, on the CPU, with the attacked parameters loaded (a reconstruction:
    the global model the target client started the round from; a membership attack: the
    run's final model), in eval mode. ``update``: the ``(d,)`` model delta the attack
    targets (the client's row as the server received it, or the round's released
    aggregate), None for a membership attack. ``samples``, ``lr``, ``steps``: the local
    training behind the update as the server knows it from the scenario (the client's
    sample count, the local learning rate, its local steps). ``input_shape``,
    ``num_classes``, ``input_range`` (the data's smallest and largest value: the box a
    reconstruction lives in). ``queries``: a membership attack's examples to score
    (inputs, labels)."""

    model: nn.Module
    update: torch.Tensor | None
    samples: int
    lr: float
    steps: int
    input_shape: tuple[int, ...]
    num_classes: int
    input_range: tuple[float, float]
    queries: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(frozen=True)
class AttackResult:
    """A reconstruction (``inputs`` of shape ``(samples, *input_shape)`` and ``labels``) or
    a membership attack's ``scores`` (one per query, higher: more likely a member)."""

    inputs: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    scores: torch.Tensor | None = None


class PrivacyAttack(Plugin, ABC):
    """An attack on the privacy of the clients' data, run against what the server receives
    (``privacy_attacks:``). A reconstruction attack (``traits.reconstructs``) targets one
    client's message in round ``round`` (1-based): ``client`` (None: the round's first
    sampled honest client), ``target`` ``update`` (the client's row as received: an
    honest-but-curious server) or ``release`` (the round's aggregate after the server's
    noise: what client-level DP protects), with an iteration budget ``iterations``; the
    engine scores what it returns against the client's samples. A membership attack scores
    queries against the final model. Neither sees the data it attacks.

    A membership attack with shadow runs (``runs`` > 1, LiRA) spans ``runs`` runs of one
    scenario, each a sweep point (``run``: its index, 0-based; the engine adds the sweep when
    ``run`` is None): ``candidates`` training samples are drawn once per seed, each included
    in exactly half of the runs (seeded), and the others train without it; each run scores
    every candidate on its final model (``attack``, the queries), and ``fedray privacy
    shadows`` takes each run in turn as the target, the others as its shadows, through
    :meth:`combine`."""

    round: int = 1
    client: int | None = None
    target: str = "update"
    iterations: int = 0
    candidates: int = 0  # a reconstruction's prior set; a shadow-run attack's samples
    runs: int = 1  # the runs a shadow-run membership attack spans (1: none)
    run: int | None = None  # this run's index among them

    @abstractmethod
    def attack(self, view: AttackView, generator: torch.Generator) -> AttackResult:
        """The attack's output from what the server sees (:class:`AttackView`); random
        draws (a reconstruction's starting point) from ``generator``."""

    def combine(self, target: np.ndarray, shadows: np.ndarray, included: np.ndarray
                ) -> np.ndarray:
        """A shadow-run attack's membership scores of the candidates in a target run
        (higher: more likely a member) from its own scores ``target`` ``(m,)`` and the
        shadow runs' ``shadows`` ``(r, m)`` with their inclusion ``included`` ``(r, m)``
        bool. By default the target's scores as they are (no shadow model)."""
        return np.asarray(target, dtype=np.float64)


# ---------------------------------------------------------------------------- data, models


@dataclass(frozen=True)
class DatasetSplit:
    """A loaded dataset: train and test arrays, one sample's shape, the classes, and the
    natural client of each training sample where the data has one."""

    # float32 features, uint8 images (0..255, scaled to [0, 1] on the worker), or int32
    # token ids (text: they reach the model as int64)
    x_train: np.ndarray
    y_train: np.ndarray  # int64, (N,)
    x_test: np.ndarray
    y_test: np.ndarray
    input_shape: tuple[int, ...]
    num_classes: int
    clients_train: np.ndarray | None = None
    clients_test: np.ndarray | None = None  # natural client of each test sample, if any
    vocabulary: int | None = None  # token data: ids are 0..vocabulary-1


@dataclass(frozen=True)
class FetchedFile:
    """A published file a data set needs, in its folder: ``downloaded`` now, or found there
    already with its published checksum (``Dataset.fetch``)."""

    path: Path
    size: int
    downloaded: bool


@dataclass(frozen=True)
class DatasetInfo:
    """What validation needs to know of a dataset before anything runs, found without
    loading it: the training samples (after the test split), one sample's shape, the classes,
    and how many bytes one stored value takes (what the data costs in memory held whole)."""

    train_samples: int
    input_shape: tuple[int, ...]
    num_classes: int
    tokens: bool = False  # integer token ids (text), not pixel or feature values
    vocabulary: int | None = None  # token data: ids are 0..vocabulary-1
    targets: Literal["classes", "values"] = "classes"  # int64 class ids or float32 values
    # the natural clients (a client column) among the training samples; 0: the data has no
    # client column; None: not known before loading (the ``natural`` partitioner's count is
    # then checked when the data loads)
    natural_clients: int | None = None
    # the bytes of one stored value of a sample: 4 (float32 features, int32 token ids) or 1
    # (uint8 pixels); with ``train_samples`` and ``input_shape`` it sizes the data held whole
    # (``data.load: auto`` loads it whole only where that fits comfortably in memory)
    value_bytes: int = 4

    @property
    def images(self) -> bool:
        """The samples are images: values (not token ids) of shape ``(C, H, W)`` or
        ``(H, W)`` (a data set of flat features is not, whatever its width)."""
        return not self.tokens and len(self.input_shape) in (2, 3)

    @property
    def kind(self) -> str:
        """What one sample is, in words (``images of shape (1, 8, 8)``)."""
        if self.tokens:
            return f"token ids of shape {self.input_shape}"
        return f"{'images' if self.images else 'features'} of shape {self.input_shape}"


class Dataset(Plugin, ABC):
    """Samples and labels. ``check(n)``: ``n`` clients; it checks what can be checked
    without loading (files exist, their schema) and raises ``ValueError("key: ...")``."""

    @abstractmethod
    def load(self, num_clients: int, seed: int, test_fraction: float) -> DatasetSplit:
        """The data, every random draw from ``seed``; ``test_fraction`` held out unless the
        data has its own test split."""

    def describe(self, num_clients: int, seed: int, test_fraction: float) -> DatasetInfo | None:
        """What ``load`` would give, cheaply (None: unknown until loaded; validation then
        skips the data and model checks)."""
        return None

    def fetch(self) -> list[FetchedFile]:
        """The published files it reads, fetched into its folder and checked (a data set
        with ``download: true``; ``fedray fetch`` and every run call it before any MLflow
        run exists), each downloaded now or found there with its published checksum; it
        raises one located line when a file cannot be had. The default has none to fetch."""
        return []


class Population(ABC):
    """A data set's natural clients, read or generated a cohort at a time: what
    ``data.load: cohort`` trains from, so that memory grows with the round's clients and not
    with the population. Picklable (it crosses Ray to every ClientWorker): it holds the
    data set's parameters and where its files are, never the samples.

    ``sizes[k]`` is client ``k``'s number of training samples (``k`` is the position of the
    client among the data set's own, as the ``natural`` partitioner numbers them). ``train``
    and ``test`` give each asked client's ``(x, y)``, in the order asked: its training
    samples and its held-out ones, each call the same arrays for the same client (a pure
    function of the data set, the seed and the client)."""

    sizes: np.ndarray  # int64, (clients,)
    input_shape: tuple[int, ...]
    num_classes: int
    vocabulary: int | None = None

    @abstractmethod
    def train(self, clients: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each client's training samples ``(x, y)``: x of shape ``(m, *input_shape)`` in
        the stored dtype (float32 features, uint8 pixels or int32 tokens), y int64 class
        ids (float32 values for regression)."""

    @abstractmethod
    def test(self, clients: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each client's held-out samples, as ``train`` gives its training ones."""


class PopulationDataset(Dataset):
    """A data set that can give its clients a cohort at a time (``population``): generated
    from (seed, client), or read per client from files partitioned by client. Its
    ``load`` is the same samples, every client at once (:func:`gather`), so
    ``data.load: all`` and ``data.load: cohort`` train on the same data.

    ``whole_is_gathered``: its ``load`` is that :func:`gather`, so the engine may load it
    whole a chunk of clients at a time (peak memory: the data once); a data set that loads
    itself otherwise (a Parquet file with its own hold-out) sets it False."""

    whole_is_gathered: ClassVar[bool] = True

    @abstractmethod
    def population(self, num_clients: int, seed: int, test_fraction: float) -> Population:
        """The data set's ``num_clients`` natural clients; raises ``ValueError("key: ...")``
        where the data cannot be read per client (say, no client column)."""

    def load(self, num_clients: int, seed: int, test_fraction: float) -> DatasetSplit:
        return gather(self.population(num_clients, seed, test_fraction))


def gather(pop: Population, clients: Sequence[int] | None = None) -> DatasetSplit:
    """The ``clients`` (default all) of ``pop`` as one :class:`DatasetSplit`, the natural
    client of each sample (train and test) recorded."""
    ids = range(len(pop.sizes)) if clients is None else clients
    parts, held = pop.train(ids), pop.test(ids)

    def stack(rows: list[tuple[np.ndarray, np.ndarray]], j: int) -> np.ndarray:
        return np.concatenate([r[j] for r in rows]) if rows else np.zeros(0)

    def owner(rows: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        return np.repeat(np.asarray(list(ids), dtype=np.int64), [len(r[1]) for r in rows])

    return DatasetSplit(stack(parts, 0), stack(parts, 1), stack(held, 0), stack(held, 1),
                        tuple(pop.input_shape), pop.num_classes, owner(parts), owner(held),
                        pop.vocabulary)


class Partitioner(Plugin, ABC):
    """Splits the training samples over clients. ``check(n)``: ``n`` clients;
    ``check_data(n, info)``: the same split against the dataset's description, before it
    loads (validation calls it when the dataset can describe itself)."""

    def check_data(self, num_clients: int, info: DatasetInfo) -> None:
        """Raise ``ValueError("key: ...")`` when ``num_clients`` clients cannot be split from
        the data ``info`` describes (more classes per client than the data names, more
        samples than it has); ``__call__`` still checks the loaded labels. By default,
        nothing to check."""

    @abstractmethod
    def __call__(self, y: np.ndarray, num_clients: int, rng: np.random.Generator,
                 clients: np.ndarray | None = None) -> list[np.ndarray]:
        """One array of training-sample indices per client (every client at least one);
        ``clients``: the dataset's natural client of each sample, if any."""

    def test_clients(self, clients_train: np.ndarray, clients_test: np.ndarray
                     ) -> np.ndarray | None:
        """The client (0..num_clients-1, or -1) of each test sample, when this partition
        keeps the data set's own clients and the data set gives its test samples' clients;
        None otherwise (the default): the test set is then evaluated pooled only."""
        return None


class Model(nn.Module, Plugin):
    """A torch module whose constructor takes ``input_shape`` (one sample's shape) and
    ``num_classes`` (supplied by the engine from the dataset), then its own scenario keys;
    ``forward`` maps a batch ``(b, *input_shape)`` to ``(b, num_classes)`` scores: float32
    values, or int64 token ids for a model with ``traits.tokens`` (validation refuses a model
    whose input kind is not the data's; a token model lists ``vocabulary`` in its
    ``traits.context`` to receive the data's number of token ids). Its parameters travel as
    one flat float32 vector (``parameters()`` order)."""

    traits = Traits(context=("input_shape", "num_classes"))

    def chain(self) -> nn.Sequential | None:
        """The layers ``forward`` applies one after another, when it is only that and the
        module holds no other parameters: the vectorised trainer then runs many clients'
        copies of them as batched kernels (bmm, grouped convolutions). None (the default):
        ``forward`` is something else, and the vectorised trainer takes ``torch.func.vmap``."""
        return None


# ---------------------------------------------------------------------------- tasks


class Task(Plugin, ABC):
    """What the model learns: the training target of a batch, its per-sample loss and the
    evaluation metrics that fit it (the scenario's ``task``; trainers list ``task`` in their
    ``traits.context``). ``traits.targets``: the labels it needs, ``classes`` (int64 ids) or
    ``values`` (float32). Metric names (without their ``test_``/``train_`` prefix) are the
    ones the dashboards read: ``loss`` always, ``accuracy`` where it means something."""


    def target(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The batch's target from its inputs and labels (default: the labels)."""
        return y

    @abstractmethod
    def losses(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss of each sample, ``(b,)``, from the model's output on the batch."""

    def hits(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
        """Each sample's accuracy in [0, 1], ``(b,)``; None where accuracy means nothing."""
        return None

    def output_shape(self, batch: int, input_shape: tuple[int, ...], num_classes: int
                     ) -> tuple[int, ...]:
        """The model output this task needs for a batch (default ``(batch, num_classes)``)."""
        return (batch, num_classes)

    def metrics(self, loss: float, accuracy: float | None) -> dict[str, float]:
        """The evaluation's metrics from the mean loss and accuracy (None without hits)."""
        return {"loss": loss} if accuracy is None else {"accuracy": accuracy, "loss": loss}


# the base class of every kind, from the table of kinds (strategies.kinds), in its order
CONTRACTS: dict[str, type] = {kind: globals()[base] for kind, base in KINDS.items()}
