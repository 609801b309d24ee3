"""Tasks: classification, next-token prediction on integer sequences, regression. Their
losses against the formulas, a next-character model that learns on fixture text (below the
unigram baseline, the same numbers on both backends), a regression that beats the mean
predictor, and the task listed with its keys."""

from __future__ import annotations

import collections
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from simulator.config import ScenarioError
from simulator.config.load import load
from simulator.runtime.backend import InlineBackend, RayBackend
from simulator.sim.engine import Engine
from strategies.tasks import Classification, NextToken, Regression
from tests import formats


def test_losses_and_hits_match_their_formulas():
    g = torch.Generator().manual_seed(0)
    out = torch.randn(3, 5, 7, generator=g)  # (b, L, V)
    x = torch.randint(0, 7, (3, 5), generator=g)
    y = torch.randint(0, 7, (3,), generator=g)
    task = NextToken()
    target = task.target(x, y)
    assert torch.equal(target[:, :-1], x[:, 1:]) and torch.equal(target[:, -1], y)
    logp = out.log_softmax(-1)
    want = -torch.stack([torch.stack([logp[i, t, target[i, t]] for t in range(5)]).mean()
                         for i in range(3)])
    torch.testing.assert_close(task.losses(out, target), want)
    hits = (out.argmax(-1) == target).float().mean(1)
    torch.testing.assert_close(task.hits(out, target), hits)
    assert task.metrics(1.5, 0.25) == {"accuracy": 0.25, "loss": 1.5,
                                       "perplexity": pytest.approx(math.exp(1.5))}
    assert task.output_shape(2, (5,), 7) == (2, 5, 7)
    last = NextToken("last")
    assert torch.equal(last.target(x, y), y) and last.output_shape(2, (5,), 7) == (2, 7)
    scores = torch.randn(4, 3, generator=g)
    labels = torch.tensor([0, 1, 2, 0])
    c = Classification()
    torch.testing.assert_close(c.losses(scores, labels),
                               -scores.log_softmax(1)[torch.arange(4), labels])
    assert c.metrics(0.5, 0.75) == {"accuracy": 0.75, "loss": 0.5}
    r = Regression()
    pred, truth = torch.tensor([[1.0], [3.0]]), torch.tensor([0.5, 1.0])
    torch.testing.assert_close(r.losses(pred, truth), torch.tensor([0.25, 4.0]))
    assert r.hits(pred, truth) is None and r.metrics(2.0, None) == {"loss": 2.0}


def _shakespeare(tmp_path):
    formats.write_shakespeare(tmp_path, roles=4, per_role=60, text=formats.SONNET)
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(f"""\
        rounds: 10
        data: {{dataset: {{name: shakespeare, root: {tmp_path}}}, partitioner: {{name: natural}}}}
        task: {{name: next_token}}
        model: {{name: char_lstm, embedding: 16, hidden: 32, layers: 2, positions: all}}
        clients: {{total: 4}}
        local: {{epochs: 3, batch_size: 10, lr: 2.0}}
    """))
    return p


def test_next_character_model_learns_below_the_unigram_baseline_on_both_backends(
        tmp_path, shared_ray):
    p = _shakespeare(tmp_path)
    sc = load(p).points[0].scenario
    inline = Engine(sc, InlineBackend(), workers=2).run()
    ray_run = Engine(sc, RayBackend(), workers=2).run()
    assert inline.metrics == ray_run.metrics  # identical metrics on both backends
    eng = Engine(sc, InlineBackend())
    tokens = np.concatenate([eng.data.source.table.column("y").to_numpy(),
                             np.asarray(eng.data.source.table.column("x").combine_chunks().values)])
    freq = np.array(list(collections.Counter(tokens.tolist()).values()), dtype=float)
    unigram = float(-(freq / freq.sum() * np.log(freq / freq.sum())).sum())
    first, last = inline.metrics[0], inline.metrics[-1]
    # measured: unigram 2.91 nats; 3.07 after round 1, 1.97 after round 10 (accuracy 0.48)
    assert last["test_loss"] < unigram - 0.5 < first["test_loss"]
    assert last["test_perplexity"] == pytest.approx(math.exp(last["test_loss"]))
    assert last["test_accuracy"] > 0.4 > first["test_accuracy"]
    # a model that scores the last position only does not fit next_token's all positions
    p.write_text(p.read_text().replace("positions: all", "positions: last"))
    with pytest.raises(ScenarioError, match=r"model: char_lstm gives outputs of shape \(2, 80\)"
                                            r" for a batch of 2; task next_token needs "
                                            r"\(2, 80, 80\)"):
        load(p)


def test_regression_beats_the_mean_predictor(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(textwrap.dedent("""\
        rounds: 15
        data: {dataset: {name: linear_regression}, partitioner: {name: natural}}
        task: {name: regression}
        model: {name: mlp, hidden: [32]}
        clients: {total: 10, per_round: 5}
        local: {epochs: 1, batch_size: 16, lr: 0.05}
    """))
    sc = load(p).points[0].scenario
    eng = Engine(sc, InlineBackend())
    res = eng.run()
    y_test = np.asarray(eng.data.y_test)
    assert y_test.dtype == np.float32
    baseline = float(((y_test - y_test.mean()) ** 2).mean())  # the best constant's MSE
    assert res.final("test_loss") < 0.5 * baseline  # measured: 0.39 against 2.01
    assert "test_accuracy" not in res.metrics[-1]
    # class-label partitioners and classification refuse real-valued targets up front
    with pytest.raises(ScenarioError, match="data.partitioner: dirichlet splits by class label"):
        load(p, ["data.partitioner={name: dirichlet}"])
    with pytest.raises(ScenarioError, match="task.name: classification learns class labels"):
        load(p, ["task={name: classification}"])


def test_list_shows_tasks_and_models_with_their_keys():
    run = [sys.executable, "-m", "fedray", "list"]
    tasks = subprocess.run([*run, "tasks"], capture_output=True, text=True, check=True).stdout
    assert "classification" in tasks and "regression" in tasks
    assert "next_token  (positions='all')" in tasks
    models = subprocess.run([*run, "models"], capture_output=True, text=True, check=True).stdout
    for line in ("resnet18  (norm='batch', groups=2)", "resnet20  (norm='batch', groups=2)",
                 "femnist_cnn", ("char_lstm  (embedding=8, hidden=256, layers=2, "
                                 "positions='last')")):
        assert line in models, models
