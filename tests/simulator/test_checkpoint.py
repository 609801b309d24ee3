"""Checkpoints every k rounds and resume: the resumed run's numbers are the uninterrupted
run's, for server state (optimizer, stateful aggregator), client state (worker momentum,
mu2-SGD) and D-SGD peers' models; ``fedray resume`` after ``kill -9`` of the driver."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from simulator.config.load import load
from simulator.metric_names import mlflow_name
from simulator.run import checkpoint
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine

FL = """\
name: ckpt
rounds: 7
data:
  dataset: {name: digits}
model: {name: logreg}
clients: {total: 9, per_round: 6, byzantine: 2}
attack: {name: sign_flip}
local: {batch_size: 16, lr: 0.2, optimizer: {name: momentum, beta: 0.9}}
aggregator: {name: cc, tau: 1.0}
server: {optimizer: {name: sgd, lr: 1.0, momentum: 0.5}}
runtime: {checkpoint_every: 3}
"""


def _point(tmp_path, text, *over):
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return load(p, list(over)).points[0].scenario


def _roundtrip(state):
    """Through a file and ``torch.load(weights_only=True)``, as a real resume reads it."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("over", [
    [],
    ["local.optimizer={name: sgd}", "server.optimizer={name: mu2sgd, lr: 0.05}"],
    ["server.optimizer={name: fedadam, lr: 0.05}", "aggregator={name: cwtm, f: 2}"],
    ["model={name: cnn, channels: [4], hidden: 8, norm: batch}"],
    ["model={name: cnn, channels: [4], hidden: 8, norm: batch}", "local.optimizer={name: sgd}",
     "server.buffers=local"],
    # control variates on the server and on each client
    ["local.optimizer={name: sgd}", "local.steps=3", "server.optimizer={name: scaffold}"],
    ["local.optimizer={name: sgd}", "local.steps=3", "server.optimizer={name: feddyn}"],
    # FedBN: each client's own BatchNorm weights and statistics
    ["model={name: cnn, channels: [4], hidden: 8, norm: batch}", "local.optimizer={name: sgd}",
     "server.buffers=fedbn"],
    # personal models, measured on each client's own test samples
    ["local.optimizer={name: ditto, lam: 0.5}", "local.steps=3",
     "data.dataset={name: synthetic, alpha: 1.0, beta: 1.0}", "data.partitioner={name: natural}"],
    # error-feedback residuals, each client's in the worker that trains it
    ["local.optimizer={name: sgd}", "codecs=[{name: top_k, fraction: 0.05, error_feedback: true}]"],
    # the clients' replica of the model under downlink compression
    ["downlink=[{name: top_k, fraction: 0.05}]"],
    # EF21's estimates, each client's in its worker and in the server
    ["local.optimizer={name: sgd}", "codecs=[{name: qsgd, levels: 2, ef21: true}]"],
    # an audit: its canaries' rows each round, its statistics from the run's first model
    ["audit={canaries: 9, every: 2}"],
    # a reconstruction's target kept from round 2 to the end, a membership attack
    [("privacy_attacks=[{name: dlg, round: 2, iterations: 20, labels: infer}, "
      "{name: loss_threshold}]")],
], ids=["momentum-cc-server-momentum", "mu2sgd", "fedadam", "batchnorm", "batchnorm-local",
        "scaffold", "feddyn", "fedbn", "ditto", "top-k-error-feedback", "downlink", "qsgd-ef21",
        "audit", "privacy-attacks"])
def test_resume_from_a_checkpoint_gives_the_uninterrupted_numbers(tmp_path, over):
    sc = _point(tmp_path, FL, *over)
    saved: dict[int, dict] = {}
    full = Engine(sc, InlineBackend(), workers=2).run(
        on_checkpoint=lambda r, st: saved.__setitem__(r, _roundtrip(st)))
    if "ditto" in str(over):
        assert full.metrics[-1]["personal_clients"] > 0
    assert sorted(saved) == [2, 5]  # after rounds 3 and 6 of 7
    for r in (2, 5):
        resumed = Engine(sc, InlineBackend(), workers=2).run(resume={**saved[r], "round": r})
        assert resumed.metrics == full.metrics
        np.testing.assert_array_equal(resumed.final_params, full.final_params)


def test_dsgd_resumes_in_both_orders(tmp_path):
    text = FL.replace("clients: {total: 9, per_round: 6, byzantine: 2}\nattack: {name: sign_flip}\n",
                      "clients: {total: 8}\ntopology: {name: ring}\n")
    text = text.replace("local: {batch_size: 16, lr: 0.2, optimizer: {name: momentum, beta: 0.9}}",
                        "local: {steps: 2, batch_size: 16, lr: 0.2}")
    text = text.replace("aggregator: {name: cc, tau: 1.0}\nserver: {optimizer: {name: sgd, lr: 1.0, momentum: 0.5}}\n", "")
    for order in ("local_then_gossip", "gossip_then_local"):
        sc = _point(tmp_path, text, f"dsgd.order={order}")
        saved: dict[int, dict] = {}

        def keep(r, st, saved=saved):
            saved[r] = _roundtrip(st)

        full = Engine(sc, InlineBackend()).run(on_checkpoint=keep)
        resumed = Engine(sc, InlineBackend()).run(resume={**saved[2], "round": 2})
        assert resumed.metrics == full.metrics
        np.testing.assert_array_equal(resumed.final_params, full.final_params)


