"""The contract file itself: one table of kinds, traits in place of class attributes."""

from __future__ import annotations

import inspect
import tomllib
from pathlib import Path

from simulator import registry
from strategies import protocols
from strategies.kinds import KINDS

ROOT = Path(__file__).resolve().parents[2]


def test_pyprojects_entry_point_groups_are_the_kinds():
    """Packaging needs the groups written in pyproject.toml: they must be the table's kinds."""
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert sorted(g.removeprefix("fedray.") for g in groups if g.startswith("fedray.")) == \
        sorted(KINDS)
    assert all(g.startswith("fedray.") for g in groups)


def test_each_kind_has_its_base_class_in_the_contracts():
    assert list(protocols.CONTRACTS) == list(KINDS)
    for kind, base in protocols.CONTRACTS.items():
        assert inspect.isclass(base) and base.__name__ == KINDS[kind]
        assert base.__module__ == "strategies.protocols" and base.__name__ in protocols.__all__


def test_the_registry_and_the_scenario_use_the_table_of_kinds():
    from simulator.config.blocks import PLUGIN_FIELDS, PLUGIN_LISTS

    assert tuple(registry.KINDS) == tuple(KINDS)
    # a plugin block per kind, but the lists (pre-aggregators, codecs) and dsgd.defense's name
    placed = {kind for _, kind in PLUGIN_FIELDS} | {kind for _, kind in PLUGIN_LISTS} | \
        {"gossip_defenses"}
    assert placed == set(KINDS)


def test_token_models_and_value_tasks_declare_it_in_their_traits():
    assert registry.get("models", "char_lstm").traits.tokens
    assert not registry.get("models", "mlp").traits.tokens
    assert registry.get("tasks", "regression").traits.targets == "values"
    assert registry.get("tasks", "classification").traits.targets == "classes"
    assert registry.get("tasks", "next_token").traits.targets == "classes"


