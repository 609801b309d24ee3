"""What the conformance suites run every registered plugin with (tests only).

A plugin that is not listed here runs with its defaults, so it is covered the moment it is
registered. Rules taking ``f`` get the number of Byzantine rows of the test matrices."""

from __future__ import annotations

import torch

from simulator import registry
from simulator.registry import instantiate

N, F, D = 11, 2, 16

PARAMS: dict[str, dict[str, dict]] = {
    "aggregators": {
        "cwtm": {"f": F}, "meamed": {"f": F}, "krum": {"f": F}, "multikrum": {"f": F},
        "bulyan": {"f": F}, "mda": {"f": F}, "monna": {"f": F}, "caf": {"f": F},
        "smea": {"f": F}, "dnc": {"f": F, "subsample_dim": 8},
        "cc": {"tau": 10.0, "iterations": 3},
    },
    "preaggregators": {"nnm": {"f": F}, "arc": {"f": F}, "bucketing": {"s": 2}},
    "meta": {"ctma": {"f": F}, "nnm": {"f": F}, "bucketing": {"s": 2}},
    "attacks": {},
}


def build(kind: str, name: str, **context):
    return instantiate(kind, {"name": name, **PARAMS[kind].get(name, {})}, **context)


def call(rule, x: torch.Tensor, seed: int = 0):
    """Call a pre-aggregator/aggregator with a fresh seeded generator if it is random."""
    if getattr(rule, "RANDOM", False):
        return rule(x, torch.Generator().manual_seed(seed))
    return rule(x)


def names(kind: str) -> list[str]:
    return registry.available(kind)
