"""Where a scenario holds plugin blocks (``{name: ..., keys}``), by kind: one table, which
validation (the plugin pass), loading (relative paths) and the path walk read; and the two
helpers they share to reach a block in a raw mapping and the class it names."""

from __future__ import annotations

from typing import Any

from simulator import registry
from simulator.config.errors import Loc

PLUGIN_FIELDS: list[tuple[Loc, str]] = [
    (("data", "dataset"), "datasets"),
    (("data", "partitioner"), "partitioners"),
    (("model",), "models"),
    (("task",), "tasks"),
    (("aggregator",), "aggregators"),
    (("meta",), "meta"),
    (("attack",), "attacks"),
    (("server", "optimizer"), "optimizers"),
    (("local", "optimizer"), "client_optimizers"),
    (("local", "trainer"), "trainers"),
    (("topology",), "topologies"),
    (("privacy",), "privacy"),
]
# the scenario's lists of plugin blocks: (key, kind)
PLUGIN_LISTS: tuple[tuple[str, str], ...] = (
    ("preaggregators", "preaggregators"), ("codecs", "codecs"), ("downlink", "codecs"),
    ("privacy_attacks", "privacy_attacks"))


def get_path(d: Any, loc: Loc) -> Any:
    for p in loc:
        if isinstance(d, dict) and p in d or isinstance(d, list) and isinstance(p, int) and p < len(d):
            d = d[p]
        else:
            return None
    return d


def plugin_class(kind: str, spec: Any) -> Any:
    """The registered class a raw plugin block names, or None (not a block, or an unknown
    name: the plugin pass reports those)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        return None
    try:
        return registry.get(kind, spec["name"])
    except registry.UnknownPlugin:
        return None
