"""Every combination validation accepts runs: server.mode x client rule x privacy x attack
kind, generated from the registry and the schema (not a hand list), each either refused
before anything runs in one line per problem, or run for 2 steps to finite numbers."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from simulator import registry
from simulator.config import ScenarioError
from simulator.config.schema import MODES
from simulator.config.validate import validate_point
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine


def _rules() -> list[dict[str, Any]]:
    """Each client rule as the scenario asks for it: a local.optimizer, or a server optimizer
    that brings its own client half."""
    out: list[dict[str, Any]] = [{"local": {"optimizer": {"name": n}}}
                                 for n in registry.available("client_optimizers")]
    for n in registry.available("optimizers"):
        if registry.instantiate("optimizers", {"name": n}, participation=0.5).client_rule():
            out.append({"server": {"optimizer": {"name": n}}})
    return out


def _attack_kinds() -> list[str | None]:
    """No attack, then one attack of each kind the engine tells apart (what it sees, whether
    it poisons data, has a target, simulates the pipeline): the first name of each kind."""
    kinds: dict[tuple[bool, ...], str] = {}
    for n in sorted(registry.available("attacks")):
        t = registry.get("attacks", n).traits
        if not t.gossip:
            kinds.setdefault((t.omniscient, t.data_poisoning, t.targeted,
                              "aggregate" in t.context), n)
    return [None, *kinds.values()]


def _scenario(mode: str, rule: dict[str, Any], privacy: str | None, attack: str | None
              ) -> dict[str, Any]:
    sc: dict[str, Any] = {
        "name": "matrix", "rounds": 2, "data": {"dataset": {"name": "digits"}},
        "model": {"name": "logreg"}, "clients": {"total": 12, "per_round": 6},
        "local": {"steps": 1, "batch_size": 8, "lr": 0.1},  # gradient rules take one
        "server": {"mode": mode, **{key: 1.0 for key in MODES[mode].required}},
        "evaluation": {"every": 2},
    }  # a mode's required server keys (deadline: seconds) at 1.0
    for key, block in rule.items():
        sc[key] = {**sc[key], **block}
    if privacy is not None:
        sc["privacy"] = {"name": privacy}
    if attack is not None:
        sc["clients"] = {**sc["clients"], "byzantine": 2}
        sc["attack"] = {"name": attack}
    return sc


MATRIX = list(itertools.product(
    sorted(MODES), range(len(_rules())), [None, *registry.available("privacy")],
    _attack_kinds()))


@pytest.mark.parametrize("mode, rule, privacy, attack", MATRIX,
                         ids=[f"{m}-{i}-{p}-{a}" for m, i, p, a in MATRIX])
def test_every_accepted_combination_runs_and_every_other_is_refused_in_one_line(
        mode, rule, privacy, attack):
    raw = _scenario(mode, _rules()[rule], privacy, attack)
    try:
        sc = validate_point(raw)
    except ScenarioError as e:
        assert e.lines and all("\n" not in line and ": " in line for line in e.lines), e.lines
        return
    res = Engine(sc, InlineBackend()).run()
    assert len(res.metrics) == 2
    assert np.isfinite(res.final_params).all() or attack is not None  # an attack may win
    assert all(m["bytes_up"] > 0 and m["bytes_down"] > 0 for m in res.metrics)
