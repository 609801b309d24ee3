"""``runtime.backend: auto`` (``simulator.runtime.backend.choose_backend``, the work estimate
of ``simulator.sim.work``): Ray where a run needs it, else the backend estimated to finish
first; the numbers are the same either way."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from simulator.config.load import load
from simulator.config.schema import Runtime
from simulator.errors import UsageError
from simulator.metric_names import mlflow_name
from simulator.runtime import backend as backends
from simulator.runtime.backend import (
    RAY_ACTOR_SECONDS,
    RAY_INIT_SECONDS,
    RAY_ROUND_SECONDS,
    choose_backend,
)

ROOT = Path(__file__).resolve().parents[2]
QUICK = ROOT / "scenarios" / "quickstart.yaml"


@dataclass(frozen=True)
class Work:
    seconds: float
    rounds: int = 10

    def text(self) -> str:
        return f"{self.seconds:.1f} s"


def never() -> Work:
    raise AssertionError("the work was estimated")


def test_explicit_backends_are_kept_and_a_bad_name_is_one_line():
    assert choose_backend("ray", [Runtime()], estimate=never).name == "ray"
    assert choose_backend("inline", [Runtime(workers=4)], estimate=never).name == "inline"
    with pytest.raises(UsageError, match=r"^--address: only with --backend ray or auto$"):
        choose_backend("inline", [Runtime()], "127.0.0.1:6379", estimate=never)
    with pytest.raises(UsageError, match=r"^runtime.backend: must be one of 'auto', 'ray' or "
                                         r"'inline', got 'gpu'$"):
        choose_backend("gpu", [Runtime()], estimate=never)


@pytest.mark.parametrize("runtime,address,workers,why", [
    (Runtime(), "10.0.0.1:6379", None, "auto: --address 10.0.0.1:6379: a Ray cluster"),
    (Runtime(), None, 3, "auto: --workers 3: more ClientWorkers than one process trains at once"),
    (Runtime(workers=2), None, None, "auto: runtime.workers 2: more ClientWorkers"),
    (Runtime(num_gpus=0.5), None, None, "auto: runtime.num_gpus 0.5: GPU shares"),
])
def test_auto_takes_ray_where_the_run_needs_it_without_estimating(runtime, address, workers,
                                                                   why):
    choice = choose_backend("auto", [Runtime(), runtime], address, workers, 2, never)
    assert choice.name == "ray" and choice.reason.startswith(why)


def test_one_worker_at_a_time_is_inline_without_estimating():
    assert choose_backend("auto", [Runtime()], None, 1, 2, never) == backends.BackendChoice(
        "inline", "auto: --workers 1: one ClientWorker, which this process runs without "
                  "Ray's start")
    assert choose_backend("auto", [Runtime(workers=4)], None, 1, 2, never).name == "inline"
    assert choose_backend("auto", [Runtime(workers=1)], None, 2, 2, never).name == "ray"
    assert choose_backend("auto", [Runtime(workers=1)], cpus=2, estimate=never).reason == \
        "auto: runtime.workers 1: one ClientWorker, which this process runs without Ray's start"
    one_cpu = choose_backend("auto", [Runtime()], cpus=1, estimate=never)
    assert one_cpu == backends.BackendChoice(
        "inline", "auto: 1 CPU(s) for workers of 1: Ray's workers could not train at once")
    assert choose_backend("auto", [Runtime(num_cpus=2)], cpus=2, estimate=never).name == \
        "inline"


def test_auto_compares_the_work_inline_with_ray_start_and_its_share_of_it(monkeypatch):
    """Inline takes W; Ray its start S (a new local instance and 3 actors on 2 CPUs) plus
    W / 2 and its cost a round: the break-even is W = 2 (S + rounds x RAY_ROUND_SECONDS)."""
    monkeypatch.setattr(backends, "ray_running", lambda: False)
    start = RAY_INIT_SECONDS + RAY_ACTOR_SECONDS * 3 / 2
    even = 2 * (start + 10 * RAY_ROUND_SECONDS)
    below = choose_backend("auto", [Runtime()], cpus=2, estimate=lambda: Work(even - 0.1))
    above = choose_backend("auto", [Runtime()], cpus=2, estimate=lambda: Work(even + 0.1))
    assert (below.name, above.name) == ("inline", "ray")
    assert below.reason == (f"auto: the rounds' work is estimated at {even - 0.1:.1f} s; on "
                            f"Ray {start + (even - 0.1) / 2 + 10 * RAY_ROUND_SECONDS:.1f} s "
                            f"with its start ({start:.1f} s) and 2 workers")
    # connected to Ray already (a session's instance): only the actors' start is left
    monkeypatch.setattr(backends, "ray_running", lambda: True)
    joined = choose_backend("auto", [Runtime()], cpus=2, estimate=lambda: Work(even - 0.1))
    assert joined.name == "ray" and f"with its start ({start - RAY_INIT_SECONDS:.1f} s)" in \
        joined.reason


def test_the_estimate_counts_each_protocols_clients_and_the_evaluations():
    """The quickstart's 30 rounds: 10 sampled clients a round of 2 epochs of batch 16 over
    about 72 samples, the test and train-loss samples evaluated every round; gossip trains
    every peer, FedBuff a buffer a step; one probe serves the points that train alike (a
    sweep of seeds)."""
    from simulator.sim.work import estimate_work

    pts = load(QUICK, ["seeds=[0, 1]"]).points
    est = estimate_work([p.scenario for p in pts])
    one = estimate_work([pts[0].scenario])
    assert est.rounds == 60 and one.rounds == 30
    sizes = pts[0].scenario.clients.total
    assert one.steps == pytest.approx(30 * 10 * 2 * 5, rel=0.05)  # ceil(72 / 16) = 5 steps
    assert one.samples % 30 == 0 and one.samples > 30 * 300
    assert est.steps == pytest.approx(2 * one.steps, rel=0.05)
    assert one.step_seconds > 0 and one.sample_seconds > 0
    assert one.seconds == pytest.approx(one.steps * one.step_seconds +
                                        one.samples * one.sample_seconds)
    later = estimate_work([pts[0].scenario], done=[20])
    assert later.rounds == 10 and later.steps == pytest.approx(one.steps / 3, rel=0.05)
    ring = load(QUICK, ["topology={name: ring}", "clients.per_round=20"]).points[0]
    assert estimate_work([ring.scenario]).steps == pytest.approx(one.steps * sizes / 10,
                                                                rel=0.05)
    buffered = load(QUICK, ["server.mode=fedbuff", "asynchrony={buffer_size: 4}"]).points[0]
    assert estimate_work([buffered.scenario]).steps == pytest.approx(one.steps * 4 / 10,
                                                                    rel=0.05)


def _run(tmp_path: Path, uri: str, workers: int | None = None, address: str | None = None):
    from simulator.run.runner import run_loaded

    out = run_loaded(load(QUICK, ["rounds=3"]), tracking_uri=uri, quiet=True,
                     workers=workers, address=address)
    run = MlflowClient(uri).get_run(out.runs[0]["run_id"])
    history = MlflowClient(uri).get_metric_history(run.info.run_id,
                                                   mlflow_name("test_accuracy"))
    return run, [m.value for m in history]


def test_auto_runs_the_quickstart_inline_and_more_workers_on_ray_with_the_same_numbers(
        tmp_path, mlflow_uri, shared_ray, caplog):
    """The quickstart (runtime.backend: auto) is inline: its work is far below Ray's start;
    with two workers asked it is on Ray (here the session's instance, which a RayBackend
    joins), and both give the same numbers. The choice and why are a run param, a tag and
    a debug line."""
    import logging

    caplog.set_level(logging.DEBUG, logger="fedray")
    inline, acc = _run(tmp_path, mlflow_uri)
    assert inline.data.tags["backend"] == "inline"
    assert inline.data.params["runtime.backend"] == "auto"
    assert inline.data.params["backend.reason"].startswith(
        "auto: the rounds' work is estimated at ")
    assert any(r.getMessage().startswith("fedray: backend inline (auto: the rounds' work")
               for r in caplog.records)

    ray_run, ray_acc = _run(tmp_path, mlflow_uri, workers=2)
    assert ray_run.data.tags["backend"] == "ray"
    assert ray_run.data.params["backend.reason"] == (
        "auto: --workers 2: more ClientWorkers than one process trains at once")
    assert ray_acc == acc and len(acc) == 3


def test_auto_with_an_address_is_ray(tmp_path, mlflow_uri, shared_ray):
    """``--address`` means a cluster: Ray (here ``auto``: the session's instance)."""
    run, acc = _run(tmp_path, mlflow_uri, address="auto")
    assert run.data.tags["backend"] == "ray"
    assert run.data.params["backend.reason"] == "auto: --address auto: a Ray cluster"
    assert len(acc) == 3


def test_show_says_which_backend_a_run_takes_and_why(capsys):
    from fedray.cli import main

    assert main(["show", str(QUICK)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("# backend:"))
    assert line.startswith("# backend: inline (auto: the rounds' work is estimated at 3,0")
    assert line.endswith("; `fedray run` without --backend, --address or --workers)")
    assert main(["show", str(QUICK), "--set", "runtime.workers=2"]) == 0
    assert "# backend: ray (auto: runtime.workers 2: more ClientWorkers than one process " \
           "trains at once; `fedray run`" in capsys.readouterr().out


def test_show_fetches_nothing_to_estimate(tmp_path, capsys):
    """A data set fetched when the run starts (``download: true``): ``fedray show`` does not
    load it to estimate the work; auto is chosen when the run starts."""
    from fedray.cli import main

    p = tmp_path / "s.yaml"
    p.write_text(f"rounds: 2\ndata: {{dataset: {{name: mnist, root: {tmp_path / 'm'}, "
                 "download: true}}\nmodel: {name: logreg}\nclients: {total: 10}\n")
    (tmp_path / "m").mkdir()
    assert main(["show", str(p)]) == 0
    assert "# backend: auto (auto: chosen when the run starts, from the rounds' work " \
           "estimated on its data;" in capsys.readouterr().out
    assert list((tmp_path / "m").iterdir()) == []


def test_show_of_a_strict_run_probes_nothing_here(capsys):
    """``deterministic: strict`` points compute only in a process started pinned: ``fedray
    show`` (not restarted) leaves the estimate to the run, which is pinned by then."""
    from fedray.cli import main
    from simulator.pinning import environment_pinned

    assert not environment_pinned()
    assert main(["show", str(QUICK), "--set", "runtime.deterministic=strict"]) == 0
    assert "# backend: auto (auto: chosen when the run starts" in capsys.readouterr().out
