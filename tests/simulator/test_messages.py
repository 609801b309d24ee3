"""Messages with named parts and the codec chain (strategies/protocols.py: MessageLayout,
Codec; strategies/codecs.py; strategies/fairness.py): q-FedAvg's scalar travels as one float,
float16 transport halves the bytes and the clock charges them, the identity changes no
number, and the modes take a multi-part message."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from simulator.config import ScenarioError
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine
from strategies.codecs import Float16, chain_bytes
from strategies.fairness import QFedAvg, qfedavg_message, qfedavg_step
from strategies.protocols import DELTA, ROWS, CodecBatch, MessageLayout, MessageShape, Part
from tests.simulator.test_engine import point as engine_point

BASE = """\
name: messages
rounds: 3
data:
  dataset: {name: digits}
model: {name: logreg}
clients: {total: 12, per_round: 6}
local: {steps: 2, batch_size: 8, lr: 0.2}
"""
D = 64 * 10 + 10  # logreg on 8x8 digits, 10 classes
TIMED = "speeds: {distribution: constant, sample_seconds: 0.001, bandwidth: 1.0e6}\n"


def run(tmp_path, extra: str = "", overrides=()):
    return Engine(engine_point(tmp_path, BASE + extra, overrides), InlineBackend()).run()


def test_a_layout_names_its_parts_and_splits_a_message_without_copying():
    layout = MessageLayout((Part(DELTA), Part("control"), Part("h", size=1, role="mean")))
    assert (layout.width(5), layout.row_width(5), layout.multipart) == (11, 10, True)
    msg = torch.arange(2 * 11, dtype=torch.float32).reshape(2, 11)
    parts = layout.split(msg, 5)
    assert [tuple(v.shape) for v in parts.values()] == [(2, 5), (2, 5), (2, 1)]
    assert parts["h"].tolist() == [[10.0], [21.0]]
    assert parts["control"].data_ptr() == msg[:, 5:].data_ptr()  # a view
    assert MessageLayout().width(7) == 7 and not MessageLayout().multipart


@pytest.mark.parametrize("parts, why", [
    ((Part("h", size=1),), "first part"),
    ((Part(DELTA), Part("h", size=1, role="mean"), Part("c")), "row parts come first"),
    ((Part(DELTA), Part(DELTA)), "must differ"),
    ((Part(DELTA), Part("h", size=0)), "size must be >= 1"),
])
def test_a_layout_that_breaks_the_contract_is_refused_where_it_is_declared(parts, why):
    with pytest.raises(ValueError, match=why):
        MessageLayout(parts)


def test_qfedavg_message_and_step_follow_algorithm_2_by_hand():
    """Two clients, q = 2, L = 4: Delta_k = F^q L (w - w_k), h_k = q F^(q-1) L^2 ||w_k - w||^2
    + L F^q, w' = w - sum Delta / sum h; fedray sends -Delta and steps w + mean / mean."""
    q, lip = 2.0, 4.0
    w = np.array([1.0, -2.0, 0.5])
    ups = [np.array([0.1, 0.2, -0.3]), np.array([-0.4, 0.0, 0.2])]
    losses = [0.7, 1.9]
    big_delta = [f**q * lip * (-u) for u, f in zip(ups, losses)]
    h = [q * f ** (q - 1) * lip**2 * float(u @ u) + lip * f**q for u, f in zip(ups, losses)]
    want = w - sum(big_delta) / sum(h)
    msgs = torch.stack([qfedavg_message(torch.tensor(u, dtype=torch.float64), f, q, lip)
                        for u, f in zip(ups, losses)])
    np.testing.assert_allclose(msgs[:, 3].numpy(), h, rtol=1e-9)
    np.testing.assert_allclose(msgs[:, :3].numpy(), -np.stack(big_delta), rtol=1e-9)
    got = qfedavg_step(torch.tensor(w), msgs[:, :3].mean(0), msgs[:, 3:].mean(0))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-9)


