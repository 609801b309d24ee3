"""Compressed messages in runs (#46; strategies/codecs.py, simulator/runtime/payloads.py):
what travels is the codec's payload and costs its declared bytes, the simulated clock
charges them at each client's bandwidth, error feedback's residuals are per-client state
(independent of the worker count), and a chain that cannot compose is refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.utils import parameters_to_vector

from simulator.config import ScenarioError
from simulator.messages import ClientRows, Encoded
from simulator.models import build_model
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine
from strategies.codecs import TopK
from strategies.protocols import ROWS, CodecBatch, MessageShape
from tests.simulator.test_engine import point as engine_point

BASE = """\
name: codecs
rounds: 3
data:
  dataset: {name: digits}
model: {name: logreg}
clients: {total: 12, per_round: 6}
local: {steps: 2, batch_size: 8, lr: 0.2}
"""
D = 64 * 10 + 10  # logreg on 8x8 digits, 10 classes
TOP_K = "codecs: [{name: top_k, k: 65, error_feedback: true}]\n"


def run(tmp_path, extra: str = "", overrides=(), workers: int | None = None):
    sc = engine_point(tmp_path, BASE + extra, overrides)
    return Engine(sc, InlineBackend(), workers=workers).run()


class Recording(InlineBackend):
    """The inline backend, keeping every worker result the server receives."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[ClientRows] = []

    def call(self, handle, method, *args):
        out = super().call(handle, method, *args)
        if method.__name__ == "train":
            self.sent.append(self.get(out))
        return out


def test_top_k_sends_indices_and_values_and_the_bytes_are_its_formula(tmp_path):
    """k = 65 of 650 entries: each client sends 65 int32 indices and 65 float32 values,
    520 bytes against the identity's 2,600; the logged bytes_up is 6 clients x 520 a round,
    and the arrays that cross the object store are exactly that size."""
    backend = Recording()
    res = Engine(engine_point(tmp_path, BASE + TOP_K), backend).run()
    assert [m["bytes_up"] for m in res.metrics] == [6.0 * 8 * 65] * 3
    assert res.metrics[-1]["bytes_up_total"] == 18.0 * 8 * 65
    sent = [r for r in backend.sent if len(r.clients)]
    assert sent and all(isinstance(r.updates, Encoded) for r in sent)
    for r in sent:
        assert isinstance(r.updates, Encoded)
        parts = r.updates.parts
        assert (parts["indices"].dtype, parts["values"].dtype) == (np.int32, np.float32)
        assert parts["indices"].shape == parts["values"].shape == (len(r.clients), 65)
        assert r.updates.nbytes == len(r.clients) * 8 * 65
    plain = run(tmp_path)
    assert [m["bytes_up"] for m in plain.metrics] == [6.0 * 4 * D] * 3


def test_the_clock_charges_the_payload_at_each_bandwidth(tmp_path):
    """sim_time per round = compute + (bytes down + bytes up) x 8 / bandwidth: at B and 2B
    the communication part halves, and top-k's up bytes replace the identity's."""
    compute = 2 * 8 * 0.001  # two steps of eight samples a client
    for bandwidth in (1.0e6, 2.0e6):
        timed = f"speeds: {{distribution: constant, sample_seconds: 0.001, bandwidth: {bandwidth}}}\n"
        sparse = run(tmp_path, timed + TOP_K)
        plain = run(tmp_path, timed)
        for r, (s, p) in enumerate(zip(sparse.metrics, plain.metrics), start=1):
            assert s["sim_time"] == pytest.approx(
                r * (compute + 8 * (4 * D + 8 * 65) / bandwidth), rel=1e-12)
            assert p["sim_time"] == pytest.approx(
                r * (compute + 8 * (4 * D + 4 * D) / bandwidth), rel=1e-12)


def test_error_feedback_is_per_client_state_whatever_the_worker_count(tmp_path):
    one = run(tmp_path, TOP_K, workers=1)
    three = run(tmp_path, TOP_K, workers=3)
    assert one.metrics == three.metrics
    np.testing.assert_array_equal(one.final_params, three.final_params)
    without = run(tmp_path, TOP_K.replace("true", "false"), workers=1)
    # the residual changes the second round's payloads, so the runs part after round 1
    assert without.metrics[0] == one.metrics[0]
    assert not np.array_equal(without.final_params, one.final_params)


def test_the_server_steps_on_the_decoded_top_k_rows(tmp_path):
    """One round, FedAvg, no error feedback: the aggregate is the mean of each client's
    top-k row, so it has at most 6 x 65 non-zero entries and its norm is at most the
    identity run's mean update's norm."""
    backend = Recording()
    sc = engine_point(tmp_path, BASE + TOP_K.replace("true", "false"), ["rounds=1"])
    res = Engine(sc, backend).run()
    plain = Engine(engine_point(tmp_path, BASE, ["rounds=1"]), InlineBackend()).run()
    rows = [r for r in backend.sent if len(r.clients)]
    c = TopK(k=65)
    shape = MessageShape(D)
    dense = torch.cat([c.decode({k: torch.from_numpy(v) for k, v in r.updates.parts.items()},
                                shape)[ROWS] for r in rows])
    assert dense.shape == (6, D) and int((dense != 0).sum()) == 6 * 65
    assert res.metrics[0]["aggregate_norm"] == pytest.approx(
        float(torch.linalg.vector_norm(dense.mean(0))), rel=1e-6)
    assert res.metrics[0]["aggregate_norm"] < plain.metrics[0]["aggregate_norm"]


