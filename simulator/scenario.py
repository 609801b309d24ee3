"""Scenario files: pydantic v2 models, loading, validation with located errors, sweeps.

Validation runs in three passes, each collecting every error it finds:

1. structure — pydantic models with ``extra="forbid"`` (unknown keys get a suggestion);
2. plugins — each ``{name: ..., key: value}`` block is looked up in the registry and its keys
   validated against a model derived from the plugin's constructor signature;
3. cross-field rules — sampled <= total, Byzantine < total, the aggregator's own constraints
   for the number of rows it will receive, ...

Every error is one line, ``file:line: dotted.path: message``.
"""

from __future__ import annotations

import copy
import difflib
import functools
import inspect
import itertools
import json
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from annotated_types import Ge, Gt, Lt
from pydantic import AllowInfNan, BaseModel, ConfigDict, ValidationError, create_model

from simulator import registry
from simulator.errors import brief, brief_text

Loc = tuple[Any, ...]
PluginSpec = dict[str, Any]


# Non-finite numbers are refused wherever a float is expected (a plugin or a field opts in
# with ``Annotated[float, AllowInfNan(True)]`` where inf means something, such as "no
# clipping"), and a value that is accepted keeps its value through every JSON dump.
FINITE = ConfigDict(allow_inf_nan=False, ser_json_inf_nan="constants")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, **FINITE)


class Data(Strict):
    dataset: PluginSpec
    partitioner: PluginSpec = {"name": "iid"}
    test_fraction: Annotated[float, Gt(0), Lt(1)] = 0.2


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
    value: Annotated[int, Ge(0)] | None = None


class Stragglers(Strict):
    """Simulated compute speed: client c's time for one local step in round r is
    exp(sigma z_c + jitter e_cr) (z_c fixed per client, e_cr per round, standard normal,
    seeded; median 1); a client whose local work (its number of minibatch steps) takes more
    than ``deadline`` step-times misses the round."""

    deadline: Annotated[float, Gt(0), AllowInfNan(True)]  # inf: nobody misses a round
    sigma: Annotated[float, Ge(0)] = 0.5
    jitter: Annotated[float, Ge(0)] = 0.1


class Clients(Strict):
    """``dropout``: the probability that a sampled honest client drops out of a round (seeded
    per round and client); ``stragglers``: honest clients too slow for the round's deadline.
    Byzantine clients never miss a round (the worst case). Both are logged per round."""

    total: Annotated[int, Ge(1)]
    per_round: Annotated[int, Ge(1)] | None = None
    byzantine: Annotated[int, Ge(0)] = 0
    b_hat: BHat | None = None
    dropout: Annotated[float, Ge(0), Lt(1)] = 0.0
    stragglers: Stragglers | None = None

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

    epochs: Annotated[int, Ge(1)] | None = None
    steps: Annotated[int, Ge(1)] | None = None
    batch_size: Annotated[int, Ge(1)] = 32
    lr: Annotated[float, Gt(0)] = 0.05
    momentum: Annotated[float, Ge(0), Lt(1)] = 0.0
    weight_decay: Annotated[float, Ge(0)] = 0.0


class Server(Strict):
    optimizer: PluginSpec = {"name": "sgd"}


class DSGD(Strict):
    """Decentralized SGD (used when ``topology`` is set): each round every peer takes
    ``local.steps``/``local.epochs`` of local SGD and ``gossip_steps`` gossip steps with its
    neighbours, in ``order``; ``defense`` against Byzantine peers: none (plain gossip),
    ``clipped_gossip`` (He et al. 2022; ``clip_tau`` fixed, or adaptive when null) or
    ``aggregator`` (the scenario's aggregator over each peer's neighbourhood)."""

    order: Literal["local_then_gossip", "gossip_then_local"] = "local_then_gossip"
    gossip_steps: Annotated[int, Ge(1)] = 1
    defense: Literal["none", "clipped_gossip", "aggregator"] = "none"
    clip_tau: Annotated[float, Gt(0), AllowInfNan(True)] | None = None  # inf: plain gossip


class Evaluation(Strict):
    every: Annotated[int, Ge(1)] = 1


class Runtime(Strict):
    """Where a run executes. ``checkpoint_every: k`` saves the whole state of the run every k
    rounds (0: never) so that ``fedray resume RUN_ID`` continues it exactly."""

    backend: Literal["ray", "inline"] = "ray"
    workers: Annotated[int, Ge(1)] | None = None
    checkpoint_every: Annotated[int, Ge(0)] = 0
    # train a worker's clients together (torch.func vmap) when their rule allows: the same
    # numbers as one at a time up to float rounding (not bit for bit across worker counts)
    vectorize: bool = False
    # precision of the per-client state workers keep (worker momentum, mu2-SGD): float16
    # halves its memory; the maths runs in float32
    state_dtype: Literal["float32", "float16"] = "float32"


