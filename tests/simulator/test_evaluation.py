"""Evaluation runs its forward passes in chunks of EVAL_CHUNK samples on the CPU (a pass over
4,096 images leaves the caches) and still sums the losses per EVAL_BATCH: every built-in
model and task gives the same accuracy, loss and per-sample hits, to the last bit, as one
forward pass per EVAL_BATCH (what fedray did before), and as a plain loop would compute."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from simulator.models import build_model
from simulator.registry import instantiate
from simulator.runtime import common
from simulator.runtime.common import evaluate_model

CASES = [  # (model, input shape, classes, vocabulary, task)
    ({"name": "logreg"}, (60,), 10, None, {"name": "classification"}),
    ({"name": "mlp", "hidden": [256]}, (60,), 10, None, {"name": "classification"}),
    ({"name": "cnn"}, (1, 28, 28), 10, None, {"name": "classification"}),
    ({"name": "simple_cnn"}, (3, 32, 32), 10, None, {"name": "classification"}),
    ({"name": "resnet20"}, (3, 32, 32), 10, None, {"name": "classification"}),
    ({"name": "char_lstm", "hidden": 32, "positions": "all"}, (20,), 30, 30,
     {"name": "next_token", "positions": "all"}),
    ({"name": "mlp", "hidden": [32]}, (8,), 3, None, {"name": "regression"}),
]


def _data(shape: tuple[int, ...], classes: int, vocabulary: int | None, task: dict, n: int
          ) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    if vocabulary:
        return (rng.integers(0, vocabulary, (n, *shape)).astype(np.int32),
                rng.integers(0, vocabulary, n).astype(np.int64))
    if len(shape) == 3:  # images as the partition table stores them: uint8, scaled on use
        x = rng.integers(0, 256, (n, *shape)).astype(np.uint8)
    else:
        x = rng.standard_normal((n, *shape)).astype(np.float32)
    if task["name"] == "regression":
        return x, rng.standard_normal((n, classes)).astype(np.float32)
    return x, rng.integers(0, classes, n).astype(np.int64)


@pytest.mark.parametrize("spec,shape,classes,vocabulary,task", CASES,
                         ids=[f"{c[0]['name']}-{c[4]['name']}" for c in CASES])
def test_chunked_evaluation_equals_one_pass_per_block(monkeypatch, spec, shape, classes,
                                                      vocabulary, task):
    torch.set_num_threads(1)
    model = build_model(spec, shape, classes, 0, vocabulary)
    t = instantiate("tasks", task)
    n = 300  # blocks of 128 (the last one 44) in chunks of 64 and 40 (never one under), whole
    x, y = _data(shape, classes, vocabulary, task, n)
    monkeypatch.setattr(common, "EVAL_BATCH", 128)
    results = {}
    for chunk in (128, 64, 40):
        monkeypatch.setattr(common, "EVAL_CHUNK", chunk)
        results[chunk] = evaluate_model(model, x, y, t)
    acc, loss, hits = results[128]
    for chunk in (64, 40):
        a, lo, h = results[chunk]
        assert a == acc and lo == loss, (chunk, a, acc, lo, loss)
        if hits is None:
            assert h is None
        else:
            np.testing.assert_array_equal(h, hits)
    # and what a plain loop computes: one forward pass per block, float64 sums of its losses
    model.eval()
    want = 0.0
    with torch.no_grad():
        for lo in range(0, n, 128):
            xb = common.model_input(x[lo:lo + 128])
            yb = torch.from_numpy(y[lo:lo + 128])
            want += float(t.losses(model(xb), t.target(xb, yb)).double().sum())
    assert loss == want / n
    assert np.isfinite(loss) and loss > 0
    if hits is not None:
        assert 0.0 <= acc <= 1.0 and len(hits) == n


def test_eval_shares_deal_every_span_once_in_balanced_contiguous_runs():
    from simulator.runtime.common import eval_shares, eval_spans

    for n_test, n_train, workers in [(5000, 10_000, 2), (300, 1437, 3), (64, 64, 4), (10, 5, 2)]:
        shares = eval_shares(n_test, n_train, workers)
        assert len(shares) == workers
        flat = [(part, span) for share in shares for part, spans in share for span in spans]
        assert flat == [("test", s) for s in eval_spans(n_test)] + \
            [("train", s) for s in eval_spans(n_train)]  # all, once, in order
        sizes = [sum(b - a for _, spans in share for a, b in spans) for share in shares]
        if n_test + n_train >= 100 * workers:  # big enough to balance within a chunk or two
            assert max(sizes) - min(sizes) <= 2 * 128, sizes


def test_workers_shares_combine_to_the_servers_numbers(tmp_path):
    """The final evaluation dealt out over three ClientWorkers (a CNN with BatchNorm, so
    the global buffers travel too) gives the server's accuracy and losses to the bit."""
    from simulator.config.load import load
    from simulator.runtime.backend import InlineBackend
    from simulator.runtime.common import combine_scores, eval_spans, gather_scores, score_spans
    from simulator.sim.engine import Engine

    p = tmp_path / "s.yaml"
    p.write_text("name: e\nrounds: 2\ndata: {dataset: {name: digits}}\n"
                 "model: {name: cnn, channels: [8], hidden: 16, norm: batch}\n"
                 "clients: {total: 6, per_round: 3}\nlocal: {steps: 2, batch_size: 16}\n")
    engine = Engine(load(p).points[0].scenario, InlineBackend(), workers=3)
    engine.run()
    rounds, be = engine.protocol, engine.backend
    server = rounds.server.actor
    n_test, n_train = rounds.eval_sizes
    assert n_test > 128 and n_train > 128 and len(engine.pool.live) == 3
    refs = engine.pool.evaluate_spans(server.params(), server.buffers(), rounds.eval_ref,
                                      n_test, n_train)
    scores = [s for share in be.get(refs) for s in share]
    assert len({id(s) for s in scores}) >= 3
    want = server.evaluate()
    got = server.evaluate(tuple(scores))
    assert got == want and 0 < got["test_accuracy"] <= 1
    acc, loss, _ = combine_scores(*gather_scores(scores, "test"))
    assert (acc, loss) == (want["test_accuracy"], want["test_loss"])
    # sample by sample (a sum of a few hundred losses is exact in float64 whatever its
    # order, so the totals alone would not show rows out of place)
    server._load_model()
    held = server.evaluation  # the server's held-out data
    for part, x, y, n in (("test", held.x_test, held.y_test, n_test),
                          ("train", held.x_tr, held.y_tr, n_train)):
        losses, part_hits = gather_scores(scores, part)
        own_losses, own_hits = score_spans(server.model, x, y, server.task, eval_spans(n))
        np.testing.assert_array_equal(losses, own_losses)
        np.testing.assert_array_equal(part_hits, own_hits)
        assert len(set(np.round(own_losses, 6))) > 10  # distinct losses: an order shows
    assert len({s.part for s in scores if s.spans[0][0] > 0}) >= 1  # a part was split


