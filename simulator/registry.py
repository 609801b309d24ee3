"""Plugin kinds, lookup by registered name, and building a plugin from a scenario block.

Every plugin, built-in or third-party, is an entry point in the group ``fedray.<kind>``.
Entry points are read from the installed distributions' metadata, so lookup works the same in
the driver and in fresh Ray worker processes (a decorator-filled registry would be empty there).
A scenario file can only name registered plugins: nothing in YAML is ever imported as a path.

A plugin class must subclass its kind's contract (``strategies.protocols``); one that does
not, and two installed plugins of one kind under one name, are refused in one line when the
kind is looked up.

A class defined in a script or a notebook registers for the session (:func:`register`,
``fedray.register``), checked as an entry point's class is. The processes a run starts
(Ray's actors and tasks) receive the session's classes with the run's Plan
(:class:`SessionPlugins`: unpickling it registers them there); Ray pickles a class of
``__main__`` by value, so it needs no package on any node.
"""

from __future__ import annotations

import collections.abc
import contextlib
import difflib
import functools
import inspect
import types
import typing
from functools import cache
from importlib import import_module
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from pydantic import BaseModel, ConfigDict, create_model, field_validator

from simulator.errors import FedrayError, brief
from strategies.kinds import KINDS as _KINDS

KINDS: tuple[str, ...] = tuple(_KINDS)  # strategies/kinds.py: the one table of kinds

# Non-finite numbers are refused wherever a float is expected (a plugin or a field opts in
# with ``Annotated[float, AllowInfNan(True)]`` where inf means something, such as "no
# clipping"), and a value that is accepted keeps its value through every JSON dump.
FINITE = ConfigDict(allow_inf_nan=False, ser_json_inf_nan="constants")

PluginSpec = dict[str, Any]


def _takes_bool(tp: Any) -> bool:
    """Whether a type hint takes a bool as itself (bool, Any, a Literal of one, a union
    with one of those)."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _takes_bool(typing.get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        return any(_takes_bool(a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return any(isinstance(a, bool) for a in typing.get_args(tp))
    return tp in (bool, Any, object)


def _numeric(tp: Any) -> bool:
    """Whether a type hint takes numbers (int or float, possibly among other things)."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _numeric(typing.get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        return any(_numeric(a) for a in typing.get_args(tp))
    return tp in (int, float)


