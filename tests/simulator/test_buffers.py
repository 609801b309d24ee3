"""Model buffers (BatchNorm running statistics): they travel with the parameters under
``server.buffers`` (mean, median, local), so a BatchNorm model learns as its plain twin does,
the final model holds the aggregated statistics, Byzantine statistics are survived by the
median, and where buffers cannot be handled the scenario is refused in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from simulator.config import ScenarioError
from simulator.config.load import load
from simulator.data import client_arrays
from simulator.models import build_model
from simulator.runtime.backend import InlineBackend
from simulator.runtime.common import model_input
from simulator.seeding import torch_generator
from simulator.sim.engine import Engine
from strategies.trainers import local_sgd, minibatches

BN = """\
name: bn
rounds: 20
data: {dataset: {name: digits}, partitioner: {name: dirichlet, alpha: 1.0}}
model: {name: cnn, channels: [8, 16], hidden: 32, norm: batch}
clients: {total: 20, per_round: 10}
local: {epochs: 2, batch_size: 16, lr: 0.1, momentum: 0.9}
"""


def point(tmp_path: Path, text: str = BN, *over: str):
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return load(p, list(over)).points[0].scenario


def run(tmp_path, *over, workers=2, text=BN):
    return Engine(point(tmp_path, text, *over), InlineBackend(), workers=workers).run()


def test_batchnorm_cnn_learns_as_its_plain_twin(tmp_path):
    """Before buffers travelled, the BatchNorm CNN evaluated with running_mean 0 and
    running_var 1 (0.48 against 0.97 in the issue). Measured here: BatchNorm 0.975, plain
    0.944, GroupNorm 0.953 after 20 rounds. The margin: BatchNorm within 2 points below its
    plain twin, about the round-to-round wobble of the plain CNN's last rounds."""
    bn = run(tmp_path)
    plain = run(tmp_path, "model.norm=none")
    group = run(tmp_path, "model.norm=group")
    assert plain.final("test_accuracy") > 0.9
    assert bn.final("test_accuracy") >= plain.final("test_accuracy") - 0.02
    assert group.final("test_accuracy") >= plain.final("test_accuracy") - 0.02
    # without an attack the mean of the participants' statistics is the server's
    assert bn.final("buffer_aggregation_error") == 0.0
    var = bn.model_state["net.1.running_var"]
    assert not torch.allclose(var, torch.ones_like(var))  # not the initial statistics


def test_the_final_model_holds_the_participants_mean_statistics(tmp_path):
    """One round, every client sampled: the final running statistics equal the mean of the
    statistics each client ends its local epoch with, recomputed here client by client from
    the initial model."""
    sc = point(tmp_path, BN, "rounds=1", "clients.total=6", "clients.per_round=6",
               "local.epochs=1")
    eng = Engine(sc, InlineBackend(), workers=3)
    res = eng.run()
    data = eng.data
    stats = []
    for c in range(6):
        model = build_model(sc.model, data.input_shape, data.num_classes, sc.seeds[0])
        lo, hi = int(data.source.offsets[c]), int(data.source.offsets[c + 1])
        x, y = client_arrays(data.source.table, data.input_shape)
        xc, yc = model_input(x[lo:hi]), torch.from_numpy(np.array(y[lo:hi]))
        start = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
        batches = minibatches(len(yc), sc.local, torch_generator(sc.seeds[0], "local", 0, c))
        local_sgd(model, start, xc, yc, batches, sc.local.lr, sc.local.momentum)
        stats.append({k: v.clone() for k, v in model.state_dict().items() if "running" in k})
    for key in stats[0]:
        mean = torch.stack([s[key] for s in stats]).mean(0)
        torch.testing.assert_close(res.model_state[key], mean, rtol=1e-5, atol=1e-6)
    assert int(res.model_state["net.1.num_batches_tracked"]) == round(np.mean(
        [len(minibatches(int(data.source.offsets[c + 1] - data.source.offsets[c]), sc.local,
                         torch_generator(sc.seeds[0], "local", 0, c))) for c in range(6)]))


ATTACK = ["clients.byzantine=4", "attack={name: gaussian}", "aggregator={name: cwtm, f: 4}",
          "rounds=10"]


def test_byzantine_statistics_break_the_mean_and_not_the_median(tmp_path):
    """Byzantine clients send poisoned statistics too (the scenario's attack on the buffer
    rows): the mean of them gives negative variances and chance accuracy; ``auto`` picks
    the coordinate-wise median with Byzantine clients and the model learns (measured: 0.095
    against 0.947; docs/models.md's bn_buffers_attack table)."""
    mean = run(tmp_path, *ATTACK, "server.buffers=mean")
    auto = run(tmp_path, *ATTACK)
    assert mean.final("test_accuracy") < 0.2
    assert (mean.model_state["net.1.running_var"] < 0).any()
    assert auto.final("test_accuracy") > 0.9
    assert (auto.model_state["net.1.running_var"] > 0).all()
    assert auto.final("buffer_aggregation_error") < 0.05 * mean.final("buffer_aggregation_error")