def test_a_ray_run_evaluates_on_its_workers_with_the_inline_numbers(tmp_path, shared_ray,
                                                                    monkeypatch):
    """On Ray the final evaluation (nothing prefetched: the workers are idle) is the
    workers'; its numbers are the inline run's, where the server evaluates alone."""
    from simulator.config.load import load
    from simulator.runtime.backend import InlineBackend
    from simulator.sim.engine import Engine
    from simulator.sim.rounds.server import ServerRounds

    dealt: list[int] = []
    real = ServerRounds._worker_scores

    def spy(self):
        out = real(self)
        dealt.append(len(out))
        return out

    monkeypatch.setattr(ServerRounds, "_worker_scores", spy)
    p = tmp_path / "s.yaml"
    p.write_text("name: e\nrounds: 3\ndata: {dataset: {name: digits}}\n"
                 "model: {name: cnn, channels: [8], hidden: 16}\n"
                 "clients: {total: 6, per_round: 3}\nlocal: {steps: 2, batch_size: 16}\n")
    sc = load(p).points[0].scenario
    inline = Engine(sc, InlineBackend(), workers=2).run()
    assert dealt == [] or set(dealt) == {0}  # inline: the server evaluates
    dealt.clear()
    on_ray = Engine(sc, shared_ray, workers=2).run()
    assert dealt and dealt[-1] >= 2  # the last round's evaluation: both workers' shares
    assert inline.metrics == on_ray.metrics