class Scenario(Strict):
    """A whole experiment. ``sweep`` maps dotted paths to value lists (grid product; a key
    ``"a.b, c.d"`` zips paths: its values are lists with one value per path); every point runs
    once per entry of ``seeds``."""

    name: str = ""
    description: str = ""
    rounds: Annotated[int, Gt(0)]
    # derived seeds take 32 bits of it: 2**32 would repeat seed 0
    seeds: list[Annotated[int, Ge(0), Lt(2**32)]] = [0]
    data: Data
    model: PluginSpec
    clients: Clients
    local: Local = Local()
    aggregator: PluginSpec = {"name": "mean"}
    preaggregators: list[PluginSpec] = []
    meta: PluginSpec | None = None
    attack: PluginSpec | None = None
    server: Server = Server()
    topology: PluginSpec | None = None
    dsgd: DSGD = DSGD()
    # differential privacy: a plugin of fedray.privacy (dp_sgd | dp_fedavg; docs/privacy.md)
    privacy: PluginSpec | None = None
    evaluation: Evaluation = Evaluation()
    runtime: Runtime = Runtime()
    sweep: dict[str, list[Any]] = {}

    def client_rule(self) -> tuple[str, PluginSpec]:
        """(kind, spec) of the clients' rule: the server optimizer's client half when it has
        one (mu2-SGD spans both sides), else ``local.optimizer``."""
        if hasattr(registry.get("optimizers", self.server.optimizer["name"]), "client_rule"):
            return "optimizers", self.server.optimizer
        return "client_optimizers", self.local.optimizer

    def points(self) -> list[RunPoint]:
        """Every (sweep point, seed) of this scenario, each as a single-run scenario."""
        return expand(self.model_dump(mode="json"))[0]


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
            parts.append(_short(v) if last == "name" else f"{key}={_short(v)}")
        return " ".join([*parts, f"seed={self.seed}"])


