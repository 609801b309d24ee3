"""Round checkpoints and resume.

A checkpoint holds everything a run's future depends on after round r: the server's model,
optimizer and aggregation-rule state (or, for D-SGD, every honest peer's model), the
clients' state kept by the workers (worker momentum, mu2-SGD), the round number and the
metrics so far. No random generator state is needed: every draw is derived from (seed,
purpose, round, client). Files are written atomically and hold only tensors, numbers,
strings, lists and dicts, so they load with ``torch.load(weights_only=True)``: nothing is
unpickled.

Checkpoints live in ``.fedray/checkpoints/<run_id>/round_<r>.pt`` under the directory
``fedray`` runs from; the run's resolved scenario is an artifact of its MLflow run.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from simulator.errors import CheckpointUnreadable
from simulator.run.removed import WorkingDirectoryGone, working_directory_removed

__all__ = ["WorkingDirectoryGone", "latest", "remove", "run_dir", "save", "working_dir"]

ROOT = Path(".fedray") / "checkpoints"
_NAME = re.compile(r"round_(\d+)\.pt$")


def working_dir() -> Path:
    """``Path.cwd()``; a working directory removed under the running process (a Ray job's
    ``--working-dir`` is a temporary folder that Ray may remove or extract again) is
    WorkingDirectoryGone, one line, where ``Path.cwd()`` raised FileNotFoundError."""
    try:
        return Path.cwd()
    except FileNotFoundError:
        raise working_directory_removed(None) from None


def run_dir(run_id: str, base: Path | None = None) -> Path:
    return (base or working_dir()) / ROOT / run_id


def save(run_id: str, round_: int, state: dict[str, Any], base: Path | None = None,
         keep: int = 2) -> Path:
    """Write the state after ``round_`` (atomically) and keep the ``keep`` newest files."""
    d = run_dir(run_id, base)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"round_{round_:06d}.pt"
    tmp = path.with_suffix(".tmp")
    import torch  # here: torch's import is for the commands that write checkpoints

    torch.save({**state, "round": int(round_)}, tmp)
    os.replace(tmp, path)
    for old in sorted(d.glob("round_*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return path


def latest(run_id: str, base: Path | None = None) -> dict[str, Any] | None:
    """The newest checkpoint of ``run_id`` (``None`` when there is none)."""
    d = run_dir(run_id, base)
    files = sorted(p for p in d.glob("round_*.pt") if _NAME.search(p.name)) if d.is_dir() else []
    if not files:
        return None
    import torch

    try:
        return torch.load(files[-1], weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch/pickle/zip errors: one line, no unsafe advice
        raise CheckpointUnreadable(
            f"checkpoint {files[-1]} cannot be read ({type(e).__name__}); move it away to "
            f"resume from the one before it, or remove {d} to start the run over") from None


def remove(run_id: str, base: Path | None = None) -> None:
    """Forget a finished run's checkpoints (none to forget when the working directory they
    were in was removed)."""
    try:
        d = run_dir(run_id, base)
    except WorkingDirectoryGone:
        return
    shutil.rmtree(d, ignore_errors=True)
