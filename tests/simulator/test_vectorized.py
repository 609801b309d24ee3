"""Vectorised local training (torch.func vmap over a worker's clients) equals training the
clients one at a time, to 1e-5, for every model and SGD setting, with uneven client sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from simulator.config.load import load
from simulator.messages import TrainRequest
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine
from strategies.trainers import local_sgd, minibatches, vectorized_sgd

BASE = """\
name: vec
rounds: 3
data:
  dataset: {name: digits}
  partitioner: {name: dirichlet, alpha: 0.5}
model: {name: logreg}
clients: {total: 12, per_round: 8}
local: {steps: 4, batch_size: 16, lr: 0.2}
"""


def _scenario(tmp_path, *over):
    p = tmp_path / "v.yaml"
    p.write_text(BASE)
    return load(p, list(over)).points[0].scenario


@pytest.mark.parametrize("over", [
    [],
    ["local={steps: 4, batch_size: 16, lr: 0.2, momentum: 0.9, weight_decay: 0.001}"],
    ["local={epochs: 2, batch_size: 16, lr: 0.1}"],  # uneven clients: different step counts
    ["model={name: mlp, hidden: [32]}", "local={steps: 5, batch_size: 8, lr: 0.1, momentum: 0.5}"],
    ["model={name: cnn, channels: [4], hidden: 16}", "local={steps: 3, batch_size: 8, lr: 0.1}"],
    ["model={name: cnn, channels: [4], hidden: 16, norm: group}",  # not a plain chain: vmap
     "local={epochs: 1, batch_size: 8, lr: 0.1, momentum: 0.5}"],
], ids=["logreg", "momentum-wd", "epochs-uneven", "mlp", "cnn", "vmap-groupnorm-uneven"])
def test_train_many_equals_the_loop(tmp_path, over):
    eng = Engine(_scenario(tmp_path, *over), InlineBackend())
    eng.start()
    worker = eng.pool.workers[0].actor
    x0 = torch.from_numpy(eng.protocol.server.actor.params())
    clients = list(range(12))
    local = eng.sc.local
    loop = [local_sgd(worker.model, x0, d.x, d.y, minibatches(len(d.y), local, d.generator),
                      local.lr, local.momentum, local.weight_decay)
            for d in (worker.client_data(1, c) for c in clients)]
    updates, losses = vectorized_sgd(worker.model, x0, [worker.client_data(1, c) for c in clients],
                                     local)
    for i in range(12):
        torch.testing.assert_close(updates[i], loop[i][0], atol=1e-5, rtol=0)
        assert float(losses[i]) == pytest.approx(loop[i][1], abs=1e-5)
    sizes = eng.data.client_sizes()
    assert len(set(sizes.tolist())) > 1  # the Dirichlet split makes clients of different sizes


def test_vectorized_run_matches_the_loop_run(tmp_path):
    loop = Engine(_scenario(tmp_path), InlineBackend()).run()
    vec = Engine(_scenario(tmp_path, "runtime.vectorize=true"), InlineBackend()).run()
    np.testing.assert_allclose(vec.final_params, loop.final_params, atol=1e-5, rtol=0)
    for a, b in zip(vec.metrics, loop.metrics):
        assert a["test_accuracy"] == pytest.approx(b["test_accuracy"], abs=2e-3)
        assert a["client_loss"] == pytest.approx(b["client_loss"], abs=1e-5)


def test_float16_client_state_halves_memory_and_stays_close(tmp_path):
    over = ["local={batch_size: 16, lr: 0.2, optimizer: {name: momentum, beta: 0.9}}",
            "clients.per_round=12"]
    full = Engine(_scenario(tmp_path, *over), InlineBackend())
    half = Engine(_scenario(tmp_path, *over, "runtime.state_dtype=float16"), InlineBackend())
    a, b = full.run(), half.run()
    np.testing.assert_allclose(b.final_params, a.final_params, atol=1e-3, rtol=0)
    eng = Engine(_scenario(tmp_path, *over, "runtime.state_dtype=float16"), InlineBackend())
    eng.start()
    eng.pool.workers[0].actor.train(TrainRequest(0, (0, 1)), eng.protocol.server.actor.params())
    states = eng.pool.workers[0].actor.client_states()
    assert states[0]["m"].dtype == torch.float16 and states[0]["m"].element_size() == 2


@pytest.mark.parametrize("timings,kept", [((2.0, 1.0), "false"), ((1.0, 2.0), "true")],
                         ids=["loop-faster", "vectorised-faster"])
def test_vectorize_keeps_the_faster_trainer_and_says_so(tmp_path, monkeypatch, caplog, timings,
                                                        kept):
    """runtime.vectorize keeps the vectorised trainer only where the first worker timed it
    faster than the loop; otherwise the run trains one client at a time (the loop's numbers,
    bit for bit), prints one line, and its params say which ran."""
    from simulator.runtime.worker import ClientWorker
    from strategies.trainers import SGD, VectorizedSGD

    asked = []

    def probe(self, specs, clients, params, steps=3):
        asked.append(([s["name"] for s in specs], list(clients)))
        return list(timings)

    monkeypatch.setattr(ClientWorker, "probe", probe)
    eng = Engine(_scenario(tmp_path, "runtime.vectorize=true"), InlineBackend())
    res = eng.run()
    err = "\n".join(r.getMessage() for r in caplog.records)  # logged; the CLI prints it
    assert asked == [(["vectorized_sgd", "sgd"], asked[0][1])] and len(asked[0][1]) == 8
    assert res.params["vectorized"] == kept
    trainer = eng.pool.workers[0].actor.trainer
    if kept == "false":
        assert isinstance(trainer, SGD) and not isinstance(trainer, VectorizedSGD)
        assert "clients train one at a time" in err and "1000.00 ms against 2000.00 ms" in err
        loop = Engine(_scenario(tmp_path), InlineBackend()).run()
        np.testing.assert_array_equal(res.final_params, loop.final_params)
    else:
        assert isinstance(trainer, VectorizedSGD) and "one at a time" not in err


def test_the_probe_times_both_trainers_and_changes_nothing(tmp_path):
    eng = Engine(_scenario(tmp_path, "runtime.vectorize=true"), InlineBackend())
    eng.start()
    worker, x0 = eng.pool.workers[0].actor, eng.protocol.server.actor.params()
    before = worker.train(TrainRequest(0, (0, 1, 2)), x0)
    seconds = worker.probe([{"name": "vectorized_sgd"}, {"name": "sgd"}], [0, 1, 2], x0)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)
    after = worker.train(TrainRequest(0, (0, 1, 2)), x0)
    for key in ("updates", "losses"):
        np.testing.assert_array_equal(getattr(before, key), getattr(after, key))


@pytest.mark.parametrize("per_client,stages", [
    ((4.0, 1.0), [8, 8]),  # the loop 4x faster on 8 clients (warm-up, timing): decided
    ((1.0, 3.0), [8, 8]),  # vectorised 3x faster: decided there
    ((1.2, 1.0), [8, 8, 12, 12, 12]),  # close: all 12, warm-up and the faster of 2 timings
], ids=["loop-clear", "vectorised-clear", "close-call"])
def test_the_probe_compares_on_8_clients_first_and_on_all_only_when_close(
        tmp_path, monkeypatch, per_client, stages):
    """A clock the fake trainers advance: per-client seconds come back, and the whole
    share is timed only when the first comparison is within 2x."""
    import types

    import simulator.runtime.worker as worker_module

    clock = [0.0]
    calls: list[int] = []

    class Fake:
        def __init__(self, cost):
            self.cost = cost

        def train(self, round_, data, start):
            clock[0] += self.cost * len(data)
            if self.cost == per_client[0]:
                calls.append(len(data))

    monkeypatch.setattr(worker_module, "time",
                        types.SimpleNamespace(perf_counter=lambda: clock[0]))
    eng = Engine(_scenario(tmp_path), InlineBackend())
    eng.start()
    worker = eng.pool.workers[0].actor
    fakes = iter([Fake(per_client[0]), Fake(per_client[1])])
    monkeypatch.setattr(worker, "_trainer", lambda spec, local=None: next(fakes))
    got = worker.probe([{"name": "vectorized_sgd"}, {"name": "sgd"}], list(range(12)),
                       eng.protocol.server.actor.params())
    assert got == pytest.approx(list(per_client))
    assert calls == stages


@pytest.mark.parametrize("name,shape,keys", [
    ("logreg", (1, 8, 8), {}), ("mlp", (60,), {"hidden": [32, 16]}),
    ("cnn", (1, 8, 8), {"channels": [4, 6], "hidden": 16}), ("simple_cnn", (3, 12, 10), {}),
    ("femnist_cnn", (1, 12, 12), {}),
])
def test_the_stacked_forward_is_each_copy_on_its_own_batch(name, shape, keys):
    """k copies of a chain model as batched kernels (bmm, grouped convolutions) give what
    each copy gives alone, with its own parameters on its own batch."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    from simulator.models import build_model
    from strategies.stacked import split_rows, stacked_forward

    model = build_model({"name": name, **keys}, shape, 5, 0)
    forward = stacked_forward(model)
    assert forward is not None
    g = torch.Generator().manual_seed(0)
    d = parameters_to_vector(model.parameters()).numel()
    w = torch.randn(3, d, generator=g) * 0.1
    x = torch.randn(3, 4, *shape, generator=g)
    out = forward(split_rows(model, w), x)
    for i in range(3):
        vector_to_parameters(w[i].clone(), model.parameters())
        torch.testing.assert_close(out[i], model(x[i]), atol=1e-5, rtol=1e-5)