def test_checkpoint_files_are_atomic_and_pruned(tmp_path):
    for r in range(4):
        checkpoint.save("run1", r, {"x": torch.ones(2) * r, "metrics": [{"a": 1.0}]}, tmp_path)
    files = sorted(p.name for p in checkpoint.run_dir("run1", tmp_path).iterdir())
    assert files == ["round_000002.pt", "round_000003.pt"]
    last = checkpoint.latest("run1", tmp_path)
    assert last["round"] == 3 and torch.equal(last["x"], torch.full((2,), 3.0))
    assert checkpoint.latest("other", tmp_path) is None
    checkpoint.remove("run1", tmp_path)
    assert checkpoint.latest("run1", tmp_path) is None


KILL = """\
name: kill
rounds: 16
data:
  dataset: {name: digits}
model: {name: mlp, hidden: [256, 256]}
clients: {total: 12, per_round: 8, byzantine: 2}
attack: {name: sign_flip}
local: {epochs: 2, batch_size: 8, lr: 0.05}
aggregator: {name: cc, tau: 1.0}
server: {optimizer: {name: sgd, lr: 1.0, momentum: 0.5}}
runtime: {backend: inline, checkpoint_every: 2}
"""


ASYNC_KILL = KILL.replace(
    "server: {optimizer: {name: sgd, lr: 1.0, momentum: 0.5}}",
    "server: {optimizer: {name: sgd, lr: 1.0, momentum: 0.5}, mode: fedbuff}\n"
    "asynchrony: {concurrency: 8, buffer_size: 4, max_staleness: 3}\n"
    "speeds: {distribution: lognormal, sigma: 1.0, jitter: 0.2}")


SCAFFOLD_KILL = KILL.replace("server: {optimizer: {name: sgd, lr: 1.0, momentum: 0.5}}",
                             "server: {optimizer: {name: scaffold}}")
DITTO_KILL = KILL.replace("dataset: {name: digits}",
                          "dataset: {name: synthetic, alpha: 1.0, beta: 1.0}\n"
                          "  partitioner: {name: natural}").replace(
    "local: {epochs: 2, batch_size: 8, lr: 0.05}",
    "local: {epochs: 2, batch_size: 8, lr: 0.05, optimizer: {name: ditto, lam: 0.5}}")

EF_KILL = KILL + "codecs: [{name: top_k, fraction: 0.01, error_feedback: true}]\n"
# an audit (statistics every 4 rounds from the run's first model) and a reconstruction of
# round 2's first client, whose target the round-4 checkpoint carries to the end
AUDIT_KILL = KILL + "audit: {canaries: 12, every: 4}\n" + \
    "privacy_attacks: [{name: inverting_gradients, round: 2, iterations: 20}]\n"
AUDIT_KEYS = ["audit_epsilon", "audit_cosine_in_mean", "audit_cosine_out_std"]


@pytest.mark.parametrize("text", [KILL, ASYNC_KILL, SCAFFOLD_KILL, DITTO_KILL, EF_KILL,
                                  AUDIT_KILL],
                         ids=["sync", "fedbuff", "scaffold", "ditto", "top-k-error-feedback",
                              "audit-attack"])
def test_kill_9_of_the_driver_then_resume_gives_the_uninterrupted_metrics(tmp_path, mlflow_uri,
                                                                          text):
    import os
    import signal
    import subprocess
    import sys
    import time

    from mlflow.tracking import MlflowClient

    p = tmp_path / "kill.yaml"
    p.write_text(text)
    cmd = [sys.executable, "-m", "fedray"]
    proc = subprocess.Popen([*cmd, "run", str(p), "--quiet", "--tracking-uri", mlflow_uri],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    found: list = []
    while not found and time.monotonic() < deadline and proc.poll() is None:
        found = list(tmp_path.glob(".fedray/checkpoints/*/round_000003.pt"))
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)  # mid-run: 4 of 16 rounds checkpointed
    proc.wait()
    assert found, "the run ended or timed out before its round-4 checkpoint"
    run_id = found[0].parent.name
    client = MlflowClient(mlflow_uri)
    assert client.get_run(run_id).info.status == "RUNNING"  # nobody closed it
    logged_before = len(client.get_metric_history(run_id, mlflow_name("test_accuracy")))
    # the run was cut short; the background sender may not have sent the last rounds it
    # queued before the kill (resume logs those from the checkpoint's metrics)
    assert logged_before < 16

    r = subprocess.run([*cmd, "resume", run_id, "--tracking-uri", mlflow_uri, "--quiet"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resuming kill seed=0" in r.stderr  # the run name: scenario and seed

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert client.get_run(run.data.tags["mlflow.parentRunId"]).info.status == "FINISHED"
    full = Engine(_point(tmp_path, text), InlineBackend()).run()
    keys = ["test_accuracy", "test_loss", "aggregation_error", "aggregate_norm"]
    for key in keys + (["sim_time", "staleness_mean"] if text is ASYNC_KILL else []) + \
            (["personal_test_accuracy_mean", "personal_test_accuracy_p10"]
             if text is DITTO_KILL else []):
        hist = sorted(client.get_metric_history(run_id, mlflow_name(key)), key=lambda m: m.step)
        assert [m.step for m in hist] == list(range(16)), key  # every round exactly once
        assert [m.value for m in hist] == [row[key] for row in full.metrics]
    if text is AUDIT_KILL:  # the audit's rounds (4, 8, 12, 16) and the attack's end
        for key in [*AUDIT_KEYS, "inverting_gradients_psnr"]:
            hist = sorted(client.get_metric_history(run_id, mlflow_name(key)),
                          key=lambda m: m.step)
            want = [(i, row[key]) for i, row in enumerate(full.metrics) if key in row]
            assert [(m.step, m.value) for m in hist] == want and want, key
    assert not list(tmp_path.glob(".fedray/checkpoints/*/*.pt"))  # forgotten once finished
    names = {a.path for a in client.list_artifacts(run_id)}
    assert {"metrics.parquet", "scenario.yaml", "model"} <= names
