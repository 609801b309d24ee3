"""A run point resolved once, before any actor starts: the frozen, typed, picklable ``Plan``.

Every decision the engine, the actors and the checks act on is made here, once, from the
plugins' declared traits (never from a built-in plugin's name): which trainer computes the
clients' updates and which scenario key chose it, which client rule they follow and whether
it keeps per-client state, where differential privacy acts, how the server combines model
buffers, the aggregation pipeline, what the attack sees, the trimming parameter ``b_hat``.
The engine reads the Plan; the actors are built from it (``build_client_rule``,
``build_trainer_context``); validation (``simulator.config.checks``) reads the same Plan, so
what was checked is what runs.

This module imports no torch: resolving a Plan looks plugin classes up (their traits) and
builds one plugin only, a server optimizer that may bring the clients' half of its rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from simulator import registry
from simulator.config.schema import (
    DEFAULT_TRAINER,
    GRADIENT_RULE_TRAINER,
    SAMPLE_PRIVACY_TRAINER,
    Asynchrony,
    ModePlan,
    Scenario,
)
from simulator.registry import PluginSpec
from simulator.seeding import derive_seed

if TYPE_CHECKING:  # the Plan carries the rule's layout; this module imports no torch
    from strategies.protocols import MessageLayout

Loc = tuple[str | int, ...]
PrivacyLevel = Literal["none", "sample", "client"]


@dataclass(frozen=True)
class AttackPlan:
    """The scenario's attack and what the engine must know of it."""

    spec: PluginSpec
    omniscient: bool  # it sees the honest updates of the round
    data_poisoning: bool  # the Byzantine clients train on labels it rewrites
    gossip: bool  # it attacks D-SGD's gossip (messages, not rows)
    targeted: bool  # it builds a test set of its success (a backdoor): the server measures it
    crafts_payload: bool = False  # its clients build their payloads (Codec.reach)


@dataclass(frozen=True)
class PipelinePlan:
    """Pre-aggregators -> aggregator -> meta-aggregator, as the server (and an attack that
    simulates the server) builds it."""

    preaggregators: tuple[PluginSpec, ...]
    aggregator: PluginSpec
    meta: PluginSpec | None


@dataclass(frozen=True)
class ShadowRun:
    """A run of a shadow-run membership attack (LiRA, ``runs`` > 1): the attack's index in
    ``privacy_attacks``, its ``runs``, this run's index ``run`` and its ``candidates``."""

    attack: int
    runs: int
    run: int
    candidates: int


def shadow_run(sc: Scenario) -> ShadowRun | None:
    """The scenario's shadow-run attack (at most one: checked), or None."""
    for i, spec in enumerate(sc.privacy_attacks):
        attack = registry.instantiate("privacy_attacks", spec)
        if attack.runs > 1:
            return ShadowRun(i, attack.runs, attack.run or 0, attack.candidates)
    return None


def training_seed(sc: Scenario) -> int:
    """The seed a run's draws derive from: the point's seed, or for the runs of a shadow-run
    attack one derived from it and the run's index (each run trains from its own seeds; the
    data split, the candidates and their inclusion take the point's seed, shared by the
    runs)."""
    seed = sc.seeds[0] if sc.seeds else 0
    shadow = shadow_run(sc)
    return seed if shadow is None else derive_seed(seed, "shadow_run", shadow.run) & 0xFFFFFFFF