def test_qfedavg_with_q_0_and_lipschitz_1_is_fedavg_bit_for_bit(tmp_path):
    fedavg = run(tmp_path)
    q0 = run(tmp_path, "server: {optimizer: {name: qfedavg, q: 0, lipschitz: 1}}\n")
    np.testing.assert_array_equal(q0.final_params, fedavg.final_params)
    assert [m["test_accuracy"] for m in q0.metrics] == \
        [m["test_accuracy"] for m in fedavg.metrics]


def test_qfedavg_h_travels_as_one_float_and_the_bytes_say_so(tmp_path):
    """Every participant sends 4 d + 4 bytes (FedAvg: 4 d) and receives the model (4 d)."""
    fedavg = run(tmp_path)
    fair = run(tmp_path, "server: {optimizer: {name: qfedavg, q: 1}}\n")
    for m, width in ((fedavg.metrics, 4 * D), (fair.metrics, 4 * D + 4)):
        assert [r["bytes_up"] for r in m] == [6.0 * width] * 3
        assert [r["bytes_down"] for r in m] == [6.0 * 4 * D] * 3
        assert m[-1]["bytes_up_total"] == 18.0 * width
    assert not np.array_equal(fair.final_params, fedavg.final_params)  # q = 1 moves it
    assert np.isfinite(fair.final_params).all()


def test_float16_transport_halves_the_bytes_and_the_clock_charges_them(tmp_path):
    plain = run(tmp_path, TIMED)
    half = run(tmp_path, TIMED + "codecs: [{name: float16}]\n")
    assert [m["bytes_up"] for m in half.metrics] == [6.0 * 2 * D] * 3
    assert [m["bytes_up"] for m in plain.metrics] == [6.0 * 4 * D] * 3
    compute = 2 * 8 * 0.001  # two steps of eight samples a client
    for r, (p, h) in enumerate(zip(plain.metrics, half.metrics), start=1):
        assert p["sim_time"] == pytest.approx(r * (compute + 8 * (4 * D + 4 * D) / 1e6))
        assert h["sim_time"] == pytest.approx(r * (compute + 8 * (4 * D + 2 * D) / 1e6))
    # lossy within float16's rounding of each update, not equal
    assert not np.array_equal(half.final_params, plain.final_params)
    np.testing.assert_allclose(half.final_params, plain.final_params, atol=2e-3)


def test_float16_rounds_each_entry_within_its_stated_bound():
    x = torch.randn(50, 300, generator=torch.Generator().manual_seed(0)) * 3
    shape = MessageShape(300)
    half = Float16().encode({ROWS: x}, CodecBatch(0, [], shape))
    back = Float16().decode(half, shape)[ROWS]
    assert half[ROWS].dtype == torch.float16 and back.dtype == torch.float32
    assert torch.equal(back, half[ROWS].to(torch.float32))
    rel = ((back - x).abs() / x.abs()).max()
    assert 0 < float(rel) <= 2.0**-11
    assert chain_bytes((Float16(),), 300) == 600 and chain_bytes((), 300) == 1200


def test_client_level_dp_as_a_codec_keeps_its_numbers(tmp_path):
    """DP-FedAvg through the chain: every row clipped before the mean, the noise after it;
    the same clipped mean as by hand on a one-round run with noise 0."""
    extra = "privacy: {name: dp_fedavg, clip: 0.05, noise_multiplier: 0.0}\n"
    clipped = run(tmp_path, extra, ["rounds=1"])
    plain = run(tmp_path, "", ["rounds=1"])
    # the clip binds: the clipped step is shorter than FedAvg's
    assert clipped.metrics[0]["aggregate_norm"] <= 0.05 + 1e-6
    assert plain.metrics[0]["aggregate_norm"] > 0.05


