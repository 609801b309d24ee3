"""The aggregation pipeline of a scenario: pre-aggregators -> aggregator -> meta-aggregator.

One class used by the Server (which steps it every round) and by the Adversary (whose optimal
attacks simulate it). Random rules get a generator derived from (seed, rule, round), so the
pipeline is a pure function of its input, its state and the round.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from simulator.scenario import instantiate
from simulator.seeding import torch_generator


def _bind(rule: Any, generator: torch.Generator):
    if getattr(rule, "RANDOM", False):
        return lambda x: rule(x, generator)
    return rule


class Pipeline:
    def __init__(self, preaggregators: list[dict], aggregator: dict, meta: dict | None,
                 seed: int) -> None:
        self.pre = [instantiate("preaggregators", s) for s in preaggregators]
        self.aggregator = instantiate("aggregators", aggregator)
        self.meta = instantiate("meta", meta) if meta else None
        self.seed = seed

    @classmethod
    def from_scenario(cls, scenario: dict) -> Pipeline:
        return cls(scenario["preaggregators"], scenario["aggregator"], scenario.get("meta"),
                   scenario["seeds"][0])

    def aggregate(self, x: torch.Tensor, round_: int) -> torch.Tensor:
        """``(n, d)`` updates -> ``(d,)`` aggregate; advances stateful rules."""
        for i, p in enumerate(self.pre):
            x = _bind(p, torch_generator(self.seed, "preaggregator", round_, i))(x)
        agg = _bind(self.aggregator, torch_generator(self.seed, "aggregator", round_))
        if self.meta is None:
            return agg(x)
        if getattr(self.meta, "RANDOM", False):
            return self.meta(x, agg, torch_generator(self.seed, "meta", round_))
        return self.meta(x, agg)

    def simulate(self, x: torch.Tensor, round_: int) -> torch.Tensor:
        """``aggregate`` on a copy: the pipeline's own state does not move."""
        return copy.deepcopy(self).aggregate(x, round_)

    def _stateful(self) -> dict[str, Any]:
        rules = {f"preaggregators.{i}": p for i, p in enumerate(self.pre)}
        rules["aggregator"] = self.aggregator
        if self.meta is not None:
            rules["meta"] = self.meta
        return {k: r for k, r in rules.items() if hasattr(r, "state_dict")}

    def state_dict(self) -> dict[str, Any]:
        return {k: r.state_dict() for k, r in self._stateful().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, r in self._stateful().items():
            r.load_state_dict(state[k])