@dataclass(frozen=True)
class Plan:
    """One run point, resolved (see the module docstring)."""

    scenario: Scenario
    seed: int
    # server rounds (the FedAvg family), gossip rounds (D-SGD) or asynchronous server
    # steps on a simulated clock (server.mode)
    protocol: str  # the RoundProtocol's name (simulator.sim.rounds)
    trainer: PluginSpec  # the trainer plugin the workers run
    trainer_key: Loc  # the scenario key that chose it (where its problems are reported)
    # the loop trainer that gives the same numbers as ``trainer``, which batches clients:
    # the engine times both before the first round and keeps the faster (runtime.vectorize)
    loop_trainer: PluginSpec | None
    client_rule: PluginSpec  # the clients' rule
    rule_from_server: bool  # it is the server optimizer's client half (mu2-SGD)
    gradient_rule: bool  # the rule sends one gradient message a round (and keeps state)
    client_state: bool  # the rule keeps per-client state between rounds
    rule_in_trainer: bool  # the rule runs inside its trainer (state, a gradient correction)
    # the named parts of a client's message (the model delta; SCAFFOLD's control-variate
    # delta; q-FedAvg's h), declared by the client rule
    message: MessageLayout
    shared_state: bool  # the rule reads the server optimizer's broadcast state each round
    personal: bool  # the rule keeps a personal model per client (Ditto), measured too
    privacy: PluginSpec | None
    privacy_level: PrivacyLevel
    local_buffers: bool  # each client keeps its own model buffers (server.buffers: local)
    # ... and its BatchNorm layers' affine weights, never aggregated (server.buffers: fedbn)
    local_norm: bool
    buffer_rule: Literal["mean", "median"]  # how the server combines the clients' buffers
    pipeline: PipelinePlan
    attack: AttackPlan | None
    b_hat: int  # the trimming parameter each round's Byzantine count is compared to
    mode: ModePlan  # server.mode, resolved
    # the message path: the scenario's codecs, in order (client-level privacy acts after
    # them on the server: ``build_codecs``)
    codecs: tuple[PluginSpec, ...] = ()
    codec_state: bool = False  # a codec keeps per-client state (error feedback)
    downlink: tuple[PluginSpec, ...] = ()  # the broadcast's codecs
    # the asynchronous modes' settings (the scenario's, or the defaults); None when sync
    asynchrony: Asynchrony | None = None
    # the plugins registered in the driver's session (fedray.register): every actor gets the
    # Plan, and unpickling it registers them in the actor's process
    plugins: registry.SessionPlugins = field(default_factory=registry.session_plugins,
                                             compare=False)

    def stateful_clients(self, has_buffers: bool) -> bool:
        """Whether clients keep state between rounds in the worker that owns them: their
        rule's, a codec's (an error-feedback residual), or (``server.buffers: local``, a
        model with buffers) their own buffers."""
        return self.client_state or self.codec_state or (self.local_buffers and has_buffers)


def privacy_level(sc: Scenario) -> PrivacyLevel:
    """Where the scenario's differential privacy acts (the privacy plugin's trait)."""
    if sc.privacy is None:
        return "none"
    level: PrivacyLevel = registry.get("privacy", sc.privacy["name"]).traits.privacy_level
    return level


def participation(sc: Scenario) -> float:
    """The fraction of the clients sampled each round (|S| / N), which a server optimizer
    may ask for in its ``traits.context`` (SCAFFOLD, FedDyn)."""
    return sc.clients.sampled / sc.clients.total


def build_server_optimizer(sc: Scenario, spec: PluginSpec | None = None) -> Any:
    """The server optimizer ``spec`` names (the scenario's by default), with the context
    the engine offers it."""
    return registry.instantiate("optimizers", spec or sc.server.optimizer,
                                participation=participation(sc))


def client_rule(sc: Scenario) -> tuple[PluginSpec, bool, Any]:
    """(the clients' rule, whether the server optimizer brings it, the rule's traits): the
    server optimizer's client half when it has one (mu2-SGD, SCAFFOLD, FedDyn; its traits
    are only known from an instance), else ``local.optimizer``."""
    half = build_server_optimizer(sc).client_rule()
    if half is not None:
        return sc.server.optimizer, True, half.traits
    return sc.local.optimizer, False, registry.get("client_optimizers",
                                                   sc.local.optimizer["name"]).traits


def build_client_rule(plan: Plan) -> Any:
    """The ClientRule a Plan names (built in each actor that runs it)."""
    if plan.rule_from_server:
        return build_server_optimizer(plan.scenario, plan.client_rule).client_rule()
    return registry.instantiate("client_optimizers", plan.client_rule)


def build_codecs(plan: Plan) -> tuple[Any, ...]:
    """The message path's codecs, client half first in order: client-level privacy (whose
    server half clips each row after the others have decoded it, and noises the aggregate;
    under secure aggregation its client half clips and adds each client's noise share),
    then the scenario's ``codecs``."""
    from strategies.codecs import ClientLevelDP

    chain = tuple(registry.instantiate("codecs", spec) for spec in plan.codecs)
    if plan.privacy is not None and plan.privacy_level == "client":
        # under secure aggregation each client noises its own row (distributed DP)
        c = plan.scenario.clients
        return (ClientLevelDP(registry.instantiate("privacy", plan.privacy),
                              any(codec.hides_rows() for codec in chain),
                              min(c.sampled, c.total)), *chain)
    return chain


def build_downlink(plan: Plan) -> tuple[Any, ...]:
    """The broadcast's codecs (``downlink``), in order."""
    return tuple(registry.instantiate("codecs", spec) for spec in plan.downlink)


