"""The contract file itself: traits in place of class attributes."""

from __future__ import annotations

import pytest
import torch

from simulator import registry
from strategies.protocols import Model, Task, Traits


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
