"""Validating one scenario mapping: the structure pass (pydantic), the plugin pass (each
plugin block against its constructor), ``clients.b_hat`` written into the rules taking an
``f``, then the cross-field checks. Every problem found is collected."""

from __future__ import annotations

import copy
from typing import Any

from pydantic import ValidationError

from simulator import registry
from simulator.config.blocks import PLUGIN_FIELDS, PLUGIN_LISTS, get_path, plugin_class
from simulator.config.checks import cross_field
from simulator.config.data_load import with_load
from simulator.config.errors import (
    Loc,
    Problem,
    ScenarioError,
    message,
    problem,
    pydantic_problems,
    suggest,
)
from simulator.config.paths import check_paths
from simulator.config.schema import Clients, Scenario, default_at
from simulator.errors import brief
from simulator.registry import PluginSpec


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
    model = registry.params_model(cls)
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
                    suggest(str(key), allowed) or f"; allowed: {', '.join(allowed) or 'none'}")
            else:
                msg = message(err, model, sub)
            problems.append(Problem(loc + sub, msg))
        return None
    return {"name": name, **validated.model_dump(mode="json")}


# the plugin blocks a scenario may leave out, with the schema's defaults
_PLUGIN_DEFAULTS: dict[Loc, PluginSpec] = {
    loc: default_at(loc) for loc in (("server", "optimizer"), ("data", "partitioner"),
                                     ("aggregator",), ("local", "optimizer"), ("task",))
}


def _trimmed_rules(raw: dict) -> list[tuple[Loc, dict]]:
    """The pipeline's plugin blocks (location, spec) whose plugin takes an ``f``."""
    blocks: list[tuple[Loc, str, Any]] = [
        (("aggregator",), "aggregators", raw.get("aggregator", _PLUGIN_DEFAULTS[("aggregator",)])),
        (("meta",), "meta", raw.get("meta")),
    ]
    pre = raw.get("preaggregators")
    if isinstance(pre, list):
        blocks += [(("preaggregators", i), "preaggregators", p) for i, p in enumerate(pre)]
    return [(loc, spec) for loc, kind, spec in blocks
            if (cls := plugin_class(kind, spec)) is not None
            and "f" in registry.params_model(cls).model_fields]


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
                problems.append(problem(("clients", "b_hat"), e))
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


def _plugin_pass(raw: dict, problems: list[Problem]) -> dict:
    """Every plugin block of ``raw`` checked against its plugin's constructor (even where
    other parts of the structure failed; a block's structural problems give way to the
    plugin's own). Returns ``raw`` with each valid block resolved (defaults filled in)."""
    resolved = copy.deepcopy(raw)
    for loc, kind in PLUGIN_FIELDS:
        spec = get_path(raw, loc)
        if spec is None:
            spec = _PLUGIN_DEFAULTS.get(loc)
            if spec is None or (len(loc) > 1 and not isinstance(raw.get(loc[0], {}), dict)):
                continue
        problems[:] = [p for p in problems if p.loc[: len(loc)] != loc or p.message == "required"]
        out = _check_plugin(kind, spec, loc, problems)
        if out is not None:
            parent = resolved
            for part in loc[:-1]:
                parent = parent.setdefault(part, {})
            parent[loc[-1]] = out
    for key, kind in PLUGIN_LISTS:  # the lists of plugin blocks
        blocks = raw.get(key)
        for i, spec in enumerate(blocks if isinstance(blocks, list) else []):
            out = _check_plugin(kind, spec, (key, i), problems)
            if out is not None:
                resolved[key][i] = out
    return resolved


def validate_point(raw: dict) -> Scenario:
    """Validate one scenario mapping (no sweep expansion); raises ScenarioError."""
    if not isinstance(raw, dict):
        raise ScenarioError([Problem((), f"must be a mapping of keys, got {type(raw).__name__}")])
    problems: list[Problem] = []
    try:
        Scenario.model_validate(raw)
    except ValidationError as e:
        problems += pydantic_problems(e, Scenario)
    b_hat_problems: list[Problem] = []
    raw = _apply_b_hat(raw, b_hat_problems)
    resolved = _plugin_pass(raw, problems)
    problems += b_hat_problems
    if problems:
        raise ScenarioError(problems)
    problems += check_paths(resolved)  # before anything reads a path: nothing blocks
    if problems:
        raise ScenarioError(problems)
    sc = Scenario.model_validate(resolved)
    choice = cross_field(sc, problems)
    if problems:
        raise ScenarioError(problems)
    return sc if choice is None else with_load(sc, choice)
