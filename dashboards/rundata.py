"""One MLflow run as the report reads it: its name, seed, tags, params and metric history."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


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
