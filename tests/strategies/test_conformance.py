"""Every registered plugin of every kind passes the conformance checks fedray ships to plugin
authors (``fedray.testing``), as scikit-learn's estimators pass ``check_estimator``: a new
plugin is covered the moment it is registered."""

from __future__ import annotations

import math
import re

import pytest
import torch

from fedray.testing import F, N, check_plugin, matrix, plugin_checks
from simulator import registry
from strategies.protocols import Task
from tests import formats

# Keys a built-in needs for the test matrices (rules taking ``f`` get F from the checks).
PARAMS: dict[tuple[str, str], dict] = {
    ("aggregators", "dnc"): {"subsample_dim": 8},
    ("aggregators", "cc"): {"tau": 100.0, "iterations": 3},  # a radius at the rows' scale
    ("preaggregators", "bucketing"): {"s": 2},
    ("meta", "bucketing"): {"s": 2},
    ("aggregators", "norm_bound"): {"bound": 100.0},  # a bound at the rows' scale
    ("aggregators", "flame"): {"lam": 0.0},  # noise-free; its noise is tested in test_defenses
}

# Data sets read from files: the checks run on small files in their real formats.
FILES = formats.WRITERS

# Checks that do not apply to a built-in, and why (stated in its docstring too).
SKIP: dict[tuple[str, str], dict[str, str]] = {
    ("aggregators", "mean"): {"survives_f_nonfinite_rows": "the mean is not robust: one row "
                              "breaks it (asserted below)"},
    ("aggregators", "majority_vote"): {
        check: "returns the sign of the vote, not an estimate of the rows' mean"
        for check in ("identical_rows", "translation_equivariance", "near_the_honest_rows",
                      "survives_f_nonfinite_rows")},
    ("aggregators", "monna"): {"permutation_invariance": "relative to its first row"},
    ("aggregators", "cc"): {"translation_equivariance": "clips around its stored centre"},
    ("aggregators", "foolsgold"): {"translation_equivariance": "cosine similarities from the "
                                   "origin"},
    ("aggregators", "flame"): {"translation_equivariance": "cosine distances and norms from "
                               "the origin"},
    ("aggregators", "fltrust"): {"translation_equivariance": "cosine similarities to the "
                                 "server's update, from the origin"},
}

CASES = [(kind, name) for kind in registry.KINDS for name in registry.available(kind)
         if PARAMS.get((kind, name), {}) is not None]