def _short(v: Any) -> str:
    """A sweep value in a run name: plugin blocks as ``name(key=value, ...)``."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("name"), str):
        args = ", ".join(f"{k}={_short(x)}" for k, x in v.items() if k != "name")
        return f"{v['name']}({args})" if args else v["name"]
    if isinstance(v, list) and all(isinstance(x, dict) for x in v):
        return "[" + ", ".join(_short(x) for x in v) + "]"
    return "none" if v is None else brief_text(json.dumps(v), 60)


# --------------------------------------------------------------------------- errors


@dataclass
class Problem:
    loc: Loc
    message: str
    line: int | None = None
    sweep_key: str | None = None  # the sweep entry that produced this problem, if any

    def format(self, source: str | None) -> str:
        path = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in self.loc)
        path = path.replace(".[", "[") or "scenario"
        where = f"{source}:{self.line}: " if source and self.line else (f"{source}: " if source else "")
        return f"{where}{path}: {self.message}"


class ScenarioError(ValueError):
    """Every problem found in a scenario, one formatted line each."""

    def __init__(self, problems: list[Problem], source: str | None = None) -> None:
        self.problems = problems
        self.source = source
        self.lines = list(dict.fromkeys(p.format(source) for p in problems))
        super().__init__("\n".join(self.lines))


def _suggest(word: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _unwrap_model(tp: Any) -> type[BaseModel] | None:
    """The pydantic model class inside ``tp`` (through Optional/Annotated/list), if any."""
    origin = typing.get_origin(tp)
    if inspect.isclass(tp) and issubclass(tp, BaseModel):
        return tp
    for arg in typing.get_args(tp) if origin is not None else ():
        m = _unwrap_model(arg)
        if m is not None:
            return m
    return None


def _fields_at(model: type[BaseModel], loc: Loc) -> list[str]:
    cur: type[BaseModel] | None = model
    for part in loc:
        if cur is None:
            return []
        if isinstance(part, int):
            continue
        f = cur.model_fields.get(part)
        cur = _unwrap_model(f.annotation) if f is not None else None
    return list(cur.model_fields) if cur is not None else []


_OPS = {
    "greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<=",
}


def _message(err: dict, root: type[BaseModel], loc: Loc) -> str:
    kind = err["type"]
    ctx = err.get("ctx") or {}
    got = err.get("input")
    if kind == "extra_forbidden":
        return "unknown key" + (_suggest(str(loc[-1]), _fields_at(root, loc[:-1])) or
                                f"; allowed: {', '.join(_fields_at(root, loc[:-1]))}")
    if kind == "missing":
        return "required"
    for k, op in _OPS.items():
        if kind == k:
            bound = next(iter(ctx.values())) if ctx else "?"
            return f"must be {op} {bound}, got {brief(got)}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}, got {brief(got)}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"must be an integer, got {brief(got)}"
    if kind in ("float_type", "float_parsing"):
        return f"must be a number, got {brief(got)}"
    if kind == "finite_number":
        return f"must be a finite number, got {brief(got)}"
    if kind in ("string_type",):
        return f"must be a string, got {brief(got)}"
    if kind in ("bool_type", "bool_parsing"):
        return f"must be true or false, got {brief(got)}"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"must be a mapping, got {brief(got)}"
    if kind == "list_type":
        return f"must be a list, got {brief(got)}"
    if kind in ("too_short", "too_long"):
        return err["msg"].replace("List", "list") + f", got {brief(got)}"
    return err["msg"]


def _pydantic_problems(e: ValidationError, root: type[BaseModel], prefix: Loc = ()) -> list[Problem]:
    out = []
    for err in e.errors(include_url=False):
        loc = tuple(err["loc"])
        out.append(Problem(prefix + loc, _message(err, root, loc)))
    return out


# --------------------------------------------------------------------------- plugins


_SKIP = {"self"}


def plugin_params_model(cls: Any) -> type[BaseModel]:
    """A pydantic model of a plugin's scenario keys, derived from its constructor signature
    (type hints with annotated_types constraints, defaults). Context arguments the engine
    supplies (``cls.CONTEXT``) are not scenario keys."""
    init = cls.__init__ if inspect.isclass(cls) else cls
    skip = _SKIP | set(getattr(cls, "CONTEXT", ()))
    try:
        hints = typing.get_type_hints(init, include_extras=True)
    except Exception:  # noqa: BLE001 - unresolvable hints: fall back to no type checks
        hints = {}
    fields: dict[str, Any] = {}
    if init is not object.__init__:
        for p in inspect.signature(init).parameters.values():
            if p.name in skip or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            tp = hints.get(p.name, Any)
            fields[p.name] = (tp, ... if p.default is p.empty else p.default)
    return create_model(f"{getattr(cls, '__name__', 'plugin')}Params",
                        __config__=ConfigDict(extra="forbid", **FINITE), **fields)


def instantiate(kind: str, spec: PluginSpec, **context: Any) -> Any:
    """Build the plugin a validated spec names."""
    params = {k: v for k, v in spec.items() if k != "name"}
    return registry.get(kind, spec["name"])(**context, **params)


def build_client_rule(kind: str, spec: PluginSpec) -> Any:
    """The clients' rule from ``Scenario.client_rule()``'s (kind, spec): a client optimizer,
    or the client half of a server optimizer that spans both sides."""
    rule = instantiate(kind, spec)
    return rule.client_rule() if kind == "optimizers" else rule


def _check_plugin(kind: str, spec: Any, loc: Loc, problems: list[Problem]) -> PluginSpec | None:
    if not isinstance(spec, dict):
        problems.append(Problem(loc, f"must be a mapping with a 'name', got {brief(spec)}"))
        return None
    name = spec.get("name")
    if not isinstance(name, str):
        problems.append(Problem(loc + ("name",), "required: the registered name of a "
                                f"{kind.removesuffix('s')}; available: "
                                f"{', '.join(registry.available(kind)) or 'none installed'}"))
        return None
    try:
        cls = registry.get(kind, name)
    except registry.UnknownPlugin as e:
        problems.append(Problem(loc + ("name",), str(e)))
        return None
    model = plugin_params_model(cls)
    params = {k: v for k, v in spec.items() if k != "name"}
    try:
        validated = model.model_validate(params)
    except ValidationError as e:
        for err in e.errors(include_url=False):
            key = err["loc"][0] if err["loc"] else ""
            sub = tuple(err["loc"])
            if err["type"] == "extra_forbidden":
                allowed = list(model.model_fields)
                msg = f"unknown key for {kind.removesuffix('s')} {name!r}" + (
                    _suggest(str(key), allowed) or f"; allowed: {', '.join(allowed) or 'none'}")
            else:
                msg = _message(err, model, sub)
            problems.append(Problem(loc + sub, msg))
        return None
    return {"name": name, **validated.model_dump(mode="json")}


# --------------------------------------------------------------------------- validation


def _cross_field(sc: Scenario, problems: list[Problem]) -> None:
    c = sc.clients
    if c.per_round is not None and c.per_round > c.total:
        problems.append(Problem(("clients", "per_round"),
                                f"must be <= clients.total ({c.total}), got {c.per_round}"))
    if c.byzantine >= c.total:
        problems.append(Problem(("clients", "byzantine"),
                                f"must be < clients.total ({c.total}), got {c.byzantine}"))
    if c.byzantine > 0 and sc.attack is None:
        usable = [a for a in registry.available("attacks")  # gossip attacks only with D-SGD
                  if bool(getattr(registry.get("attacks", a), "GOSSIP", False)) == bool(sc.topology)]
        problems.append(Problem(("attack",), f"required when clients.byzantine > 0 (got "
                                f"{c.byzantine}); available: {', '.join(usable)}"))
    if sc.local.epochs is not None and sc.local.steps is not None:
        problems.append(Problem(("local", "steps"), "give local.epochs or local.steps, not both"))
    _check_dsgd(sc, problems)
    level = getattr(registry.get("privacy", sc.privacy["name"]), "LEVEL", "") if sc.privacy else ""
    if level == "client" and (sc.aggregator["name"] != "mean" or sc.preaggregators or sc.meta):
        problems.append(Problem(("privacy", "name"), "client-level DP adds noise calibrated to the "
                                "mean's sensitivity: it needs aggregator mean and no pre- or "
                                f"meta-aggregator (got {sc.aggregator['name']}); dp_sgd (sample "
                                "level) composes with robust aggregation"))
    if level == "sample" and sc.client_rule()[1]["name"] != "sgd":
        problems.append(Problem(("privacy", "name"), "DP-SGD runs the clients' local SGD; "
                                "local.optimizer and server.optimizer must not bring another "
                                "client rule"))
    if level == "client" and sc.topology is not None:
        problems.append(Problem(("privacy", "name"), "client-level DP needs a server; use "
                                "dp_sgd with D-SGD"))
    kind, rule = sc.client_rule()
    if kind == "optimizers" and sc.local.optimizer["name"] != "sgd":
        problems.append(Problem(("local", "optimizer"), f"server.optimizer {rule['name']!r} "
                                f"brings its own client half; remove local.optimizer, got "
                                f"{sc.local.optimizer['name']!r}"))
    elif getattr(build_client_rule(kind, rule), "GRADIENT_RULE", False):
        for key in ("steps", "epochs"):
            if getattr(sc.local, key) not in (None, 1):
                problems.append(Problem(("local", key), f"{rule['name']} takes one minibatch "
                                        f"gradient per round; remove local.{key}, got "
                                        f"{getattr(sc.local, key)}"))
    if len(set(sc.seeds)) != len(sc.seeds) or not sc.seeds:
        problems.append(Problem(("seeds",), f"must be a non-empty list of distinct integers, got {sc.seeds}"))
    n = min(c.sampled, c.total)
    try:
        for i, spec in enumerate(sc.preaggregators):
            pre = instantiate("preaggregators", spec)
            if hasattr(pre, "check"):
                try:
                    pre.check(n)
                except ValueError as e:
                    problems.append(Problem(("preaggregators", i) + _param_loc(e), str(e)))
            n = pre.output_rows(n) if hasattr(pre, "output_rows") else n
        meta = instantiate("meta", sc.meta) if sc.meta is not None else None
        if hasattr(meta, "check"):
            try:
                meta.check(n)
            except ValueError as e:
                problems.append(Problem(("meta",) + _param_loc(e), _strip_param(e)))
        agg = instantiate("aggregators", sc.aggregator)
        if hasattr(agg, "check"):
            # a meta-aggregator may hand the aggregator fewer rows (bucketing: one per bucket)
            inner = meta.output_rows(n) if hasattr(meta, "output_rows") else n
            try:
                agg.check(inner)
            except ValueError as e:
                where = f" (meta {sc.meta['name']} gives it {inner} rows)" if inner != n else ""
                problems.append(Problem(("aggregator",) + _param_loc(e), _strip_param(e) + where))
        ds = instantiate("datasets", sc.data.dataset)
        if hasattr(ds, "check"):
            try:
                ds.check()
            except ValueError as e:
                problems.append(Problem(("data", "dataset") + _param_loc(e), _strip_param(e)))
                return
        _check_data_and_model(sc, problems)
    except registry.UnknownPlugin:  # already reported by the plugin pass
        pass


@functools.lru_cache(maxsize=16)
def _describe(dataset: str, total: int, seed: int, test_fraction: float) -> Any:
    """The dataset's DatasetInfo (cached: every sweep point of a file asks for the same)."""
    return instantiate("datasets", json.loads(dataset)).describe(total, seed, test_fraction)


