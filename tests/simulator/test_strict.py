"""``runtime.deterministic: strict`` (simulator.runtime.kernels, simulator.pinning): the
fedray command restarts itself in a process started with the pinned kernels' environment,
Ray actors and tasks start pinned, a process that chose its kernels is stopped in one line,
and a strict run's numbers do not move with what a machine's CPU offers.

One machine cannot be another, but it can hide what it has: MKL's instruction sets
(``MKL_ENABLE_INSTRUCTIONS``) and glibc's FMA/AVX2 variants of its maths
(``GLIBC_TUNABLES``) are not among the pinned variables, so a strict run under them must
give the same bits; ATen's AVX2 kernels on this AVX-512 machine move a run that is not
strict. The golden numbers below were computed on an AMD EPYC with AVX-512 (the machine of
the commit that added them): under ``strict`` any x86-64 machine must give them to the bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from fedray.cli import main
from simulator.config import ScenarioError
from simulator.config.load import load
from simulator.errors import UsageError
from simulator.pinning import PINNED_ENV, NeedsPinnedProcess, environment_pinned, strict_options
from simulator.run.resume import resume_run
from simulator.run.runner import run_loaded, run_sweep
from simulator.run.tuning import run_tune
from simulator.runtime.kernels import KernelsNotPinned, pin_kernels

SMALL = """\
name: strict
rounds: 4
data: {dataset: {name: digits}}
model: {name: cnn, channels: [8], hidden: 16}
clients: {total: 12, per_round: 6}
aggregator: {name: cwtm, f: 2}
local: {steps: 10, batch_size: 16, lr: 0.1}
"""
# eval/test_loss and eval/train_loss after the 4 rounds of SMALL under strict (a CNN: its
# convolutions through ATen and MKL; the trimmed mean's sort): module docstring
GOLDEN = (2.2577462269403146, 2.2550116881873246)
FEDRAY = [sys.executable, "-m", "fedray"]


def scenario(tmp_path: Path, deterministic: str = "strict") -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(SMALL + f"runtime: {{deterministic: {deterministic}}}\n")
    return p


def losses(uri: str) -> list[tuple[float, float]]:
    """(test loss, train loss) of every point run in the store, oldest first."""
    client = MlflowClient(uri)
    out = []
    for e in client.search_experiments():
        for r in client.search_runs([e.experiment_id], order_by=["attribute.start_time ASC"]):
            if r.data.tags.get("fedray.kind") == "point":
                m = r.data.metrics
                out.append((m["eval/test_loss"], m["eval/train_loss"]))
    return out


def fedray_run(tmp_path: Path, path: Path, *args: str, env: dict | None = None,
               store: str = "m.db") -> tuple[subprocess.CompletedProcess, str]:
    uri = f"sqlite:///{tmp_path / store}"
    env = {**{k: v for k, v in os.environ.items()  # a process that starts unpinned
              if k not in PINNED_ENV and k != "MLFLOW_TRACKING_URI"}, **(env or {})}
    done = subprocess.run([*FEDRAY, "run", str(path), "--tracking-uri", uri, "--quiet", *args],
                          capture_output=True, text=True, cwd=tmp_path, env=env, check=False)
    return done, uri


def test_the_command_restarts_pinned_and_gives_the_golden_numbers(tmp_path):
    done, uri = fedray_run(tmp_path, scenario(tmp_path), "--backend", "inline", "-v")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "deterministic: strict: restarting with ATEN_CPU_CAPABILITY=default" in done.stderr
    assert losses(uri) == [GOLDEN]


@pytest.mark.parametrize("hide", [
    {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2,-FMA,-AVX512F"},
    {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
], ids=["sse42-no-fma", "avx2"])
def test_a_strict_run_does_not_move_with_what_the_cpu_offers(tmp_path, hide):
    done, uri = fedray_run(tmp_path, scenario(tmp_path), "--backend", "inline", env=hide)
    assert done.returncode == 0, done.stderr[-2000:]
    assert losses(uri) == [GOLDEN]


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                    reason="ATen's AVX2 kernels are this machine's own without AVX-512")
def test_without_strict_the_kernels_the_cpu_offers_move_the_numbers(tmp_path):
    path = scenario(tmp_path, "false")
    found, uri1 = fedray_run(tmp_path, path, "--backend", "inline", store="a.db")
    avx2, uri2 = fedray_run(tmp_path, path, "--backend", "inline", store="b.db",
                            env={"ATEN_CPU_CAPABILITY": "avx2"})
    assert found.returncode == 0 and avx2.returncode == 0, found.stderr[-2000:] + avx2.stderr
    (a,), (b,) = losses(uri1), losses(uri2)
    assert a != b and a != GOLDEN
    assert abs(a[0] - b[0]) < 1e-4  # the last digits only


def test_ray_tasks_start_pinned_and_give_the_same_numbers(tmp_path, shared_ray, mlflow_uri):
    """A sweep's points are Ray tasks with the pinned environment (strict_options); this
    driver (pytest) is not pinned and computes nothing of them."""
    loaded = load(scenario(tmp_path), [])
    run_sweep(loaded, tracking_uri=mlflow_uri, ray_init={})
    assert losses(mlflow_uri) == [GOLDEN]


def test_an_unpinned_process_is_refused_before_anything_runs(tmp_path, mlflow_uri, capsys):
    assert not environment_pinned()  # pytest did not start pinned
    with pytest.raises(NeedsPinnedProcess, match="runtime.deterministic: strict"):
        run_loaded(load(scenario(tmp_path), []), "inline", None, mlflow_uri, quiet=True)
    assert losses(mlflow_uri) == []  # no run was created
    # main() called from Python does not restart its process: one line, exit 2
    rc = main(["run", str(scenario(tmp_path)), "--backend", "inline", "--tracking-uri",
               mlflow_uri, "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "MKL_CBWR=COMPATIBLE" in err[0]


def test_a_process_that_chose_its_kernels_cannot_pin_them():
    """This process imported numpy without NPY_DISABLE_CPU_FEATURES: its maths are chosen.
    The failed pin leaves the process as it was (a later strict run here is still refused,
    and a subprocess it starts does not inherit half a pin)."""
    before = dict(os.environ)
    with pytest.raises(KernelsNotPinned, match="chose its kernels"):
        pin_kernels()
    assert dict(os.environ) == before and torch.backends.mkldnn.enabled
    assert not environment_pinned()


def test_strict_is_for_fp32_on_the_cpu_and_the_union_is_one_line(tmp_path):
    for over, key in ((["runtime.device=auto"], "runtime.device"),
                      (["runtime.server_device=cuda"], "runtime.server_device"),
                      (["runtime.precision=bf16"], "runtime.precision")):
        with pytest.raises(ScenarioError) as e:
            load(scenario(tmp_path), over)
        assert len(e.value.lines) == 1 and f"{key}: deterministic: strict" in e.value.lines[0]
    with pytest.raises(ScenarioError) as e:
        load(scenario(tmp_path), ["runtime.deterministic=always"])
    assert [ln.split(": ", 1)[1] for ln in e.value.lines] == [
        "runtime.deterministic: must be true or false, or one of 'strict', got 'always'"]


def test_actors_of_a_strict_run_start_pinned():
    assert strict_options(False) == {}
    assert strict_options(True) == {"runtime_env": {"env_vars": dict(PINNED_ENV)}}
    assert set(PINNED_ENV) >= {"ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA"}


def test_strict_beside_other_values_in_one_process_is_refused(tmp_path, mlflow_uri):
    """Pinned kernels would compute a sweep's other points too (fedray run computes every
    point in its process): refused in one line, before anything runs; `fedray sweep` gives
    each point its own process."""
    loaded = load(scenario(tmp_path), ["sweep={runtime.deterministic: [false, strict]}"])
    with pytest.raises(UsageError, match="mixes strict with false in one process"):
        run_loaded(loaded, "inline", None, mlflow_uri, quiet=True)
    assert losses(mlflow_uri) == []


def test_a_search_over_strict_is_refused_beside_other_values(tmp_path, mlflow_uri):
    path = scenario(tmp_path, "false")
    path.write_text(path.read_text() + "tune: {metric: test_accuracy, mode: max, trials: 2, "
                    "space: {runtime.deterministic: {choice: [false, strict]}}}\n")
    with pytest.raises(UsageError, match="mixes strict with false"):
        run_tune(load(path, []), tracking_uri=mlflow_uri)


def test_resuming_a_strict_run_needs_a_pinned_process_before_anything_runs(tmp_path):
    done, uri = fedray_run(tmp_path, scenario(tmp_path), "--backend", "inline")
    assert done.returncode == 0, done.stderr[-2000:]
    client = MlflowClient(uri)
    (exp,) = [e for e in client.search_experiments() if e.name == "strict"]
    runs = client.search_runs([exp.experiment_id])
    point = next(r for r in runs if r.data.tags.get("fedray.kind") == "point")
    client.set_terminated(point.info.run_id, "FAILED")
    with pytest.raises(NeedsPinnedProcess, match=f"run {point.info.run_id} is runtime"):
        resume_run(point.info.run_id, uri)
    assert client.get_run(point.info.run_id).info.status == "FAILED"  # nothing ran again
    # the command restarts itself pinned and resumes it: the same numbers, FINISHED
    again = subprocess.run([*FEDRAY, "resume", point.info.run_id, "--tracking-uri", uri,
                            "--backend", "inline", "--quiet"], capture_output=True, text=True,
                           cwd=tmp_path, check=False,
                           env={k: v for k, v in os.environ.items() if k not in PINNED_ENV})
    assert again.returncode == 0, again.stderr[-2000:]
    assert client.get_run(point.info.run_id).info.status == "FINISHED"
    assert losses(uri) == [GOLDEN]