def test_models_that_are_not_a_plain_chain_take_vmap():
    from simulator.models import build_model
    from strategies.stacked import stacked_forward

    assert stacked_forward(build_model({"name": "resnet20", "norm": "group"}, (3, 8, 8), 4, 0)) is None
    assert stacked_forward(build_model({"name": "cnn", "norm": "group"}, (1, 8, 8), 4, 0)) is None
    assert stacked_forward(torch.nn.Sequential(torch.nn.Linear(3, 2))) is None  # not a Model


@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.9, 1e-3),
                                                   (0.0, 1e-2)])
def test_local_sgd_is_torch_optim_sgd_bit_for_bit(momentum, weight_decay):
    """local_sgd takes SGD's step function (or, without momentum and weight decay, its
    in-place update) without building the optimizer: the same bits as torch.optim.SGD, a
    parameter without a gradient (a frozen layer) left as SGD leaves it."""
    import copy

    from torch import nn
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 5), nn.Linear(5, 5))
    model[3].bias.requires_grad_(False)
    x, y = torch.randn(100, 20), torch.randint(0, 5, (100,))
    start = parameters_to_vector(model.parameters()).detach()
    batches = [torch.randperm(100)[:16] for _ in range(10)]
    update, _ = local_sgd(copy.deepcopy(model), start, x, y, batches, 0.1, momentum,
                          weight_decay)
    ref = copy.deepcopy(model)
    params = list(ref.parameters())
    vector_to_parameters(start.clone(), params)
    opt = torch.optim.SGD(params, lr=0.1, momentum=momentum, weight_decay=weight_decay)
    for idx in batches:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ref(x[idx]), y[idx]).backward()
        opt.step()
    assert torch.equal(update, parameters_to_vector(params).detach() - start)


@pytest.mark.parametrize("local", [{"batch_size": 16}, {"batch_size": 5, "epochs": 3},
                                   {"batch_size": 8, "steps": 7}])
def test_step_counts_are_the_batches_minibatches_gives(local):
    """The engine's simulated local time and the vectorised trainer's chunk bound count the
    batches as minibatches makes them."""
    from types import SimpleNamespace

    from strategies.trainers import step_counts

    lc = SimpleNamespace(**{"steps": None, "epochs": None, **local})
    sizes = np.array([1, 4, 5, 16, 17, 33, 100])
    g = torch.Generator().manual_seed(0)
    assert step_counts(sizes, lc).tolist() == [len(minibatches(int(n), lc, g)) for n in sizes]
