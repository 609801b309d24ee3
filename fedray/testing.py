"""Conformance checks shipped to plugin authors, as scikit-learn ships ``check_estimator``.

``check_plugin(kind, cls)`` runs every check of a kind on a plugin class and raises an
AssertionError naming the check that failed; ``plugin_checks(kind, cls)`` gives them one by
one (name, callable) for a parametrised test, as ``parametrize_with_checks`` does::

    import pytest
    from fedray.testing import check_plugin, plugin_checks
    from my_package import MyAggregator

    def test_my_aggregator():
        check_plugin("aggregators", MyAggregator)

    @pytest.mark.parametrize("name, check", plugin_checks("aggregators", MyAggregator))
    def test_my_aggregator_one_check(name, check):
        check()

A rule whose constructor takes ``f`` is built with the number of Byzantine rows of the test
matrices (``F``); other required keys come from ``params``. An aggregation rule with
``traits.weighted`` gets the weighted checks too: equal weights give its unweighted output,
``weights=None`` is the call without weights, the weights are never modified, scaling them
changes nothing and they follow their rows when the rows are permuted. ``skip`` names checks that do
not apply, with the reason (``{"permutation_invariance": "relative to its first row"}``).
fedray's own plugins run through these same checks (tests/strategies/test_conformance.py).
"""

from __future__ import annotations

import inspect
import math
import pickle
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from simulator import registry
from strategies.protocols import (
    CONTRACTS,
    Attack,
    ClientData,
    ClientRule,
    DriftRule,
    GossipAttack,
    GossipStep,
    MessageLayout,
)

N, F, D = 11, 2, 16  # rows of the test matrices, Byzantine rows among them, dimension
Check = tuple[str, Callable[[], None]]

__all__ = ["D", "F", "N", "build", "check_plugin", "plugin_checks"]


def build(kind: str, cls: Any, params: dict[str, Any] | None = None, **context: Any) -> Any:
    """An instance of ``cls`` for the checks: ``params``, plus ``f = F`` when the
    constructor takes an ``f`` that ``params`` does not set, plus the engine's ``context``."""
    keys = dict(params or {})
    if "f" in registry.params_model(cls).model_fields and "f" not in keys:
        keys["f"] = F
    return cls(**{k: context[k] for k in cls.traits.context}, **keys)


def matrix(seed: int = 0, n: int = N, d: int = D, offset: float = 10.0) -> torch.Tensor:
    """``(n, d)`` test rows: standard normal around a common point far from the origin (a
    rule that returns zeros, or ignores the data, is far from every honest row)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, d), generator=g) + torch.linspace(-1, 1, d) + offset


def _call(rule: Any, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A pre-aggregator or aggregator on ``x``, given a seeded generator as every caller may
    (a deterministic rule ignores it); an aggregator with ``traits.reference`` (FLTrust) gets
    the coordinate-wise median of the finite rows as the server's own update."""
    g = torch.Generator().manual_seed(seed)
    if rule.traits.reference:
        return rule(x, generator=g, reference=x[torch.isfinite(x).all(dim=1)].median(0).values)
    return rule(x, generator=g)


def _takes_a_generator(cls: Any) -> Check:
    """The aggregation rules' one signature: ``generator=None`` may always be passed."""
    def generator_keyword() -> None:
        p = inspect.signature(cls.__call__).parameters.get("generator")
        assert p is not None and p.default is None and p.kind in (
            p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY), \
            f"{cls.__name__}.__call__ takes no generator=None keyword (every aggregation " \
            "rule takes one; a deterministic rule ignores it)"

    return ("generator_keyword", generator_keyword)


def _spread(x: torch.Tensor) -> float:
    """Root mean squared distance of the rows to their mean."""
    return float(((x - x.mean(0)) ** 2).sum(1).mean().sqrt())


# ---------------------------------------------------------------------------- aggregation


