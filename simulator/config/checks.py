"""Cross-field checks of a structurally valid scenario: counts against each other, the
aggregation pipeline's and the topology's own ``check(n)`` for the rows and peers they will
get, what the privacy plugin composes with, the data and the model (shapes, classes, memory).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from simulator import registry
from simulator.config.data_load import (
    LoadChoice,
    available_memory,
    choose_load,
    dataset_info,
    describe_dataset,
)
from simulator.config.errors import Problem, problem
from simulator.config.plan import Plan, build_codecs, build_downlink, resolve
from simulator.config.schema import MODES, Runtime, Scenario, Stragglers, default_at
from simulator.errors import DataError, brief_text
from simulator.registry import instantiate
from simulator.sim.sampling import byzantine_clients, sample_clients


def cross_field(sc: Scenario, problems: list[Problem]) -> LoadChoice | None:
    """Every cross-field check; what ``data.load: auto`` chose (None: the scenario gave
    ``load``, or a problem was found)."""
    choice = None
    c = sc.clients
    if c.per_round is not None and c.per_round > c.total:
        problems.append(Problem(("clients", "per_round"),
                                f"must be <= clients.total ({c.total}), got {c.per_round}"))
    if c.byzantine >= c.total:
        problems.append(Problem(("clients", "byzantine"),
                                f"must be < clients.total ({c.total}), got {c.byzantine}"))
    if c.byzantine_period is not None and (c.byzantine == 0 or sc.topology is not None):
        problems.append(Problem(("clients", "byzantine_period"), "switches the Byzantine "
                                "clients' identities: it needs clients.byzantine > 0 and a "
                                "server (D-SGD's Byzantine peers are fixed); remove it"))
    if c.byzantine > 0 and sc.attack is None:
        usable = [a for a in registry.available("attacks")  # gossip attacks only with D-SGD
                  if registry.get("attacks", a).traits.gossip == bool(sc.topology)]
        problems.append(Problem(("attack",), f"required when clients.byzantine > 0 (got "
                                f"{c.byzantine}); available: {', '.join(usable)}"))
    if sc.local.epochs is not None and sc.local.steps is not None:
        problems.append(Problem(("local", "steps"), "give local.epochs or local.steps, not both"))
    _check_runtime(sc.runtime, problems)
    _check_stragglers(c.stragglers, problems)
    if len(set(sc.seeds)) != len(sc.seeds) or not sc.seeds:
        problems.append(Problem(("seeds",), f"must be a non-empty list of distinct integers, got {sc.seeds}"))
    try:
        _check_dsgd(sc, problems)
        _check_async(sc, problems)
        plan = resolve(sc)  # what the run will do, resolved once for every check below
        _check_clients_rule(sc, plan, problems)
        if not _check_plugins(sc, problems):
            return None
        choice = _check_load(sc, problems)
        _check_data_and_model(sc, plan, problems)
    except registry.UnknownPlugin:  # already reported by the plugin pass
        pass
    return choice


def _check_runtime(rt: Runtime, problems: list[Problem]) -> None:
    """A GPU share for cuda workers; ``deterministic: strict`` pins x86 CPU kernels in fp32
    (simulator.runtime.kernels): a GPU's kernels or bf16's oneDNN paths have no such pin."""
    if rt.device == "cuda" and rt.num_gpus == 0:
        problems.append(Problem(("runtime", "num_gpus"), "device: cuda needs a GPU share per "
                                "worker (> 0, fractional packs workers on a GPU), got 0"))
    if not rt.strict:
        return
    for key in ("device", "server_device"):
        if getattr(rt, key) != "cpu":
            problems.append(Problem(("runtime", key), "deterministic: strict pins the CPU's "
                                    f"kernels: it needs {key}: cpu, got {getattr(rt, key)}"))
    if rt.precision != "fp32":
        problems.append(Problem(("runtime", "precision"), "deterministic: strict pins fp32 "
                                f"kernels: it needs precision: fp32, got {rt.precision}"))


def _check_stragglers(s: Stragglers | None, problems: list[Problem]) -> None:
    """``clients.stragglers``: no key that only another ``kind`` reads (the likelier
    mistake, said alone: the kind was left out), else the key its kind requires."""
    if s is None:
        return
    loc = ("clients", "stragglers")
    foreign = [Problem((*loc, key), f"used by kind {other} only; remove it, or set "
                       f"clients.stragglers.kind: {other}")
               for other, keys in Stragglers.KEYS.items() if other != s.kind
               for key in keys if key in s.model_fields_set]
    problems += foreign
    required = Stragglers.REQUIRED[s.kind]
    if not foreign and getattr(s, required) is None:
        problems.append(Problem((*loc, required), f"required with kind {s.kind}: "
                                f"{Stragglers.REQUIRED_WHAT[s.kind]}"))


def _check_clients_rule(sc: Scenario, plan: Plan, problems: list[Problem]) -> None:
    """The clients' rule, the trainer and the privacy plugin against each other (as the
    run's Plan resolves them)."""
    level = plan.privacy_level
    averaging = registry.get("aggregators", sc.aggregator["name"]).traits.averaging
    # under secure aggregation over groups each group's sum is noised by its clients: the
    # robust rule over the group means is post-processing of a DP release
    grouped = any(c.hides_rows() for c in build_codecs(plan)) and any(
        c.get("group_size") is not None for c in sc.codecs)
    if level == "client" and not grouped and (not averaging or sc.preaggregators or sc.meta):
        problems.append(Problem(("privacy", "name"), "client-level DP adds noise calibrated to the "
                                "mean's sensitivity: it needs aggregator mean and no pre- or "
                                f"meta-aggregator (got {sc.aggregator['name']}); dp_sgd (sample "
                                "level) composes with robust aggregation"))
    if level == "sample" and plan.gradient_rule:
        problems.append(Problem(("privacy", "name"), "DP-SGD runs the clients' local SGD; "
                                "local.optimizer and server.optimizer must not bring another "
                                "client rule"))
    if level == "client" and sc.topology is not None:
        problems.append(Problem(("privacy", "name"), "client-level DP needs a server; use "
                                "dp_sgd with D-SGD"))
    if plan.rule_from_server and sc.local.optimizer["name"] != default_at(("local", "optimizer"))["name"]:
        problems.append(Problem(("local", "optimizer"), f"server.optimizer "
                                f"{sc.server.optimizer['name']!r} brings its own client half; "
                                f"remove local.optimizer, got {sc.local.optimizer['name']!r}"))
    elif plan.gradient_rule:
        for key, value in (("steps", sc.local.steps), ("epochs", sc.local.epochs)):
            if value not in (None, 1):
                problems.append(Problem(("local", key), f"{plan.client_rule['name']} takes one "
                                        f"minibatch gradient per round; remove local.{key}, "
                                        f"got {value}"))
    _check_trainer(sc, plan, problems)
    _check_reference(sc, plan, problems)
    _check_message(sc, plan, problems)
    if sc.audit is not None:
        _check_audit(sc, plan, problems)
    if sc.privacy_attacks:
        _check_privacy_attacks(sc, plan, problems)