@pytest.mark.parametrize("mode", ["fedasync", "fedbuff", "latest", "basgd"])
def test_every_mode_takes_a_message_of_two_parts(tmp_path, mode):
    """The FedAsync x multi-part crash (rows + gap: 2d against d) cannot happen: a mode's
    transforms act on the model delta, the other parts ride beside it."""
    res = run(tmp_path, f"server: {{mode: {mode}, optimizer: {{name: qfedavg, q: 1}}}}\n")
    assert len(res.metrics) == 3 and np.isfinite(res.final_params).all()
    assert all(m["bytes_up"] > 0 for m in res.metrics)


@pytest.mark.parametrize("extra, where", [
    (("server: {optimizer: {name: qfedavg}}\n"
      "privacy: {name: dp_fedavg, clip: 1.0, noise_multiplier: 1.0}\n"), "privacy.name"),
    ("topology: {name: ring}\ncodecs: [{name: float16}]\n", "codecs"),
    ("codecs: [{name: float8}]\n", "codecs[0].name: unknown codec"),
])
def test_what_the_message_path_cannot_do_is_refused_in_one_line(tmp_path, extra, where):
    with pytest.raises(ScenarioError) as e:
        engine_point(tmp_path, BASE + extra)
    assert any(where in line for line in e.value.lines), e.value.lines


def test_the_qfedavg_server_half_declares_its_clients_layout():
    half = QFedAvg(q=1.0).client_rule()
    assert [(p.name, p.size, p.role) for p in half.traits.message.parts] == \
        [(DELTA, None, "row"), ("h", 1, "mean")]


@pytest.mark.parametrize("codec, per_message", [
    ("{name: top_k, k: 10, error_feedback: true}", 8 * 10),
    ("{name: rand_k, k: 10}", 8 * 10),
    ("{name: qsgd, levels: 4}", D + 4),
    ("{name: sign}", math.ceil(D / 8) + 4),
    ("{name: quantize, dtype: int8}", D + 4),
    ("{name: quantize, dtype: float16}", 2 * D),
    ("{name: quantize, dtype: bfloat16, error_feedback: true}", 2 * D),
    ("{name: powersgd, rank: 2}", 4 * (10 * 2 + 64 * 2 + 10)),  # (10, 64) weight, 10 biases
    ("{name: powersgd, rank: 1, error_feedback: true}", 4 * (10 + 64 + 10)),
])
def test_each_compressor_runs_and_charges_its_bytes(tmp_path, codec, per_message):
    res = run(tmp_path, f"codecs: [{codec}]\n")
    assert [m["bytes_up"] for m in res.metrics] == [6.0 * per_message] * 3
    assert np.isfinite(res.final_params).all()


def test_signsgd_with_majority_vote_steps_by_the_vote(tmp_path):
    """Unscaled signs and the vote: every coordinate of the aggregate is -1, 0 or +1."""
    res = run(tmp_path, "codecs: [{name: sign, scale: false}]\n"
              "aggregator: {name: majority_vote}\n")
    assert [m["bytes_up"] for m in res.metrics] == [6.0 * math.ceil(D / 8)] * 3
    assert np.isfinite(res.final_params).all()
    assert all(0 < m["aggregate_norm"] <= math.sqrt(D) + 1e-4 for m in res.metrics)


def test_a_bfloat16_part_crosses_the_object_store_as_its_bits():
    """NumPy has no bfloat16: the part travels as int16 (2 bytes an entry, as declared) and
    the server reads it back through the chain's layout."""
    from simulator.runtime.payloads import decode_payload, encode_payload
    from strategies.codecs import Quantize

    chain, shape = (Quantize("bfloat16", stochastic=False),), MessageShape(5)
    rows = np.random.default_rng(0).normal(size=(2, 5)).astype(np.float32)
    enc = encode_payload(chain, rows, 0, shape, 0, [3, 4], None)
    assert not isinstance(enc, np.ndarray)
    assert enc.parts["values"].dtype == np.int16 and enc.nbytes == 2 * chain_bytes(chain, 5)
    back = decode_payload(chain, enc, shape)
    np.testing.assert_array_equal(back, torch.from_numpy(rows).to(torch.bfloat16).float().numpy())
