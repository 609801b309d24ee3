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
