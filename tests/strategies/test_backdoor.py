"""Backdoor attacks (strategies.backdoor) on hand-computed cases: where the trigger lands,
how many samples are poisoned, DBA's parts, the attack-success test set, model replacement's
boost and norm bound; and a backdoor learnt by a logistic regression on fedray's digits."""

from __future__ import annotations

import doctest
import math
import pickle

import pytest
import torch
from pydantic import ValidationError

import strategies.backdoor as B
from fedray.testing import check_plugin
from simulator import registry
from simulator.data.datasets import Digits
from simulator.runtime.common import model_input


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def images(n: int = 10, shape: tuple[int, ...] = (3, 8, 8), seed: int = 0) -> torch.Tensor:
    # values in [0, 0.5): a stamped pixel (1.0) is never equal to a clean one
    return torch.rand((n, *shape), generator=gen(seed)) * 0.5


def labels(n: int = 10, classes: int = 10, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, classes, (n,), generator=gen(seed))


ATTACKS = [B.PixelBackdoor(), B.DistributedBackdoor(), B.ModelReplacement(),
           B.EdgeCaseBackdoor()]
NAMES = [type(a).__name__ for a in ATTACKS]


def test_doctests_of_the_module():
    result = doctest.testmod(B)
    assert result.attempted == 4 and result.failed == 0


# ---------------------------------------------------------------------------- triggers


def test_trigger_grid_of_images_and_flat_samples():
    assert B.trigger_grid((3, 32, 32)) == (32, 32)
    assert B.trigger_grid((28, 28)) == (28, 28)
    assert B.trigger_grid((64,)) == (8, 8)  # a flattened 8x8 digit
    assert B.trigger_grid((10,)) == (1, 10)  # not a square: one row of pixels


def test_square_trigger_stamps_value_in_every_channel_and_nothing_else():
    x = images()
    before = x.clone()
    out = B.stamp_trigger(x, B.square_trigger((8, 8), 3), 1.0)
    assert torch.equal(x, before)  # not in place
    assert torch.equal(out[:, :, 5:, 5:], torch.ones((10, 3, 3, 3)))
    changed = out != x
    assert int(changed.sum()) == 10 * 3 * 9  # 9 pixels x 3 channels x 10 samples
    assert not changed[:, :, :5, :].any() and not changed[:, :, :, :5].any()
    assert out.dtype == torch.float32


def test_square_trigger_on_flat_samples():
    # a flat square sample: the same pixels as the image, stored row by row
    x = images(4, (1, 8, 8))
    flat = B.stamp_trigger(x.reshape(4, 64), B.square_trigger((8, 8), 3), 0.75)
    assert torch.equal(flat, B.stamp_trigger(x, B.square_trigger((8, 8), 3), 0.75).reshape(4, 64))
    assert sorted({int(i) for i in torch.nonzero(flat[0] == 0.75)}) == \
        [45, 46, 47, 53, 54, 55, 61, 62, 63]
    # a flat sample that is not a square: one row, the last `size` features
    z = images(4, (10,))
    out = B.stamp_trigger(z, B.square_trigger((1, 10), 3), 1.0)
    assert torch.equal(out[:, 7:], torch.ones(4, 3)) and torch.equal(out[:, :7], z[:, :7])
    # the square is clipped to a small image
    assert int(B.square_trigger((2, 5), 3).sum()) == 6


def test_stamp_refuses_a_mask_of_another_grid():
    with pytest.raises(ValueError, match=r"trigger: a \(7, 7\) mask .* pixel grid is \(8, 8\)"):
        B.stamp_trigger(images(2), torch.zeros((7, 7), dtype=torch.bool), 1.0)


# ---------------------------------------------------------------------------- poisoning


def test_poison_indices_round_half_up_and_follow_the_generator():
    assert B.poison_indices(10, 0.5, gen(3)).numel() == 5
    assert B.poison_indices(10, 0.25, gen(3)).numel() == 3  # 2.5 rounds up
    assert B.poison_indices(10, 0.24, gen(3)).numel() == 2
    assert B.poison_indices(10, 0.0, gen(3)).numel() == 0
    assert torch.equal(B.poison_indices(10, 1.0, gen(3)), torch.arange(10))
    expected = torch.sort(torch.randperm(10, generator=gen(3))[:5]).values
    assert torch.equal(B.poison_indices(10, 0.5, gen(3)), expected)


