"""The compressors of strategies/codecs.py and the majority-vote aggregator, on numbers
computed by hand: payloads and error-feedback residuals over two rounds, the bytes each codec
declares against what it sends, unbiasedness and QSGD's variance bound over 10,000 seeded
draws, PowerSGD's exact recovery of a low-rank matrix."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from strategies.aggregators import MajorityVote, majority_vote
from strategies.codecs import (
    QSGD,
    Float16,
    PowerSGD,
    Quantize,
    RandK,
    SignCompressor,
    TopK,
    chain_bytes,
    chain_layout,
    decode_chain,
    encode_chain,
    pack_signs,
    power_step,
    qsgd,
    quantize_int8,
    round_float,
    unpack_signs,
)
from strategies.protocols import ROWS, CodecBatch, MessageShape


def gens(*seeds: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def draws(n: int) -> list[torch.Generator]:
    return gens(*range(1000, 1000 + n))


def t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


# ---------------------------------------------------------------------------- sparsifiers


def test_top_k_payloads_and_residuals_over_two_rounds_by_hand():
    """k = 2 of w = 5 with error feedback: round 1 sends -3 and 2 and keeps the rest; round 2
    adds it to the new message (1.5 and 1 are then the largest)."""
    c, shape = TopK(k=2, error_feedback=True), MessageShape(5)
    states: list[dict[str, torch.Tensor]] = [{}, {}]
    out = c.encode({ROWS: t([1, -3, 0.5, 2, -0.25], [0, 0, -1, 0, 4])},
                   CodecBatch(1, [], shape, states))
    assert out["indices"].tolist() == [[1, 3], [2, 4]]
    assert out["values"].tolist() == [[-3, 2], [-1, 4]]
    assert states[0]["residual"].tolist() == [1, 0, 0.5, 0, -0.25]
    assert states[1]["residual"].tolist() == [0, 0, 0, 0, 0]
    out = c.encode({ROWS: t([0.5, 1, -1, 0.125, 0], [2, 0, 0, 0, 0])},
                   CodecBatch(2, [], shape, states))
    # p = u + e = (1.5, 1, -0.5, 0.125, -0.25); the second row's tie of zeros: lower index
    assert out["indices"].tolist() == [[0, 1], [0, 1]]
    assert out["values"].tolist() == [[1.5, 1], [2, 0]]
    assert states[0]["residual"].tolist() == [0, 0, -0.5, 0.125, -0.25]
    assert states[1]["residual"].tolist() == [0, 0, 0, 0, 0]
    assert c.decode(out, shape)[ROWS].tolist() == [[1.5, 1, 0, 0, 0], [2, 0, 0, 0, 0]]


def test_rand_k_payloads_and_residuals_over_two_rounds_by_hand():
    """k = 2 of w = 5, values times w / k = 2.5, with error feedback. The seeded draws pick
    entries (0, 3) in round 1 and (2, 4) in round 2 (a regression on the generators);
    the values and residuals follow by hand."""
    c, shape = RandK(k=2, error_feedback=True), MessageShape(5)
    states: list[dict[str, torch.Tensor]] = [{}]
    out = c.encode({ROWS: t([1, -3, 0.5, 2, -0.25])}, CodecBatch(1, gens(1), shape, states))
    assert out["indices"].tolist() == [[0, 3]] and out["indices"].dtype == torch.int32
    assert out["values"].tolist() == [[2.5, 5]]
    assert states[0]["residual"].tolist() == [-1.5, -3, 0.5, -3, -0.25]
    out = c.encode({ROWS: t([0.5, 1, -1, 0.125, 0])}, CodecBatch(2, gens(2), shape, states))
    # p = (-1, -2, -0.5, -2.875, -0.25)
    assert out["indices"].tolist() == [[2, 4]]
    assert out["values"].tolist() == [[-1.25, -0.625]]
    assert states[0]["residual"].tolist() == [-1, -2, 0.75, -2.875, 0.375]


def test_rand_k_is_unbiased_and_picks_without_replacement():
    x = torch.linspace(-2, 3, 10)
    c, shape = RandK(k=3), MessageShape(10)
    out = c.encode({ROWS: x.expand(10_000, -1).clone()}, CodecBatch(0, draws(10_000), shape))
    idx = out["indices"]
    assert (idx[:, 1:] > idx[:, :-1]).all()  # ascending, so distinct
    counts = torch.bincount(idx.flatten().long(), minlength=10).float()
    # each coordinate is kept with probability k / w = 0.3
    assert ((counts / 10_000 - 0.3).abs() < 4 * math.sqrt(0.3 * 0.7 / 10_000)).all()
    dec = c.decode(out, shape)[ROWS]
    se = dec.std(0) / 100
    assert ((dec.mean(0) - x).abs() <= 3 * se + 1e-6).all()


# ---------------------------------------------------------------------------- QSGD


def test_qsgd_levels_by_hand_and_a_zero_row_decodes_to_zero():
    # x = (0, 3, -4), s = 4: 4 |x| / 5 = (0, 2.4, 3.2); draws 0.3 < 0.4 rounds up, 0.5 > 0.2
    norm, levels = qsgd(t([0, 3, -4]), 4, t([0.9, 0.3, 0.5]))
    assert norm.tolist() == [[5.0]] and levels.tolist() == [[0, 3, -3]]
    c, shape = QSGD(levels=4), MessageShape(3)
    out = c.encode({ROWS: t([0, 0, 0], [0, 3, -4])}, CodecBatch(0, gens(1, 2), shape))
    assert out["levels"].dtype == torch.int8 and out["norm"].dtype == torch.float32
    assert out["norm"].tolist() == [[0.0], [5.0]]
    dec = c.decode(out, shape)[ROWS]
    assert dec[0].tolist() == [0, 0, 0]
    # each decoded entry is a neighbouring level of 5/4
    assert set(dec[1].tolist()) <= {0.0, 2.5, 3.75, -3.75, -5.0}
    assert QSGD(levels=127).dtype == torch.int8 and QSGD(levels=128).dtype == torch.int16


@pytest.mark.parametrize("s", [1, 2, 8, 200])
def test_qsgd_is_unbiased_within_its_variance_bound(s):
    """10,000 seeded draws of one row: the mean within 3 standard errors of the row in every
    coordinate, and E||Q(x) - x||^2 <= min(w / s^2, sqrt(w) / s) ||x||^2 (Lemma 3.1)."""
    w = 16
    x = torch.randn(w, generator=torch.Generator().manual_seed(7))
    c, shape = QSGD(levels=s), MessageShape(w)
    out = c.encode({ROWS: x.expand(10_000, -1).clone()}, CodecBatch(0, draws(10_000), shape))
    dec = c.decode(out, shape)[ROWS]
    se = dec.std(0) / 100
    assert ((dec.mean(0) - x).abs() <= 3 * se + 1e-5).all()
    var = float(((dec - x) ** 2).sum(1).mean())
    bound = min(w / s**2, math.sqrt(w) / s) * float(x @ x)
    assert 0 < var <= bound


# ---------------------------------------------------------------------------- sign


def test_signs_pack_eight_to_a_byte_as_numpy_packbits_does():
    x = torch.randn(7, 21, generator=torch.Generator().manual_seed(3))
    x[0, :3] = torch.tensor([0.0, -0.0, -1e-30])
    bits = pack_signs(x)
    assert bits.shape == (7, 3) and bits.dtype == torch.uint8
    np.testing.assert_array_equal(bits.numpy(), np.packbits((x >= 0).numpy(), axis=1))
    signs = unpack_signs(bits, 21)
    assert signs[0, :3].tolist() == [1, 1, -1]  # sign of 0 (and -0): +1
    assert torch.equal(signs, torch.where(x >= 0, 1.0, -1.0))


def test_sign_payload_by_hand_with_and_without_scale():
    x = t([0.5, -1, 0, -2, 3, 1, 1, 1, -1])  # ||x||_1 / w = 10.5 / 9
    shape = MessageShape(9)
    scaled = SignCompressor().encode({ROWS: x}, CodecBatch(0, [], shape))
    assert scaled["bits"].tolist() == [[0b10101111, 0]]
    assert scaled["scale"].tolist() == [[pytest.approx(10.5 / 9)]]
    plain = SignCompressor(scale=False)
    out = plain.encode({ROWS: x}, CodecBatch(0, [], shape))
    assert out.keys() == {"bits"}
    assert plain.decode(out, shape)[ROWS].tolist() == [[1, -1, 1, -1, 1, 1, 1, 1, -1]]


# ---------------------------------------------------------------------------- quantize


def test_quantize_int8_by_hand():
    # scale 2.54 / 127 = 0.02: levels -127, 50, 0 (nearest); stochastic 0.3 -> 15 or 16
    scale, levels = quantize_int8(t([-2.54, 1.0, 0.003, 0.31]), None)
    assert scale.tolist() == [[pytest.approx(0.02)]]
    assert levels.tolist() == [[-127, 50, 0, 16]]
    _, up = quantize_int8(t([-2.54, 1.0, 0.003, 0.31]), t([0.9, 0.9, 0.1, 0.4]))
    assert up.tolist() == [[-127, 50, 1, 16]]  # 0.15 and 15.5: 0.1 < 0.15 up, 0.4 < 0.5 up
    _, zero = quantize_int8(t([0, 0]), t([0.0, 0.0]))
    assert zero.tolist() == [[0, 0]]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_nearest_float_rounding_is_torchs_cast(dtype):
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(5)) * 100
    c, shape = Quantize(dtype, stochastic=False), MessageShape(50)
    out = c.encode({ROWS: x}, CodecBatch(0, [], shape))
    assert torch.equal(out["values"], x.to(getattr(torch, dtype)))


@pytest.mark.parametrize("dtype", ["int8", "float16", "bfloat16"])
def test_stochastic_quantize_is_unbiased_between_neighbours(dtype):
    w = 12
    x = torch.randn(w, generator=torch.Generator().manual_seed(11)) * 3 + 0.001
    c, shape = Quantize(dtype), MessageShape(w)
    out = c.encode({ROWS: x.expand(10_000, -1).clone()}, CodecBatch(0, draws(10_000), shape))
    dec = c.decode(out, shape)[ROWS]
    se = dec.std(0) / 100
    # float32 rounding of level * scale: a few ulps where the entry is a level exactly
    assert ((dec.mean(0) - x).abs() <= 3 * se + 1e-6 * x.abs()).all()
    # each entry takes at most two values, its neighbours
    assert all(len(torch.unique(dec[:, j])) <= 2 for j in range(w))
    assert ((dec.max(0).values >= x) & (dec.min(0).values <= x)).all()


def test_stochastic_float16_saturates_where_nearest_overflows():
    x = t([65504.0, 65510.0, 70000.0, -1e6])
    assert round_float(x, torch.float16, None).float().tolist() == \
        [[65504, 65504, math.inf, -math.inf]]
    assert round_float(x, torch.float16, t([0.0, 0.0, 0.0, 0.0])).float().tolist() == \
        [[65504, 65504, 65504, -65504]]


# ---------------------------------------------------------------------------- PowerSGD


def test_power_step_recovers_a_rank_one_matrix_from_a_random_start():
    a, b = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([3.0, 1.0, -1.0, 2.0])
    m = torch.outer(a, b)
    c, shape = PowerSGD(rank=1), MessageShape(14, ((3, 4), (2,)))
    x = torch.cat([m.flatten(), torch.tensor([5.0, -6.0])]).expand(3, -1).clone()
    out = c.encode({ROWS: x}, CodecBatch(0, gens(1, 2, 3), shape))
    assert {k: tuple(v.shape) for k, v in out.items()} == \
        {"p": (3, 3), "q": (3, 4), "dense": (3, 2)}
    torch.testing.assert_close(c.decode(out, shape)[ROWS], x, rtol=1e-5, atol=1e-5)
    # P is a unit vector along a
    p = out["p"][0]
    torch.testing.assert_close(p * torch.sign(p[0]), a / a.norm())


def test_powersgd_two_by_two_by_hand_and_keeps_its_warm_start():
    """M = diag(2, 1), Q = (1, 1): P = (2, 1) / sqrt 5, Q' = M^T P = (4, 1) / sqrt 5, and
    P Q'^T = (8, 2; 4, 1) / 5; Q' is the client's next start."""
    c, shape = PowerSGD(rank=1), MessageShape(4, ((2, 2),))
    states = [{"q": torch.tensor([1.0, 1.0])}]
    out = c.encode({ROWS: t([2, 0, 0, 1])}, CodecBatch(0, gens(0), shape, states))
    r5 = math.sqrt(5)
    sign = float(torch.sign(out["p"][0, 0]))
    torch.testing.assert_close(out["p"] * sign, t([2 / r5, 1 / r5]))
    torch.testing.assert_close(out["q"] * sign, t([4 / r5, 1 / r5]))
    assert torch.equal(states[0]["q"], out["q"][0])
    torch.testing.assert_close(c.decode(out, shape)[ROWS], t([8 / 5, 2 / 5, 4 / 5, 1 / 5]))
    p, q = power_step(torch.tensor([[[2.0, 0.0], [0.0, 1.0]]]), torch.ones(1, 2, 1))
    torch.testing.assert_close(p.flatten().abs(), torch.tensor([2 / r5, 1 / r5]))
    torch.testing.assert_close(q.flatten().abs(), torch.tensor([4 / r5, 1 / r5]))
    # round 2 starts from Q' = (4, 1) / sqrt 5: P = M Q' ∝ (8, 1)
    out = c.encode({ROWS: t([2, 0, 0, 1])}, CodecBatch(1, gens(0), shape, states))
    p2 = out["p"][0] * torch.sign(out["p"][0, 0])
    torch.testing.assert_close(p2, torch.tensor([8.0, 1.0]) / math.sqrt(65))