def test_error_feedback_residual_by_hand_over_two_rounds():
    """u1 = [3, -1, 0.5, 2], k = 1: sends [3, 0, 0, 0], keeps e1 = [0, -1, 0.5, 2];
    u2 = [1, 1, 1, -4]: p = u2 + e1 = [1, 0, 1.5, -2] sends [0, 0, 0, -2], keeps
    e2 = [1, 0, 1.5, 0]."""
    c, shape = TopK(k=1, error_feedback=True), MessageShape(4)
    state: dict[str, torch.Tensor] = {}
    sent = []
    for u in ([3.0, -1.0, 0.5, 2.0], [1.0, 1.0, 1.0, -4.0]):
        out = c.encode({ROWS: torch.tensor([u])}, CodecBatch(0, [], shape, [state]))
        sent.append(c.decode(out, shape)[ROWS][0].tolist())
        if len(sent) == 1:
            assert state["residual"].tolist() == [0.0, -1.0, 0.5, 2.0]
    assert sent == [[3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, -2.0]]
    assert state["residual"].tolist() == [1.0, 0.0, 1.5, 0.0]


@pytest.mark.parametrize("codecs, where", [
    ("[{name: top_k, k: 651}]", "codecs[0].k: must be <= a message's 650 entries, got 651"),
    ("[{name: top_k, k: 3, fraction: 0.1}]", "codecs[0].fraction: give k or fraction"),
    ("[{name: top_k, k: 0}]", "codecs[0].k"),
    ("[{name: top_k, fraction: 1.5}]", "codecs[0].fraction"),
    ("[{name: top_k}, {name: top_k}]", "codecs[1]: top_k compresses the dense rows"),
])
def test_codec_keys_are_checked_before_anything_runs(tmp_path, codecs, where):
    with pytest.raises(ScenarioError) as e:
        engine_point(tmp_path, BASE + f"codecs: {codecs}\n")
    assert any(where in line for line in e.value.lines), e.value.lines


def test_float16_may_follow_top_k_and_halves_its_values(tmp_path):
    """top-k then float16: int32 indices, float16 values: 6 bytes an entry kept."""
    res = run(tmp_path, "codecs: [{name: top_k, k: 65}, {name: float16}]\n")
    assert [m["bytes_up"] for m in res.metrics] == [6.0 * 6 * 65] * 3
    assert np.isfinite(res.final_params).all()


DOWN = "downlink: [{name: top_k, k: 65}]\n"


def test_downlink_compression_moves_the_clients_replica_and_costs_its_bytes(tmp_path):
    """Each round the server sends top-k of (model - replica): 65 indices and values, 520
    bytes to each of the 6 clients instead of the model's 2,600; the replica moves by it, so
    what compression dropped is sent later (the server's error feedback); a full k equals
    no downlink compression to the bit."""
    res = run(tmp_path, DOWN)
    assert [m["bytes_down"] for m in res.metrics] == [6.0 * 8 * 65] * 3
    assert all(m["replica_distance"] > 0 for m in res.metrics)
    plain = run(tmp_path)
    assert [m["bytes_down"] for m in plain.metrics] == [6.0 * 4 * D] * 3
    assert not np.array_equal(res.final_params, plain.final_params)
    full = run(tmp_path, f"downlink: [{{name: top_k, k: {D}}}]\n")
    np.testing.assert_array_equal(full.final_params, plain.final_params)
    assert [m["replica_distance"] for m in full.metrics] == [0.0] * 3
    assert [m["test_accuracy"] for m in full.metrics] == [m["test_accuracy"] for m in plain.metrics]


def test_the_replica_by_hand_after_one_round(tmp_path):
    """Round 1 (FedAvg, server lr 1): x1 = x0 + mean update; the clients' replica is x0 plus
    top-k of (x1 - x0), so x1 - replica is what top-k dropped."""
    sc = engine_point(tmp_path, BASE + DOWN, ["rounds=1"])
    res = Engine(sc, InlineBackend()).run()
    plain = Engine(engine_point(tmp_path, BASE, ["rounds=1"]), InlineBackend()).run()
    info = res.model_info
    x0 = parameters_to_vector(build_model(sc.model, info["input_shape"], info["num_classes"],
                                          sc.seeds[0]).parameters()).detach()
    x1 = torch.from_numpy(res.final_params)
    np.testing.assert_array_equal(res.final_params, plain.final_params)  # round 1 trains from x0
    change = (x1 - x0).unsqueeze(0)
    c, shape = TopK(k=65), MessageShape(D)
    kept = c.decode(c.encode({ROWS: change}, CodecBatch(0, [], shape)), shape)[ROWS][0]
    assert res.metrics[0]["replica_distance"] == pytest.approx(
        float(torch.linalg.vector_norm(change[0] - kept)), rel=1e-5)


