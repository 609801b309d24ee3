"""Weighted aggregation (``traits.weighted``): each weighted rule on hand-computed cases with
unequal weights, its unweighted twin at equal weights, the unweighted rule on repeated rows at
integer weights (where that is the definition), ``weights=None`` bit for bit; a slow
per-coordinate reference; the registry's and the pipeline's refusals."""

from __future__ import annotations

import math
from importlib.metadata import EntryPoint

import pytest
import torch

from fedray.testing import check_plugin
from simulator import registry
from simulator.runtime.pipeline import Pipeline
from strategies import aggregators as A
from strategies import geometry as G
from strategies.meta import CenteredTrimmedMetaAggregator as CTMA
from strategies.protocols import Aggregator, Traits


def col(*v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)[:, None]


def w64(*v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float64)


def rows(seed: int, n: int = 5, d: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, d), generator=g) * 3 + 1


def repeated(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(x, torch.tensor(counts), dim=0)


def ctma_on(x, agg, f, weights=None):
    return CTMA(f)(x, agg, weights=weights)


# the weighted built-ins and a call of each (x, weights) -> (d,)
WEIGHTED = {
    "mean": lambda x, **kw: A.Mean()(x, **kw),
    "median": lambda x, **kw: A.CoordinateWiseMedian()(x, **kw),
    "cwtm": lambda x, **kw: A.CoordinateWiseTrimmedMean(1)(x, **kw),
    "geomed": lambda x, **kw: A.GeometricMedian()(x, **kw),
    "geomed_median_start": lambda x, **kw: A.GeometricMedian(init="median")(x, **kw),
    "multikrum": lambda x, **kw: A.MultiKrum(1)(x, **kw),
    "krum": lambda x, **kw: A.Krum(1)(x, **kw),
    "ctma": lambda x, **kw: CTMA(1)(x, A.CoordinateWiseMedian(), **kw),
    "majority_vote": lambda x, **kw: A.MajorityVote()(x, **kw),
}


def test_the_weighted_rules_are_exactly_the_ones_with_a_definition():
    weighted = {n for n in registry.available("aggregators")
                if registry.get("aggregators", n).traits.weighted}
    assert weighted == {"mean", "median", "cwtm", "geomed", "krum", "multikrum",
                        "majority_vote"}
    assert {n for n in registry.available("meta") if registry.get("meta", n).traits.weighted} \
        == {"ctma"}
    assert not registry.get("preaggregators", "nnm").traits.weighted
    assert A.Mean.traits.averaging  # the existing traits stay


# ---------------------------------------------------------------------------- hand-computed


def test_weighted_mean_by_hand():
    # (1*0 + 2*1 + 3*2 + 1*10 + 1*11) / 8 = 29 / 8
    assert A.Mean()(col(0, 1, 2, 10, 11), weights=w64(1, 2, 3, 1, 1)).item() == 29 / 8
    # two coordinates: ([0,0] + [2,0] + 2 [0,4]) / 4
    x = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 4.0]])
    assert A.Mean()(x, weights=w64(1, 1, 2)).tolist() == [0.5, 2.0]


def test_weighted_median_by_hand():
    x = torch.tensor([[0.0, 5.0], [1.0, 4.0], [2.0, 3.0], [10.0, 2.0], [11.0, 1.0]])
    # W = 8, half 4. Column 0 ascending 0, 1, 2, 10, 11 with weights 1, 1, 1, 4, 1: cumulative
    # 1, 2, 3, 7 -> 10 is the first to reach 4. Column 1 ascending 1, 2, 3, 4, 5 with weights
    # 1, 4, 1, 1, 1: cumulative 1, 5 -> 2
    assert A.CoordinateWiseMedian()(x, weights=w64(1, 1, 1, 4, 1)).tolist() == [10.0, 2.0]
    # weights 1, 1, 2, 3, 1: column 0 cumulative 1, 2, 4 = half exactly at 2 -> (2 + 10) / 2;
    # column 1 (1, 2, 3, ... weigh 1, 3, 2, ...) cumulative 1, 4 = half at 2 -> (2 + 3) / 2
    assert A.CoordinateWiseMedian()(x, weights=w64(1, 1, 2, 3, 1)).tolist() == [6.0, 2.5]
    # the unweighted median of both columns: 2 and 3
    assert A.CoordinateWiseMedian()(x).tolist() == [2.0, 3.0]