def _weighted_checks(cls: Any, run: Callable[..., torch.Tensor]) -> list[Check]:
    """The checks of a weighted aggregation rule (``traits.weighted``); ``run(x, **kw)``
    calls a fresh instance on ``x`` with a seeded generator and the keywords ``kw``."""
    def weights_keyword() -> None:
        p = inspect.signature(cls.__call__).parameters.get("weights")
        assert p is not None and p.default is None and p.kind in (
            p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY), \
            f"{cls.__name__} declares traits.weighted but its __call__ takes no weights=None"

    def weights_none_is_unweighted() -> None:
        x = matrix(22)
        assert torch.equal(run(x, weights=None), run(x)), \
            "weights=None gives another output than the call without weights"

    def equal_weights_are_unweighted() -> None:
        x = matrix(23)
        plain = run(x)
        for value, dtype in ((1.0, torch.float64), (0.3, torch.float64), (7.0, torch.float32)):
            out = run(x, weights=torch.full((N,), value, dtype=dtype))
            err = float((out - plain).abs().max())
            assert torch.allclose(out, plain, rtol=1e-5, atol=1e-5), \
                f"equal weights {value} ({dtype}) move the output by {err:.3g} from no weights"

    def weights_not_modified() -> None:
        x = matrix(24)
        for dtype in (torch.float64, torch.float32):
            w = torch.rand(N, generator=torch.Generator().manual_seed(25), dtype=dtype) + 0.1
            before, x_before = w.clone(), x.clone()
            out = run(x, weights=w)
            assert torch.equal(w, before), "modified its weights"
            assert torch.equal(x, x_before), "modified its input"
            assert out.shape == (D,) and out.dtype == torch.float32 and torch.isfinite(out).all(), \
                f"output {tuple(out.shape)} {out.dtype} with {dtype} weights"

    def weights_scale_free() -> None:
        """Weights are not normalised: the rule divides by their total."""
        x = matrix(26)
        w = torch.rand(N, generator=torch.Generator().manual_seed(27), dtype=torch.float64) + 0.1
        torch.testing.assert_close(run(x, weights=w * 5.0), run(x, weights=w),
                                   rtol=1e-5, atol=1e-5)

    def weights_follow_their_rows() -> None:
        x = matrix(28)
        w = torch.rand(N, generator=torch.Generator().manual_seed(29), dtype=torch.float64) + 0.1
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(30))
        torch.testing.assert_close(run(x[perm], weights=w[perm]), run(x, weights=w),
                                   rtol=1e-5, atol=1e-4)

    return [(c.__name__, c) for c in (weights_keyword, weights_none_is_unweighted,
                                      equal_weights_are_unweighted, weights_not_modified,
                                      weights_scale_free, weights_follow_their_rows)]


def _aggregator_checks(make: Callable[[], Any]) -> list[Check]:
    def output_contract() -> None:
        x = matrix()
        before = x.clone()
        out = _call(make(), x)
        assert out.shape == (D,) and out.dtype == torch.float32, f"output {tuple(out.shape)} {out.dtype}"
        assert torch.isfinite(out).all(), "non-finite output on finite rows"
        assert torch.equal(x, before), "modified its input"

    def deterministic_and_picklable() -> None:
        x = matrix(1)
        a, b = _call(make(), x), _call(make(), x)
        c = _call(pickle.loads(pickle.dumps(make())), x)
        assert torch.equal(a, b), "two instances give different outputs"
        assert torch.equal(a, c), "a pickled copy gives a different output"

    def permutation_invariance() -> None:
        x = matrix(2)
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(_call(make(), x[perm]), _call(make(), x), rtol=1e-5, atol=1e-4)

    def identical_rows() -> None:
        row = matrix(4, n=1)[0]
        torch.testing.assert_close(_call(make(), row.expand(N, -1).clone()), row,
                                   rtol=1e-5, atol=1e-4)

    def translation_equivariance() -> None:
        x = matrix(5)
        shift = torch.full((D,), 7.5)
        torch.testing.assert_close(_call(make(), x + shift), _call(make(), x) + shift,
                                   rtol=1e-4, atol=1e-3)

    def near_the_honest_rows() -> None:
        """On honest rows alone the output lies within the rows' spread of their mean."""
        x = matrix(14)
        err = float((_call(make(), x) - x.mean(0)).norm())
        assert err <= 2 * _spread(x), f"{err:.3g} from the mean of the rows (spread {_spread(x):.3g})"

    def survives_f_nonfinite_rows() -> None:
        """``F`` rows of NaN or +/-inf leave the output finite and near the honest rows."""
        x = matrix(6)
        honest = x[: N - F]
        for bad in (math.nan, math.inf, -math.inf):
            y = x.clone()
            y[N - F :] = bad
            out = _call(make(), y)
            assert torch.isfinite(out).all(), f"output non-finite with {F} rows of {bad}"
            err = float((out - honest.mean(0)).norm())
            assert err <= 3 * _spread(honest), f"{err:.3g} from the honest mean with {bad} rows"

    return [(c.__name__, c) for c in (output_contract, deterministic_and_picklable,
                                      permutation_invariance, identical_rows,
                                      translation_equivariance, near_the_honest_rows,
                                      survives_f_nonfinite_rows)]


def _preaggregator_checks(make: Callable[[], Any]) -> list[Check]:
    def output_contract() -> None:
        x = matrix(7)
        before = x.clone()
        p = make()
        out = _call(p, x)
        assert out.shape == (p.output_rows(N), D), f"{tuple(out.shape)} rows, output_rows says {p.output_rows(N)}"
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
        assert torch.equal(x, before), "modified its input"
        assert torch.equal(out, _call(make(), x)), "two instances give different outputs"
        assert torch.equal(out, _call(pickle.loads(pickle.dumps(p)), x)), "a pickled copy differs"

    def permutation_invariance() -> None:
        """The mean after it does not depend on the clients' order (a random rule: on
        average over seeds, a permutation only relabels its random draws)."""
        x = matrix(8)
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(9))
        p = make()
        if p.traits.random:
            a = torch.stack([_call(p, x, s).mean(0) for s in range(50)]).mean(0)
            b = torch.stack([_call(p, x[perm], s).mean(0) for s in range(50)]).mean(0)
            torch.testing.assert_close(a, b, rtol=0, atol=0.05)
        else:
            torch.testing.assert_close(_call(p, x).mean(0), _call(p, x[perm]).mean(0),
                                       rtol=1e-5, atol=1e-4)

    def identical_rows() -> None:
        row = (matrix(10, n=1, offset=0.0)[0]) * 0.1  # inside a clipping radius
        out = _call(make(), row.expand(N, -1).clone())
        torch.testing.assert_close(out, row.expand_as(out), rtol=1e-5, atol=1e-5)

    return [(c.__name__, c) for c in (output_contract, permutation_invariance, identical_rows)]