def _check_message(sc: Scenario, plan: Plan, problems: list[Problem]) -> None:
    """The message path: client-level DP covers the row parts of a message, so a rule that
    sends parts beside them (averaged without clipping) is refused with it; D-SGD's gossip
    has no codec chain."""
    beside = [p.name for p in plan.message.parts if p.role != "row"]
    if plan.privacy_level == "client" and beside:
        problems.append(Problem(("privacy", "name"), f"client-level DP clips and noises the "
                                f"robust row of a message; {plan.client_rule['name']!r} also "
                                f"sends {beside} beside it, which it would leave unprotected; "
                                "use dp_sgd (sample level) or another client rule"))
    if sc.codecs and sc.topology is not None:
        problems.append(Problem(("codecs",), "D-SGD's gossip carries models, not messages "
                                "through a codec chain; remove codecs or the topology"))
    chain = build_codecs(plan)
    ours = chain[len(chain) - len(sc.codecs):]  # client-level DP comes first, dense
    hiding = [i for i, c in enumerate(ours) if c.hides_rows()]
    if hiding:
        _check_hidden_rows(sc, plan, hiding[0], problems)
    else:
        _check_composes("codecs", sc.codecs, ours, problems)
    if sc.downlink:
        _check_downlink(sc, plan, problems)


def _check_audit(sc: Scenario, plan: Plan, problems: list[Problem]) -> None:
    """An audit's canaries are clients of a synchronous server that send one model delta,
    fewer than the population; what they cannot be yet is refused in one line."""
    audit = sc.audit
    assert audit is not None
    mode = sc.server.resolved_mode
    if sc.topology is not None:
        problems.append(Problem(("audit",), "canaries are clients of a server; D-SGD has "
                                "none: remove audit or the topology"))
    elif not mode.in_rounds:
        problems.append(Problem(("server", "mode"), f"an audit's canaries join a round's "
                                f"cohort; {mode.name} steps on arrivals: use sync or "
                                "deadline, or remove audit"))
    if plan.privacy_level == "sample":
        if not registry.get("trainers", plan.trainer["name"]).traits.canaries:
            problems.append(Problem(("audit",), f"under sample-level DP canaries are "
                                    f"examples the trainer adds; {plan.trainer['name']} does "
                                    "not (traits.canaries): use dp_sgd"))
        if audit.norm is not None:
            problems.append(Problem(("audit", "norm"), "canary examples' gradients have "
                                    "DP-SGD's clip as their norm; remove audit.norm"))
    if sc.codecs:
        problems.append(Problem(("audit",), f"canaries send their rows as they are; the "
                                f"codecs {[c['name'] for c in sc.codecs]} would change "
                                "them (not built yet): remove codecs or audit"))
    if plan.message.multipart:
        problems.append(Problem(("audit",), f"canaries send a model delta only; "
                                f"{plan.client_rule['name']!r} sends parts beside it: use "
                                "another client rule"))
    if audit.canaries > sc.clients.total and plan.privacy_level != "sample":
        problems.append(Problem(("audit", "canaries"), f"at most clients.total "
                                f"({sc.clients.total}): canaries beyond the population would "
                                f"outweigh its clients (got {audit.canaries})"))
    if audit.every is not None and audit.every > sc.rounds:
        problems.append(Problem(("audit", "every"), f"at most rounds ({sc.rounds}), or null "
                                f"for the end only (got {audit.every})"))


def _check_privacy_attacks(sc: Scenario, plan: Plan, problems: list[Problem]) -> None:
    """Privacy attacks: each name once (its metrics are named after it); a
    reconstruction inverts a classifier's cross-entropy on value inputs, in a round of a
    synchronous server that trains its client."""
    names = [a["name"] for a in sc.privacy_attacks]
    mode = sc.server.resolved_mode
    for i, spec in enumerate(sc.privacy_attacks):
        loc: tuple = ("privacy_attacks", i)
        if names.index(spec["name"]) != i:
            problems.append(Problem(loc, f"{spec['name']} is listed twice; its metrics are "
                                    "named after it: one of each"))
            continue
        attack = registry.instantiate("privacy_attacks", spec)
        if attack.runs > 1:
            _check_shadow_runs(sc, attack, loc, problems)
        if not attack.traits.reconstructs:
            continue
        if sc.topology is not None or not mode.in_rounds:
            problems.append(Problem(loc, f"{spec['name']} inverts a client's message to a "
                                    "server in a round: use server.mode sync or deadline"))
            return
        if registry.get("tasks", sc.task["name"]).traits.targets != "classes" or \
                registry.get("models", sc.model["name"]).traits.tokens:
            problems.append(Problem(loc, f"{spec['name']} inverts a classifier's "
                                    f"cross-entropy on value inputs; task {sc.task['name']} "
                                    f"with model {sc.model['name']} has none to invert"))
        if attack.round > sc.rounds:
            problems.append(Problem((*loc, "round"), f"at most rounds ({sc.rounds}): the "
                                    f"attacked round must be trained (got {attack.round})"))
        elif attack.client is not None:
            _check_attacked_client(sc, plan, attack, loc, problems)
        if attack.target == "update" and any(x.hides_rows() for x in build_codecs(plan)):
            problems.append(Problem((*loc, "target"), "secure aggregation hides a client's "
                                    "row from the server: target release (the round's "
                                    "aggregate)"))


