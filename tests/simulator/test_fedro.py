"""The FedRo and Dahan & Levy studies (scenarios/fedro_*.yaml) at reduced size: the direction
of each effect, with margins read from several seeds (docs/fedro.md has the full tables)."""

from __future__ import annotations

import statistics
from pathlib import Path

from simulator.engine import Engine
from simulator.runtime.backend import InlineBackend
from simulator.scenario import load
from strategies.subsampling import hypergeometric_tail

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"


def _runs(name: str, *overrides: str) -> dict[str, list]:
    """label without the seed -> results over the seeds, for every point of a shipped scenario."""
    out: dict[str, list] = {}
    for p in load(SCENARIOS / name, list(overrides)).points:
        key = p.label.rsplit(" seed=", 1)[0]
        out.setdefault(key, []).append(Engine(p.scenario, InlineBackend()).run())
    return out


def _rel_error(result) -> float:
    return statistics.fmean(m["relative_aggregation_error"] for m in result.metrics)


def test_a_accuracy_threshold_in_sample_size_where_the_hypergeometric_tail_drops():
    runs = _runs("fedro_sample_size.yaml", "seeds=[0, 1, 2, 3]",
                 "sweep={clients.per_round: [3, 4, 12, 16]}")
    acc = {s: [r.final("test_accuracy") for r in runs[f"per_round={s}"]] for s in (3, 4, 12, 16)}
    # below the threshold the sample often holds a Byzantine majority (P > 9 % a round) ...
    for s in (3, 4):
        assert hypergeometric_tail(30, 6, s, (s - 1) // 2) > 0.09
        assert statistics.fmean(acc[s]) < 0.5 and min(acc[s]) < 0.3
        assert sum(m["byzantine_exceeded"] for r in runs[f"per_round={s}"] for m in r.metrics) >= 8
    # ... above it almost never (P < 0.2 %): every seed trains
    for s in (12, 16):
        assert hypergeometric_tail(30, 6, s, (s - 1) // 2) < 0.002
        assert min(acc[s]) > 0.85


def test_b_more_local_steps_lower_the_byzantine_error():
    runs = _runs("fedro_local_steps.yaml", "seeds=[0, 1, 2]",
                 "sweep={'local.steps, local.lr': [[1, 0.5], [16, 0.03125]]}")
    one = [_rel_error(r) for r in runs["steps=1 lr=0.5"]]
    many = [_rel_error(r) for r in runs["steps=16 lr=0.03125"]]
    assert all(m < o - 0.04 for m, o in zip(many, one))  # every seed, paired
    assert statistics.fmean(many) < 0.85 * statistics.fmean(one)
    for r in runs["steps=16 lr=0.03125"]:
        assert r.final("test_accuracy") > 0.8
