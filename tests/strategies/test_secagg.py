"""Secure aggregation over groups (strategies/secagg.py): the masks cancel to the bit, with
and without dropouts after masking; Shamir's threshold; the runs it gives (group means in the
pipeline, the bytes of its protocol) and the keys refused before anything runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from simulator.config import ScenarioError
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine
from strategies.secagg import (
    KEY_BYTES,
    SHARE_BYTES,
    SecureAggregation,
    agreed_key,
    from_fixed,
    group_sum,
    groups_of,
    keys_of,
    masked_group,
    public_key,
    reconstruct,
    scale_of,
    share,
    to_fixed,
)
from tests.simulator.test_engine import point as engine_point


def _group(g: int, width: int = 257, bits: int = 32, seed: int = 11):
    rows = torch.randn(g, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    scale = scale_of(bits, g, 3.0)
    words = to_fixed(rows, scale, 3.0, bits)
    keys = keys_of(list(range(100, 100 + g)), seed)
    return rows, words, keys, scale


@pytest.mark.parametrize("dropped", [0, 1, "g-1"])
def test_the_masks_cancel_and_the_group_sum_is_the_plaintext_fixed_point_sum(dropped):
    """g = 6 clients: the server's sum of the survivors' masked words, unmasked with the
    shares, equals the plaintext fixed-point sum of the survivors' words exactly, with no
    dropout, one, and all but one (threshold 1)."""
    g, bits = 6, 32
    rows, words, keys, scale = _group(g, bits=bits)
    masked = masked_group(words, keys, bits)
    gone = {0: [], 1: [2], "g-1": [0, 1, 2, 4, 5]}[dropped]
    survivors = [p for p in range(g) if p not in gone]
    threshold = 1 if dropped == "g-1" else 4
    out = group_sum(masked[survivors], survivors, keys, threshold, bits, seed=5)
    assert out.words is not None
    plain = words[survivors].sum(0) & (2**bits - 1)
    assert torch.equal(out.words, plain)
    # and the float sum it stands for is the clipped rows' sum to the fixed-point step
    back = from_fixed(out.words, scale, bits)
    assert torch.allclose(back, rows[survivors].clamp(-3, 3).sum(0), atol=len(survivors) / scale)
    # each masked row alone shows nothing like its words
    assert not torch.equal(masked[survivors[0]], words[survivors[0]])
    assert abs(float(masked.double().mean()) / 2**bits - 0.5) < 0.01


def test_too_few_survivors_lose_the_group():
    g, bits = 5, 16
    _, words, keys, _ = _group(g, bits=bits)
    masked = masked_group(words, keys, bits)
    out = group_sum(masked[[0, 1]], [0, 1], keys, 3, bits, seed=1)
    assert out.words is None and out.survivors == [0, 1]


def test_shamir_any_threshold_of_shares_gives_the_secret_and_fewer_do_not():
    secret, xs = 123456789012345, [1, 2, 3, 4, 5]
    ys = share(secret, xs, 3, seed=9)
    for pick in ([0, 1, 2], [4, 2, 0], [1, 3, 4]):
        assert reconstruct([(xs[i], ys[i]) for i in pick]) == secret
    assert reconstruct([(xs[0], ys[0]), (xs[1], ys[1])]) != secret


def test_the_agreed_key_is_the_same_from_both_sides():
    a, b = 987654321, 192837465
    assert agreed_key(a, public_key(b)) == agreed_key(b, public_key(a))
    assert agreed_key(a, public_key(b)) != agreed_key(a, public_key(b + 1))


def test_groups_are_a_seeded_split_as_even_as_can_be():
    groups = groups_of(11, 5, seed=3)
    assert sorted(len(g) for g in groups) == [3, 4, 4]
    assert sorted(i for g in groups for i in g) == list(range(11))
    assert groups == groups_of(11, 5, seed=3) and groups != groups_of(11, 5, seed=4)


def test_combine_gives_each_group_its_mean():
    rows = torch.tensor([[0.5, -0.25], [0.25, 0.25], [1.0, 0.0], [-1.0, 0.5]])
    c = SecureAggregation(group_size=2, bits=32, range=1.0)
    means, info = c.combine(rows, round_=0, seed=0)
    groups = groups_of(4, 2, seed=_groups_seed(0, 0))
    want = torch.stack([rows[g].double().mean(0) for g in groups]).float()
    torch.testing.assert_close(means, want, rtol=0, atol=1e-8)
    assert info == {"secagg_groups": 2.0, "secagg_dropped": 0.0, "secagg_groups_lost": 0.0}


def _groups_seed(seed: int, round_: int) -> int:
    from strategies.secagg import _seed

    return _seed(seed, 5, round_)


BASE = """\
name: secagg
rounds: 3
data:
  dataset: {name: digits}