def _check_data_and_model(sc: Scenario, problems: list[Problem]) -> None:
    """What the data and the model say before anything runs: enough training samples for
    the clients, labels and features a model can learn from, a model that takes the data's
    samples and gives one score per class, and that fits in this machine's memory."""
    from simulator.data import DataError

    c = sc.clients
    if not hasattr(registry.get("datasets", sc.data.dataset["name"]), "describe"):
        return  # a third-party dataset without describe(): checked when it loads
    try:
        info = _describe(json.dumps(sc.data.dataset, sort_keys=True), c.total, sc.seeds[0],
                         sc.data.test_fraction)
    except (DataError, ValueError) as e:
        problems.append(Problem(("data", "dataset") + _param_loc(e), _strip_param(e)))
        return
    if info.train_samples < c.total:
        problems.append(Problem(("clients", "total"), f"more clients ({c.total}) than training "
                                f"samples ({info.train_samples}); each client needs one at least"))
    if info.num_classes < 2:
        problems.append(Problem(("data", "dataset"), f"the labels name {info.num_classes} class; "
                                "a classifier needs 2 at least"))
        return
    _check_model(sc, info, problems)


def _available_memory() -> int | None:
    """MemAvailable of this machine in bytes (None where /proc/meminfo is missing)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _check_model(sc: Scenario, info: Any, problems: list[Problem]) -> None:
    import torch

    from simulator.models import build_model

    name = sc.model["name"]

    def forward(device: str) -> tuple[Any, Any]:
        with torch.device(device):
            model = build_model(sc.model, info.input_shape, info.num_classes, 0)
            return model, model(torch.zeros((2, *info.input_shape)))

    try:
        try:
            model, out = forward("meta")  # shapes only: no memory, no arithmetic
        except Exception:  # noqa: BLE001 - a model that needs real tensors to be built
            model, out = forward("cpu")  # (numpy in its constructor, say): as the run builds it
    except Exception as e:  # noqa: BLE001 - the model plugin's own error, in one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].removeprefix("model: ")
        problems.append(Problem(("model",), f"{name} does not take the data's samples of shape "
                                f"{tuple(info.input_shape)}: {brief_text(first, 200)}"))
        return
    if tuple(out.shape) != (2, info.num_classes):
        problems.append(Problem(("model",), f"{name} gives outputs of shape {tuple(out.shape)} "
                                f"for a batch of 2; expected (2, {info.num_classes}): one score "
                                "per class"))
        return
    d = sum(p.numel() for p in model.parameters())
    workers = sc.runtime.workers or os.cpu_count() or 1
    # per worker: parameters, gradients, an optimizer buffer and the update; the server: the
    # model, the round's (n, d) update matrix and the optimizer's state; per-client state
    per_client = 4 if sc.runtime.state_dtype == "float32" else 2
    stateful = getattr(build_client_rule(*sc.client_rule()), "GRADIENT_RULE", False)
    need = 4 * d * (4 * workers + 3 + min(sc.clients.sampled, sc.clients.total)) + \
        (per_client * d * sc.clients.total if stateful else 0) + \
        (4 * d * sc.clients.total if sc.topology is not None else 0)  # D-SGD peers' models
    have = _available_memory()
    if have is not None and need > have:
        problems.append(Problem(("model",), f"{name} has {d:,} parameters: this run needs about "
                                f"{need / 2**30:.1f} GiB ({workers} workers, "
                                f"{sc.clients.sampled} updates a round"
                                + (f", state for {sc.clients.total} clients" if stateful else "")
                                + f"), more than the {have / 2**30:.1f} GiB available here"))


def _check_dsgd(sc: Scenario, problems: list[Problem]) -> None:
    """D-SGD (a ``topology``) versus server-based runs: what each one accepts."""
    gossip_attack = bool(sc.attack) and getattr(
        registry.get("attacks", sc.attack["name"]), "GOSSIP", False)
    if sc.topology is None:
        if gossip_attack:
            problems.append(Problem(("attack", "name"), f"{sc.attack['name']!r} attacks gossip: "
                                    "it needs a topology (D-SGD)"))
        return
    c = sc.clients
    if c.per_round is not None and c.per_round != c.total:
        problems.append(Problem(("clients", "per_round"), "every D-SGD peer takes part in every "
                                f"round; remove it or set {c.total}, got {c.per_round}"))
    if sc.attack is not None and not gossip_attack:
        names = [n for n in registry.available("attacks")
                 if getattr(registry.get("attacks", n), "GOSSIP", False)]
        problems.append(Problem(("attack", "name"), f"D-SGD needs an attack on gossip; "
                                f"available: {', '.join(names)}; got {sc.attack['name']!r}"))
    for key in ("preaggregators", "meta", "b_hat", "dropout", "stragglers"):
        in_clients = key in ("b_hat", "dropout", "stragglers")
        value = getattr(sc.clients, key) if in_clients else getattr(sc, key)
        if value:
            where = ("clients", key) if in_clients else (key,)
            problems.append(Problem(where, "not used by D-SGD (a topology is set); remove it"))
    if sc.server.optimizer["name"] != "sgd" or sc.local.optimizer["name"] != "sgd":
        problems.append(Problem(("server", "optimizer"), "D-SGD peers run local SGD; "
                                "server.optimizer and local.optimizer must be sgd"))
    topo = instantiate("topologies", sc.topology)
    agg = instantiate("aggregators", sc.aggregator)
    for seed in sc.seeds:  # random graphs differ by seed: check each run's
        where = f" (seed {seed})" if len(sc.seeds) > 1 else ""
        try:
            topo.check(c.total)
            w = topo.mixing_matrix(c.total, seed)
            if not getattr(topo, "TIME_VARYING", False):
                from strategies.topologies import validate_mixing

                validate_mixing(w)
        except ValueError as e:
            problems.append(Problem(("topology",) + _param_loc(e), _strip_param(e) + where))
            return
        if sc.dsgd.defense == "aggregator" and hasattr(agg, "check"):
            # an honest peer aggregates its own model, its neighbours' and Byzantine messages
            from simulator.engine import byzantine_clients

            byz = set(byzantine_clients(seed, c.total, c.byzantine).tolist())
            sizes = {i: int((w[i] > 0).sum()) for i in range(c.total) if i not in byz}
            peer = min(sizes, key=lambda i: (sizes[i], i))
            try:
                agg.check(sizes[peer])
            except ValueError as e:
                problems.append(Problem(("aggregator",) + _param_loc(e), f"{_strip_param(e)} "
                                        f"(the smallest neighbourhood, peer {peer}'s, has "
                                        f"{sizes[peer]} models){where}"))
                return


def _param_loc(e: Exception) -> Loc:
    """A plugin's check() message starts with its parameter name: 'f: must be ...'."""
    head, sep, _ = str(e).partition(": ")
    return (head,) if sep and head.isidentifier() else ()