def test_pixel_poison_stamps_and_relabels_exactly_the_fraction():
    x, y = images(10), labels(10)
    xb, yb = x.clone(), y.clone()
    a = B.PixelBackdoor(target=3, poison_fraction=0.5)
    px, py = a.poison(x, y, attacker=0, round_=0, num_classes=10, generator=gen(7))
    assert torch.equal(x, xb) and torch.equal(y, yb)  # not in place
    assert px.shape == x.shape and px.dtype == x.dtype and py.dtype == y.dtype
    chosen = B.poison_indices(10, 0.5, gen(7))
    stamped = (px != x).flatten(1).any(1)
    assert torch.equal(torch.nonzero(stamped).reshape(-1), chosen)
    assert torch.equal(py[chosen], torch.full((5,), 3))
    rest = torch.ones(10, dtype=torch.bool)
    rest[chosen] = False
    assert torch.equal(py[rest], y[rest]) and torch.equal(px[rest], x[rest])
    assert torch.equal(px[chosen][:, :, 5:, 5:], torch.ones(5, 3, 3, 3))
    # the same generator seed, the same poisoned data
    again = a.poison(x, y, 0, 0, 10, gen(7))
    assert torch.equal(again[0], px) and torch.equal(again[1], py)


def test_pixel_value_and_size_keys():
    a = B.PixelBackdoor(target=0, poison_fraction=1.0, size=2, value=0.9)
    px, _ = a.poison(images(3), labels(3), 0, 0, 10, gen(0))
    assert int((px == 0.9).sum()) == 3 * 3 * 4


def test_target_must_be_a_class():
    with pytest.raises(ValueError, match=r"^target: must be < num_classes = 10, got 12"):
        B.PixelBackdoor(target=12).poison(images(2), labels(2), 0, 0, 10, gen(0))
    with pytest.raises(ValueError, match=r"^source: must be < num_classes = 5, got 7"):
        B.EdgeCaseBackdoor(target=1).poison(images(2), labels(2, 5), 0, 0, 5, gen(0))


def test_triggered_excludes_the_target_class():
    x = images(8)
    y = torch.tensor([0, 2, 0, 5, 9, 0, 1, 2])
    xb, yb = x.clone(), y.clone()
    tx, ty = B.PixelBackdoor(target=0).triggered(x, y)
    assert torch.equal(x, xb) and torch.equal(y, yb)
    keep = torch.tensor([1, 3, 4, 6, 7])
    assert torch.equal(ty, torch.zeros(5, dtype=torch.int64))
    assert torch.equal(tx[:, :, 5:, 5:], torch.ones(5, 3, 3, 3))
    mask = B.square_trigger((8, 8), 3)
    assert torch.equal(tx[:, :, ~mask], x[keep][:, :, ~mask])


# ---------------------------------------------------------------------------- DBA


def test_dba_parts_are_disjoint_bars_whose_union_is_the_global_trigger():
    parts = B.dba_parts((8, 8), 3, 4)
    assert parts.shape == (4, 8, 8)
    assert int(parts.sum(0).max()) == 1  # disjoint
    for k in range(4):  # bar k: row 4 + k, columns 5..7
        expected = torch.zeros((8, 8), dtype=torch.bool)
        expected[4 + k, 5:] = True
        assert torch.equal(parts[k], expected)
        assert torch.equal(B.dba_part((8, 8), 3, 4, k), expected)
    a = B.DistributedBackdoor()
    union = a.global_trigger((1, 8, 8))
    assert torch.equal(union, parts.any(0))
    assert int(union.sum()) == 12
    # with a gap of one row: rows 1, 3, 5, 7
    gapped = B.dba_parts((8, 8), 2, 4, gap=1)
    assert [int(r) for r in torch.nonzero(gapped.any(0).any(1)).reshape(-1)] == [1, 3, 5, 7]
    assert int(gapped.sum(0).max()) == 1


def test_dba_refuses_bars_that_do_not_fit():
    with pytest.raises(ValueError, match=r"^parts: 4 bars with gap 2 need 10 rows"):
        B.dba_parts((8, 8), 3, 4, gap=2)
    with pytest.raises(ValueError, match=r"^part: must be in 0\.\.3, got 4"):
        B.dba_part((8, 8), 3, 4, 4)


