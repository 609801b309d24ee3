"""The environment of a ``runtime.deterministic: strict`` process (why each variable:
``simulator.runtime.kernels``, which pins and checks the kernels in a process). Here without
torch, for the command line: whether this process started pinned, and the Ray options that
start an actor or a task pinned."""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable, Mapping
from typing import Any

from simulator.errors import UsageError

# the features this numpy dispatches its kernels on, above its baseline (X86_V3, X86_V4...)
NUMPY_DISPATCH: tuple[str, ...] = tuple(importlib.import_module("numpy._core._multiarray_umath").__cpu_dispatch__)
PINNED_ENV: Mapping[str, str] = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    **({"NPY_DISABLE_CPU_FEATURES": ",".join(NUMPY_DISPATCH)} if NUMPY_DISPATCH else {}),
}


class NeedsPinnedProcess(UsageError):
    """A strict run asked of a process that did not start with :data:`PINNED_ENV`, before
    anything ran: the ``fedray`` command restarts itself pinned on it (``fedray.cli``)."""


def require_pinned(modes: Iterable[bool | str], what: str) -> None:
    """Before a process computes runs whose ``runtime.deterministic`` values are ``modes``:
    raise :class:`NeedsPinnedProcess` if one is ``strict`` and this process did not start
    pinned, and refuse strict beside other values (pinned kernels would compute those too:
    each needs its own process, as ``fedray sweep``'s points have)."""
    modes = set(modes)
    if "strict" not in modes:
        return
    if len(modes) > 1:
        raise UsageError(
            f"runtime.deterministic: {what} mixes strict with "
            f"{', '.join(sorted(str(m).lower() for m in modes - {'strict'}))} in one process, "
            "where the pinned kernels would compute every point; run it with `fedray sweep` "
            "(each point its own process) or split it")
    if not environment_pinned():
        raise NeedsPinnedProcess(
            f"{what} is runtime.deterministic: strict: it runs in a process started with "
            + " ".join(f"{k}={v}" for k, v in PINNED_ENV.items())
            + " (the fedray command restarts itself so)")


def environment_pinned(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``env`` (default: this process's) carries :data:`PINNED_ENV`."""
    env = os.environ if env is None else env
    return all(env.get(k) == v for k, v in PINNED_ENV.items())


def pinned_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with :data:`PINNED_ENV` over it: the environment
    a process needs to start with."""
    return {**(os.environ if env is None else env), **PINNED_ENV}


def strict_options(strict: bool) -> dict[str, Any]:
    """Ray options that start an actor or a task in a fresh process with the pinned
    environment (a worker process with another environment is never reused for it)."""
    return {"runtime_env": {"env_vars": dict(PINNED_ENV)}} if strict else {}