model: {name: logreg}
clients: {total: 12, per_round: 6}
local: {steps: 2, batch_size: 8, lr: 0.2}
"""
D = 650


def run(tmp_path, extra: str = "", overrides=()):
    return Engine(engine_point(tmp_path, BASE + extra, overrides), InlineBackend()).run()


def test_one_group_with_the_mean_is_fedavg_to_the_fixed_point_step(tmp_path):
    plain = run(tmp_path)
    secure = run(tmp_path, "codecs: [{name: secagg, range: 10.0}]\n")
    np.testing.assert_allclose(secure.final_params, plain.final_params, atol=1e-6)
    assert [m["secagg_groups"] for m in secure.metrics] == [1.0] * 3
    # each client sends its 650 masked words, two keys and a share pair for each of 5 mates
    # (and a share for each in the unmasking round)
    per_client = 4 * D + 2 * KEY_BYTES + 5 * SHARE_BYTES + 5 * (SHARE_BYTES // 2)
    assert [m["bytes_up"] for m in secure.metrics] == [6.0 * per_client] * 3


def test_groups_of_two_give_the_robust_rule_three_group_means(tmp_path):
    """A sign-flipping client spoils its group; the median of the three group means is what
    the server steps on (the bucketing shape)."""
    res = run(tmp_path, "attack: {name: sign_flip}\naggregator: {name: median}\n"
                        "codecs: [{name: secagg, group_size: 2, range: 10.0}]\n",
              ["clients.byzantine=1"])
    assert all(m["secagg_groups"] == 3.0 for m in res.metrics)
    assert np.isfinite(res.final_params).all()


def test_dropouts_after_masking_are_recovered_or_lose_their_group(tmp_path):
    res = run(tmp_path, "codecs: [{name: secagg, group_size: 3, range: 10.0, dropout: 0.3, "
                        "threshold: 0.5}]\n", ["rounds=6"])
    dropped = sum(m["secagg_dropped"] for m in res.metrics)
    lost = sum(m["secagg_groups_lost"] for m in res.metrics)
    assert dropped > 0  # 36 clients at 0.3
    assert lost <= dropped  # a group of 3 needs 2 survivors (threshold floor(1.5) + 1)
    assert np.isfinite(res.final_params).all()


@pytest.mark.parametrize("extra, where", [
    ("codecs: [{name: secagg}]\naggregator: {name: median}\n",
     "codecs[0]: without group_size the server sees one sum of the round, so median"),
    ("codecs: [{name: secagg, group_size: 2}, {name: float16}]\n",
     "codecs[0]: secagg masks each client's dense fixed-point row and takes no other codec"),
    ("codecs: [{name: secagg, group_size: 2}]\nserver: {mode: fedbuff}\n",
     "server.mode: secagg sums a round's cohort"),
    ("codecs: [{name: secagg, bits: 8}]\n",
     "codecs[0].bits: 2^8 leaves a group of 6 only 21 fixed-point steps an entry"),
    ("codecs: [{name: secagg, bits: 40}]\n", "codecs[0].bits"),
    ("codecs: [{name: secagg, group_size: 2}]\nserver: {optimizer: {name: qfedavg}}\n",
     "codecs[0]: 'qfedavg' sends parts beside its row"),
])
def test_what_secure_aggregation_cannot_do_is_refused_in_one_line(tmp_path, extra, where):
    with pytest.raises(ScenarioError) as e:
        engine_point(tmp_path, BASE + extra)
    assert any(where in line for line in e.value.lines), e.value.lines


DP = "privacy: {name: dp_fedavg, clip: 0.5, noise_multiplier: %s}\n"


def test_distributed_dp_under_one_sum_spends_the_central_epsilon(tmp_path):
    """Each client clips and adds N(0, (z C)^2 / m): the round's sum carries the central
    noise, so the accountant's epsilon is DP-FedAvg's to the digit; with z = 0 the numbers
    are server-side clipping's to the fixed-point step."""
    central = run(tmp_path, DP % 1.0)
    shared = run(tmp_path, DP % 1.0 + "codecs: [{name: secagg, range: 10.0}]\n")
    assert shared.params["privacy.epsilon"] == central.params["privacy.epsilon"]
    assert [m["epsilon"] for m in shared.metrics] == [m["epsilon"] for m in central.metrics]
    assert not np.array_equal(shared.final_params, central.final_params)  # other draws
    plain = run(tmp_path, DP % 0.0)
    clipped = run(tmp_path, DP % 0.0 + "codecs: [{name: secagg, range: 10.0}]\n")
    np.testing.assert_allclose(clipped.final_params, plain.final_params, atol=1e-6)