def test_dba_client_stamps_its_part_and_the_test_set_the_union():
    a = B.DistributedBackdoor(target=0, poison_fraction=1.0)
    x, y = images(6), labels(6)
    for client in (1, 5, 9):  # all part 1 (client mod 4): row 5, columns 5..7
        px, py = a.poison(x, y, client, 0, 10, gen(client))
        changed = (px != x).any(1).any(0)
        expected = torch.zeros((8, 8), dtype=torch.bool)
        expected[5, 5:] = True
        assert torch.equal(changed, expected)
        assert torch.equal(py, torch.zeros(6, dtype=torch.int64))
    local = [a.local_trigger((3, 8, 8), c) for c in range(4)]
    assert torch.equal(torch.stack(local).any(0), a.global_trigger((3, 8, 8)))
    tx, _ = a.triggered(x, torch.full((6,), 4))
    assert torch.equal((tx != x).any(1).any(0), a.global_trigger((3, 8, 8)))


# ---------------------------------------------------------------------------- model replacement


def test_model_replacement_boosts_the_own_updates():
    own = torch.tensor([[3.0, 4.0, 0.0], [0.0, -1.0, 2.0]])
    before = own.clone()
    rows = B.ModelReplacement(boost=10.0)(own, 2, gen(0))
    assert torch.equal(own, before)
    assert torch.equal(rows, torch.tensor([[30.0, 40.0, 0.0], [0.0, -10.0, 20.0]]))
    assert torch.equal(B.PixelBackdoor()(own, 2, gen(0)), own)  # plain poisoning: unchanged


def test_model_replacement_projects_onto_the_norm_bound():
    own = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0], [math.nan, 1.0]])
    rows = B.ModelReplacement(boost=2.0, norm_bound=5.0)(own, 4, gen(0))
    # norm 10 -> scaled to 5 (the direction kept); norm 1 and the zero row stay
    torch.testing.assert_close(rows[0], torch.tensor([3.0, 4.0]), rtol=0, atol=1e-6)
    assert float(torch.linalg.vector_norm(rows[0])) == pytest.approx(5.0, rel=1e-6)
    assert torch.equal(rows[1], torch.tensor([0.6, 0.8]))
    assert torch.equal(rows[2], torch.zeros(2))
    assert bool(torch.isnan(rows[3, 0]))  # a non-finite row stays non-finite
    # a bound above every boosted norm changes nothing
    assert torch.equal(B.boost_and_constrain(own[:3], 2.0, 100.0), own[:3] * 2.0)


# ---------------------------------------------------------------------------- edge case


def test_edge_case_relabels_the_source_class_only():
    x = images(8)
    y = torch.tensor([7, 2, 7, 5, 7, 0, 7, 1])
    xb, yb = x.clone(), y.clone()
    a = B.EdgeCaseBackdoor()  # sevens labelled one, all of them
    px, py = a.poison(x, y, 0, 0, 10, gen(0))
    assert torch.equal(x, xb) and torch.equal(y, yb)
    assert torch.equal(px, x)
    assert torch.equal(py, torch.tensor([1, 2, 1, 5, 1, 0, 1, 1]))
    half = B.EdgeCaseBackdoor(poison_fraction=0.5)
    _, hy = half.poison(x, y, 0, 0, 10, gen(4))
    changed = torch.nonzero(hy != y).reshape(-1)
    expected = torch.tensor([0, 2, 4, 6])[B.poison_indices(4, 0.5, gen(4))]
    assert torch.equal(changed, expected) and torch.equal(hy[changed], torch.ones(2).long())
    tx, ty = a.triggered(x, y)
    assert torch.equal(tx, x[[0, 2, 4, 6]]) and torch.equal(ty, torch.ones(4).long())


def test_edge_case_check_refuses_source_equal_target():
    with pytest.raises(ValueError, match=r"^source: must differ from target = 3, got 3"):
        B.EdgeCaseBackdoor(target=3, source=3).check(2)
    B.EdgeCaseBackdoor().check(2)


# ---------------------------------------------------------------------------- contract


@pytest.mark.parametrize("attack", ATTACKS, ids=NAMES)
def test_no_method_modifies_its_inputs(attack):
    x, y = images(12), labels(12)
    own = torch.randn((3, 20), generator=gen(2))
    xb, yb, ob = x.clone(), y.clone(), own.clone()
    px, py = attack.poison(x, y, 2, 5, 10, gen(1))
    px.add_(1.0)
    py.add_(1)  # the results are not views of the inputs
    attack.triggered(x, y)
    attack(own, 3, gen(0))
    assert torch.equal(x, xb) and torch.equal(y, yb) and torch.equal(own, ob)