def build_privacy(plan: Plan) -> Any:
    """The privacy plugin a Plan names (None without one)."""
    return registry.instantiate("privacy", plan.privacy) if plan.privacy is not None else None


def choose_trainer(sc: Scenario, rule_traits: Any, rule_key: Loc = ("local", "optimizer")
                   ) -> tuple[PluginSpec, Loc]:
    """(the trainer, the scenario key that chose it): ``local.trainer`` when given; else the
    one the privacy plugin runs with (its ``traits.trainer``; sample-level privacy's default),
    else the client rule's (its ``traits.trainer``; a gradient rule's default), else the
    default trainer, or its batched twin under ``runtime.vectorize``."""
    if sc.local.trainer is not None:
        return sc.local.trainer, ("local", "trainer")
    if sc.privacy is not None:
        traits = registry.get("privacy", sc.privacy["name"]).traits
        if traits.trainer is not None:
            return {"name": traits.trainer}, ("privacy", "name")
        if traits.privacy_level == "sample":
            return SAMPLE_PRIVACY_TRAINER, ("privacy", "name")
    if rule_traits.trainer is not None:
        return {"name": rule_traits.trainer}, rule_key
    if rule_traits.gradient_rule:
        return GRADIENT_RULE_TRAINER, rule_key
    default = DEFAULT_TRAINER
    if sc.runtime.vectorize:
        twin = registry.get("trainers", default["name"]).traits.batched
        if twin is not None:
            return {"name": twin}, ("runtime", "vectorize")
    return default, ("local", "trainer")


def buffer_rule(sc: Scenario) -> Literal["mean", "median"]:
    """How the server combines the clients' buffers: ``server.buffers`` when it says mean or
    median; ``auto``, ``local`` and ``fedbn``: median with Byzantine clients (they send poisoned
    statistics too), else mean."""
    chosen = sc.server.buffers
    if chosen == "mean" or chosen == "median":
        return chosen
    return "median" if sc.clients.byzantine > 0 else "mean"


def b_hat(sc: Scenario) -> int:
    """The aggregation's trimming parameter: ``clients.b_hat``'s value when it has one, else
    the aggregator's ``f`` (0 without one)."""
    b = sc.clients.b_hat
    if b is not None and b.value is not None:
        return int(b.value)
    return int(sc.aggregator.get("f", 0) or 0)


def _attack(sc: Scenario) -> AttackPlan | None:
    if sc.attack is None:
        return None
    t = registry.get("attacks", sc.attack["name"]).traits
    return AttackPlan(sc.attack, t.omniscient, t.data_poisoning, t.gossip, t.targeted,
                      t.crafts_payload)


def resolve(sc: Scenario) -> Plan:
    """The Plan of a validated scenario (of its first seed; a run point has one)."""
    rule, from_server, traits = client_rule(sc)
    mode = sc.server.resolved_mode
    trainer, key = choose_trainer(sc, traits, ("server", "optimizer") if from_server
                                  else ("local", "optimizer"))
    loop = registry.get("trainers", trainer["name"]).traits.loop if sc.runtime.vectorize \
        else None
    return Plan(
        scenario=sc, seed=training_seed(sc),
        protocol="gossip" if sc.topology is not None else mode.protocol,
        trainer=trainer, trainer_key=key,
        loop_trainer={"name": loop} if loop is not None else None,
        client_rule=rule, rule_from_server=from_server, gradient_rule=traits.gradient_rule,
        client_state=traits.client_state or traits.gradient_rule,
        rule_in_trainer=traits.client_state or traits.gradient_rule or traits.trainer is not None,
        message=traits.message, shared_state=traits.shared_state,
        personal=traits.personal,
        privacy=sc.privacy, privacy_level=privacy_level(sc),
        local_buffers=sc.server.buffers in ("local", "fedbn"),
        local_norm=sc.server.buffers == "fedbn", buffer_rule=buffer_rule(sc),
        pipeline=PipelinePlan(tuple(sc.preaggregators), sc.aggregator, sc.meta),
        attack=_attack(sc), b_hat=b_hat(sc), mode=mode, codecs=tuple(sc.codecs),
        codec_state=any(registry.instantiate("codecs", c).keeps_state() for c in sc.codecs),
        downlink=tuple(sc.downlink),
        asynchrony=(sc.asynchrony or Asynchrony()) if mode.clock else None,
    )