def bool_for_number(tp: Any, value: Any) -> bool:
    """Whether ``value`` holds a bool where the hint ``tp`` takes a number and no bool:
    pydantic's lax mode reads True as 1, and YAML reads yes, no, on and off as booleans
    (``hidden: [yes]`` was a layer of width 1, ``lr: on`` a learning rate of 1)."""
    if not isinstance(value, (bool, list, tuple, dict)):
        return False  # a scalar that is not a bool: nothing to look for
    if isinstance(value, bool):
        return _numeric(tp) and not _takes_bool(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return bool_for_number(args[0], value)
    if origin in (typing.Union, types.UnionType):
        return all(bool_for_number(a, value) for a in args if a is not type(None)) and \
            any(bool_for_number(a, value) for a in args)
    if isinstance(value, (list, tuple)) and args:
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return any(bool_for_number(a, v) for a, v in zip(args, value))
        if origin in (list, tuple, set, frozenset, collections.abc.Sequence):
            return any(bool_for_number(args[0], v) for v in value)
    if isinstance(value, dict) and origin is dict and len(args) == 2:
        return any(bool_for_number(args[1], v) for v in value.values())
    return False


def _mentions_number(tp: Any) -> bool:
    """Whether int or float appears anywhere in a type hint (what ``bool_for_number`` can
    ever find a bool in place of)."""
    return tp in (int, float) or any(_mentions_number(a) for a in typing.get_args(tp))


@functools.lru_cache(maxsize=4096)
def _number_field(cls: type[BaseModel], name: str) -> Any:
    """The annotation of field ``name`` of ``cls`` when it mentions a number, else None
    (every field of every block of every sweep point is asked: once per field here)."""
    field = cls.model_fields.get(name)
    return field.annotation if field is not None and _mentions_number(field.annotation) \
        else None


def refuse_bool_numbers(cls: type[BaseModel], value: Any, info: Any) -> Any:
    """A before-validator of every field of a scenario model: a bool where a number is
    expected is an error, not 1 or 0."""
    from pydantic_core import PydanticCustomError

    tp = _number_field(cls, info.field_name) if info.field_name else None
    if tp is not None and bool_for_number(tp, value):
        raise PydanticCustomError(
            "bool_for_number", "must be a number, got a boolean (YAML reads true, false, yes, "
            "no, on and off as booleans)")
    return value


# A plugin's integer key without a bound of its own gets this one: no count, size or index a
# simulation takes reaches 2**31, and a larger one validated, then exhausted the machine (a
# layer of 2**62 units) or overflowed a C integer after runs existed
PLUGIN_INT_BOUND = 2**31


def _takes_int(tp: Any) -> bool:
    """Whether a type hint takes integers anywhere (int, or a union, list, tuple or mapping
    of them)."""
    if tp is int:
        return True
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return False
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        return _takes_int(args[0])
    return any(_takes_int(a) for a in args if a is not Ellipsis)


def _out_of_bound(value: Any) -> int | None:
    """The first integer in ``value`` (through lists, tuples and mappings) outside
    (-PLUGIN_INT_BOUND, PLUGIN_INT_BOUND), if any."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if abs(value) >= PLUGIN_INT_BOUND else None
    items = value.values() if isinstance(value, dict) else \
        value if isinstance(value, (list, tuple)) else ()
    return next((v for v in map(_out_of_bound, items) if v is not None), None)


def bound_plugin_ints(cls: type[BaseModel], value: Any, info: Any) -> Any:
    """An after-validator of every key of a plugin's params model: an integer key (as its
    type hint says) whose value is PLUGIN_INT_BOUND or more in size is refused."""
    from pydantic_core import PydanticCustomError

    field = cls.model_fields.get(info.field_name) if info.field_name else None
    if field is not None and _takes_int(field.annotation):
        bad = _out_of_bound(value)
        if bad is not None:
            raise PydanticCustomError(
                "int_bound", "must be > -2**31 and < 2**31 (a plugin's integer), got {got}",
                {"got": brief(bad)})
    return value


class UnknownPlugin(LookupError):
    """A name that no installed plugin of that kind is registered under."""


class BadPlugin(FedrayError):
    """An installed plugin that breaks the contract of its kind (not a subclass of the
    kind's base class, or a name registered twice)."""


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown plugin kind {kind!r}; allowed: {', '.join(KINDS)}")


def _origin(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)  # importlib.metadata sets it on entry points it reads
    return f"{ep.value} (from {dist.name})" if dist is not None else ep.value


@cache
def _entry_points(kind: str) -> dict[str, EntryPoint]:
    out: dict[str, EntryPoint] = {}
    for ep in entry_points(group=f"fedray.{kind}"):
        seen = out.get(ep.name)
        if seen is not None and seen.value != ep.value:
            both = sorted([_origin(seen), _origin(ep)], key=lambda o: "(from fedray)" not in o)
            raise BadPlugin(f"{kind.removesuffix('s')} {ep.name!r} is registered twice: "
                            f"{both[0]} and {both[1]}; uninstall one or rename it")
        out[ep.name] = ep
    return out


def refresh() -> None:
    """Forget cached entry points (after installing a plugin package in this process)."""
    _entry_points.cache_clear()
    _loaded.cache_clear()


def available(kind: str) -> list[str]:
    """Sorted names registered for ``kind`` (installed, and this session's)."""
    _check_kind(kind)
    return sorted({*_entry_points(kind), *_SESSION[kind]})


# this process's plugins registered by ``register`` (a script's or a notebook's classes)
_SESSION: dict[str, dict[str, type]] = {k: {} for k in KINDS}


def register(kind: str, name: str, cls: type) -> type:
    """Register ``cls`` as plugin ``name`` of ``kind`` for this session: a scenario names it
    as an installed plugin, it is checked as one is (BadPlugin in one line), and the runs
    this process starts carry it to their Ray processes (:class:`SessionPlugins`). A name
    an installed plugin has is refused; registering a name again replaces the class (a
    notebook cell run twice)."""
    _check_kind(kind)
    if not isinstance(name, str) or not name.isidentifier():
        raise BadPlugin(f"register: a plugin's name is an identifier (letters, digits, _), "
                        f"got {brief(name)}")
    if name in _entry_points(kind):
        raise BadPlugin(f"{kind.removesuffix('s')} {name!r} is an installed plugin "
                        f"({_origin(_entry_points(kind)[name])}); register yours under "
                        "another name")
    origin = f"{cls.__module__}.{cls.__qualname__}" if inspect.isclass(cls) else brief(cls)
    _SESSION[kind][name] = _checked(kind, name, cls, f"{origin}, registered in this session")
    return cls


def unregister(kind: str, name: str) -> None:
    """Forget a plugin ``register`` registered (nothing when there is none)."""
    _check_kind(kind)
    _SESSION[kind].pop(name, None)


class SessionPlugins:
    """The plugins registered in a process (``register``), carried with a run's Plan to the
    processes it starts: unpickling registers them there (Ray pickles classes of
    ``__main__`` by value). Empty, it costs nothing to pickle."""

    def __init__(self, plugins: dict[str, dict[str, type]]) -> None:
        self.plugins = {k: dict(v) for k, v in plugins.items() if v}

    def __getstate__(self) -> dict[str, dict[str, type]]:
        return self.plugins

    def __setstate__(self, state: dict[str, dict[str, type]]) -> None:
        self.plugins = state
        self.adopt()

    def adopt(self) -> None:
        """Register the carried plugins in this process (as they were where they came from)."""
        for kind, named in self.plugins.items():
            _SESSION[kind].update(named)


def session_plugins() -> SessionPlugins:
    """This process's registered plugins, to carry to another process."""
    return SessionPlugins(_SESSION)


def contract(kind: str) -> type:
    """The base class every plugin of ``kind`` subclasses (``strategies.protocols``)."""
    _check_kind(kind)
    return import_module("strategies.protocols").CONTRACTS[kind]


# kinds whose rules are called with the round's generator, by keyword (deterministic rules
# ignore it): the pipeline calls every rule the same way
GENERATOR_KINDS = ("aggregators", "preaggregators", "meta")
# kinds whose rules may declare traits.weighted, and then take weights=None by keyword
WEIGHTED_KINDS = ("aggregators", "meta")


@cache
def _loaded(kind: str, name: str) -> type:
    ep = _entry_points(kind)[name]
    return _checked(kind, name, ep.load(), _origin(ep))


def _checked(kind: str, name: str, cls: Any, origin: str) -> type:
    """``cls`` if it keeps the contract of ``kind`` (BadPlugin in one line otherwise)."""
    base = contract(kind)
    if not (inspect.isclass(cls) and issubclass(cls, base)):
        raise BadPlugin(f"{kind.removesuffix('s')} {name!r} ({origin}) does not subclass "
                        f"{base.__module__}.{base.__qualname__}, the contract of its kind")
    if kind in GENERATOR_KINDS and "generator" not in inspect.signature(cls.__call__).parameters:
        raise BadPlugin(f"{kind.removesuffix('s')} {name!r} ({origin}): __call__ must take "
                        "generator=None (the one signature of aggregation rules, "
                        f"{base.__module__}.{base.__qualname__}); a deterministic rule ignores it")
    traits = typing.cast(Any, cls).traits  # every contract declares traits
    protocols = import_module("strategies.protocols")  # torch: a plugin is being loaded
    stray = protocols.stray_traits(kind, traits)
    if stray:
        allowed = sorted(protocols.KIND_TRAITS[kind] | protocols.ANY_KIND_TRAITS)
        raise BadPlugin(f"{kind.removesuffix('s')} {name!r} ({origin}): traits "
                        f"{', '.join(stray)} mean nothing to {kind}; remove them (allowed: "
                        f"{', '.join(allowed)})")
    weighted = traits.weighted
    if kind in WEIGHTED_KINDS and weighted and \
            "weights" not in inspect.signature(cls.__call__).parameters:
        raise BadPlugin(f"{kind.removesuffix('s')} {name!r} ({origin}): traits.weighted, "
                        "but __call__ takes no weights=None (the signature of weighted "
                        f"aggregation rules, {base.__module__}.{base.__qualname__})")
    return cls


def unknown_message(kind: str, name: object) -> str:
    """One-line message for an unregistered name: a suggestion and the allowed names."""
    names = available(kind)
    close = difflib.get_close_matches(str(name), names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    allowed = ", ".join(names) if names else "none installed"
    return f"unknown {kind.removesuffix('s')} {name!r}{hint}; available: {allowed}"


def get(kind: str, name: str) -> Any:
    """The plugin class registered as ``name`` in ``fedray.<kind>``, or in this session."""
    _check_kind(kind)
    if name in _SESSION[kind]:
        return _SESSION[kind][name]
    if name not in _entry_points(kind):
        raise UnknownPlugin(unknown_message(kind, name))
    return _loaded(kind, name)


def instantiate(kind: str, spec: PluginSpec, **context: Any) -> Any:
    """The plugin a validated spec ``{"name": ..., **keys}`` names. ``context`` offers what
    the engine can supply; the plugin receives the entries its ``traits.context`` lists."""
    cls = get(kind, spec["name"])
    wanted = cls.traits.context
    missing = [k for k in wanted if k not in context]
    if missing:
        raise BadPlugin(f"{kind.removesuffix('s')} {spec['name']!r} asks for "
                        f"{', '.join(missing)}, which the engine does not supply to {kind}")
    params = {k: v for k, v in spec.items() if k != "name"}
    return cls(**{k: context[k] for k in wanted}, **params)


def params_model(cls: Any) -> type[BaseModel]:
    """A pydantic model of a plugin's scenario keys, derived from its constructor signature
    (type hints with annotated_types constraints, defaults). The arguments the engine
    supplies (``traits.context``) are not scenario keys. Built once per class (a sweep
    validates every point's blocks with it)."""
    return _params_model(cls)


@functools.lru_cache(maxsize=512)
def _params_model(cls: Any) -> type[BaseModel]:
    """``params_model``, uncached."""
    init = cls.__init__
    skip = {"self", *cls.traits.context}
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
    return create_model(f"{cls.__name__}Params",
                        __config__=ConfigDict(extra="forbid", **FINITE),
                        __validators__={
                            "_no_bool_numbers": field_validator("*", mode="before")(
                                refuse_bool_numbers),
                            "_bounded_ints": field_validator("*", mode="after")(
                                bound_plugin_ints)}, **fields)


def keys(kind: str, name: str) -> dict[str, Any]:
    """The scenario keys a plugin takes, with their defaults (``...``: required)."""
    return {k: ... if f.is_required() else f.default
            for k, f in params_model(get(kind, name)).model_fields.items()}


def type_text(tp: Any) -> str:
    """A type hint as a person reads it: ``int >= 1``, ``list[int]``, ``'batch' | 'group'``."""
    import annotated_types as at

    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        base, *meta = typing.get_args(tp)
        bounds = []
        for m in meta:
            for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
                if isinstance(m, getattr(at, attr.capitalize())):
                    bounds.append(f"{sign} {getattr(m, attr)}")
            if isinstance(m, at.Len):
                bounds.append(f"length {m.min_length}..{m.max_length}")
        return " ".join([type_text(base), *bounds])
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in typing.get_args(tp))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_text(a) for a in typing.get_args(tp))}]"
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))


def describe(kind: str, name: str) -> dict[str, Any]:
    """A plugin for ``fedray list -v``: the first paragraph of its docstring (what it does
    and the paper it follows) and, per scenario key, its type and default."""
    cls = get(kind, name)
    doc = inspect.getdoc(cls) or ""
    hints: dict[str, Any] = {}
    with contextlib.suppress(Exception):  # unresolvable hints: keys without types
        hints = typing.get_type_hints(cls.__init__, include_extras=True)
    return {"doc": " ".join(doc.split("\n\n")[0].split()),
            "keys": {k: (type_text(hints[k]) if k in hints else "any", d)
                     for k, d in keys(kind, name).items()}}