def _meta_checks(make: Callable[[], Any]) -> list[Check]:
    from strategies.aggregators import CoordinateWiseMedian

    def run(m: Any, x: torch.Tensor) -> torch.Tensor:
        return m(x, CoordinateWiseMedian(), generator=torch.Generator().manual_seed(0))

    def output_contract() -> None:
        x = matrix(11)
        before = x.clone()
        m = make()
        out = run(m, x)
        assert out.shape == (D,) and torch.isfinite(out).all()
        assert torch.equal(x, before), "modified its input"
        assert torch.equal(run(make(), x), out), "two instances give different outputs"
        assert torch.equal(run(pickle.loads(pickle.dumps(m)), x), out), "a pickled copy differs"

    def identical_rows() -> None:
        row = matrix(12, n=1)[0]
        torch.testing.assert_close(run(make(), row.expand(N, -1).clone()), row)

    def permutation_invariance() -> None:
        m = make()
        if m.traits.random:
            return  # random buckets: a permutation relabels them
        x = matrix(13)
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(12))
        torch.testing.assert_close(run(m, x[perm]), run(m, x), rtol=1e-5, atol=1e-4)

    def near_the_honest_rows() -> None:
        x = matrix(15)
        err = float((run(make(), x) - x.mean(0)).norm())
        assert err <= 2 * _spread(x), f"{err:.3g} from the mean of the rows (spread {_spread(x):.3g})"

    return [(c.__name__, c) for c in (output_contract, identical_rows, permutation_invariance,
                                      near_the_honest_rows)]


# ---------------------------------------------------------------------------- attacks


def _checks_the_data(make: Callable[[], Any]) -> Callable[[], None]:
    def checks_the_data() -> None:
        """``check_data`` accepts the images the other checks poison, and refuses other
        data, if at all, with a ValueError naming a key."""
        from strategies.protocols import DatasetInfo

        make().check_data(DatasetInfo(20, (1, 8, 8), 10))
        for info in (DatasetInfo(20, (6,), 3), DatasetInfo(20, (16,), 30, tokens=True)):
            try:
                make().check_data(info)
            except ValueError as e:
                assert re.match(r"^\w+: ", str(e)), f"check_data's message names no key: {e}"
    return checks_the_data


def _attack_checks(make: Callable[[], Any], cls: Any) -> list[Check]:
    if cls.traits.gossip:
        def messages_contract() -> None:
            h = 6
            x = matrix(16, n=h)
            before = x.clone()
            w = torch.full((h, h), 0.1) + torch.eye(h) * 0.3
            w_byz = torch.full((h,), 0.1)
            out = make().messages(x, w, w_byz, torch.Generator().manual_seed(0))
            assert out.shape == (h, D) and torch.isfinite(out).all()
            assert torch.equal(x, before), "modified the honest models"
        return [("messages_contract", messages_contract)]

    def rows_contract() -> None:
        a = make()
        # an omniscient attack sees the honest rows, any other its own f honestly computed rows
        seen = matrix(13, n=N - F if a.traits.omniscient else F)
        before = seen.clone()
        rows = a(seen, F, torch.Generator().manual_seed(0))
        assert rows.shape == (F, D) and rows.dtype == torch.float32, f"{tuple(rows.shape)} {rows.dtype}"
        assert torch.equal(seen, before), "modified the rows it saw"
        again = make()(seen, F, torch.Generator().manual_seed(0))
        assert torch.equal(rows, again) or (torch.isnan(rows).all() and torch.isnan(again).all()), \
            "not deterministic under a seeded generator"

    def picklable() -> None:
        if not cls.traits.context:  # an ``aggregate`` function is the engine's, not the plugin's
            pickle.loads(pickle.dumps(make()))

    checks = [("rows_contract", rows_contract), ("picklable", picklable),
              ("checks_the_data", _checks_the_data(make))]
    if cls.traits.data_poisoning:
        def poisons_data() -> None:
            g = torch.Generator().manual_seed(3)
            x, y = torch.rand((20, 1, 8, 8), generator=g), torch.arange(20) % 10
            x0, y0 = x.clone(), y.clone()
            px, py = make().poison(x, y, 1, 0, 10, torch.Generator().manual_seed(0))
            assert torch.equal(x, x0) and torch.equal(y, y0), "poison() modified its inputs"
            assert px.shape == x.shape and px.dtype == x.dtype
            assert py.shape == y.shape and py.dtype == y.dtype
            assert bool(((py >= 0) & (py < 10)).all()), "labels outside 0..num_classes-1"
            again = make().poison(x, y, 1, 0, 10, torch.Generator().manual_seed(0))
            assert torch.equal(again[0], px) and torch.equal(again[1], py), "not seeded"
        checks.append(("poisons_data", poisons_data))
    if cls.traits.targeted:
        def builds_its_success_set() -> None:
            x, y = torch.rand((20, 1, 8, 8), generator=torch.Generator().manual_seed(4)), \
                torch.arange(20) % 10
            tx, ty = make().triggered(x, y)
            assert tx.shape[1:] == x.shape[1:] and len(tx) == len(ty) > 0
            assert bool(((ty >= 0) & (ty < 10)).all()), "labels outside 0..num_classes-1"
            again = make().triggered(x, y)
            assert torch.equal(again[0], tx) and torch.equal(again[1], ty), "not deterministic"
        checks.append(("builds_its_success_set", builds_its_success_set))
    return checks


