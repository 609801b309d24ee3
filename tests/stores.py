"""Running a scenario given as text into a test's own store (the store from the ``new_store``
fixture of tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path


def run_text(folder: Path, uri: str, text: str, file: str = "s.yaml", **kwargs):
    """``fedray run`` of a scenario given as ``text`` (written to ``folder/file``) into
    ``uri``, quietly; ``kwargs`` go to ``run_loaded``."""
    from simulator.config.load import load
    from simulator.run.runner import run_loaded

    (folder / file).write_text(text)
    return run_loaded(load(folder / file), tracking_uri=uri, quiet=True, **kwargs)