def _check_shadow_runs(sc: Scenario, attack: Any, loc: tuple, problems: list[Problem]) -> None:
    """A shadow-run membership attack (LiRA): one a scenario, its run among its runs, its
    candidates removable from a table of the clients' samples, a classifier to score."""
    shadows = [i for i, s in enumerate(sc.privacy_attacks)
               if registry.instantiate("privacy_attacks", s).runs > 1]
    if shadows[0] != loc[1]:
        problems.append(Problem(loc, "one attack with shadow runs a scenario (each adds its "
                                "runs to the sweep)"))
        return
    if attack.run is None:
        problems.append(Problem((*loc, "run"), f"the scenario's sweep sets privacy_attacks: "
                                f"give each point its run, 0..{attack.runs - 1}"))
    elif attack.run >= attack.runs:
        problems.append(Problem((*loc, "run"), f"at most runs - 1 ({attack.runs - 1}), got "
                                f"{attack.run}"))
    if sc.data.load == "cohort":
        problems.append(Problem(("data", "load"), "a shadow-run attack removes samples from "
                                "the clients' table: use all (or auto)"))
    if registry.get("tasks", sc.task["name"]).traits.targets != "classes":
        problems.append(Problem(loc, f"{sc.privacy_attacks[loc[1]]['name']} scores a "
                                f"classifier's confidence in each label; task "
                                f"{sc.task['name']} has no classes"))
    info = dataset_info(sc)  # None: it cannot say before loading, or its problem is reported
    if info is not None and attack.candidates > info.train_samples - sc.clients.total:
        problems.append(Problem((*loc, "candidates"), f"at most "
                                f"{max(info.train_samples - sc.clients.total, 0):,} (the "
                                f"{info.train_samples:,} training samples but each client's "
                                f"first, which it keeps), got {attack.candidates:,}"))


def _check_attacked_client(sc: Scenario, plan: Plan, attack: Any, loc: tuple,
                           problems: list[Problem]) -> None:
    """The attacked client exists, is honest and is sampled in the attacked round."""
    c = sc.clients
    if attack.client >= c.total:
        problems.append(Problem((*loc, "client"), f"at most clients.total - 1 "
                                f"({c.total - 1}), got {attack.client}"))
        return
    if attack.client in set(byzantine_clients(plan.seed, c.total, c.byzantine).tolist()):
        problems.append(Problem((*loc, "client"), f"client {attack.client} is Byzantine "
                                f"with seed {plan.seed}: attack an honest client"))
        return
    sampled = sample_clients(plan.seed, attack.round - 1, c.total, c.sampled).tolist()
    if attack.client not in sampled:
        problems.append(Problem((*loc, "client"), f"client {attack.client} is not sampled in "
                                f"round {attack.round} with seed {plan.seed} (sampled: "
                                f"{brief_text(str(sorted(sampled)), 80)}): pick one of them, "
                                "or null for the round's first"))


def _check_composes(key: str, specs: list, chain: Any, problems: list[Problem]) -> None:
    """A compressor takes the dense rows: one a chain, before any codec of another payload."""
    for i, codec in enumerate(chain):
        sparse = [specs[j]["name"] for j, c in enumerate(chain[:i]) if not c.dense()]
        if codec.needs_rows() and sparse:
            problems.append(Problem((key, i), f"{specs[i]['name']} compresses the dense rows, "
                                    f"which {sparse[-1]} before it no longer sends: one "
                                    "compressor a chain, first (a precision codec such as "
                                    "float16 may follow it)"))


def _check_downlink(sc: Scenario, plan: Plan, problems: list[Problem]) -> None:
    """The broadcast's codecs: a round's model change from one server to every client."""
    chain = build_downlink(plan)
    mode = sc.server.resolved_mode
    if sc.topology is not None:
        problems.append(Problem(("downlink",), "D-SGD has no server broadcast; remove "
                                "downlink or the topology"))
    elif not mode.in_rounds:
        problems.append(Problem(("server", "mode"), f"downlink compresses the round's "
                                f"broadcast; {mode.name} serves each client the version it "
                                "starts from: use sync or deadline, or remove downlink"))
    for i, (spec, codec) in enumerate(zip(sc.downlink, chain, strict=True)):
        if codec.hides_rows():
            problems.append(Problem(("downlink", i), f"{spec['name']} aggregates clients' "
                                    "messages; the broadcast is one model"))
        elif spec.get("error_feedback"):
            problems.append(Problem(("downlink", i, "error_feedback"), "the server's replica of "
                                    "the clients' model already feeds back what compression "
                                    "drops; remove it"))
    _check_composes("downlink", sc.downlink, chain, problems)


def _check_hidden_rows(sc: Scenario, plan: Plan, at: int, problems: list[Problem]) -> None:
    """Secure aggregation: its server sees group sums, so what needs a client's row (a
    server that clips it, a part averaged beside it, a rule over single rows without
    groups, an asynchronous step) is refused in one line."""
    name = sc.codecs[at]["name"]
    loc = ("codecs", at)
    if len(sc.codecs) > 1:
        others = [c["name"] for i, c in enumerate(sc.codecs) if i != at]
        problems.append(Problem(loc, f"{name} masks each client's dense fixed-point row and "
                                f"takes no other codec ({others}): a mask makes a sparse or "
                                "rounded payload dense again"))
    if plan.message.multipart:
        problems.append(Problem(loc, f"{plan.client_rule['name']!r} sends parts beside its "
                                f"row that the server averages one by one; {name} shows it "
                                "only sums: use another client rule"))
    mode = sc.server.resolved_mode
    if not mode.in_rounds:
        problems.append(Problem(("server", "mode"), f"{name} sums a round's cohort; "
                                f"{mode.name} steps on arrivals it keeps one by one: use "
                                "sync or deadline"))
    if sc.codecs[at].get("group_size") is None:
        agg = sc.aggregator["name"]
        if sc.preaggregators or sc.meta is not None or \
                not registry.get("aggregators", agg).traits.averaging:
            rules = [p["name"] for p in sc.preaggregators] + \
                ([sc.meta["name"]] if sc.meta is not None else []) + [agg]
            problems.append(Problem(loc, f"without group_size the server sees one sum of "
                                    f"the round, so {' + '.join(rules)} has no rows to "
                                    "work on: set group_size (the robust rules then run "
                                    "over the group means) or use aggregator mean"))