# ---------------------------------------------------------------------------- D-SGD


def _topology_checks(make: Callable[[], Any], cls: Any) -> list[Check]:
    from strategies.topologies import validate_mixing

    def mixing_matrices() -> None:
        t = make()
        checked = 0
        for n in (4, 8, 9, 16):
            try:
                t.check(n)
            except ValueError:
                continue
            for step in (range(3) if cls.traits.time_varying else (0,)):
                w = t.mixing_matrix(n, 0, step)
                assert w.shape == (n, n), f"{w.shape} for {n} peers"
                np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-9)
                np.testing.assert_allclose(w.sum(0), 1.0, atol=1e-9)
                assert (w >= -1e-12).all(), "negative weights"
            if not cls.traits.time_varying:
                validate_mixing(t.mixing_matrix(n, 0))
                np.testing.assert_array_equal(t.mixing_matrix(n, 0), make().mixing_matrix(n, 0))
            checked += 1
        assert checked, "check(n) refused every n in 4, 8, 9, 16"

    return [("mixing_matrices", mixing_matrices)]


def _gossip_defense_checks(make: Callable[[], Any]) -> list[Check]:
    from strategies.gossip import sparse_rows

    def consensus_is_a_fixed_point() -> None:
        h = 5
        w = np.full((h, h), 0.1) + np.eye(h) * 0.5
        step = GossipStep(w, sparse_rows(w), np.zeros(h), np.zeros(h, dtype=np.int64))
        row = matrix(17, n=1)[0]
        x = row.expand(h, -1).clone()
        out = make()(x, step, None)
        assert out.shape == (h, D)
        torch.testing.assert_close(out, x, rtol=1e-5, atol=1e-4)
        y = matrix(18, n=h)
        before = y.clone()
        out = make()(y, step, None)
        assert torch.equal(y, before) and torch.isfinite(out).all()

    return [("consensus_is_a_fixed_point", consensus_is_a_fixed_point)]


# ---------------------------------------------------------------------------- optimizers


def _optimizer_checks(make: Callable[[], Any]) -> list[Check]:
    half = make().client_rule()
    layout = half.traits.message if half is not None else MessageLayout()

    def step_and_state_round_trip() -> None:
        # the aggregated parts of the client half's message, by name (as the server gives them)
        x, deltas = matrix(19, n=1)[0], matrix(20, n=3, d=layout.width(D), offset=0.0) * 0.1
        deltas = deltas.abs() + 0.1 if layout.multipart else deltas  # a scalar part may divide
        parts = [layout.split(row, D) for row in deltas]
        a = make()
        before = x.clone()
        y = a.step_parts(x, parts[0])
        assert y.shape == x.shape and torch.isfinite(y).all() and torch.equal(x, before)
        saved = pickle.loads(pickle.dumps(a.state_dict()))
        nxt = a.step_parts(y, parts[1])
        b = make()
        b.load_state_dict(saved)
        assert torch.equal(b.step_parts(y, parts[1]), nxt), \
            "load_state_dict does not restore the state"
        shared = a.shared()
        assert shared is None or (shared.shape == x.shape and torch.isfinite(shared).all()), \
            "shared() is a flat tensor of the model's size, or None"

    checks = [("step_and_state_round_trip", step_and_state_round_trip)]
    if isinstance(half, DriftRule):  # the client half meets the drift contract too
        checks += _drift_rule_checks(lambda: make().client_rule())
    return checks