def _strip_param(e: Exception) -> str:
    head, sep, rest = str(e).partition(": ")
    return rest if sep and head.isidentifier() else str(e)


_PLUGIN_FIELDS: list[tuple[Loc, str]] = [
    (("data", "dataset"), "datasets"),
    (("data", "partitioner"), "partitioners"),
    (("model",), "models"),
    (("aggregator",), "aggregators"),
    (("meta",), "meta"),
    (("attack",), "attacks"),
    (("server", "optimizer"), "optimizers"),
    (("local", "optimizer"), "client_optimizers"),
    (("topology",), "topologies"),
    (("privacy",), "privacy"),
]


_PLUGIN_DEFAULTS: dict[Loc, PluginSpec] = {
    ("server", "optimizer"): {"name": "sgd"},
    ("data", "partitioner"): {"name": "iid"},
    ("aggregator",): {"name": "mean"},
    ("local", "optimizer"): {"name": "sgd"},
}


def _get(d: Any, loc: Loc) -> Any:
    for p in loc:
        if isinstance(d, dict) and p in d or isinstance(d, list) and isinstance(p, int) and p < len(d):
            d = d[p]
        else:
            return None
    return d


def set_path(d: dict, dotted: str, value: Any) -> None:
    """Set ``d[a][b][c] = value`` for ``dotted = "a.b.c"``, creating mappings as needed."""
    parts = dotted.split(".")
    cur = d
    for p in parts[:-1]:
        if not isinstance(cur.get(p), dict):
            cur[p] = {}
        cur = cur[p]
    cur[parts[-1]] = value


