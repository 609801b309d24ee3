"""The FedRo and Dahan & Levy studies (scenarios/fedro_*.yaml) at reduced size: the direction
of each effect, with margins read from several seeds (docs/fedro.md has the full tables)."""

from __future__ import annotations

import statistics
from pathlib import Path

from simulator.config.load import load
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine
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


def _acc(runs: dict[str, list], label: str) -> list[float]:
    return [r.final("test_accuracy") for r in runs[label]]


def test_c_ctma_over_each_base_aggregator_and_mu2sgd_versus_momentum():
    """17 workers, 8 Byzantine (Dahan & Levy): under label flipping CTMA lifts every base
    aggregator on every seed; mu2-SGD beats worker momentum on every seed where the
    aggregator alone is weak (geometric median under sign flipping); and the documented
    failure: at f/n = 8/17, CTMA over the bare median loses to the median under IPM."""
    momentum = "local.optimizer=momentum(beta=0.9) server.optimizer=sgd"
    mu2 = "local.optimizer=sgd server.optimizer=mu2sgd(lr=0.05)"
    runs = _runs("fedro_meta_mu2sgd.yaml", "seeds=[0, 1, 2]", """sweep={
        attack: [{name: label_flip}],
        "aggregator.name, meta": [[mean, null], [mean, {name: ctma}], [median, null],
                                  [median, {name: ctma}], [geomed, null], [geomed, {name: ctma}]]}""")
    for base in ("mean", "median", "geomed"):
        bare = _acc(runs, f"attack=label_flip {base} meta=none")
        ctma = _acc(runs, f"attack=label_flip {base} meta=ctma")
        assert all(c > b + 0.05 for c, b in zip(ctma, bare)), (base, bare, ctma)
        assert min(ctma) > 0.9
    opt = _runs("fedro_meta_mu2sgd.yaml", "seeds=[0, 1, 2]", """sweep={
        attack: [{name: sign_flip}], aggregator.name: [geomed],
        "local.optimizer, server.optimizer": [[{name: momentum, beta: 0.9}, {name: sgd}],
                                              [{name: sgd}, {name: mu2sgd, lr: 0.05}]]}""")
    with_mom = _acc(opt, f"attack=sign_flip geomed {momentum}")
    with_mu2 = _acc(opt, f"attack=sign_flip geomed {mu2}")
    assert all(m2 > m + 0.04 for m2, m in zip(with_mu2, with_mom)), (with_mom, with_mu2)
    ipm = _runs("fedro_meta_mu2sgd.yaml", "seeds=[0, 1, 2]", """sweep={
        attack: [{name: ipm, epsilon: 0.5}], "aggregator.name, meta": [[median, null], [median, {name: ctma}]]}""")
    bare = _acc(ipm, "attack=ipm(epsilon=0.5) median meta=none")
    ctma = _acc(ipm, "attack=ipm(epsilon=0.5) median meta=ctma")
    assert all(c < b - 0.02 for c, b in zip(ctma, bare)), (bare, ctma)
