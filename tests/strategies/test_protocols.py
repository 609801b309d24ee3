"""The contract file itself: one table of kinds, traits in place of class attributes."""

from __future__ import annotations

import inspect
import tomllib
from pathlib import Path

import pytest
import torch

from simulator import registry
from strategies import protocols
from strategies.kinds import KINDS
from strategies.protocols import Model, Task, Traits

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
    from simulator.config.validate import PLUGIN_FIELDS, PLUGIN_LISTS

    assert tuple(registry.KINDS) == tuple(KINDS)
    # a plugin block per kind, but the lists (pre-aggregators, codecs) and dsgd.defense's name
    placed = {kind for _, kind in PLUGIN_FIELDS} | set(PLUGIN_LISTS) | {"gossip_defenses"}
    assert placed == set(KINDS)


def test_token_models_and_value_tasks_declare_it_in_their_traits():
    assert registry.get("models", "char_lstm").traits.tokens
    assert not registry.get("models", "mlp").traits.tokens
    assert registry.get("tasks", "regression").traits.targets == "values"
    assert registry.get("tasks", "classification").traits.targets == "classes"
    assert registry.get("tasks", "next_token").traits.targets == "classes"


def test_the_former_class_attributes_read_the_traits():
    lstm, mlp = registry.get("models", "char_lstm"), registry.get("models", "mlp")
    assert (lstm.TOKENS, mlp.TOKENS) == (True, False)
    assert registry.get("tasks", "regression").TARGETS == "values"
    assert registry.get("tasks", "classification")().TARGETS == "classes"
    with pytest.raises(AttributeError, match="traits.targets"):
        registry.get("tasks", "classification")().TARGETS = "values"


def test_a_plugin_that_still_assigns_the_former_name_has_it_moved_into_its_traits():
    with pytest.warns(DeprecationWarning, match=r"Tokens.TOKENS is deprecated"):
        class Tokens(Model):
            TOKENS = True
            traits = Traits(context=("input_shape", "num_classes", "vocabulary"))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x

    with pytest.warns(DeprecationWarning, match=r"Values.TARGETS is deprecated"):
        class Values(Task):
            TARGETS = "values"

            def losses(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
                return output

    assert Tokens.traits.tokens and Tokens.TOKENS is True
    assert Tokens.traits.context == ("input_shape", "num_classes", "vocabulary")
    assert Values.traits.targets == "values" and Values.TARGETS == "values"
