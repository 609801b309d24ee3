"""Devices and resources: ``runtime.device`` / ``server_device`` / ``num_cpus`` /
``num_gpus`` / ``threads`` / ``precision`` / ``deterministic``. CI has no GPU: the device
path runs here with ``device: cpu`` through the same code (model moved, data and state on
the device, float32 host arrays back), and must give today's numbers exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from simulator.config import ScenarioError
from simulator.config.load import load
from simulator.errors import DeviceUnavailable
from simulator.runtime.backend import InlineBackend, RayBackend
from simulator.sim.engine import Engine

SMALL = """\
name: dev
rounds: 5
data: {dataset: {name: digits}}
model: {name: cnn, channels: [8], hidden: 16}
clients: {total: 12, per_round: 6, byzantine: 2}
attack: {name: sign_flip}
aggregator: {name: cwtm, f: 2}
local: {batch_size: 16, lr: 0.1, optimizer: {name: momentum, beta: 0.9}}
"""


def point(tmp_path, *over):
    p = tmp_path / "s.yaml"
    p.write_text(SMALL)
    return load(p, list(over)).points[0].scenario


def run(tmp_path, *over, workers=2):
    return Engine(point(tmp_path, *over), InlineBackend(), workers=workers).run()


@pytest.fixture
def nondeterministic_after():
    """``deterministic: true`` switches torch's global mode in this (inline) process."""
    yield
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False


def test_device_cpu_and_auto_without_a_gpu_give_todays_numbers(tmp_path,
                                                               nondeterministic_after):
    """Worker momentum (per-client state on the device) and local SGD (the model on it)."""
    for rule in ([], ["local.optimizer={name: sgd}", "local.steps=4"]):
        today = run(tmp_path, *rule)
        for over in (["runtime.device=cpu", "runtime.server_device=cpu", "runtime.num_cpus=1",
                      "runtime.deterministic=true"],
                     ["runtime.device=auto", "runtime.server_device=auto"]):
            if "auto" in over[0] and torch.cuda.is_available():
                continue  # auto is cuda there
            res = run(tmp_path, *rule, *over)
            assert res.metrics == today.metrics
            np.testing.assert_array_equal(res.final_params, today.final_params)


def test_bf16_autocast_learns_as_fp32_does(tmp_path):
    """bf16 autocast of the forward passes: the numbers move, the learning does not. (It
    once reused autocast's cached casts of the first weights for every step of a round:
    bf16 stayed at chance, 0.09, while fp32 reached 0.77.)"""
    plain = ["rounds=10", "attack=null", "clients.byzantine=0", "local.optimizer={name: sgd}",
             "local.epochs=1", "local.momentum=0.9"]
    fp32 = run(tmp_path, *plain)
    bf16 = run(tmp_path, *plain, "runtime.precision=bf16")
    assert bf16.metrics != fp32.metrics  # the forward passes did run in bfloat16
    assert bf16.final_params.dtype == np.float32
    # measured: 0.769 (fp32) and 0.763 (bf16) after 10 rounds
    assert fp32.final("test_accuracy") > 0.7
    assert abs(bf16.final("test_accuracy") - fp32.final("test_accuracy")) < 0.03


def test_more_threads_per_worker(tmp_path):
    res = run(tmp_path, "runtime.threads=2")
    assert np.isfinite(res.final("test_loss"))
    np.testing.assert_allclose(res.final("test_loss"), run(tmp_path).final("test_loss"),
                               rtol=1e-3)


def test_evaluation_threads_leave_training_alone(tmp_path, monkeypatch):
    """runtime.eval_threads: the server evaluates with that many torch threads and goes back
    to one: the model trains bit for bit as with one, and the test metrics agree."""
    from simulator.runtime import evaluation

    seen: list[int] = []
    real = evaluation.evaluate_model

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate_model", spy)
    one, two = run(tmp_path), run(tmp_path, "runtime.eval_threads=2")
    assert set(seen) == {1, 2} and torch.get_num_threads() == 1
    np.testing.assert_array_equal(two.final_params, one.final_params)
    for a, b in zip(one.metrics, two.metrics, strict=True):
        assert a["test_accuracy"] == b["test_accuracy"]
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-6)


class _GPUs(InlineBackend):
    def __init__(self, gpus: float) -> None:
        self._gpus = gpus

    def gpus(self) -> float:
        return self._gpus


@pytest.mark.parametrize("over,gpus,workers,want", [
    ([], 4.0, 2, ({"num_cpus": 1.0}, {})),  # device cpu takes no GPU
    (["runtime.device=cuda"], 2.0, 4, ({"num_cpus": 1.0, "num_gpus": 0.5}, {})),
    (["runtime.device=auto", "runtime.num_gpus=0.25", "runtime.num_cpus=2"], 1.0, 8,
     ({"num_cpus": 2.0, "num_gpus": 0.25}, {})),
    (["runtime.device=cuda", "runtime.server_device=cuda"], 1.0, 1,
     ({"num_cpus": 1.0, "num_gpus": 0.9}, {"num_gpus": 0.1})),
    (["runtime.device=auto"], 0.0, 2, ({"num_cpus": 1.0}, {})),  # no GPU: auto is cpu
])
def test_resources_map_to_ray_actor_options(tmp_path, over, gpus, workers, want):
    eng = Engine(point(tmp_path, *over), _GPUs(gpus), workers=workers)
    assert eng.actor_options() == want


def test_cuda_without_a_gpu_is_one_line(tmp_path):
    eng = Engine(point(tmp_path, "runtime.device=cuda"), _GPUs(0.0), workers=2)
    with pytest.raises(DeviceUnavailable, match="runtime.device: cuda, but workers get no GPU"):
        eng.actor_options()
    with pytest.raises(ScenarioError, match="runtime.num_gpus: device: cuda needs a GPU share"):
        point(tmp_path, "runtime.device=cuda", "runtime.num_gpus=0")
    with pytest.raises(ScenarioError, match="runtime.device: must be one of 'cpu', 'cuda' or "
                                            "'auto'"):
        point(tmp_path, "runtime.device=tpu")


def test_ray_workers_hold_the_resources_asked_for(tmp_path, shared_ray):
    eng = Engine(point(tmp_path, "runtime.num_cpus=0.5", "runtime.threads=2"), RayBackend(),
                 workers=2)
    try:
        eng.start()
        got = eng.backend.get([w.resources() for w in eng.pool.workers])
    finally:
        eng.backend.release(eng._handles)
    assert got == [{"device": "cpu", "threads": 2, "CPU": 0.5}] * 2


def test_sweep_tasks_take_the_points_resources(tmp_path):
    from simulator.run.executors import task_resources

    assert task_resources(point(tmp_path), 2.0, 4) == {"num_cpus": 1.0}
    assert task_resources(point(tmp_path, "runtime.device=auto"), 2.0, 4) == \
        {"num_cpus": 1.0, "num_gpus": 0.5}
    assert task_resources(point(tmp_path, "runtime.device=cuda", "runtime.num_gpus=0.25",
                                 "runtime.num_cpus=2"), 1.0, 8) == \
        {"num_cpus": 2.0, "num_gpus": 0.25}