@pytest.mark.parametrize("attack", ATTACKS, ids=NAMES)
def test_flat_inputs_are_poisoned_as_the_images(attack):
    x, y = images(12, (1, 8, 8)), labels(12)
    ix, iy = attack.poison(x, y, 2, 0, 10, gen(1))
    fx, fy = attack.poison(x.reshape(12, 64), y, 2, 0, 10, gen(1))
    assert torch.equal(fx, ix.reshape(12, 64)) and torch.equal(fy, iy)
    tx, ty = attack.triggered(x.reshape(12, 64), y)
    ix, iy = attack.triggered(x, y)
    assert torch.equal(tx, ix.reshape(-1, 64)) and torch.equal(ty, iy)


@pytest.mark.parametrize("attack", ATTACKS, ids=NAMES)
def test_the_attack_contract_and_the_shipped_checks(attack):
    cls = type(attack)
    assert issubclass(cls, B.BackdoorAttack) and cls.traits.data_poisoning
    assert cls.traits.targeted and not cls.traits.omniscient
    with pytest.raises(NotImplementedError, match="poison\\(x, y, attacker"):
        attack.poison_labels(labels(3), 10)
    check_plugin("attacks", cls)
    copy = pickle.loads(pickle.dumps(attack))
    x, y = images(6), labels(6)
    assert torch.equal(copy.poison(x, y, 1, 0, 10, gen(3))[0], attack.poison(x, y, 1, 0, 10,
                                                                             gen(3))[0])


def test_keys_are_validated():
    pixel = registry.params_model(B.PixelBackdoor)
    assert pixel().model_dump() == {"target": 0, "poison_fraction": 0.5, "size": 3,
                                    "value": 1.0}
    for bad in ({"poison_fraction": 1.5}, {"poison_fraction": -0.1}, {"size": 0},
                {"target": -1}):
        with pytest.raises(ValidationError):
            pixel(**bad)
    replacement = registry.params_model(B.ModelReplacement)
    assert replacement().model_dump()["boost"] == 10.0
    assert replacement().model_dump()["norm_bound"] is None
    for bad in ({"boost": 0.0}, {"norm_bound": 0.0}, {"norm_bound": -1.0}):
        with pytest.raises(ValidationError):
            replacement(**bad)
    with pytest.raises(ValidationError):
        registry.params_model(B.DistributedBackdoor)(parts=0)
    with pytest.raises(ValidationError):
        registry.params_model(B.DistributedBackdoor)(gap=-1)
    assert registry.params_model(B.EdgeCaseBackdoor)().model_dump() == \
        {"target": 1, "poison_fraction": 1.0, "source": 7}


# ---------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("attack", [B.PixelBackdoor(), B.DistributedBackdoor()],
                         ids=["pixel", "dba"])
def test_a_logistic_regression_learns_the_backdoor_on_digits(attack):
    """Ten clients of fedray's digits (scaled to [0, 1] as the engine gives them), two of
    them Byzantine poisoning half their samples; a logistic regression trained on the union
    keeps its clean accuracy and maps the full trigger to the target."""
    torch.manual_seed(0)  # nn.Linear's initialisation
    split = Digits().load(10, seed=0, test_fraction=0.2)
    x, y = model_input(split.x_train), torch.from_numpy(split.y_train)
    x_test, y_test = model_input(split.x_test), torch.from_numpy(split.y_test)
    xs, ys = [], []
    for c, idx in enumerate(torch.arange(len(y)).chunk(10)):
        xc, yc = x[idx], y[idx]
        if c < 2:  # the Byzantine clients: DBA's two train parts 0 and 1 only
            xc, yc = attack.poison(xc, yc, c, 0, 10, gen(c))
        xs.append(xc)
        ys.append(yc)
    xt, yt = torch.cat(xs).flatten(1), torch.cat(ys)
    model = torch.nn.Linear(64, 10)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(60):  # full batch: clean 0.95, ASR 1.0 at 50 steps
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xt), yt).backward()
        opt.step()
    with torch.no_grad():
        clean = float((model(x_test.flatten(1)).argmax(1) == y_test).float().mean())
        tx, ty = attack.triggered(x_test, y_test)
        asr = float((model(tx.flatten(1)).argmax(1) == ty).float().mean())
    assert len(ty) == int((y_test != 0).sum())
    assert clean > 0.85, clean
    assert asr > 0.8, asr
