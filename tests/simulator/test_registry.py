from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from simulator import registry
from simulator.config import ScenarioError
from simulator.config.load import load
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine
from tests.entry_points import registered

BUILTINS = {
    "aggregators": {"mean", "median", "cwtm"},
    "attacks": {"sign_flip", "gaussian"},
    "datasets": {"synthetic", "gaussian-mixture", "digits", "parquet"},
    "models": {"logreg", "mlp", "cnn"},
    "optimizers": {"sgd", "fedadam", "mu2sgd"},
    "client_optimizers": {"sgd", "momentum"},
    "privacy": {"dp_sgd", "dp_fedavg"},
    "topologies": {"ring", "torus", "complete", "erdos_renyi"},
    "partitioners": {"iid", "dirichlet", "shards", "natural"},
}


@pytest.mark.parametrize("kind", sorted(BUILTINS))
def test_builtins_register_through_entry_points(kind):
    assert BUILTINS[kind] <= set(registry.available(kind))


def test_unknown_name_lists_available_and_suggests():
    with pytest.raises(registry.UnknownPlugin) as e:
        registry.get("aggregators", "meen")
    assert "did you mean 'mean'?" in str(e.value) and "available: " in str(e.value)
    with pytest.raises(ValueError, match="unknown plugin kind 'widgets'"):
        registry.available("widgets")


PLUGIN_PYPROJECT = """\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "fedray-plugin-example"
version = "0.0.1"

[project.entry-points."fedray.aggregators"]
scaled_mean = "fedray_plugin_example:ScaledMean"
old_mean = "fedray_plugin_example:OldMean"
"""

PLUGIN_CODE = '''\
from typing import Annotated
from annotated_types import Ge
import torch

from strategies.protocols import Aggregator


class ScaledMean(Aggregator):
    """Mean of the rows times a factor (a test plugin)."""

    def __init__(self, factor: Annotated[float, Ge(0)] = 1.0) -> None:
        self.factor = factor

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        return self.factor * x.mean(dim=0)


class OldMean(Aggregator):
    """A rule without the generator keyword."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=0)
'''


@pytest.fixture()
def third_party_plugin(tmp_path, monkeypatch):
    """A separate distribution, really installed (pip, into a target dir on sys.path)."""
    src = tmp_path / "plugin-src"
    src.mkdir()
    (src / "pyproject.toml").write_text(PLUGIN_PYPROJECT)
    (src / "fedray_plugin_example.py").write_text(PLUGIN_CODE)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(src)], check=True, capture_output=True)
    monkeypatch.syspath_prepend(str(site))
    registry.refresh()
    yield
    monkeypatch.undo()
    registry.refresh()


def test_third_party_plugin_is_usable_from_a_scenario(third_party_plugin, tmp_path):
    assert "scaled_mean" in registry.available("aggregators")
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent("""\
        rounds: 2
        data: {dataset: {name: digits}}
        model: {name: logreg}
        clients: {total: 6}
        local: {steps: 2}
        aggregator: {name: scaled_mean, factor: 0.0}
    """))
    sc = load(p).points[0].scenario
    assert sc.aggregator == {"name": "scaled_mean", "factor": 0.0}
    res = Engine(sc, InlineBackend()).run()
    # factor 0: the model never moves
    assert res.metrics[0]["aggregate_norm"] == 0.0
    assert res.metrics[0]["test_accuracy"] == res.metrics[1]["test_accuracy"]
    p.write_text(p.read_text().replace("factor: 0.0", "factr: 2"))
    with pytest.raises(ScenarioError, match=r"aggregator.factr: unknown key for aggregator "
                                            r"'scaled_mean'; did you mean 'factor'\?"):
        load(p)
    # a rule without the one signature is refused in one line, before anything runs
    p.write_text(p.read_text().replace("{name: scaled_mean, factr: 2}", "{name: old_mean}"))
    with pytest.raises(registry.BadPlugin) as e:
        load(p)
    assert len(str(e.value).splitlines()) == 1
    assert "aggregator 'old_mean'" in str(e.value) and "must take generator=None" in str(e.value)


def test_a_boolean_is_never_read_as_a_number():
    """pydantic's lax mode reads True as 1 and YAML reads yes/no/on/off as booleans: a bool
    where a hint takes numbers is refused, in lists, tuples, dicts and unions too; a hint
    that takes bools keeps them."""
    from typing import Annotated, Any, Literal

    from annotated_types import Ge

    from simulator.registry import bool_for_number

    refused = [(int, True), (float, False), (Annotated[int, Ge(1)], True),
               (int | None, True), (list[int], [64, True]), (tuple[int, ...], (1, False)),
               (tuple[int, float], (1, True)), (dict[str, float], {"a": 1.0, "b": True}),
               (float | Literal["auto"], True), (list[Annotated[int, Ge(1)]] | None, [True])]
    kept = [(int, 3), (float, 0.5), (bool, True), (int | bool, True), (Any, True),
            (Literal[True, "x"], True), (list[int], [1, 2]), (str, "yes"), (int | None, None),
            (list[bool], [True]), (dict[str, Any], {"a": True}), (float | str, "on")]
    assert [bool_for_number(tp, v) for tp, v in refused] == [True] * len(refused)
    assert [bool_for_number(tp, v) for tp, v in kept] == [False] * len(kept)


def test_a_trait_meaningless_for_its_kind_is_refused_at_registration(monkeypatch):
    """For every kind: a class of that contract declaring a trait of another kind (one the
    engine never reads for it) is refused in one line naming the trait; the traits it may
    declare pass."""
    from dataclasses import fields

    from strategies.protocols import (
        ANY_KIND_TRAITS,
        CONTRACTS,
        KIND_TRAITS,
        Traits,
        stray_traits,
    )

    module = sys.modules[__name__]
    made: dict[str, dict[str, str]] = {}
    for kind, base in CONTRACTS.items():
        stray = next(f.name for f in fields(Traits) if f.name not in KIND_TRAITS[kind]
                     and f.name not in ANY_KIND_TRAITS and f.type == "bool")
        cls = type(f"Stray_{kind}", (base,), {"traits": Traits(**{stray: True})})
        monkeypatch.setattr(module, cls.__name__, cls, raising=False)
        made[kind] = {"stray_one": f"{__name__}:{cls.__name__}"}
        assert stray_traits(kind, cls.traits) == [stray]
    with registered(monkeypatch, made):
        for kind in CONTRACTS:
            with pytest.raises(registry.BadPlugin) as e:
                registry.get(kind, "stray_one")
            stray = stray_traits(kind, registry._entry_points(kind)["stray_one"].load().traits)
            assert len(str(e.value).splitlines()) == 1
            assert f"traits {stray[0]} mean nothing to {kind}" in str(e.value)