def _check_codec_layout(sc: Scenario, plan: Plan, net: Any, d: int,
                        problems: list[Problem]) -> None:
    """Each codec's payload for the model's messages and for the broadcast (a ``k`` beyond
    a message's entries, a rank beyond a layer's): its ValueError at its key."""
    from strategies.codecs import chain_layout, message_shape  # torch: only with a model

    shape = message_shape(net, plan.message.width(d))
    chain = build_codecs(plan)
    scenario_at = len(chain) - len(sc.codecs)
    for key, codecs, at, message in (
            ("codecs", chain[scenario_at:], chain_layout(chain[:scenario_at], shape), shape),
            ("downlink", build_downlink(plan), None, message_shape(net, d))):
        layout = at if at is not None else chain_layout((), message)
        for i, codec in enumerate(codecs):
            try:
                layout = codec.layout(layout, message)
            except ValueError as e:
                problems.append(problem((key, i), e))
                break


def _check_reference(sc: Scenario, plan: Plan, problems: list[Problem]) -> None:
    """An aggregator that takes the server's own update (FLTrust) compares it with rows of
    one model's size, and only the server can train it: refused with a two-block message
    (SCAFFOLD) and with an attack that simulates the pipeline without the server."""
    name = sc.aggregator["name"]
    if not registry.get("aggregators", name).traits.reference:
        return
    if plan.message.multipart:
        parts = [p.name for p in plan.message.parts]
        problems.append(Problem(("aggregator", "name"), f"{name!r} compares each row with the "
                                f"server's model update, and {plan.client_rule['name']!r} "
                                f"sends the parts {parts}; use another aggregator or client "
                                "rule"))
    if sc.attack is not None and "aggregate" in registry.get(
            "attacks", sc.attack["name"]).traits.context:
        problems.append(Problem(("attack", "name"), f"{sc.attack['name']!r} simulates the "
                                f"aggregation, and {name!r} needs the server's own update, "
                                "which the adversary does not have; use another attack"))


def _check_trainer(sc: Scenario, plan: Plan, problems: list[Problem]) -> None:
    """The trainer must take what the scenario hands it: the task, the privacy plugin, the
    client rule."""
    trainer, level = plan.trainer, plan.privacy_level
    context = registry.get("trainers", trainer["name"]).traits.context
    # a trainer that takes no task trains the default task's loss (a classifier's)
    if sc.task["name"] != default_at(("task",))["name"] and "task" not in context:
        problems.append(Problem(("local", "trainer"), f"{trainer['name']!r} does not take "
                                f"'task' and trains classifiers only; task {sc.task['name']} "
                                "needs a trainer that takes it (sgd)"))
    for needed, present in (("privacy", level == "sample"), ("rule", plan.rule_in_trainer)):
        what = "sample-level privacy (dp_sgd)" if needed == "privacy" else \
            f"client rule {plan.client_rule['name']!r} (it runs inside its trainer)"
        if present != (needed in context):
            fix = "remove local.trainer or pick one that fits" \
                if plan.trainer_key == ("local", "trainer") else \
                f"the trainer comes from {'.'.join(map(str, plan.trainer_key))}; the two " \
                "cannot be combined"
            problems.append(Problem(plan.trainer_key, f"{trainer['name']!r} " + (
                f"does not take {needed!r}, which {what} needs" if present else
                f"needs {what}, which the scenario does not have") + f"; {fix}"))


def _check(plugin: Any, n: int, loc: tuple[Any, ...], problems: list[Problem],
           note: str = "") -> bool:
    """``plugin.check(n)``, its ValueError as a problem at ``loc`` (+ the key it names)."""
    try:
        plugin.check(n)
    except ValueError as e:
        problems.append(problem(loc, e, note))
        return False
    return True


def _check_plugins(sc: Scenario, problems: list[Problem]) -> bool:
    """Every plugin's ``check(n)`` for what it will be given: the pipeline's rules the rows
    of a full round, the attack its Byzantine rows, data plugins the clients. False when the
    dataset refused (nothing further can be checked)."""
    from simulator.sim.clock import rows_per_step

    c = sc.clients
    # the rows of a full round, or of an asynchronous step
    n = rows_per_step(sc) if sc.server.resolved_mode.clock else min(c.sampled, c.total)
    for i, spec in enumerate(sc.codecs):
        codec = instantiate("codecs", spec)
        _check(codec, n, ("codecs", i), problems)
        n = codec.output_rows(n)  # secure aggregation: the groups' means
    for i, spec in enumerate(sc.preaggregators):
        pre = instantiate("preaggregators", spec)
        _check(pre, n, ("preaggregators", i), problems)
        n = pre.output_rows(n)
    meta = instantiate("meta", sc.meta) if sc.meta is not None else None
    inner = n
    if meta is not None:
        _check(meta, n, ("meta",), problems)
        inner = meta.output_rows(n)  # bucketing hands the aggregator one row per bucket
    agg = instantiate("aggregators", sc.aggregator)
    _check(agg, inner, ("aggregator",), problems,
           f" (meta {sc.meta['name']} gives it {inner} rows)" if sc.meta and inner != n else "")
    if sc.attack is not None and not registry.get("attacks", sc.attack["name"]).traits.context:
        _check(instantiate("attacks", sc.attack), c.byzantine, ("attack",), problems)
    if sc.privacy is not None:
        _check(instantiate("privacy", sc.privacy), c.total, ("privacy",), problems)
    _check(instantiate("partitioners", sc.data.partitioner), c.total, ("data", "partitioner"),
           problems)
    return _check(instantiate("datasets", sc.data.dataset), c.total, ("data", "dataset"),
                  problems)


def _check_load(sc: Scenario, problems: list[Problem]) -> LoadChoice | None:
    """``data.load`` against the data and this machine's memory (``data_load.choose_load``):
    what ``auto`` chose, or None (given, or refused)."""
    load = choose_load(sc)
    if isinstance(load, Problem):
        problems.append(load)
    return load if isinstance(load, LoadChoice) else None