def _drift_rule_checks(make: Callable[[], Any]) -> list[Check]:
    from simulator.config import Local

    local = Local(steps=3, batch_size=4, lr=0.1)

    def drift_contract() -> None:
        rule = make()
        rule.prepare(np.array([3, 5, 2]), local)
        start, update = matrix(21, n=1)[0], matrix(22, n=1, offset=0.0)[0] * 0.1
        shared = torch.full_like(start, 0.5) if rule.traits.shared_state else None
        state: dict[str, torch.Tensor] = {}
        for _ in range(2):  # a first round (no state yet), then one with the state kept
            fix = rule.correction(start, state, shared)
            if fix is not None:
                v = fix(start + 0.01)
                assert v.shape == start.shape and torch.isfinite(v).all(), \
                    "correction(w) is a finite flat vector of the model's size"
            before = update.clone()
            msg, state = rule.message(update, 3, state, shared, local)
            assert torch.equal(update, before), "message() modified the update"
            width = rule.traits.message.width(start.numel())
            assert msg.shape == (width,), \
                f"a message of {tuple(msg.shape)}, not traits.message's {width} entries"
            assert torch.isfinite(msg).all()
            assert all(isinstance(t, torch.Tensor) for t in state.values()), \
                "state holds non-tensors"
            assert rule.traits.client_state or not state, \
                "a rule that keeps state declares traits.client_state"
        if rule.traits.personal:
            assert rule.traits.client_state, "a personal model is client state: declare it"
            fix = rule.personal_correction(start)
            assert fix is None or fix(start + 0.01).shape == start.shape
        pickle.loads(pickle.dumps(rule))

    return [("drift_contract", drift_contract)]


def _client_rule_checks(make: Callable[[], Any], cls: Any) -> list[Check]:
    if issubclass(cls, DriftRule):
        return _drift_rule_checks(make)
    if not cls.traits.gradient_rule:
        return [("builds", lambda: pickle.loads(pickle.dumps(make())) and None)]

    def message_contract() -> None:
        x = matrix(21, n=1)[0]

        def grad(p: torch.Tensor) -> tuple[torch.Tensor, float]:
            return 2 * p, float((p ** 2).sum())

        msg, state, loss = make().client_message(0, x, grad, {}, 0.1)
        assert msg.shape == x.shape and torch.isfinite(msg).all() and math.isfinite(loss)
        assert all(isinstance(v, torch.Tensor) for v in state.values()), "state holds non-tensors"
        msg2, _, _ = make().client_message(1, x, grad, state, 0.1)
        assert msg2.shape == x.shape

    return [("message_contract", message_contract)]


# ---------------------------------------------------------------------------- trainers


def _trainer_checks(make_with: Callable[..., Any], layout: MessageLayout) -> list[Check]:
    from simulator.config import Local
    from simulator.models import MLP

    local = Local(steps=3, batch_size=4, lr=0.1)

    def clients(seed: int, ids: list[int]) -> list[ClientData]:
        out = []
        for c in ids:
            g = torch.Generator().manual_seed(1000 * seed + c)
            x = torch.randn((6 + c, 1, 8, 8), generator=g)
            y = torch.randint(0, 3, (6 + c,), generator=g)
            out.append(ClientData(c, x, y, torch.Generator().manual_seed(seed * 7 + c)))
        return out

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return MLP((1, 8, 8), 3, hidden=[8])

    def updates_contract() -> None:
        m = model()
        start = torch.nn.utils.parameters_to_vector(m.parameters()).detach().clone()
        t = make_with(model=m, local=local)
        u, losses = t.train(0, clients(1, [0, 1, 2]), start)
        width = layout.width(start.numel())  # the rule's message: its parts side by side
        assert u.shape == (3, width) and losses.shape == (3,), f"{tuple(u.shape)}"
        assert torch.isfinite(u).all() and bool((u != 0).any()), "no finite, non-zero update"
        again, _ = make_with(model=model(), local=local).train(0, clients(1, [0, 1, 2]), start)
        torch.testing.assert_close(u, again, rtol=0, atol=1e-6)

    def independent_of_the_other_clients() -> None:
        m = model()
        start = torch.nn.utils.parameters_to_vector(m.parameters()).detach().clone()
        together, _ = make_with(model=m, local=local).train(0, clients(2, [0, 1, 2]), start)
        alone, _ = make_with(model=model(), local=local).train(0, clients(2, [1]), start)
        torch.testing.assert_close(together[1], alone[0], rtol=0, atol=1e-5)

    return [("updates_contract", updates_contract),
            ("independent_of_the_other_clients", independent_of_the_other_clients)]


# ---------------------------------------------------------------------------- codecs