@pytest.mark.parametrize("extra, where", [
    ("downlink: [{name: top_k, k: 651}]\n", "downlink[0].k: must be <= a message's 650"),
    ("downlink: [{name: top_k, error_feedback: true}]\n", "downlink[0].error_feedback"),
    ("downlink: [{name: secagg}]\n", "downlink[0]: secagg aggregates"),
    ("downlink: [{name: top_k}]\nserver: {mode: fedbuff}\n", "server.mode: downlink compresses"),
    ("downlink: [{name: top_k}]\ntopology: {name: ring}\n", "downlink: D-SGD has no server"),
])
def test_downlink_keys_are_checked_before_anything_runs(tmp_path, extra, where):
    with pytest.raises(ScenarioError) as e:
        engine_point(tmp_path, BASE + extra)
    assert any(where in line for line in e.value.lines), e.value.lines


def test_ef21_by_hand_over_two_rounds():
    """k = 1. Round 1: u1 = [3, -1, 0.5, 2], g0 = 0: c1 = top1(u1) = [3, 0, 0, 0], and client
    and server both hold g1 = [3, 0, 0, 0], the server's row. Round 2: u2 = [1, 1, 1, -4]:
    c2 = top1(u2 - g1) = top1([-2, 1, 1, -4]) = [0, 0, 0, -4]; g2 = [3, 0, 0, -4]."""
    from strategies.codecs import decode_chain

    c, shape = TopK(k=1, ef21=True), MessageShape(4)
    client: dict[str, torch.Tensor] = {}
    server: dict[str, torch.Tensor] = {}
    rows = []
    for u in ([3.0, -1.0, 0.5, 2.0], [1.0, 1.0, 1.0, -4.0]):
        payload = c.encode({ROWS: torch.tensor([u])}, CodecBatch(0, [], shape, [client]))
        rows.append(decode_chain([c], payload, shape, [[server]])[0].tolist())
        assert torch.equal(client["estimate"], server["estimate"])
    assert rows == [[3.0, 0.0, 0.0, 0.0], [3.0, 0.0, 0.0, -4.0]]


def test_ef21_runs_the_same_on_any_worker_count_and_resumes(tmp_path):
    ef21 = "codecs: [{name: top_k, k: 65, ef21: true}]\n"
    one = run(tmp_path, ef21, workers=1)
    three = run(tmp_path, ef21, workers=3)
    assert one.metrics == three.metrics
    np.testing.assert_array_equal(one.final_params, three.final_params)
    plain_ef = run(tmp_path, TOP_K, workers=1)
    assert not np.array_equal(one.final_params, plain_ef.final_params)
    with pytest.raises(ScenarioError, match="codecs.0..ef21: is an error feedback of its own"):
        engine_point(tmp_path, BASE + "codecs: [{name: top_k, error_feedback: true, ef21: true}]\n")


@pytest.mark.parametrize("codecs, where", [
    # logreg's one matrix is 10 x 64: rank 10 compresses nothing
    ("[{name: powersgd, rank: 10}]", ("codecs[0].rank: must be < the smaller dimension of at "
                                     "least one parameter matrix (at most 9 here), got 10")),
    ("[{name: secagg, group_size: 7}]", "codecs[0].group_size: must be <= the 6 rows of a step"),
    ("[{name: qsgd, levels: 0}]", "codecs[0].levels"),
    ("[{name: quantize, dtype: float8}]", "codecs[0].dtype"),
])
def test_more_codec_keys_are_checked_before_anything_runs(tmp_path, codecs, where):
    with pytest.raises(ScenarioError) as e:
        engine_point(tmp_path, BASE + f"codecs: {codecs}\n")
    assert any(where in line for line in e.value.lines), e.value.lines


def test_an_attack_that_crafts_its_payloads_sends_the_worst_case(tmp_path):
    """crafted_ipm (IPM whose clients build their payloads) under rand_k sends its k
    largest entries unscaled, not k random ones scaled by w / k: another run than ipm's;
    without a codec it is IPM to the bit."""
    extra = "attack: {name: %s, epsilon: 2.0}\naggregator: {name: median}\n"
    over = ["clients.byzantine=2"]
    plain = [run(tmp_path, extra % name, over) for name in ("ipm", "crafted_ipm")]
    np.testing.assert_array_equal(plain[0].final_params, plain[1].final_params)
    sparse = [run(tmp_path, extra % name + "codecs: [{name: rand_k, k: 65}]\n", over)
              for name in ("ipm", "crafted_ipm")]
    assert not np.array_equal(sparse[0].final_params, sparse[1].final_params)
    assert all(np.isfinite(r.final_params).all() for r in sparse)