def test_powersgd_state_with_error_feedback_and_without_state():
    c, shape = PowerSGD(rank=1, error_feedback=True), MessageShape(9, ((3, 3),))
    x = torch.randn(2, 9, generator=torch.Generator().manual_seed(0))
    states: list[dict[str, torch.Tensor]] = [{}, {}]
    out = c.encode({ROWS: x}, CodecBatch(0, gens(1, 2), shape, states))
    assert all(st.keys() == {"q", "residual"} for st in states)
    torch.testing.assert_close(torch.stack([st["residual"] for st in states]),
                               x - c.decode(out, shape)[ROWS])
    # Byzantine rows (no state): the start is drawn from the generator each time
    a = c.encode({ROWS: x}, CodecBatch(0, gens(1, 2), shape))
    b = c.encode({ROWS: x}, CodecBatch(0, gens(1, 2), shape))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert c.keeps_state() and PowerSGD().keeps_state()


def test_powersgd_sends_dense_where_the_rank_saves_nothing():
    """A matrix whose smaller dimension is <= rank travels dense (its payload, decoded, is
    the row); a layout where no matrix is compressed is refused before anything runs."""
    c, shape = PowerSGD(rank=2), MessageShape(7, ((2, 3), (1,)))
    with pytest.raises(ValueError, match="rank: must be < the smaller dimension"):
        c.layout({}, shape)
    assert PowerSGD(rank=1).layout({}, shape).keys() == {"dense", "p", "q"}
    x = torch.arange(14.0).reshape(2, 7)
    out = c.encode({ROWS: x}, CodecBatch(0, gens(1, 2), shape, [{}, {}]))
    assert torch.equal(c.decode(out, shape)[ROWS], x)
    with pytest.raises(ValueError, match="exceed the message's width"):
        c.layout({}, MessageShape(3, ((2, 3),)))