def _trimmed_rules(raw: dict) -> list[tuple[Loc, dict]]:
    """The pipeline's plugin blocks (location, spec) whose plugin takes an ``f``."""
    blocks: list[tuple[Loc, str, Any]] = [
        (("aggregator",), "aggregators", raw.get("aggregator", {"name": "mean"})),
        (("meta",), "meta", raw.get("meta")),
    ]
    pre = raw.get("preaggregators")
    if isinstance(pre, list):
        blocks += [(("preaggregators", i), "preaggregators", p) for i, p in enumerate(pre)]
    return [(loc, spec) for loc, kind, spec in blocks
            if (cls := _plugin_class(kind, spec)) is not None
            and "f" in plugin_params_model(cls).model_fields]


def _plugin_class(kind: str, spec: Any) -> Any:
    """The registered class a raw plugin block names, or None (not a block, or an unknown
    name: the plugin pass reports those)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        return None
    try:
        return registry.get(kind, spec["name"])
    except registry.UnknownPlugin:
        return None


def _apply_b_hat(raw: dict, problems: list[Problem]) -> dict:
    """With ``clients.b_hat`` set: compute its value (rules ``kl``, ``hypergeometric``) and
    write it as ``f`` into every pipeline rule that takes one. Returns the rewritten mapping
    (``raw`` itself when there is nothing to do)."""
    from strategies.subsampling import b_hat

    clients = raw.get("clients")
    if not isinstance(clients, dict) or not isinstance(clients.get("b_hat"), dict):
        return raw
    try:
        c = Clients.model_validate(clients)
    except ValidationError:
        return raw  # reported by the structure pass
    assert c.b_hat is not None
    rule = c.b_hat.rule
    if rule == "fixed":
        if c.b_hat.value is None:
            problems.append(Problem(("clients", "b_hat", "value"), "required with rule 'fixed'"))
            return raw
        value = c.b_hat.value
    else:
        s = min(c.sampled, c.total)
        try:
            value = b_hat(c.total, min(c.byzantine, c.total), s, rule, c.b_hat.level)
        except ValueError as e:
            if c.b_hat.clamp:
                value = (s - 1) // 2
            else:
                problems.append(Problem(("clients", "b_hat") + _param_loc(e), _strip_param(e)))
                return raw
        if c.b_hat.value is not None and c.b_hat.value != value:
            problems.append(Problem(("clients", "b_hat", "value"), f"computed by rule {rule!r} "
                                    f"(= {value} here); remove it, got {c.b_hat.value}"))
            return raw
    out = copy.deepcopy(raw)
    out["clients"]["b_hat"] = {**clients["b_hat"], "value": value}
    for loc, spec in _trimmed_rules(out):
        if "f" in spec and spec["f"] != value:
            problems.append(Problem(loc + ("f",), f"set by clients.b_hat (= {value}); remove "
                                    f"it, got {brief(spec['f'])}"))
        spec["f"] = value
    return out


def validate_point(raw: dict) -> Scenario:
    """Validate one scenario mapping (no sweep expansion); raises ScenarioError."""
    if not isinstance(raw, dict):
        raise ScenarioError([Problem((), f"must be a mapping of keys, got {type(raw).__name__}")])
    problems: list[Problem] = []
    try:
        Scenario.model_validate(raw)
    except ValidationError as e:
        problems += _pydantic_problems(e, Scenario)
    b_hat_problems: list[Problem] = []
    raw = _apply_b_hat(raw, b_hat_problems)
    # plugin blocks are validated even when other parts of the structure failed
    resolved = copy.deepcopy(raw)
    for loc, kind in _PLUGIN_FIELDS:
        spec = _get(raw, loc)
        if spec is None:
            spec = _PLUGIN_DEFAULTS.get(loc)
            if spec is None or (len(loc) > 1 and not isinstance(raw.get(loc[0], {}), dict)):
                continue
        problems = [p for p in problems if p.loc[: len(loc)] != loc or p.message == "required"]
        out = _check_plugin(kind, spec, loc, problems)
        if out is not None:
            parent = resolved
            for part in loc[:-1]:
                parent = parent.setdefault(part, {})
            parent[loc[-1]] = out
    pre = raw.get("preaggregators")
    if isinstance(pre, list):
        for i, spec in enumerate(pre):
            out = _check_plugin("preaggregators", spec, ("preaggregators", i), problems)
            if out is not None:
                resolved["preaggregators"][i] = out
    problems += b_hat_problems
    if problems:
        raise ScenarioError(problems)
    sc = Scenario.model_validate(resolved)
    _cross_field(sc, problems)
    if problems:
        raise ScenarioError(problems)
    return sc


MAX_POINTS = 10_000  # sweep points of one scenario file


def _sweep_parts(key: str) -> list[str]:
    """The dotted paths of a sweep key: ``"local.steps, local.lr"`` zips two paths (each value
    of that key is a list with one value per path); a plain key is one path."""
    return [part.strip() for part in key.split(",")]


def expand(raw: dict) -> tuple[list[RunPoint], Scenario]:
    """Validate a scenario mapping and expand its sweep grid x seeds into run points.

    Returns the points and the validated base scenario. Raises ScenarioError listing every
    problem of the base and of each sweep point.
    """
    if not isinstance(raw, dict):
        raise ScenarioError([Problem((), f"must be a mapping of keys, got {type(raw).__name__}")])
    sweep = raw.get("sweep") or {}
    problems: list[Problem] = []
    if not isinstance(sweep, dict):
        raise ScenarioError([Problem(("sweep",), f"must map dotted paths to lists, got {brief(sweep)}")])
    for k, v in sweep.items():
        if not isinstance(v, list) or not v:
            problems.append(Problem(("sweep", k), f"must be a non-empty list of values, got {brief(v)}"))
            continue
        width = len(_sweep_parts(k))
        bad = [e for e in v if width > 1 and (not isinstance(e, list) or len(e) != width)]
        if bad:
            problems.append(Problem(("sweep", k), f"zips {width} paths: each value must be a "
                                    f"list of {width} values, one per path, got {brief(bad[0])}"))
    if problems:
        raise ScenarioError(problems)
    n_grid = math.prod(len(v) for v in sweep.values())
    if n_grid > MAX_POINTS:
        raise ScenarioError([Problem(("sweep",), f"{n_grid:,} points; at most {MAX_POINTS:,} "
                                     "(split the study into several files)")])
    base_raw = {k: v for k, v in raw.items() if k != "sweep"}
    keys = list(sweep)
    points: list[RunPoint] = []
    base: Scenario | None = None
    per_point: dict[tuple[Loc, str], list[tuple[Problem, str]]] = {}
    n_points = 0
    for combo in itertools.product(*(sweep[k] for k in keys)) if keys else [()]:
        n_points += 1
        point = copy.deepcopy(base_raw)
        values: dict[str, Any] = {}
        for k, v in zip(keys, combo):
            parts = _sweep_parts(k)
            values.update(zip(parts, v) if len(parts) > 1 else {k: v})
        for k, v in values.items():
            set_path(point, k, v)
        try:
            sc = validate_point(point)
        except ScenarioError as e:
            where = ", ".join(f"{k}={_short(v)}" for k, v in values.items())
            for p in e.problems:
                dotted = ".".join(map(str, p.loc))
                p.sweep_key = next((k for k in keys for part in _sweep_parts(k)
                                    if dotted == part or dotted.startswith(part + ".")
                                    or part.startswith(dotted + ".")), None)
                per_point.setdefault((p.loc, p.message), []).append((p, where))
            continue
        base = base or sc
        for seed in sc.seeds:
            points.append(RunPoint(values, seed, sc.model_copy(update={"seeds": [seed]})))
    for group in per_point.values():
        if len(group) == n_points or not keys:  # the same problem at every point: say it once
            problems.append(group[0][0])
        else:
            for p, where in group:
                p.message += f" (sweep point {where})"
                problems.append(p)
    if problems:
        raise ScenarioError(problems)
    assert base is not None
    full = Scenario.model_validate({**base.model_dump(mode="json"), "sweep": sweep})
    return points, full


# --------------------------------------------------------------------------- files


def _line_of(root: yaml.Node | None, loc: Loc) -> int | None:
    node, line = root, None
    if node is not None:
        line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == str(part):
                    node, line = v, k.start_mark.line + 1
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


@dataclass
class LoadedScenario:
    path: Path
    text: str
    raw: dict
    scenario: Scenario
    points: list[RunPoint] = field(default_factory=list)


def _resolve_paths(raw: dict, base: Path) -> None:
    """Relative file paths in plugin blocks (a plugin lists them in ``PATH_PARAMS``) are
    relative to the scenario file's directory, wherever ``fedray`` is started from."""
    for loc, kind in _PLUGIN_FIELDS:
        spec = _get(raw, loc)
        cls = _plugin_class(kind, spec)
        for key in getattr(cls, "PATH_PARAMS", ()):
            value = spec.get(key)
            if isinstance(value, str) and value and not Path(value).is_absolute():
                spec[key] = str((base / value).resolve())