@pytest.mark.parametrize("kind, name", CASES, ids=[f"{k}:{n}" for k, n in CASES])
def test_builtin_passes_the_shipped_checks(kind, name, tmp_path):
    params = PARAMS.get((kind, name))
    if (kind, name) == ("topologies", "edge_list"):  # a ring of 16 peers in a file
        (tmp_path / "ring.txt").write_text("".join(f"{i} {(i + 1) % 16}\n" for i in range(16)))
        params = {"path": str(tmp_path / "ring.txt")}
    if kind == "datasets" and name in FILES:
        FILES[name](tmp_path / "data")
        params = {formats.FOLDER_KEY.get(name, "root"): str(tmp_path / "data")}
    if (kind, name) == ("datasets", "parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        x, y = formats.images(40, 0, (16,))
        pq.write_table(pa.table({"pixels": pa.array(list(x)), "label": y}), tmp_path / "d.parquet")
        params = {"path": str(tmp_path / "d.parquet"), "shape": [1, 4, 4]}
    check_plugin(kind, registry.get(kind, name), params, SKIP.get((kind, name)))


def test_every_kind_has_checks_beyond_the_contract():
    for kind in registry.KINDS:
        name = next(n for n in registry.available(kind) if PARAMS.get((kind, n), {}) is not None)
        checks = plugin_checks(kind, registry.get(kind, name), PARAMS.get((kind, name)))
        assert len(checks) >= 2 and checks[0][0] == "subclasses_the_contract", kind


def test_mean_is_broken_by_one_nonfinite_row():
    from strategies.aggregators import Mean

    x = matrix(6)
    x[N - 1] = math.nan
    assert not torch.isfinite(Mean()(x)).all()


def test_rules_taking_f_are_checked_with_the_byzantine_rows_of_the_matrices():
    """A rule that takes ``f`` is built with f = F, the Byzantine rows of the test matrices
    (with f = 0 the checks would test nothing of its robustness)."""
    from fedray.testing import build
    from strategies.aggregators import CoordinateWiseTrimmedMean, Krum

    assert build("aggregators", Krum).f == F and build("aggregators", CoordinateWiseTrimmedMean).f == F


class ZeroAggregator(registry.contract("aggregators")):
    """Returns zeros whatever the rows: the checks must catch it."""

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.zeros(x.shape[1])


class FirstRow(registry.contract("aggregators")):
    """The first row, whatever the others: not permutation invariant."""

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return x[0].clone()


class NoGenerator(registry.contract("aggregators")):
    """The mean, but its call takes no generator: callers that pass one would fail."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(0)


class NotAPlugin:
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(0)


@pytest.mark.parametrize("cls, failing", [
    (ZeroAggregator, "identical_rows"), (FirstRow, "permutation_invariance"),
    (NoGenerator, "generator_keyword"), (NotAPlugin, "subclasses_the_contract")])
def test_the_checks_catch_broken_rules(cls, failing):
    with pytest.raises(AssertionError, match=f"check {failing} failed"):
        check_plugin("aggregators", cls)
    checks = dict(plugin_checks("aggregators", cls))
    if failing != "subclasses_the_contract":
        with pytest.raises(AssertionError):
            checks["near_the_honest_rows" if cls is ZeroAggregator else failing]()


class _SummedLoss(Task):
    """Broken: one loss for the whole batch, not one per sample."""

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(output, target, reduction="sum").reshape(1)


class _DetachedLoss(Task):
    """Broken: a loss that does not depend on the model's output."""

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.ones(len(output)) * output.detach().mean() + 0 * output.sum(1)


@pytest.mark.parametrize("cls,words", [(_SummedLoss, "losses of shape (1,), not (3,)"),
                                       (_DetachedLoss, "no gradient")])
def test_the_checks_catch_broken_tasks(cls, words):
    with pytest.raises(AssertionError, match=rf"check loss_contract failed: {re.escape(words)}"):
        check_plugin("tasks", cls)


def test_every_registered_attack_honours_its_contract():
    """The attacks kind holds two contracts under one base: every Attack makes rows when
    called, every GossipAttack sends messages (and is not an Attack)."""
    from strategies.protocols import Attack, BaseAttack, GossipAttack

    classes = [registry.get("attacks", n) for n in registry.available("attacks")]
    assert registry.contract("attacks") is BaseAttack
    assert any(issubclass(c, GossipAttack) for c in classes)
    assert not issubclass(GossipAttack, Attack)
    for cls in classes:
        assert issubclass(cls, Attack) != issubclass(cls, GossipAttack), cls
        assert bool(cls.traits.gossip) == issubclass(cls, GossipAttack), cls


class _NeitherAttack(registry.contract("attacks")):
    """Broken: subclasses the kind's base but neither of its two contracts."""


def test_the_checks_catch_an_attack_of_no_contract():
    with pytest.raises(AssertionError, match="check subclasses_the_contract failed: "
                       "_NeitherAttack subclasses neither Attack"):
        check_plugin("attacks", _NeitherAttack)


def test_the_checks_catch_a_gossip_trait_that_is_not_the_class():
    from strategies.protocols import Attack, Traits

    class Rows(Attack):
        traits = Traits(gossip=True)

        def __call__(self, seen, f, generator):
            return seen[:1].expand(f, -1).clone()

    with pytest.raises(AssertionError, match="traits.gossip is True, but it is not a GossipAttack"):
        check_plugin("attacks", Rows)
