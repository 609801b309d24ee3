"""Plugin kinds and lookup by registered name.

Every plugin, built-in or third-party, is an entry point in the group ``fedray.<kind>``.
Entry points are read from the installed distributions' metadata, so lookup works the same in
the driver and in fresh Ray worker processes (a decorator-filled registry would be empty there).
A scenario file can only name registered plugins: nothing in YAML is ever imported as a path.
"""

from __future__ import annotations

import difflib
from functools import cache
from importlib.metadata import entry_points
from typing import Any

KINDS: tuple[str, ...] = (
    "aggregators",
    "preaggregators",
    "meta",
    "attacks",
    "topologies",
    "datasets",
    "models",
    "optimizers",
    "client_optimizers",
    "partitioners",
    "privacy",
)


class UnknownPlugin(LookupError):
    """A name that no installed plugin of that kind is registered under."""


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown plugin kind {kind!r}; allowed: {', '.join(KINDS)}")


@cache
def _entry_points(kind: str) -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=f"fedray.{kind}")}


def refresh() -> None:
    """Forget cached entry points (after installing a plugin package in this process)."""
    _entry_points.cache_clear()
    _loaded.cache_clear()


def available(kind: str) -> list[str]:
    """Sorted names registered for ``kind``."""
    _check_kind(kind)
    return sorted(_entry_points(kind))


@cache
def _loaded(kind: str, name: str) -> Any:
    return _entry_points(kind)[name].load()


def unknown_message(kind: str, name: object) -> str:
    """One-line message for an unregistered name: a suggestion and the allowed names."""
    names = available(kind)
    close = difflib.get_close_matches(str(name), names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    allowed = ", ".join(names) if names else "none installed"
    return f"unknown {kind.removesuffix('s')} {name!r}{hint}; available: {allowed}"


def get(kind: str, name: str) -> Any:
    """The plugin class (or factory) registered as ``name`` in ``fedray.<kind>``."""
    _check_kind(kind)
    if name not in _entry_points(kind):
        raise UnknownPlugin(unknown_message(kind, name))
    return _loaded(kind, name)