def test_local_statistics_stay_with_their_client_on_any_worker_count(tmp_path):
    """SiloBN: each client trains from its own statistics after its first round; the numbers
    do not depend on which worker holds the client."""
    one = run(tmp_path, "server.buffers=local", "rounds=6", workers=1)
    three = run(tmp_path, "server.buffers=local", "rounds=6", workers=3)
    shared = run(tmp_path, "rounds=6")
    assert one.metrics == three.metrics
    assert one.final("test_accuracy") > 0.7
    assert one.metrics != shared.metrics


@pytest.mark.parametrize("over,loc,words", [
    (["topology={name: ring}"], "model", "D-SGD gossips parameters only"),
    (["runtime.vectorize=true"], "runtime.vectorize", "cannot update cnn's buffers"),
    (["privacy={name: dp_sgd, clip: 1.0, noise_multiplier: 1.0}"], "local.trainer",
     "cannot update cnn's buffers"),
    (["privacy={name: dp_fedavg, clip: 1.0, noise_multiplier: 1.0}"], "privacy.name",
     "statistics would leave the clients unprotected"),
    (["server.buffers=average"], "server.buffers",
     "'auto', 'mean', 'median', 'local' or 'fedbn'"),
])
def test_where_buffers_cannot_be_handled_the_scenario_is_refused(tmp_path, over, loc, words):
    with pytest.raises(ScenarioError) as e:
        point(tmp_path, BN, *over)
    text = str(e.value)
    assert f"{loc}:" in text and words in text and "norm: group" in text or \
        loc == "server.buffers" and words in text


def test_fedbn_keeps_each_clients_batchnorm_weights_and_measures_its_own_model(tmp_path):
    """FedBN (Li et al., ICLR 2021): the server never aggregates the BatchNorm layers' affine
    weights (the global ones stay at their initial 1 and 0, whatever the rows say), each
    client trains from its own; on a natural partition each client's own model (the global
    one with its BatchNorm weights and statistics) is measured on its own test samples."""
    from simulator.models import build_model
    from simulator.runtime.common import norm_parameter_mask
    from simulator.sim.sampling import sample_clients

    eng = Engine(point(tmp_path, BN, "server.buffers=fedbn", "rounds=4"), InlineBackend(),
                 workers=2)
    res = eng.run()
    model = build_model(eng.plan.scenario.model, (1, 8, 8), 10, 0)
    mask = norm_parameter_mask(model).numpy()
    x0 = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
    assert mask.sum() == 2 * (8 + 16)  # two BatchNorm2d layers' weights and biases
    np.testing.assert_array_equal(res.final_params[mask], x0[mask])  # never aggregated
    assert not np.allclose(res.final_params[~mask], x0[~mask])
    states = eng.pool.client_states()
    own = [s["model.norm"] for s in states.values()]
    assert len(own) == len({c for r in range(4) for c in sample_clients(0, r, 20, 10).tolist()})
    assert all(o.shape == (mask.sum(),) for o in own)
    assert not torch.equal(own[0], own[1])  # each client its own
    assert "personal_test_accuracy_mean" not in res.metrics[-1]  # digits: no own test sets
    local = run(tmp_path, "server.buffers=local", "rounds=4")
    assert local.metrics != res.metrics


def test_fedbn_measures_each_clients_own_model_on_its_own_test_samples(tmp_path):
    from tests import formats

    formats.write_leaf(tmp_path / "leaf", writers=8, per_writer=40)
    text = f"""\
name: fedbn
rounds: 6
data: {{dataset: {{name: femnist, root: {tmp_path / 'leaf'}}}, partitioner: {{name: natural}}}}
model: {{name: cnn, channels: [4], hidden: 16, norm: batch}}
clients: {{total: 8, per_round: 4}}
local: {{epochs: 1, batch_size: 10, lr: 0.1}}
"""
    fedbn = run(tmp_path, "server.buffers=fedbn", text=text)
    last = fedbn.metrics[-1]
    assert 0 < last["personal_clients"] <= 8
    assert 0.0 <= last["personal_test_accuracy_p10"] <= last["personal_test_accuracy_mean"] <= 1
    one = run(tmp_path, "server.buffers=fedbn", text=text, workers=1)
    assert one.metrics == fedbn.metrics  # any worker count


def test_fedbn_without_batchnorm_is_refused(tmp_path):
    with pytest.raises(ScenarioError) as e:
        point(tmp_path, BN, "server.buffers=fedbn", "model.norm=group")
    assert e.value.lines[0].endswith("server.buffers: fedbn keeps BatchNorm layers local; cnn "
                                     "has none: use a model with norm: batch, or another value "
                                     "(auto | mean | median | local)")
