"""The aggregation pipeline of a scenario: pre-aggregators -> aggregator -> meta-aggregator.

One class used by the Server (which steps it every round) and by the Adversary (whose optimal
attacks simulate it). Random rules get a generator derived from (seed, rule, round), so the
pipeline is a pure function of its input, its state and the round.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from simulator.errors import TooFewRows, guarded
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
        self.names = {"aggregator": aggregator["name"], "meta": meta["name"] if meta else "",
                      **{f"preaggregators[{i}]": s["name"] for i, s in enumerate(preaggregators)}}
        self.seed = seed

    def check(self, n: int) -> None:
        """Raise TooFewRows when a rule cannot take the rows it would get from ``n`` updates
        (each rule's ``check``, as scenario validation runs it for the full sample)."""
        rules = [(f"preaggregators[{i}]", p) for i, p in enumerate(self.pre)]
        for where, rule in rules:
            self._check_rule(where, rule, n)
            n = rule.output_rows(n) if hasattr(rule, "output_rows") else n
        if self.meta is not None:
            self._check_rule("meta", self.meta, n)
            n = self.meta.output_rows(n) if hasattr(self.meta, "output_rows") else n
        self._check_rule("aggregator", self.aggregator, n)

    def _check_rule(self, where: str, rule: Any, n: int) -> None:
        if not hasattr(rule, "check"):
            return
        try:
            rule.check(n)
        except ValueError as e:  # check()'s contract: ValueError when n rows are too few
            raise TooFewRows(f"{where} {self.names[where]!r} with {n} rows: {e}") from None

    @classmethod
    def from_scenario(cls, scenario: dict) -> Pipeline:
        return cls(scenario["preaggregators"], scenario["aggregator"], scenario.get("meta"),
                   scenario["seeds"][0])

    def aggregate(self, x: torch.Tensor, round_: int) -> torch.Tensor:
        """``(n, d)`` updates -> ``(d,)`` aggregate; advances stateful rules. Raises
        TooFewRows when ``n`` is below what a rule accepts, PluginError when a rule fails."""
        self.check(x.shape[0])
        for i, p in enumerate(self.pre):
            where = f"preaggregators[{i}]"
            x = guarded(where, self.names[where],
                         _bind(p, torch_generator(self.seed, "preaggregator", round_, i)))(x)
        agg = guarded("aggregator", self.names["aggregator"],
                       _bind(self.aggregator, torch_generator(self.seed, "aggregator", round_)))
        if self.meta is None:
            return agg(x)
        meta = guarded("meta", self.names["meta"], self.meta)
        if getattr(self.meta, "RANDOM", False):
            return meta(x, agg, torch_generator(self.seed, "meta", round_))
        return meta(x, agg)

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