def _check_data_and_model(sc: Scenario, plan: Plan, problems: list[Problem]) -> None:
    """What the data and the model say before anything runs: enough training samples for
    the clients and for the partitioner's split (``check_data``: classes per client, samples
    per client), labels and features a model can learn from, a model that takes the data's
    samples and gives one score per class, and that fits in this machine's memory."""
    c = sc.clients
    try:
        seed = sc.seeds[0] if sc.seeds else 0  # no seeds: reported by cross_field
        info = describe_dataset(json.dumps(sc.data.dataset, sort_keys=True), c.total, seed,
                                sc.data.test_fraction)
    except (DataError, ValueError) as e:
        problems.append(problem(("data", "dataset"), e))
        return
    if info is None:
        return  # a dataset that cannot say before loading: checked when it loads
    split = info.train_samples >= c.total  # each client can have a sample
    if not split:
        problems.append(Problem(("clients", "total"), f"more clients ({c.total}) than training "
                                f"samples ({info.train_samples}); each client needs one at least"))
    task = registry.get("tasks", sc.task["name"])
    if task.traits.targets != info.targets:
        problems.append(Problem(("task", "name"), f"{sc.task['name']} learns " + (
            "class labels; the data's targets are real values: use task regression"
            if task.traits.targets == "classes" else
            "real values; the data's targets are class labels: use task classification")))
        return
    partitioner = sc.data.partitioner["name"]
    if info.targets == "values" and registry.get("partitioners", partitioner).traits.by_label:
        problems.append(Problem(("data", "partitioner"), f"{partitioner} splits by class "
                                "label; the data's targets are real values: use iid, "
                                "shards, sizes or natural"))
        split = False
    elif info.targets == "classes" and info.num_classes < 2:
        problems.append(Problem(("data", "dataset"), f"the labels name {info.num_classes} class; "
                                "a classifier needs 2 at least"))
        return
    if split:
        try:
            instantiate("partitioners", sc.data.partitioner).check_data(c.total, info)
        except ValueError as e:
            problems.append(problem(("data", "partitioner"), e))
    _check_root_set(sc, info, problems)
    if _check_attack_data(sc, info, problems) and plan.attack is not None \
            and plan.attack.targeted:
        _check_targeted(sc, info, problems)
    _check_model(sc, plan, info, problems)


def _check_attack_data(sc: Scenario, info: Any, problems: list[Problem]) -> bool:
    """The attack against the data it poisons or measures: its ``check_data(info)`` (a
    trigger that does not fit the images, an image attack on features or tokens, a class
    key beyond the classes). False when it refused."""
    if sc.attack is None or registry.get("attacks", sc.attack["name"]).traits.context:
        return True  # an attack built with the engine's context is checked when it is built
    try:
        instantiate("attacks", sc.attack).check_data(info)
    except ValueError as e:
        problems.append(problem(("attack",), e))
        return False
    return True


def _check_root_set(sc: Scenario, info: Any, problems: list[Problem]) -> None:
    """An aggregator that takes the server's own update (``traits.reference``: FLTrust)
    trains it on ``server.root_samples`` samples drawn from the training data: no more
    than the data holds."""
    name = sc.aggregator["name"]
    if registry.get("aggregators", name).traits.reference and \
            sc.server.root_samples > info.train_samples:
        problems.append(Problem(("server", "root_samples"), f"{name!r} draws its root set "
                                f"from the {info.train_samples:,} training samples the data "
                                f"holds; at most {info.train_samples:,}, got "
                                f"{sc.server.root_samples:,}"))


def _check_targeted(sc: Scenario, info: Any, problems: list[Problem]) -> None:
    """A targeted attack (a backdoor) poisons samples of a classifier and measures a class:
    it needs images or features and class labels, and its class keys below the data's
    number of classes (its ``poison`` raises ValueError naming the key)."""
    import torch

    assert sc.attack is not None
    name = sc.attack["name"]
    if info.tokens or info.targets != "classes":
        problems.append(Problem(("attack", "name"), f"{name!r} is a targeted attack on a "
                                "classifier of images or features; the data gives " +
                                ("token ids" if info.tokens else "real-valued targets")))
        return
    x = torch.zeros((2, *info.input_shape))
    try:
        instantiate("attacks", sc.attack).poison(x, torch.zeros(2, dtype=torch.int64), 0, 0,
                                                 info.num_classes, torch.Generator())
    except ValueError as e:
        problems.append(problem(("attack",), e))