# ---------------------------------------------------------------------------- bytes


W, SHAPES = 650, ((10, 64), (10,))  # logreg on 8x8 digits


@pytest.mark.parametrize("codec, formula", [
    (TopK(k=10), 8 * 10),
    (RandK(k=10), 8 * 10),
    (RandK(fraction=0.1), 8 * 65),
    (QSGD(levels=4), W + 4),
    (QSGD(levels=200), 2 * W + 4),
    (SignCompressor(), math.ceil(W / 8) + 4),
    (SignCompressor(scale=False), math.ceil(W / 8)),
    (Quantize("int8"), W + 4),
    (Quantize("float16"), 2 * W),
    (Quantize("bfloat16"), 2 * W),
    (PowerSGD(rank=1), 4 * (10 * 1 + 64 * 1 + 10)),
    (PowerSGD(rank=3), 4 * (10 * 3 + 64 * 3 + 10)),
    (PowerSGD(rank=9), 4 * (10 * 9 + 64 * 9 + 10)),  # rank 10 is refused: no saving
])
def test_bytes_a_message_follow_the_formula_and_what_is_sent(codec, formula):
    shape = MessageShape(W, SHAPES)
    assert chain_bytes((codec,), shape) == formula
    for chain, alone in (((codec,), True), ((codec, Float16()), False)):
        x = torch.randn(3, W, generator=torch.Generator().manual_seed(0))
        states: list[list[dict[str, torch.Tensor]]] = [[{} for _ in range(3)] for _ in chain]
        parts = encode_chain(chain, x, 0, shape, [gens(1, 2, 3) for _ in chain], states)
        sent = sum(v[0].numel() * v.element_size() for v in parts.values())
        assert sent == chain_bytes(chain, shape) == sum(
            p.nbytes for p in chain_layout(chain, shape).values())
        if alone:
            assert sent == formula
        dec = decode_chain(chain, parts, shape)
        assert dec.shape == (3, W) and torch.isfinite(dec).all()