def test_groups_spend_what_one_group_sum_shows(tmp_path):
    """Groups of 2 of 6 rows: a group sum carries 2 of the 6 noise shares, so it is the
    central mechanism at z * sqrt(2 / 6); the robust rule over the group means is
    post-processing, so a median is allowed."""
    grouped = run(tmp_path, DP % 1.5 + "aggregator: {name: median}\n"
                  "codecs: [{name: secagg, group_size: 2, range: 10.0}]\n")
    seen = run(tmp_path, DP % repr(1.5 * (2 / 6) ** 0.5))
    assert grouped.params["privacy.epsilon"] == seen.params["privacy.epsilon"]
    assert float(grouped.params["privacy.epsilon"]) > float(run(tmp_path, DP % 1.5)
                                                             .params["privacy.epsilon"])


def test_noise_shares_of_m_clients_sum_to_the_central_noise():
    from strategies.privacy import DPFedAvg

    dp, m, width = DPFedAvg(clip=2.0, noise_multiplier=1.5), 8, 4000
    rows = torch.zeros(m, width)
    noisy = dp.noise_share(rows, m, [torch.Generator().manual_seed(i) for i in range(m)])
    total = noisy.sum(0)
    # std of the sum: z C = 3; 4000 draws estimate it within a few percent
    assert abs(float(total.std()) / 3.0 - 1) < 0.05
    # each row is clipped to C before its share is added
    quiet = DPFedAvg(clip=2.0, noise_multiplier=0.0)
    clipped = quiet.noise_share(torch.full((2, 3), 10.0), m, [torch.Generator()] * 2)
    torch.testing.assert_close(clipped.norm(dim=1), torch.tensor([2.0, 2.0]))


def test_a_crafted_payload_skips_the_clip_and_wraps_the_group_sum():
    """One group of two, bits 16, range 1: scale = floor(32767 / 2) = 16383. The honest row
    0.5 is the word 8192 (8191.5, ties to even). A protocol-following Byzantine row 3.0 is
    clipped to 1.0 (16383): the mean is (8192 + 16383) / 2 / 16383 = 0.7500. Crafted, its
    word is 3.0 x 16383 = 49149: the sum 57341 modulo 2^16 reads as -8195, a mean of
    -0.2501: the modulus, not the clip, bounds what the crafted payload adds."""
    c = SecureAggregation(group_size=2, bits=16, range=1.0)
    rows = torch.tensor([[0.5], [3.0]])
    clipped, _ = c.combine(rows, 0, 0)
    wrapped, _ = c.combine(rows, 0, 0, crafted=1)
    assert float(clipped[0, 0]) == pytest.approx((8192 + 16383) / 2 / 16383, abs=1e-7)
    assert float(wrapped[0, 0]) == pytest.approx(-8195 / 2 / 16383, abs=1e-7)