def check_local_workers(n: int | None, num_cpus: float, where: str,
                        cpus: float | None = None) -> None:
    """On a local Ray instance (its CPUs are this machine's, known before it starts): ``n``
    ClientWorkers of ``num_cpus`` CPUs each that could never all be placed are refused in one
    line (UsageError), before Ray starts; ``where`` names the option or field that asked,
    ``cpus`` the CPUs the instance will be given (default: this machine's)."""
    from simulator.errors import UsageError

    have = cpus or os.cpu_count() or 1  # Ray's local instance gets at most this many CPUs
    if n is None or n * num_cpus <= have:
        return
    fit = int(have // num_cpus)
    fewer = f"{where} {fit} or fewer, " if fit >= 1 else ""
    raise UsageError(f"{where}: {n} ClientWorkers need {n * num_cpus:g} CPUs ({num_cpus:g} "
                     f"each, runtime.num_cpus), and this machine has {have:g}; use {fewer}a "
                     "smaller runtime.num_cpus, or --address a cluster")


CPU_CHECK_BYTES = 1 << 30  # a model larger than this is shape-checked on torch's meta device


class _TooLarge(Exception):
    """Raised by the allocation guard of the model check (and caught there only)."""


def _model_forward(spec: dict, info: Any) -> tuple[Any, Any]:
    """The model and its output for a batch of 2, built as the run builds it, on the CPU,
    while its tensors stay under CPU_CHECK_BYTES; a larger model is built again on torch's
    meta device (shapes only, no memory). The meta device is not the first choice: its first
    use costs 1.4 s of imports (its decompositions pull in sympy and dynamo), more than
    building and running any shipped model on the CPU (0.2-0.3 s, ResNet-18 included)."""
    import math

    import torch
    from torch.overrides import TorchFunctionMode

    from simulator.models import build_model

    class Guard(TorchFunctionMode):
        """Refuses a factory call (torch.empty, zeros, ...) past the byte budget, before
        it allocates."""

        total = 0

        # the public factories that take a size first (what a module's constructor
        # allocates its parameters and buffers with)
        factories = (torch.empty, torch.zeros, torch.ones, torch.full, torch.rand,
                     torch.randn, torch.empty_strided)

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in self.factories and args:
                size = args[0] if isinstance(args[0], (tuple, list, torch.Size)) else args
                if all(isinstance(n, int) for n in size):
                    self.total += 4 * math.prod(size)
                    if self.total > CPU_CHECK_BYTES:
                        raise _TooLarge
            return func(*args, **(kwargs or {}))

    def forward() -> tuple[Any, Any]:
        model = build_model(spec, info.input_shape, info.num_classes, 0, info.vocabulary)
        dtype = torch.int64 if info.tokens else torch.float32
        with torch.no_grad():
            return model, model(torch.zeros((2, *info.input_shape), dtype=dtype))

    try:
        with Guard():
            return forward()
    except _TooLarge:
        with torch.device("meta"):
            return forward()


@functools.lru_cache(maxsize=4)
def _forward_once(model: str, info: Any) -> tuple[Any, Any, bool, int]:
    """``_model_forward`` of the model block ``model`` (JSON) on the data ``info``
    describes, with whether the model has buffers and its parameter count: once for every
    sweep point that shares them (which only read them)."""
    from simulator.runtime.common import model_buffers

    net, out = _model_forward(json.loads(model), info)
    return net, out, bool(model_buffers(net)), sum(p.numel() for p in net.parameters())


def _check_model(sc: Scenario, plan: Plan, info: Any, problems: list[Problem]) -> None:
    name = sc.model["name"]

    if registry.get("models", name).traits.tokens != info.tokens:
        problems.append(Problem(("model",), f"{name} takes " + (
            "token ids; the data gives values (images or features)" if not info.tokens else
            "values; the data gives token ids (text): use a model with an embedding, such as "
            "char_lstm")))
        return

    try:
        _, out, buffered, d = _forward_once(json.dumps(sc.model, sort_keys=True), info)
    except Exception as e:  # noqa: BLE001 - the model plugin's own error, in one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].removeprefix("model: ")
        problems.append(Problem(("model",), f"{name} does not take the data's samples of shape "
                                f"{tuple(info.input_shape)}: {brief_text(first, 200)}"))
        return
    want = instantiate("tasks", sc.task).output_shape(2, tuple(info.input_shape),
                                                      info.num_classes)
    if tuple(out.shape) != tuple(want):
        problems.append(Problem(("model",), f"{name} gives outputs of shape {tuple(out.shape)} "
                                f"for a batch of 2; task {sc.task['name']} needs {tuple(want)}"
                                + ("" if len(want) == 2 else
                                   " (a score per position: char_lstm's positions: all)")))
        return
    if buffered and any(registry.get("privacy_attacks", a["name"]).traits.reconstructs
                        for a in sc.privacy_attacks):
        problems.append(Problem(("privacy_attacks",), f"{name} has buffers (BatchNorm), "
                                "whose training-mode statistics a reconstruction does not "
                                "simulate: use a model without norm: batch"))
    if buffered:
        _check_buffers(sc, plan, problems)
    elif plan.local_norm:
        problems.append(Problem(("server", "buffers"), f"fedbn keeps BatchNorm layers local; "
                                f"{name} has none: use a model with norm: batch, or another "
                                "value (auto | mean | median | local)"))
    _check_work(sc, plan, info, d, problems)
    if sc.codecs or sc.downlink:
        _check_codec_layout(sc, plan, _forward_once(json.dumps(sc.model, sort_keys=True),
                                                    info)[0], d, problems)
    workers = sc.runtime.workers or os.cpu_count() or 1
    # per worker: parameters, gradients, an optimizer buffer and the update; the server: the
    # model, the round's (n, d) update matrix and the optimizer's state; per-client state
    per_client = 4 if sc.runtime.state_dtype == "float32" else 2
    stateful = plan.client_state or plan.codec_state
    need = 4 * d * (4 * workers + 3 + min(sc.clients.sampled, sc.clients.total)) + \
        (per_client * d * sc.clients.total if stateful else 0) + \
        (4 * d * sc.clients.total if sc.topology is not None else 0)  # D-SGD peers' models
    have = available_memory()
    if have is not None and need > have:
        problems.append(Problem(("model",), f"{name} has {d:,} parameters: this run needs about "
                                f"{need / 2**30:.1f} GiB ({workers} workers, "
                                f"{sc.clients.sampled} updates a round"
                                + (f", state for {sc.clients.total} clients" if stateful else "")
                                + f"), more than the {have / 2**30:.1f} GiB available here"))


# The most work a scenario may ask for, in model-parameter x training-example products (a
# forward and backward pass cost about 6 floating-point operations each): 1e18 is about
# 6e18 operations, weeks of a CPU and hours of a large GPU, and 10,000 times the largest
# published study the shipped scenarios follow
MAX_WORK = 10**18


def _check_work(sc: Scenario, plan: Plan, info: Any, d: int, problems: list[Problem]
                ) -> None:
    """The scenario's total work estimated before anything runs: rounds x clients a round x
    training examples each client processes a round x model parameters (plus, under D-SGD,
    rounds x gossip steps x peers x peers x parameters, the dense mixing); refused past
    MAX_WORK with the fields that make it."""
    c, local = sc.clients, sc.local
    sampled = c.total if sc.topology is not None else min(c.sampled, c.total)
    if plan.gradient_rule:
        examples, how = local.batch_size, f"local.batch_size {local.batch_size:,}"
    elif local.steps is not None:
        examples = local.steps * local.batch_size
        how = f"local.steps {local.steps:,} x local.batch_size {local.batch_size:,}"
    else:
        epochs = local.epochs or 1
        examples = epochs * -(-info.train_samples // c.total)
        how = f"local.epochs {epochs} x {-(-info.train_samples // c.total):,} examples"
    work = sc.rounds * sampled * examples * d
    parts = [(f"rounds {sc.rounds:,} x {sampled:,} clients a round x ({how}) x {d:,} "
             "model parameters")]
    if sc.topology is not None:
        work += sc.rounds * sc.dsgd.gossip_steps * c.total * c.total * d
        parts.append(f"rounds x dsgd.gossip_steps {sc.dsgd.gossip_steps:,} x "
                     f"{c.total:,}^2 peers x parameters")
    if work > MAX_WORK:
        problems.append(Problem((), f"the total work is about {work:.1e} parameter x example "
                                f"products ({' + '.join(parts)}); at most {MAX_WORK:.0e} "
                                "(hours of a large GPU): lower rounds, clients.per_round, "
                                "the local work or the model"))


def _check_buffers(sc: Scenario, plan: Plan, problems: list[Problem]) -> None:
    """A model with buffers (BatchNorm statistics) where they cannot be handled: refused."""
    name, fix = sc.model["name"], "; use norm: group (GroupNorm has no statistics)"
    if sc.topology is not None:
        problems.append(Problem(("model",), f"{name} has buffers (BatchNorm running "
                                f"statistics) and D-SGD gossips parameters only{fix}"))
    elif plan.privacy_level == "client":
        problems.append(Problem(("privacy", "name"), f"{sc.privacy and sc.privacy['name']} "
                                f"clips and noises parameters only; {name}'s BatchNorm "
                                f"statistics would leave the clients unprotected{fix}"))
    trainer = plan.trainer["name"]
    if not registry.get("trainers", trainer).traits.buffers:
        where = plan.trainer_key if plan.trainer_key == ("runtime", "vectorize") \
            else ("local", "trainer")
        problems.append(Problem(where, f"trainer {trainer!r} cannot update {name}'s buffers "
                                f"(BatchNorm statistics; per-sample or vmapped steps){fix}, or "
                                "the sgd trainer"))


def _check_dsgd(sc: Scenario, problems: list[Problem]) -> None:
    """D-SGD (a ``topology``) versus server-based runs: what each one accepts."""
    attack = sc.attack["name"] if sc.attack is not None else None
    gossip_attack = attack is not None and registry.get("attacks", attack).traits.gossip
    if sc.topology is None:
        if gossip_attack:
            problems.append(Problem(("attack", "name"), f"{attack!r} attacks gossip: "
                                    "it needs a topology (D-SGD)"))
        return
    c = sc.clients
    if c.per_round is not None and c.per_round != c.total:
        problems.append(Problem(("clients", "per_round"), "every D-SGD peer takes part in every "
                                f"round; remove it or set {c.total}, got {c.per_round}"))
    if attack is not None and not gossip_attack:
        names = [n for n in registry.available("attacks") if registry.get("attacks", n).traits.gossip]
        problems.append(Problem(("attack", "name"), f"D-SGD needs an attack on gossip; "
                                f"available: {', '.join(names)}; got {attack!r}"))
    problems += [Problem(loc, "not used by D-SGD (a topology is set); remove it")
                 for loc, value in [(("preaggregators",), sc.preaggregators), (("meta",), sc.meta),
                                    (("clients", "b_hat"), c.b_hat),
                                    (("clients", "dropout"), c.dropout),
                                    (("clients", "stragglers"), c.stragglers)] if value]
    if any(getattr(getattr(sc, a), b)["name"] != default_at((a, b))["name"]
           for a, b in (("server", "optimizer"), ("local", "optimizer"))):
        problems.append(Problem(("server", "optimizer"), "D-SGD peers run local SGD; "
                                "server.optimizer and local.optimizer must be sgd"))
    if sc.dsgd.defense not in registry.available("gossip_defenses"):
        problems.append(Problem(("dsgd", "defense"),
                                registry.unknown_message("gossip_defenses", sc.dsgd.defense)))
        return
    for seed in sc.seeds:  # random graphs differ by seed: check each run's
        if not _check_graph(sc, seed, problems):
            return


MODES_ASYNC = ", ".join(name for name, m in MODES.items() if m.clock)


def _check_async(sc: Scenario, problems: list[Problem]) -> None:
    """The asynchronous modes (``server.mode``, the ``asynchrony`` block) against the rest:
    what they replace (dropout and deadlines: the simulated clock), what they do not support
    yet, and the block's keys against each other."""
    from simulator.sim.clock import settings

    if sc.speeds is not None:
        from simulator.sim.speeds import check_speeds

        for loc, message in check_speeds(sc.speeds, sc.clients.total):
            problems.append(Problem(loc, message))
    mode = sc.server.mode
    _check_mode_keys(sc, problems)
    if not sc.server.resolved_mode.clock:
        for loc, value in ((("asynchrony",), sc.asynchrony),
                           (("speeds", "availability"), sc.speeds and sc.speeds.availability)):
            if value:
                problems.append(Problem(loc, "used by the asynchronous modes only; set "
                                        f"server.mode to one of {MODES_ASYNC}, or remove it"))
        return
    if sc.topology is not None:
        problems.append(Problem(("server", "mode"), f"D-SGD (a topology) has no server to run "
                                f"{mode}; remove server.mode or the topology"))
        return
    c, a = sc.clients, settings(sc)
    replaced = "the simulated clock decides who arrives when (speeds); remove it"
    problems += [Problem(loc, f"not used by server.mode {mode}: {replaced}")
                 for loc, value in [(("clients", "dropout"), c.dropout),
                                    (("clients", "stragglers"), c.stragglers)] if value]
    if sc.privacy is not None:
        problems.append(Problem(("privacy",), f"not supported with server.mode {mode} yet (its "
                                "accounting assumes sampled rounds); use server.mode sync"))
    _check_round_optimizer(sc, problems)
    if c.b_hat is not None and c.b_hat.rule != "fixed":
        problems.append(Problem(("clients", "b_hat", "rule"), f"{c.b_hat.rule} assumes rounds of "
                                f"sampled clients; with server.mode {mode} use fixed"))
    _check_async_keys(sc, problems)
    if a.weights != "none":
        _check_weights(sc, problems)


def _check_mode_keys(sc: Scenario, problems: list[Problem]) -> None:
    """The ``server`` keys a mode reads (``ModePlan.keys``): refused with the modes that do
    not read them, required where the mode says so; a timed mode's devices decide who is
    late, so the other straggler model is refused with it."""
    mode, m = sc.server.mode, sc.server.resolved_mode
    elsewhere = {key: name for name, other in MODES.items() for key in other.keys
                 if key not in m.keys}
    problems += [Problem(("server", key), f"used by server.mode {name} only; remove it, or "
                         f"set server.mode {name}")
                 for key, name in elsewhere.items() if getattr(sc.server, key) is not None]
    problems += [Problem(("server", key), f"required with server.mode {mode}")
                 for key in m.required if getattr(sc.server, key) is None]
    if m.timed and not m.clock and sc.clients.stragglers is not None:
        problems.append(Problem(("clients", "stragglers"), f"not used by server.mode {mode}: "
                                "the devices' simulated speeds (speeds) decide who is late; "
                                "remove it"))


def _check_round_optimizer(sc: Scenario, problems: list[Problem]) -> None:
    """A server optimizer that steps once per round of sampled clients (it takes the
    sampling fraction, ``participation``, or broadcasts a state its client half reads:
    SCAFFOLD, FedDyn) has no round in an asynchronous mode."""
    from simulator.config.plan import client_rule

    name, mode = sc.server.optimizer["name"], sc.server.mode
    rule, _, traits = client_rule(sc)
    if traits.personal:
        problems.append(Problem(("local", "optimizer"), f"{rule['name']!r} (personal models) "
                                f"is not supported with server.mode {mode} yet; use server.mode "
                                "sync"))
    if "participation" in registry.get("optimizers", name).traits.context or \
            traits.shared_state:
        usable = [n for n in registry.available("optimizers")
                  if "participation" not in registry.get("optimizers", n).traits.context]
        problems.append(Problem(("server", "optimizer"), f"{name!r} steps once per round of "
                                f"sampled clients (|S|/N, a state broadcast to them), which "
                                f"server.mode {mode} does not have; use server.mode sync or "
                                f"one of {', '.join(usable)}"))


def _check_async_keys(sc: Scenario, problems: list[Problem]) -> None:
    """The ``asynchrony`` block's keys against each other and the population."""
    from simulator.sim.clock import concurrency, settings

    c, a, mode = sc.clients, settings(sc), sc.server.mode
    on = sc.server.resolved_mode.steps_on
    k = concurrency(sc)
    if k > c.total:
        where = ("asynchrony", "concurrency") if a.concurrency is not None else \
            ("clients", "per_round")
        problems.append(Problem(where, f"clients in flight must be <= clients.total "
                                f"({c.total}), got {k}"))
    if on == "arrival" and a.buffer_size not in (None, 1):
        problems.append(Problem(("asynchrony", "buffer_size"), f"{mode} steps on every "
                                f"update; remove it (or use fedbuff), got {a.buffer_size}"))
    if on == "buffer" and a.buffer_size is not None and a.buffer_size > c.total:
        problems.append(Problem(("asynchrony", "buffer_size"), f"must be <= clients.total "
                                f"({c.total}): a client sends at most one update from each "
                                f"model version, got {a.buffer_size}"))
    if on == "buffers" and a.buffers > c.total:
        problems.append(Problem(("asynchrony", "buffers"), f"must be <= clients.total "
                                f"({c.total}): client c goes to buffer c mod B, got {a.buffers}"))


def _check_weights(sc: Scenario, problems: list[Problem]) -> None:
    """``asynchrony.weights`` needs every rule of the pipeline to have a weighted
    definition (``traits.weighted``), and rows that are clients' updates (not BASGD's)."""
    weights = sc.asynchrony.weights if sc.asynchrony is not None else "none"
    if sc.server.resolved_mode.buffer_means:
        problems.append(Problem(("asynchrony", "weights"), f"{sc.server.mode} aggregates its "
                                "buffers' means, not clients' updates; remove it"))
    rules: list[tuple[tuple[str | int, ...], str, str]] = [
        (("preaggregators", i), "preaggregators", s["name"])
        for i, s in enumerate(sc.preaggregators)]
    rules.append((("aggregator",), "aggregators", sc.aggregator["name"]))
    if sc.meta is not None:
        rules.append((("meta",), "meta", sc.meta["name"]))
    for loc, group, name in rules:
        if registry.get(group, name).traits.weighted:
            continue
        have = [n for n in registry.available(group) if registry.get(group, n).traits.weighted]
        problems.append(Problem(loc, f"{name!r} has no weighted definition, which "
                                f"asynchrony.weights: {weights} needs; weighted: "
                                f"{', '.join(have) or 'none'}"))


def _check_graph(sc: Scenario, seed: int, problems: list[Problem]) -> bool:
    """The topology for the run of ``seed``: a valid gossip matrix, and (a defense that runs
    the scenario's aggregator over each peer's neighbourhood) the aggregator's ``check`` for
    the smallest neighbourhood; False at the first problem."""
    assert sc.topology is not None
    c = sc.clients
    where = f" (seed {seed})" if len(sc.seeds) > 1 else ""
    topo = instantiate("topologies", sc.topology)
    try:
        topo.check(c.total)
        w = topo.mixing_matrix(c.total, seed)
        if not topo.traits.time_varying:
            from strategies.topologies import validate_mixing

            validate_mixing(w)
    except ValueError as e:
        problems.append(problem(("topology",), e, where))
        return False
    if "aggregator" not in registry.get("gossip_defenses", sc.dsgd.defense).traits.context:
        return True
    # an honest peer aggregates its own model, its neighbours' and Byzantine messages
    byz = set(byzantine_clients(seed, c.total, c.byzantine).tolist())
    sizes = {i: int((w[i] > 0).sum()) for i in range(c.total) if i not in byz}
    peer = min(sizes, key=lambda i: (sizes[i], i))
    return _check(instantiate("aggregators", sc.aggregator), sizes[peer], ("aggregator",),
                  problems, f" (the smallest neighbourhood, peer {peer}'s, has "
                  f"{sizes[peer]} models){where}")