# ---------------------------------------------------------------------------- majority vote


def test_majority_vote_by_hand_with_a_tie():
    """Column 0 votes (+, +, -): +1 although the rows sum to -5.5 (one vote each);
    column 3 votes (-, +, 0): a tie, 0."""
    x = t([0.5, -2, 3, -1], [1, -1, -4, 2], [-7, 1, 2, 0])
    assert MajorityVote()(x).tolist() == [1, -1, 1, 0]
    # weights (1, 1, 3): the third client outvotes the others where it disagrees
    w = torch.tensor([1.0, 1.0, 3.0], dtype=torch.float64)
    assert majority_vote(x, w).tolist() == [-1, 1, 1, 0]
    # a NaN row abstains, an infinite one votes its sign
    nan = torch.full((1, 4), math.nan)
    assert majority_vote(torch.cat([x, nan])).tolist() == [1, -1, 1, 0]
    assert majority_vote(torch.cat([x, -torch.full((1, 4), math.inf)])).tolist() == \
        [0, -1, 0, -1]


def test_huge_rows_buy_no_more_than_their_votes():
    """12 honest rows agree on the signs (+, -, +, -); 3 rows of 1e6 against them move the
    mean but not the vote; 7 of them against 6 honest rows (a majority) do."""
    honest = t([1, -1, 2, -0.5]).expand(12, -1) * torch.linspace(0.5, 1.5, 12)[:, None]
    bad = torch.full((3, 4), 1e6) * t([-1, 1, -1, 1])
    assert MajorityVote()(torch.cat([honest, bad])).tolist() == [1, -1, 1, -1]
    assert MajorityVote()(torch.cat([honest[:6], bad.repeat(3, 1)[:7]])).tolist() == \
        [-1, 1, -1, 1]


def test_a_crafted_payload_reaches_the_worst_case_within_each_codec():
    """reach: what the server decodes from a payload the sender built itself. rand_k: its
    k largest entries, unscaled (not k random ones times w / k); top_k the same; QSGD
    (s = 2): [3, -4] on the grid of 4 / 2 = 2: levels [2, -2] (1.5 rounds to 2), so
    [4, -4]; int8: the nearest levels of max / 127."""
    shape = MessageShape(4)
    x = torch.tensor([[1.0, -5.0, 2.0, 0.0]])
    for c in (RandK(k=2), TopK(k=2)):
        assert c.reach(x, shape).tolist() == [[0.0, -5.0, 2.0, 0.0]]
    assert QSGD(levels=2).reach(torch.tensor([[3.0, -4.0]]), MessageShape(2)).tolist() == \
        [[4.0, -4.0]]
    q = Quantize("int8").reach(torch.tensor([[127.0, 0.6, -1.4]]), MessageShape(3))
    assert q.tolist() == [[127.0, 1.0, -1.0]]
