"""Every key of a scenario that holds a path, found by walking the schema (keys marked
``PathKey``) and every plugin block's ``traits.path_params``, and each one checked by the
one guard (``strategies.paths.guard``: what the key expects, no FIFO, device, socket or
symbolic-link loop) before any check or run reads it. A new path key is covered the moment
it is declared."""

from __future__ import annotations

import functools
import typing
from typing import Annotated, Any, NamedTuple

from pydantic import BaseModel

from simulator.config.blocks import PLUGIN_FIELDS, get_path, plugin_class
from simulator.config.errors import Loc, Problem
from simulator.config.schema import PathKey, Scenario
from strategies.paths import PathKind, PathRefused, guard

ANY = "*"  # a list's or a mapping's every entry, in a location


def _marker(annotation: Any, metadata: list[Any]) -> PathKey | None:
    """The PathKey a field's annotation carries (at its top, or inside Optional)."""
    for m in metadata:
        if isinstance(m, PathKey):
            return m
    if typing.get_origin(annotation) is Annotated:
        return _marker(None, list(annotation.__metadata__))
    for arg in typing.get_args(annotation) if typing.get_origin(annotation) else ():
        found = _marker(arg, [])
        if found is not None:
            return found
    return None


def _models(annotation: Any) -> list[tuple[tuple[str, ...], type[BaseModel]]]:
    """The pydantic models inside ``annotation``, each with the location steps that reach
    it (``()`` directly or through Optional, ``("*",)`` through a list or a mapping)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [((), annotation)]
    origin = typing.get_origin(annotation)
    if origin is None:
        return []
    step: tuple[str, ...] = (ANY,) if origin in (list, dict, tuple, set) else ()
    args = typing.get_args(annotation)
    if origin is dict:
        args = args[1:]
    elif origin is Annotated:
        args = args[:1]
    return [(step + s, m) for a in args for s, m in _models(a)]


def schema_path_keys(model: type[BaseModel] = Scenario, prefix: Loc = ()
                     ) -> list[tuple[Loc, PathKind]]:
    """Every schema key marked ``PathKey`` under ``model``, with what it names."""
    return list(_schema_path_keys(model, prefix))


@functools.lru_cache(maxsize=64)
def _schema_path_keys(model: type[BaseModel], prefix: Loc) -> tuple[tuple[Loc, PathKind], ...]:
    """``schema_path_keys``, walked once per model (a sweep's every point asks)."""
    out: list[tuple[Loc, PathKind]] = []
    for name, f in model.model_fields.items():
        key = _marker(f.annotation, list(f.metadata))
        if key is not None:
            out.append(((*prefix, name), key.kind))
            continue
        for steps, sub in _models(f.annotation):
            out += _schema_path_keys(sub, (*prefix, name, *steps))
    return tuple(out)


def _at(doc: Any, loc: Loc) -> list[tuple[Loc, Any]]:
    """The values at ``loc`` in ``doc`` (``*`` steps expanded), with their locations."""
    found: list[tuple[Loc, Any]] = [((), doc)]
    for part in loc:
        nxt: list[tuple[Loc, Any]] = []
        for where, d in found:
            if part == ANY:
                items = d.items() if isinstance(d, dict) else \
                    enumerate(d) if isinstance(d, list) else ()
                nxt += [((*where, k), v) for k, v in items]
            elif isinstance(d, dict) and part in d:
                nxt.append(((*where, part), d[part]))
        found = nxt
    return found


def plugin_blocks(doc: dict) -> list[tuple[Loc, str, Any]]:
    """Every plugin block of a scenario mapping: (location, kind, block)."""
    blocks = [(loc, kind, get_path(doc, loc)) for loc, kind in PLUGIN_FIELDS]
    pre = doc.get("preaggregators")
    blocks += [(("preaggregators", i), "preaggregators", spec)
               for i, spec in enumerate(pre if isinstance(pre, list) else [])]
    return [b for b in blocks if isinstance(b[2], dict)]


class PathKeyAt(NamedTuple):
    """A path key in a scenario mapping: where, the block holding it, the key, what it
    names, and whether the plugin creates it (``traits.created_params``)."""

    loc: Loc
    block: dict
    key: str
    kind: PathKind
    created: bool = False


def path_keys(doc: dict) -> list[PathKeyAt]:
    """Every path key present in the scenario mapping ``doc``, the schema's and the
    plugins' alike."""
    out: list[PathKeyAt] = []
    for loc, kind in schema_path_keys():
        for where, block in _at(doc, loc[:-1]):
            if isinstance(block, dict) and loc[-1] in block:
                out.append(PathKeyAt((*where, loc[-1]), block, str(loc[-1]), kind))
    for loc, plugin_kind, spec in plugin_blocks(doc):
        traits = getattr(plugin_class(plugin_kind, spec), "traits", None)
        if traits is None:
            continue
        out += [PathKeyAt((*loc, key), spec, key, traits.path_kind(key),
                          key in traits.created_params)
                for key in traits.path_params if key in spec]
    return out


def check_paths(doc: dict) -> list[Problem]:
    """A problem for each path key of ``doc`` whose path is not what the key expects
    (``strategies.paths.guard``); nothing is opened."""
    problems = []
    for loc, block, key, kind, created in path_keys(doc):
        value = block[key]
        if value is None:
            continue
        if not isinstance(value, str):
            continue  # the structure pass reports a value that is not text
        try:
            guard(value, kind, missing_ok=created)
        except PathRefused as e:
            problems.append(Problem(loc, str(e)))
    return problems