def _codec_checks(make: Callable[[], Any]) -> list[Check]:
    from strategies.codecs import chain_layout
    from strategies.protocols import ROWS, CodecBatch, MessageShape, PartSpec

    # a model of a (3, 4) weight and a bias of 4 (D entries): a codec that compresses layers
    # as matrices (PowerSGD) is checked on one
    shape = MessageShape(D, ((3, 4), (4,)))

    def batch(codec: Any) -> CodecBatch:
        gens = [torch.Generator().manual_seed(100 + i) for i in range(N)]
        return CodecBatch(3, gens, shape, [{} for _ in range(N)] if codec.keeps_state()
                          else None)

    def round_trip() -> None:
        x = matrix(23, n=N, offset=0.0)
        before = x.clone()
        codec = make()
        payload = codec.encode({ROWS: x}, batch(codec))
        assert torch.equal(x, before), "encode() modified its input"
        assert payload and all(v.shape[0] == N for v in payload.values()), \
            f"a payload of {[tuple(v.shape) for v in payload.values()]}: one row a message"
        again = make().encode({ROWS: x}, batch(codec))
        assert payload.keys() == again.keys() and all(
            torch.equal(payload[k], again[k]) for k in payload), \
            "encode() is not deterministic under the batch's generators"
        layout = codec.layout({ROWS: PartSpec(D, "float32")}, shape)
        assert layout.keys() == payload.keys(), \
            f"layout() names {sorted(layout)}, encode() sent {sorted(payload)}"
        for k, spec in layout.items():
            per_row = payload[k][0]
            assert (per_row.numel(), str(per_row.dtype).removeprefix("torch.")) == \
                (spec.entries, spec.dtype), f"part {k!r}: layout {spec}, sent " \
                f"{per_row.numel()} {per_row.dtype}"
        assert chain_layout((codec,), shape) == layout
        rows = codec.decode(payload, shape)
        assert rows.keys() == {ROWS}, f"decode() gave parts {sorted(rows)}"
        dense = rows[ROWS]
        assert dense.shape == (N, D) and dense.dtype == torch.float32 and \
            torch.isfinite(dense).all(), f"decode() gave {tuple(dense.shape)} {dense.dtype}"
        screened = codec.screen(dense)
        assert screened.shape == (N, D) and torch.isfinite(screened).all()
        combined, info = codec.combine(screened, 3, 7)
        m = codec.output_rows(N)
        assert combined.shape == (m, D) and torch.isfinite(combined).all(), \
            f"combine() gave {tuple(combined.shape)}, output_rows({N}) says {m}"
        assert codec.hides_rows() or torch.equal(combined, screened), \
            "a codec that hides no rows changed them in combine()"
        assert all(isinstance(v, float) for v in info.values())
        agg = codec.finish(screened.mean(0), N, torch.Generator().manual_seed(0))
        assert agg.shape == (D,) and torch.isfinite(agg).all()
        pickle.loads(pickle.dumps(codec))

    return [("round_trip", round_trip)]


# ---------------------------------------------------------------------------- the rest


def _privacy_checks(make: Callable[[], Any]) -> list[Check]:
    def accounting() -> None:
        p = make()
        mech = p.mechanism(10, 0.1, 0.05, 5)
        eps = mech.epsilon(p.delta, p.accountant)
        assert eps > 0, f"epsilon {eps}"
        assert mech.epsilon(p.delta, p.accountant) <= p.mechanism(20, 0.1, 0.05, 5).epsilon(
            p.delta, p.accountant), "more rounds spend less privacy"

    return [("accounting", accounting)]


def _privacy_attack_checks(make: Callable[[], Any]) -> list[Check]:
    """A reconstruction returns one input a sample in the data's range and a label each,
    the same from the same generator seed; a membership attack one finite score a query."""
    from torch import nn

    from strategies.protocols import AttackView

    def shapes() -> None:
        attack = make()
        model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3)).eval()
        g = torch.Generator().manual_seed(0)
        x, y = torch.rand(2, 3, 4, generator=g), torch.tensor([0, 2])
        if attack.traits.reconstructs:
            update = torch.randn(sum(p.numel() for p in model.parameters()), generator=g)
            view = AttackView(model, update, 2, 0.1, 1, (3, 4), 3, (0.0, 1.0))
            out = attack.attack(view, torch.Generator().manual_seed(1))
            assert out.inputs is not None and tuple(out.inputs.shape) == (2, 3, 4), \
                "a reconstruction: inputs of shape (samples, *input_shape)"
            assert out.labels is not None and tuple(out.labels.shape) == (2,)
            assert bool(((out.inputs >= -1e-6) & (out.inputs <= 1 + 1e-6)).all()), \
                "inputs outside the data's range (view.input_range)"
            again = attack.attack(view, torch.Generator().manual_seed(1))
            assert torch.equal(again.inputs, out.inputs), "not a function of its generator"
        else:
            view = AttackView(model, None, 2, 0.0, 0, (3, 4), 3, (0.0, 1.0), (x, y))
            out = attack.attack(view, torch.Generator().manual_seed(1))
            assert out.scores is not None and tuple(out.scores.shape) == (2,), \
                "a membership attack: one score a query"
            assert bool(torch.isfinite(out.scores).all())

    return [("attack_contract", shapes)]


def _dataset_checks(make: Callable[[], Any]) -> list[Check]:
    def load_contract() -> None:
        split = make().load(4, 0, 0.2)
        n = len(split.y_train)
        assert split.x_train.shape == (n, *split.input_shape)
        assert split.x_train.dtype in (np.float32, np.uint8, np.int32), \
            f"samples of {split.x_train.dtype}: float32 values, uint8 images or int32 tokens"
        info = make().describe(4, 0, 0.2)
        values = info is not None and info.targets == "values"
        want = np.float32 if values else np.int64
        assert split.y_train.dtype == want and split.y_test.dtype == want, \
            f"labels of {split.y_train.dtype}: int64 class ids, or float32 values (describe()" \
            " says targets='values')"
        assert len(split.x_test) == len(split.y_test) > 0
        if not values:
            assert 0 <= split.y_train.min() and split.y_train.max() < split.num_classes
        if info is not None:
            assert (info.train_samples, tuple(info.input_shape), info.num_classes) == \
                (n, tuple(split.input_shape), split.num_classes), f"describe() says {info}"
            assert info.tokens == (split.x_train.dtype == np.int32), "describe()'s tokens"
            assert info.value_bytes == split.x_train.dtype.itemsize, \
                f"describe()'s value_bytes {info.value_bytes}: the samples are " \
                f"{split.x_train.dtype} ({split.x_train.dtype.itemsize} bytes a value)"
        again = make().load(4, 0, 0.2)
        np.testing.assert_array_equal(again.y_train, split.y_train)

    return [("load_contract", load_contract)]


