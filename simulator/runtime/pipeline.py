"""The aggregation pipeline of a scenario: pre-aggregators -> aggregator -> meta-aggregator.

One class used by the Server (which steps it every round) and by the Adversary (whose optimal
attacks simulate it). Every rule is called with a generator derived from (seed, rule, round)
(deterministic rules ignore it), so the pipeline is a pure function of its input, its state
and the round. Given weights (one per row: an asynchronous server's), it hands them to the
aggregator and the meta-aggregator, which must both have a weighted definition
(``traits.weighted``); pre-aggregators take none.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from simulator.config.plan import PipelinePlan
from simulator.errors import TooFewRows, guarded
from simulator.registry import PluginSpec, instantiate
from simulator.seeding import torch_generator
from strategies.protocols import (
    Aggregator,
    MetaAggregator,
    Plugin,
    PreAggregator,
    Stateful,
    check_weights,
)


class Pipeline:
    def __init__(self, preaggregators: list[PluginSpec], aggregator: PluginSpec,
                 meta: PluginSpec | None, seed: int) -> None:
        self.pre: list[PreAggregator] = [instantiate("preaggregators", s) for s in preaggregators]
        self.aggregator: Aggregator = instantiate("aggregators", aggregator)
        self.meta: MetaAggregator | None = instantiate("meta", meta) if meta else None
        self.names = {"aggregator": aggregator["name"], "meta": meta["name"] if meta else "",
                      **{f"preaggregators[{i}]": s["name"] for i, s in enumerate(preaggregators)}}
        self.seed = seed

    def check(self, n: int) -> None:
        """Raise TooFewRows when a rule cannot take the rows it would get from ``n`` updates
        (each rule's ``check``, as scenario validation runs it for the full sample)."""
        rules = [(f"preaggregators[{i}]", p) for i, p in enumerate(self.pre)]
        for where, rule in rules:
            self._check_rule(where, rule, n)
            n = rule.output_rows(n)
        if self.meta is not None:
            self._check_rule("meta", self.meta, n)
            n = self.meta.output_rows(n)
        self._check_rule("aggregator", self.aggregator, n)

    def _check_rule(self, where: str, rule: Plugin, n: int) -> None:
        try:
            rule.check(n)
        except ValueError as e:  # check()'s contract: ValueError when n rows are too few
            raise TooFewRows(f"{where} {self.names[where]!r} with {n} rows: {e}") from None

    @classmethod
    def from_plan(cls, plan: PipelinePlan, seed: int) -> Pipeline:
        """The pipeline a Plan names, its random rules seeded from ``seed``."""
        return cls(list(plan.preaggregators), plan.aggregator, plan.meta, seed)

    def check_weighted(self) -> None:
        """Raise ValueError, in one line naming the rule, unless every rule of the pipeline
        takes weights (``traits.weighted``; pre-aggregators never do)."""
        rules: list[tuple[str, Plugin]] = [
            *((f"preaggregators[{i}]", p) for i, p in enumerate(self.pre)),
            ("aggregator", self.aggregator),
            *((("meta", self.meta),) if self.meta is not None else ())]
        for where, rule in rules:
            if not rule.traits.weighted:
                raise ValueError(f"{where} {self.names[where]!r} has no weighted definition "
                                 "(traits.weighted): it cannot aggregate rows with weights")

    def aggregate(self, x: torch.Tensor, round_: int, weights: torch.Tensor | None = None,
                  reference: torch.Tensor | None = None) -> torch.Tensor:
        """``(n, d)`` updates -> ``(d,)`` aggregate; advances stateful rules. ``weights``:
        None, or one positive weight per row (``strategies.protocols.check_weights``) for
        the aggregator and the meta-aggregator. ``reference``: the server's own update, for
        an aggregator with ``traits.reference`` (FLTrust). Raises TooFewRows when ``n`` is below what a
        rule accepts, ValueError when given weights that a rule cannot take or that are not
        one positive number per row, PluginError when a rule fails."""
        self.check(x.shape[0])
        if weights is not None:
            self.check_weighted()
            check_weights(weights, x.shape[0])
        for i, p in enumerate(self.pre):
            where = f"preaggregators[{i}]"
            x = guarded(where, self.names[where], p)(
                x, generator=torch_generator(self.seed, "preaggregator", round_, i))
        aggregator, g = self.aggregator, torch_generator(self.seed, "aggregator", round_)

        extra = {"reference": reference} if aggregator.traits.reference else {}

        def call(rows: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
            if weights is None:
                return aggregator(rows, generator=g, **extra)
            return aggregator(rows, generator=g, weights=weights, **extra)  # type: ignore[call-arg]

        agg = guarded("aggregator", self.names["aggregator"], call)
        if self.meta is None:
            return agg(x) if weights is None else agg(x, weights=weights)
        meta = guarded("meta", self.names["meta"], self.meta)
        gm = torch_generator(self.seed, "meta", round_)
        if weights is None:
            return meta(x, agg, generator=gm)
        return meta(x, agg, generator=gm, weights=weights)

    def simulate(self, x: torch.Tensor, round_: int, weights: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """``aggregate`` on a copy: the pipeline's own state does not move."""
        return copy.deepcopy(self).aggregate(x, round_, weights)

    def _stateful(self) -> dict[str, Stateful]:
        rules: dict[str, Stateful] = {f"preaggregators.{i}": p for i, p in enumerate(self.pre)}
        rules["aggregator"] = self.aggregator
        if self.meta is not None:
            rules["meta"] = self.meta
        return rules

    def state_dict(self) -> dict[str, Any]:
        """The state of the rules that hold some (by their place in the pipeline)."""
        return {k: s for k, r in self._stateful().items() if (s := r.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, r in self._stateful().items():
            if k in state:  # a checkpoint omits the rules that held no state
                r.load_state_dict(state[k])
