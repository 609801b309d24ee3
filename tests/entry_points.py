"""Entry points a plugin package would declare, added for one test (``registered``), as an
installed distribution's ``pyproject.toml`` would add them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import EntryPoint

import pytest

from simulator import registry


@contextmanager
def registered(monkeypatch: pytest.MonkeyPatch, extra: dict[str, dict[str, str]]
               ) -> Iterator[None]:
    """The registry with ``extra`` ({kind: {name: "module:Class"}}) beside the installed
    entry points, until the block ends."""
    real = registry._entry_points.__wrapped__

    def entry_points(kind: str) -> dict[str, EntryPoint]:
        out = dict(real(kind))
        for name, value in extra.get(kind, {}).items():
            out[name] = EntryPoint(name, value, f"fedray.{kind}")
        return out

    registry.refresh()
    monkeypatch.setattr(registry, "_entry_points", entry_points)
    try:
        yield
    finally:
        monkeypatch.undo()
        registry.refresh()