def test_weighted_trimmed_mean_by_hand():
    # f = 1 of n = 5, W = 8: trim f W / n = 1.6 from each end, keep 4.8.
    # ascending 0, 1, 2, 10, 11, weights 1, 1, 1, 4, 1, cumulative 1, 2, 3, 7, 8; each value
    # keeps min(C, 8 - 1.6) - max(C - w, 1.6), at least 0:
    # 0: 1 - 1.6 -> 0;  1: 2 - 1.6 = 0.4;  2: 3 - 2 = 1;  10: 6.4 - 3 = 3.4;  11: 6.4 - 7 -> 0
    # (0.4 * 1 + 1 * 2 + 3.4 * 10) / 4.8 = 36.4 / 4.8 = 91 / 12
    out = A.CoordinateWiseTrimmedMean(1)(col(0, 1, 2, 10, 11), weights=w64(1, 1, 1, 4, 1))
    assert out.item() == pytest.approx(91 / 12, rel=1e-6)
    # unweighted: (1 + 2 + 10) / 3
    assert A.CoordinateWiseTrimmedMean(1)(col(0, 1, 2, 10, 11)).item() == pytest.approx(13 / 3)
    # f = 0: the weighted mean
    out = A.CoordinateWiseTrimmedMean(0)(col(0, 1, 2, 10, 11), weights=w64(1, 2, 3, 1, 1))
    assert out.item() == 29 / 8


