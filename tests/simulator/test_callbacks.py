"""Callbacks that answer a round (``Callback.after_round``, simulator/run/callbacks.py): their
metrics are logged with the round's, and a request to stop ends the point after that round,
FINISHED, with the model it had then."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

from simulator.config.load import load
from simulator.metric_names import mlflow_name
from simulator.run.callbacks import Callback, EarlyStopping, RoundAnswer
from simulator.run.runner import run_loaded

SCENARIO = """\
name: answers
rounds: 8
data: {dataset: {name: digits}}
model: {name: logreg}
clients: {total: 10, per_round: 5}
local: {steps: 2, batch_size: 16, lr: 0.1}
evaluation: {every: 2}
"""


class Doubled(Callback):
    """Logs twice the round's client loss as a metric of its own."""

    def after_round(self, run, round_, metrics):
        return RoundAnswer({"twice_client_loss": 2 * metrics["client_loss"]})


def _run(tmp_path, uri, callbacks, *over):
    p = tmp_path / "s.yaml"
    p.write_text(SCENARIO)
    return run_loaded(load(p, list(over)), "inline", tracking_uri=uri, quiet=True,
                      callbacks=callbacks)


def test_early_stopping_ends_the_point_after_the_round_it_asks(tmp_path, mlflow_uri):
    """Accuracy is evaluated every 2 rounds; nothing improves by 1.0, so with patience 2 the
    point stops after its third evaluation (round 6 of 8)."""
    out = _run(tmp_path, mlflow_uri, [EarlyStopping("test_accuracy", patience=2,
                                                    min_delta=1.0)])
    client = MlflowClient(mlflow_uri)
    run = client.get_run(out.runs[0]["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["stopped_after_round"] == "6"
    waits = client.get_metric_history(run.info.run_id, mlflow_name("early_stopping_wait"))
    assert [(m.step, m.value) for m in waits] == [(1, 0.0), (3, 1.0), (5, 2.0)]
    steps = client.get_metric_history(run.info.run_id, mlflow_name("client_loss"))
    assert [m.step for m in steps] == list(range(6))  # rounds 7 and 8 never ran
    # the model of round 6 is the run's: its accuracy is the last one logged
    acc = client.get_metric_history(run.info.run_id, mlflow_name("test_accuracy"))
    assert out.runs[0]["final_test_accuracy"] == pytest.approx(acc[-1].value)


def test_a_callbacks_metrics_are_logged_with_the_round(tmp_path, mlflow_uri):
    out = _run(tmp_path, mlflow_uri, [Doubled()], "rounds=3")
    client = MlflowClient(mlflow_uri)
    run_id = out.runs[0]["run_id"]
    loss = client.get_metric_history(run_id, mlflow_name("client_loss"))
    twice = client.get_metric_history(run_id, "twice_client_loss")
    assert [m.value for m in twice] == pytest.approx([2 * m.value for m in loss])
    assert len(twice) == 3
    assert "stopped_after_round" not in client.get_run(run_id).data.params
    local = client.download_artifacts(run_id, "metrics.parquet", str(tmp_path))
    table = pq.read_table(local).to_pydict()
    assert table["twice_client_loss"] == pytest.approx([2 * v for v in table["client_loss"]])


@pytest.mark.parametrize("mode, values, stop_at", [
    ("max", [0.5, 0.6, 0.6, 0.59, 0.7], 3),  # 0.6 then two without improvement
    ("min", [1.0, 0.8, 0.81, 0.9, 0.5], 3),
    ("max", [0.1, 0.2, 0.3, 0.4, 0.5], None),
])
def test_early_stopping_counts_evaluations_without_improvement(mode, values, stop_at):
    cb = EarlyStopping("m", patience=2, mode=mode)
    run = object()
    stops = [cb.after_round(run, r, {"m": v}).stop for r, v in enumerate(values)]
    assert (stops.index(True) if True in stops else None) == stop_at
    assert cb.after_round(run, 9, {"other": 1.0}) is None  # no evaluation: no count
    with pytest.raises(ValueError, match="patience >= 1"):
        EarlyStopping(patience=0)