def _partitioner_checks(make: Callable[[], Any]) -> list[Check]:
    def partition_contract() -> None:
        y = np.arange(300) % 5
        parts = make()(y, 10, np.random.default_rng(0), np.arange(300) % 10)
        assert len(parts) == 10 and all(len(p) for p in parts), "a client without samples"
        flat = np.concatenate(parts)
        assert len(np.unique(flat)) == len(flat) and flat.min() >= 0 and flat.max() < 300
        again = make()(y, 10, np.random.default_rng(0), np.arange(300) % 10)
        assert all(np.array_equal(a, b) for a, b in zip(parts, again)), "not seeded"

    return [("partition_contract", partition_contract)]


def _model_checks(make_with: Callable[..., Any], cls: Any) -> list[Check]:
    def forward_contract() -> None:
        torch.manual_seed(0)
        if cls.traits.tokens:  # token ids: sequences of 12 over 10 symbols
            m = make_with(input_shape=(12,), num_classes=10, vocabulary=10)
            out = m(torch.randint(0, 10, (3, 12), generator=torch.Generator().manual_seed(0)))
        else:
            m = make_with(input_shape=(1, 8, 8), num_classes=10)
            out = m(torch.zeros((3, 1, 8, 8)))
        assert tuple(out.shape) == (3, 10), f"output {tuple(out.shape)}"
        assert all(torch.isfinite(p).all() for p in m.parameters())
        pickle.loads(pickle.dumps(m))

    return [("forward_contract", forward_contract)]


def _task_checks(make: Callable[[], Any]) -> list[Check]:
    def loss_contract() -> None:
        task = make()
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 10, (3, 12), generator=g)  # token ids, 10 symbols
        classes = task.traits.targets == "classes"  # else one real-valued output per sample
        y = torch.randint(0, 10, (3,), generator=g) if classes else torch.randn(3, generator=g)
        shape = tuple(task.output_shape(3, (12,), 10 if classes else 1))
        assert shape[0] == 3, f"output_shape {shape} for a batch of 3"
        out = torch.randn(shape, generator=g, requires_grad=True)
        target = task.target(x, y)
        losses = task.losses(out, target)
        assert tuple(losses.shape) == (3,), f"losses of shape {tuple(losses.shape)}, not (3,)"
        assert torch.isfinite(losses).all(), "non-finite losses"
        (grad,) = torch.autograd.grad(losses.sum(), out)
        assert torch.isfinite(grad).all() and bool((grad != 0).any()), "no gradient"
        hits = task.hits(out.detach(), target)
        if hits is not None:
            assert tuple(hits.shape) == (3,) and bool(((hits >= 0) & (hits <= 1)).all()), \
                "hits: each sample's accuracy in [0, 1]"
        acc = None if hits is None else float(hits.mean())
        assert "loss" in task.metrics(float(losses.detach().mean()), acc), \
            "metrics without 'loss'"
        pickle.loads(pickle.dumps(task))

    return [("loss_contract", loss_contract)]


# ---------------------------------------------------------------------------- entry points


