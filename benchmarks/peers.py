"""Loading peer libraries for benchmarks and agreement tests (never a runtime dependency).

ByzFL 0.0.11 is installed with ``--no-deps`` (the Makefile does it): it asks for torchvision,
whose PyPI build does not load beside the CPU build of torch used here. Its package
``__init__`` imports its training framework (torchvision), so its aggregators and attacks,
which need only numpy, torch and scipy, are loaded under a bare package object.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator


@contextlib.contextmanager
def byzfl() -> Iterator[types.SimpleNamespace]:
    """ByzFL's aggregator, pre-aggregator and attack classes, by their ByzFL names."""
    spec = importlib.util.find_spec("byzfl")
    if spec is None:
        raise ModuleNotFoundError("byzfl is not installed: run `make install` "
                                  "(pip install --no-deps byzfl==0.0.11)")
    saved = {k: v for k, v in sys.modules.items() if k == "byzfl" or k.startswith("byzfl.")}
    pkg = types.ModuleType("byzfl")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["byzfl"] = pkg
    try:
        mods = [importlib.import_module(m) for m in ("byzfl.aggregators", "byzfl.attacks")]
        yield types.SimpleNamespace(**{k: getattr(m, k) for m in mods for k in dir(m) if k[0].isupper()})
    finally:
        for k in [k for k in sys.modules if k == "byzfl" or k.startswith("byzfl.")]:
            del sys.modules[k]
        sys.modules.update(saved)