MAX_FILE_BYTES = 1 << 20  # a scenario file is text of a few kB
MAX_VALUES = 100_000  # values in a scenario once YAML aliases are expanded


def _expanded_size(root: yaml.Node | None, limit: int) -> int:
    """How many values the YAML document holds once its aliases are expanded (counted on the
    node graph, where an alias is a shared node: a small file cannot make this walk big);
    stops counting past ``limit``."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        sizes[id(node)] = 1  # a recursive alias counts once
        if isinstance(node, yaml.MappingNode):
            total = 1 + sum(size(k) + size(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(v) for v in node.value)
        else:
            total = 1
        sizes[id(node)] = total = min(total, limit + 1)
        return total

    return 0 if root is None else size(root)


def read_yaml(text: str, loc: Loc = ()) -> tuple[Any, yaml.Node | None]:
    """``(value, node tree)`` of a YAML text; ``ScenarioError`` (one line) when it is not
    valid YAML or holds more than MAX_VALUES values once its aliases are expanded."""
    try:
        root = yaml.compose(text)
        n = _expanded_size(root, MAX_VALUES)
        if n > MAX_VALUES:
            raise ScenarioError([Problem(loc, f"more than {MAX_VALUES:,} values once its YAML "
                                         "aliases are expanded; a scenario is far smaller")])
        return yaml.safe_load(text), root
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        msg = brief_text(str(getattr(e, "problem", None) or e).strip().splitlines()[0], 160)
        raise ScenarioError([Problem(loc, f"not valid YAML: {msg}",
                                     mark.line + 1 if mark and not loc else None)]) from None


def parse_override(item: str) -> tuple[str, Any]:
    """``key.path=value`` from ``--set``; the value is read as YAML (``rounds=5`` -> 5)."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ScenarioError([Problem(("--set",), f"expected KEY=VALUE, got {brief(item)}")])
    if not value.strip():
        return key.strip(), None
    return key.strip(), read_yaml(value, (f"--set {brief_text(key.strip(), 60)}",))[0]