def plugin_checks(kind: str, cls: Any, params: dict[str, Any] | None = None,
                  skip: dict[str, str] | None = None) -> list[Check]:
    """The conformance checks of ``kind`` for ``cls`` as ``(name, check)`` pairs, the
    ``skip``ped ones left out. The first check is always ``subclasses_the_contract``."""
    base = CONTRACTS[kind]

    def subclasses_the_contract() -> None:
        assert inspect.isclass(cls) and issubclass(cls, base), \
            f"{cls!r} does not subclass {base.__module__}.{base.__qualname__}"
        if kind == "attacks":
            _one_attack_contract(cls)
        registry.params_model(cls)  # its keys can be read from its constructor

    def make(**context: Any) -> Any:
        return build(kind, cls, params, **context)

    def plain() -> Any:
        return make()

    def weighted(run: Callable[..., torch.Tensor]) -> list[Check]:
        return _weighted_checks(cls, run) if getattr(cls, "traits", None) is not None \
            and cls.traits.weighted else []

    def run_aggregator(x: torch.Tensor, **kw: Any) -> torch.Tensor:
        return plain()(x, generator=torch.Generator().manual_seed(0), **kw)

    def run_meta(x: torch.Tensor, **kw: Any) -> torch.Tensor:
        from strategies.aggregators import CoordinateWiseMedian

        return plain()(x, CoordinateWiseMedian(), generator=torch.Generator().manual_seed(0),
                       **kw)

    by_kind: dict[str, Callable[[], list[Check]]] = {
        "aggregators": lambda: [_takes_a_generator(cls), *_aggregator_checks(plain),
                                *weighted(run_aggregator)],
        "preaggregators": lambda: [_takes_a_generator(cls), *_preaggregator_checks(plain)],
        "meta": lambda: [_takes_a_generator(cls), *_meta_checks(plain), *weighted(run_meta)],
        "attacks": lambda: _attack_checks(_with_aggregate(make), cls),
        "topologies": lambda: _topology_checks(plain, cls),
        "gossip_defenses": lambda: _gossip_defense_checks(_defense(make)),
        # the engine offers the sampling fraction (SCAFFOLD, FedDyn take it)
        "optimizers": lambda: _optimizer_checks(lambda: make(participation=0.5)),
        "client_optimizers": lambda: _client_rule_checks(plain, cls),
        "trainers": lambda: _trainer_checks(*_trainer(make, cls)),
        "codecs": lambda: _codec_checks(plain),
        "privacy": lambda: _privacy_checks(plain),
        # a reconstruction's iteration budget (a key every one has) kept short
        "privacy_attacks": lambda: _privacy_attack_checks(
            lambda: make(iterations=5) if cls.traits.reconstructs else make()),
        "datasets": lambda: _dataset_checks(plain),
        "partitioners": lambda: _partitioner_checks(plain),
        "models": lambda: _model_checks(make, cls),
        "tasks": lambda: _task_checks(plain),
    }
    checks = [("subclasses_the_contract", subclasses_the_contract), *by_kind[kind]()]
    return [(name, fn) for name, fn in checks if name not in (skip or {})]


def _one_attack_contract(cls: Any) -> None:
    """An attack is an Attack (rows) or a GossipAttack (messages), as ``traits.gossip``
    declares."""
    assert issubclass(cls, (Attack, GossipAttack)), \
        f"{cls.__name__} subclasses neither Attack (rows) nor GossipAttack (gossip messages)"
    assert bool(cls.traits.gossip) == issubclass(cls, GossipAttack), \
        f"{cls.__name__}: traits.gossip is {cls.traits.gossip}, but it is " + \
        ("" if issubclass(cls, GossipAttack) else "not ") + "a GossipAttack"


def _with_aggregate(make: Callable[..., Any]) -> Callable[[], Any]:
    from strategies.aggregators import CoordinateWiseMedian

    return lambda: make(aggregate=CoordinateWiseMedian())


def _defense(make: Callable[..., Any]) -> Callable[[], Any]:
    from strategies.aggregators import CoordinateWiseMedian

    return lambda: make(clip_tau=None, aggregator=CoordinateWiseMedian())


def declared_rule(trainer: Any) -> ClientRule | None:
    """A client rule that declares it runs with ``trainer`` (a registered trainer class):
    the first, by name, of the registered client rules and the server optimizers' client
    halves whose ``traits.trainer`` names it (or, for the gradient-rule trainer, that are
    gradient rules); None when none does."""
    from simulator import registry
    from simulator.config.schema import GRADIENT_RULE_TRAINER

    names = [n for n in registry.available("trainers") if registry.get("trainers", n) is trainer]
    rules: list[ClientRule] = [registry.instantiate("client_optimizers", {"name": n})
                               for n in registry.available("client_optimizers")]
    for n in registry.available("optimizers"):
        half = registry.instantiate("optimizers", {"name": n}, participation=0.5).client_rule()
        if half is not None:
            rules.append(half)
    for rule in rules:
        t = rule.traits
        if t.trainer in names or (t.gradient_rule and t.trainer is None
                                  and GRADIENT_RULE_TRAINER["name"] in names):
            return rule
    return None


def _trainer(make: Callable[..., Any], cls: Any) -> tuple[Callable[..., Any], MessageLayout]:
    """The trainer with the engine's context: the client rule that declares it runs with it
    (``declared_rule``; a trainer that takes a rule no registered rule names fails here),
    the clients' sizes of ``_trainer_checks`` (6, 7 and 8 samples); and the layout of the
    messages it then sends (the rule's, when it takes one)."""
    from strategies.privacy import DPSGD
    from strategies.tasks import Classification

    rule = declared_rule(cls) if "rule" in cls.traits.context else None
    assert rule is not None or "rule" not in cls.traits.context, (
        f"{cls.__name__} takes a client rule, and no registered rule declares it "
        "(traits.trainer): register the rule it runs with")

    def with_context(**context: Any) -> Any:
        return make(rule=rule, privacy=DPSGD(noise_multiplier=0.0), task=Classification(),
                    client_sizes=np.array([6, 7, 8]), **context)

    return with_context, rule.traits.message if rule is not None else MessageLayout()


def check_plugin(kind: str, cls: Any, params: dict[str, Any] | None = None,
                 skip: dict[str, str] | None = None) -> None:
    """Run every conformance check of ``kind`` on ``cls``; an AssertionError names the check
    and the plugin."""
    for name, check in plugin_checks(kind, cls, params, skip):
        try:
            check()
        except AssertionError as e:
            raise AssertionError(f"{kind} {cls.__name__}: check {name} failed: {e}") from e