def test_weighted_geometric_median_by_hand():
    # (-1, 0) and (1, 0) of weight 1, (0, 1) of weight c: the minimiser is (0, y) with
    # d/dy [2 sqrt(1 + y^2) + c (1 - y)] = 0, y / sqrt(1 + y^2) = c / 2: c = 1.2 -> y = 0.75
    # (c = 1: the Fermat point, y = 1 / sqrt(3))
    x = torch.tensor([[-1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    gm = A.GeometricMedian(iterations=2000, tol=1e-12)
    torch.testing.assert_close(gm(x, weights=w64(1, 1, 1.2)), torch.tensor([0.0, 0.75]),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(gm(x), torch.tensor([0.0, 1 / math.sqrt(3)]), rtol=0, atol=1e-5)
    # weight 3 at (0, 0) of (0,0), (4,0), (0,3): the pull of the others, |(1,0) + (0,1)| =
    # sqrt(2) <= 3, so the minimiser is (0, 0) itself (unweighted: sqrt(2) > 1, it is not)
    y = torch.tensor([[0.0, 0.0], [4.0, 0.0], [0.0, 3.0]])
    torch.testing.assert_close(gm(y, weights=w64(3, 1, 1)), torch.zeros(2), rtol=0, atol=1e-5)
    assert float(gm(y).norm()) > 0.1


def test_weighted_krum_by_hand():
    x = col(0, 1, 2, 10, 11)
    w = w64(1, 1, 1, 2, 1)
    # n = 5, f = 1, W = 6: row i covers the weight (n - f - 1) W / n - w_i = 3.6 - w_i of its
    # nearest others (squared distances).
    # 0 (2.6): 1 (1) + 2 (4) + 0.6 of 10 (100) = 65
    # 1 (2.6): 0 (1) + 2 (1) + 0.6 of 10 (81) = 50.6
    # 2 (2.6): 1 (1) + 0 (4) + 0.6 of 10 (64) = 43.4
    # 10 (1.6): 11 (1) + 0.6 of 2 (64) = 39.4
    # 11 (2.6): 2 of 10 (1) + 0.6 of 2 (81) = 50.6
    scores = G.weighted_krum_scores(G.squared_distances(x), w, 1)
    assert scores.tolist() == pytest.approx([65, 50.6, 43.4, 39.4, 50.6])
    assert A.Krum(1)(x, weights=w).item() == 10  # unweighted: 1 (test_aggregators)
    assert A.Krum(1)(x).item() == 1
    # the two lowest scores, 10 (weight 2) and 2 (weight 1): (2 * 10 + 2) / 3
    assert A.MultiKrum(1, m=2)(x, weights=w).item() == pytest.approx(22 / 3)
    # scale does not matter: the same scores in units of the weights
    torch.testing.assert_close(G.weighted_krum_scores(G.squared_distances(x), w * 4, 1),
                               scores * 4)


def test_weighted_ctma_by_hand():
    x = col(0, 1, 2, 10, 11)
    w = w64(1, 1, 1, 4, 1)
    # x0 = weighted median = 10. By distance to it: 10 (w 4), 11 (1), 2 (1), 1 (1), 0 (1);
    # keep K = (1 - f/m) W = 0.8 * 8 = 6.4: 4 + 1 + 1 + 0.4 of row 1.
    # 10 + (4 * 0 + 1 * 1 + 1 * (-8) + 0.4 * (-9)) / 6.4 = 10 - 10.6 / 6.4 = 267 / 32
    out = CTMA(1)(x, A.CoordinateWiseMedian(), weights=w)
    assert out.item() == pytest.approx(267 / 32, rel=1e-6)
    # unweighted: x0 = 2, keep 2, 1, 0, 10: 2 + (0 - 1 - 2 + 8) / 4
    assert CTMA(1)(x, A.CoordinateWiseMedian()).item() == 3.25
    # the aggregator is called with the same weights
    seen = []

    def spy(rows, weights=None):
        seen.append(weights)
        return A.CoordinateWiseMedian()(rows, weights=weights)

    CTMA(1)(x, spy, weights=w)
    CTMA(1)(x, spy)
    assert seen[0] is w and seen[1] is None


# ---------------------------------------------------------------------------- equal weights


@pytest.mark.parametrize("name", sorted(WEIGHTED))
def test_equal_weights_give_the_unweighted_rule_bit_for_bit(name):
    """Equal weights are scaled to exactly 1, so the weighted arithmetic repeats the
    unweighted one: the same numbers, geometric median iterates included."""
    rule = WEIGHTED[name]
    for seed in range(3):
        x = rows(seed, n=11, d=16) + 10
        plain = rule(x)
        for value, dtype in ((1.0, torch.float64), (0.1, torch.float64), (0.37, torch.float32),
                             (3.0, torch.float64)):
            out = rule(x, weights=torch.full((11,), value, dtype=dtype))
            assert torch.equal(out, plain), (name, seed, value, dtype)


@pytest.mark.parametrize("name", sorted(WEIGHTED))
def test_weights_none_is_the_call_without_weights_bit_for_bit(name):
    rule = WEIGHTED[name]
    x = rows(7, n=11, d=16)
    x[3] = math.nan  # the non-finite paths too
    plain = rule(x)
    assert torch.equal(rule(x, weights=None), plain) or (
        torch.isnan(plain).all() and torch.isnan(rule(x, weights=None)).all())


def test_even_n_equal_weights_keep_the_midpoint():
    x = col(1, 2, 3, 10)
    assert A.CoordinateWiseMedian()(x, weights=w64(5, 5, 5, 5)).item() == 2.5


# ---------------------------------------------------------------------------- integer weights


COUNTS = [1, 2, 3, 2, 2]  # W = 10 over n = 5 rows


@pytest.mark.parametrize("seed", range(4))
def test_integer_weights_are_repeated_rows(seed):
    x = rows(seed)
    w = torch.tensor(COUNTS, dtype=torch.float64)
    big = repeated(x, COUNTS)
    torch.testing.assert_close(A.Mean()(x, weights=w), A.Mean()(big), rtol=1e-6, atol=1e-6)
    assert torch.equal(A.CoordinateWiseMedian()(x, weights=w), A.CoordinateWiseMedian()(big))
    # f' = f W / n = 1 * 10 / 5 = 2
    torch.testing.assert_close(A.CoordinateWiseTrimmedMean(1)(x, weights=w),
                               A.CoordinateWiseTrimmedMean(2)(big), rtol=1e-6, atol=1e-6)
    gm = A.GeometricMedian(iterations=500, tol=0)
    torch.testing.assert_close(gm(x, weights=w), gm(big), rtol=1e-5, atol=1e-5)
    gm = A.GeometricMedian(init="median", iterations=5, tol=0)  # the same iterates
    torch.testing.assert_close(gm(x, weights=w), gm(big), rtol=1e-5, atol=1e-5)
    # Krum: f' = (f + 1) W / n - 1 = 2 * 10 / 5 - 1 = 3 (10 > 2 * 3 + 2 rows)
    assert torch.equal(A.Krum(1)(x, weights=w), A.Krum(3)(big))
    # CTMA: f' = f W / m = 2, its aggregator weighted the same way
    for agg in (A.CoordinateWiseMedian(), A.Mean()):
        torch.testing.assert_close(CTMA(1)(x, agg, weights=w), CTMA(2)(big, agg),
                                   rtol=1e-6, atol=1e-6)


def test_integer_weights_even_total_median_is_the_repeated_midpoint():
    # weights 1, 1, 2 on 1, 2, 3: the rows 1, 2, 3, 3, whose median is 2.5
    assert A.CoordinateWiseMedian()(col(1, 2, 3), weights=w64(1, 1, 2)).item() == 2.5
    assert A.CoordinateWiseMedian()(col(1, 2, 3), weights=w64(1, 2, 1)).item() == 2.0


# ---------------------------------------------------------------------------- reference


def _slow_weighted_median(v: list[float], w: list[float]) -> float:
    pairs = sorted(zip(v, w))
    total, c = sum(w), 0.0
    for i, (value, weight) in enumerate(pairs):
        c += weight
        if math.isclose(c, total / 2, rel_tol=1e-12):
            return (value + pairs[i + 1][0]) / 2
        if c > total / 2:
            return value
    raise AssertionError


def _slow_weighted_trimmed_mean(v: list[float], w: list[float], f: int) -> float:
    pairs = sorted(zip(v, w))
    total = sum(w)
    t = f * total / len(v)
    c, num = 0.0, 0.0
    for value, weight in pairs:
        kept = max(0.0, min(c + weight, total - t) - max(c, t))
        num += kept * value
        c += weight
    return num / (total - 2 * t)


@pytest.mark.parametrize("seed", range(3))
def test_coordinate_rules_agree_with_a_slow_reference(seed, monkeypatch):
    monkeypatch.setattr(G, "WEIGHTED_BLOCK_ENTRIES", 9 * 4)  # several column blocks
    x = rows(seed, n=9, d=10).double()
    w = torch.rand(9, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.05
    med = A.CoordinateWiseMedian()(x, weights=w)
    tm = A.CoordinateWiseTrimmedMean(3)(x, weights=w)
    for j in range(10):
        v = x[:, j].tolist()
        assert med[j].item() == pytest.approx(_slow_weighted_median(v, w.tolist()), rel=1e-12)
        assert tm[j].item() == pytest.approx(_slow_weighted_trimmed_mean(v, w.tolist(), 3),
                                             rel=1e-9)


def test_weighted_krum_scores_agree_with_a_slow_reference():
    x = rows(11, n=8, d=4).double()
    w = torch.rand(8, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.05
    d2 = ((x[:, None] - x[None]) ** 2).sum(-1)
    n, f, total = 8, 2, float(w.sum())
    for i in range(n):
        budget = (n - f - 1) * total / n - float(w[i])
        score = 0.0
        for j in sorted((j for j in range(n) if j != i), key=lambda j: float(d2[i, j])):
            take = min(max(budget, 0.0), float(w[j]))
            score += take * float(d2[i, j])
            budget -= take
        got = G.weighted_krum_scores(G.squared_distances(x), w, f)[i].item()
        assert got == pytest.approx(score, rel=1e-9)


# ---------------------------------------------------------------------------- robustness


def test_nonfinite_rows_do_not_break_the_weighted_rules():
    """f = 2 non-finite rows of 11, lighter than their share 2/11 of the weight (robustness
    is in weight: a rule trims or outvotes the fraction f/n of the total)."""
    x = rows(3, n=11, d=4) + 5
    honest = x[:9].clone()
    x[9], x[10] = math.nan, math.inf
    w = torch.linspace(2, 1, 11, dtype=torch.float64)  # 2.1 of 16.5 on the bad rows
    rules = [A.CoordinateWiseMedian(), A.CoordinateWiseTrimmedMean(2), A.GeometricMedian(),
             A.MultiKrum(2), A.Krum(2),
             lambda y, weights: CTMA(2)(y, A.CoordinateWiseMedian(), weights=weights)]
    for rule in rules:
        out = rule(x, weights=w)
        assert torch.isfinite(out).all(), rule
        assert float((out - honest.mean(0)).norm()) < 3 * float(honest.std(0).norm()), rule
    # beyond the bound, a non-finite row so heavy that its own weight covers its budget still
    # ranks after every finite row (whose scores are then all infinite)
    w = w64(*([1.0] * 9), 100.0, 1.0)
    scores = G.weighted_krum_scores(G.squared_distances(x), w, 2)
    assert scores[9] == 0 and bool(torch.isinf(scores[:9]).all())
    assert torch.isfinite(A.Krum(2)(x, weights=w)).all()
    assert torch.isfinite(A.MultiKrum(2, m=9)(x, weights=w)).all()


def test_bad_weights_are_refused_in_one_line():
    x = rows(0)
    for bad, words in ((w64(1, 2, 3), r"shape \(5,\)"), (w64(1, 1, 0, 1, 1), "> 0"),
                       (w64(1, 1, math.nan, 1, 1), "finite"),
                       (torch.ones(5, dtype=torch.int64), "float64 or float32")):
        with pytest.raises(ValueError, match=f"weights: .*{words}"):
            A.CoordinateWiseMedian()(x, weights=bad)


# ---------------------------------------------------------------------------- registry


class _WeightedWithoutWeights(Aggregator):
    """Broken: declares traits.weighted, but its call takes no weights."""

    traits = Traits(weighted=True)

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return x.mean(0)


class _IgnoresItsWeights(Aggregator):
    """Broken: takes weights and ignores them, but divides by their total."""

    traits = Traits(weighted=True)

    def __call__(self, x, generator=None, weights=None):
        return x.mean(0) if weights is None else x.mean(0) * (weights.sum() / len(weights))


class _NormalisesInPlace(Aggregator):
    """Broken: normalises its weights in place."""

    traits = Traits(weighted=True)

    def __call__(self, x, generator=None, weights=None):
        return A.Mean()(x, weights=None if weights is None else weights.div_(weights.sum()))


@pytest.fixture()
def fake_entry_points(monkeypatch):
    def install(**classes):
        eps = {name: EntryPoint(name, f"{__name__}:{cls.__name__}", "fedray.aggregators")
               for name, cls in classes.items()}
        monkeypatch.setattr(registry, "_entry_points", lambda kind: eps)
        registry._loaded.cache_clear()

    yield install
    monkeypatch.undo()
    registry._loaded.cache_clear()


def test_the_registry_refuses_a_weighted_rule_whose_call_takes_no_weights(fake_entry_points):
    fake_entry_points(wmean=_WeightedWithoutWeights, ok=_IgnoresItsWeights)
    with pytest.raises(registry.BadPlugin) as e:
        registry.get("aggregators", "wmean")
    assert len(str(e.value).splitlines()) == 1
    assert "aggregator 'wmean'" in str(e.value) and "takes no weights=None" in str(e.value)
    assert registry.get("aggregators", "ok") is _IgnoresItsWeights


@pytest.mark.parametrize("cls, failing", [
    (_WeightedWithoutWeights, "weights_keyword"),
    (_IgnoresItsWeights, "equal_weights_are_unweighted"),
    (_NormalisesInPlace, "weights_not_modified")])
def test_the_conformance_checks_catch_broken_weighted_rules(cls, failing):
    with pytest.raises(AssertionError, match=f"check {failing} failed"):
        check_plugin("aggregators", cls, skip={"survives_f_nonfinite_rows": "a mean"})


# ---------------------------------------------------------------------------- pipeline


def test_the_pipeline_hands_the_weights_to_the_aggregator_and_the_meta():
    x = rows(5, n=7, d=3)
    w = torch.linspace(1, 3, 7, dtype=torch.float64)
    p = Pipeline([], {"name": "median"}, {"name": "ctma", "f": 2}, seed=0)
    want = CTMA(2)(x, A.CoordinateWiseMedian(), weights=w)
    assert torch.equal(p.aggregate(x, 0, weights=w), want)
    assert torch.equal(p.simulate(x, 0, weights=w), want)
    assert torch.equal(p.aggregate(x, 0), CTMA(2)(x, A.CoordinateWiseMedian()))
    q = Pipeline([], {"name": "krum", "f": 2}, None, seed=0)
    assert torch.equal(q.aggregate(x, 0, weights=w), A.Krum(2)(x, weights=w))
    with pytest.raises(ValueError, match=r"weights: must be a tensor of shape \(7,\)"):
        q.aggregate(x, 0, weights=w[:6])


@pytest.mark.parametrize("pre, agg, meta, where", [
    ([], {"name": "meamed", "f": 1}, None, "aggregator 'meamed'"),
    ([{"name": "nnm", "f": 1}], {"name": "median"}, None, "preaggregators[0] 'nnm'"),
    ([], {"name": "median"}, {"name": "nnm", "f": 1}, "meta 'nnm'")])
def test_the_pipeline_refuses_weights_for_a_rule_without_a_weighted_definition(
        pre, agg, meta, where):
    p = Pipeline(pre, agg, meta, seed=0)
    x = rows(1, n=7)
    with pytest.raises(ValueError) as e:
        p.aggregate(x, 0, weights=torch.ones(7, dtype=torch.float64))
    assert len(str(e.value).splitlines()) == 1
    assert str(e.value).startswith(where) and "traits.weighted" in str(e.value)
    p.aggregate(x, 0)  # without weights it runs as before
