"""Every random draw of a run is derived from (seed, purpose, round, client): a retry, another
backend or another number of workers draws exactly the same numbers."""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported by the draws that need it, not by numpy's
    import torch


def _key(part: int | str) -> int:
    return zlib.crc32(part.encode()) if isinstance(part, str) else int(part)


def derive_seed(seed: int, *parts: int | str) -> int:
    """A 63-bit integer seed that depends only on ``seed`` and ``parts``."""
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, *(_key(p) for p in parts)])
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def numpy_rng(seed: int, *parts: int | str) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, *parts))


def torch_generator(seed: int, *parts: int | str) -> torch.Generator:
    import torch

    return torch.Generator().manual_seed(derive_seed(seed, *parts))
