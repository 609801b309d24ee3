"""One MLflow run as the report reads it: its name, seed, tags, params and metric history,
and what the report draws of its artifacts (a DP run's trade-off curve, a reconstruction
attack's first samples)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Reconstruction:
    """A reconstruction attack's first samples (``privacy/attack_<name>.parquet``'s rows:
    sample, client, label, reconstructed_label, psnr, truth, reconstruction, shape) and how
    many the attacked client had (``total``)."""

    rows: list[dict[str, Any]]
    total: int


@dataclass
class RunData:
    run_id: str
    name: str
    group: str  # the run name without its seed
    seed: str
    tags: dict[str, str]
    params: dict[str, str]
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    tradeoff: tuple[list[float], list[float]] | None = None  # (alpha, beta) of a DP run
    # a reconstruction attack's samples by its name (the first seed of a sweep point only)
    reconstructions: dict[str, Reconstruction] = field(default_factory=dict)

    def final(self, key: str) -> float:
        h = self.history.get(key)
        return h[-1][1] if h else math.nan

    @property
    def diverged(self) -> bool:
        """Whether the run diverged: its final test loss or accuracy is not finite, or the
        aggregate was not finite in some round (the server then keeps the model, so the
        accuracy it logs is that of a model the rule no longer moves)."""
        if any(v != 0 for _, v in self.history.get("nonfinite_aggregate", [])):
            return True
        return any(key in self.history and not math.isfinite(self.final(key))
                   for key in ("test_loss", "test_accuracy"))
