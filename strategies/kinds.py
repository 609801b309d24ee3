"""The plugin kinds: the one table that every list of kinds derives from.

Each kind is an entry-point group ``fedray.<kind>`` and has one base class in
``strategies.protocols`` (named here; ``protocols.CONTRACTS`` maps each kind to the class).
The registry's kinds, ``fedray list`` and the contracts come from this table, in its order
(the order ``fedray list`` prints); the entry-point groups of pyproject.toml are checked
against it by a test (tests/strategies/test_protocols.py). The module imports nothing, so
that ``fedray list`` reads it without importing torch.
"""

from __future__ import annotations

__all__ = ["KINDS"]

KINDS: dict[str, str] = {  # kind -> the name of its base class in strategies.protocols
    "aggregators": "Aggregator",
    "preaggregators": "PreAggregator",
    "meta": "MetaAggregator",
    "attacks": "BaseAttack",
    "topologies": "Topology",
    "gossip_defenses": "GossipDefense",
    "datasets": "Dataset",
    "models": "Model",
    "optimizers": "ServerOptimizer",
    "client_optimizers": "ClientRule",
    "trainers": "Trainer",
    "partitioners": "Partitioner",
    "privacy": "Privacy",
    "privacy_attacks": "PrivacyAttack",
    "codecs": "Codec",
    "tasks": "Task",
}