def load(path: str | Path, overrides: list[str] | None = None) -> LoadedScenario:
    """Read, validate and expand a scenario file; ``overrides`` are ``--set`` items."""
    path = Path(path)
    source = str(path)
    try:
        if not path.is_file():
            raise ScenarioError([Problem((), "not a regular file" if path.exists()
                                         else "no such file")], source)
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ScenarioError([Problem((), f"larger than {MAX_FILE_BYTES >> 20} MiB: not a "
                                         "scenario file")], source)
        text = path.read_text()
    except OSError as e:
        raise ScenarioError([Problem((), f"cannot read: {e.strerror}")], source) from None
    except UnicodeDecodeError:
        raise ScenarioError([Problem((), "not a text file")], source) from None
    try:
        raw, root = read_yaml(text)
        raw = {} if raw is None else raw
        if isinstance(raw, dict):
            for item in overrides or []:
                k, v = parse_override(item)
                set_path(raw, k, v)
    except ScenarioError as e:
        raise ScenarioError(e.problems, source) from None
    if isinstance(raw, dict):
        raw.setdefault("name", path.stem)
        _resolve_paths(raw, path.parent)
    try:
        points, sc = expand(raw)
    except ScenarioError as e:
        for p in e.problems:
            loc = ("sweep", p.sweep_key) if p.sweep_key else p.loc
            p.line = _line_of(root, loc) if loc else None
        raise ScenarioError(e.problems, source) from None
    return LoadedScenario(path, text, raw, sc, points)


def json_schema() -> dict:
    """JSON Schema of a scenario file (plugin blocks are open mappings with a ``name``)."""
    return Scenario.model_json_schema()
