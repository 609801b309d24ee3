"""A file or folder a run still needs, removed while it goes on (simulator/run/removed.py):
the working directory, a data file, the tracking store's folder. Each is reported as that, in
one line with the runs it left and what to do, never as what its absence broke ("tracking
store ... cannot be opened ... pass --tracking-uri", a user's mistake, a traceback)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fedray.cli import main
from simulator.config import Scenario
from simulator.config.load import load
from simulator.errors import DataError, Removed, WorkerLost
from simulator.run import callbacks, tracking
from simulator.run.removed import Needs

SESSION = "session_2026-12-04_10-35-12_345678_12345"  # the shape of a Ray session's folder

SCENARIO = """\
name: removed
rounds: {rounds}
data:
  dataset: {{name: parquet, path: {data}/train.parquet, test_path: {data}/test.parquet,
             client: client}}
  partitioner: {{name: natural}}
  load: {load}
model: {{name: logreg}}
clients: {{total: 6, per_round: 3}}
aggregator: {{name: mean}}
local: {{steps: 2, batch_size: 16, lr: 0.1}}
runtime: {{backend: inline}}
"""


def _parquet(path: Path, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    x = rng.normal(size=(n, 4)) + y[:, None]
    cols = {f"x{i}": x[:, i].astype("float32") for i in range(4)}
    cols |= {"label": y.astype("int64"), "client": np.sort(rng.integers(0, 6, n))}
    pq.write_table(pa.table(cols), path)


@pytest.fixture()
def setup(tmp_path, _mlflow_template, monkeypatch):
    """(a scenario writer, its data folder, the store's URI, the working directory): the
    data in its own folder, the store in another, the command run from a third."""
    data, store, cwd = tmp_path / "data", tmp_path / "store", tmp_path / "cwd"
    for d in (data, store, cwd):
        d.mkdir()
    _parquet(data / "train.parquet", 300, 0)
    _parquet(data / "test.parquet", 100, 1)
    shutil.copy(_mlflow_template, store / "mlflow.db")
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    def scenario(rounds: int = 3, load: str = "all") -> str:
        path = tmp_path / "s.yaml"
        path.write_text(SCENARIO.format(rounds=rounds, data=data, load=load))
        return str(path)

    return scenario, data, f"sqlite:///{store / 'mlflow.db'}", cwd


def _remove(path: Path) -> None:
    """Away at once, whatever writes into it (a rename: a folder being written to can make
    rmtree fail), as a cleaner or Ray's agent would leave it: not there. The working
    directory is removed (renamed, the process would be in it still, under its new name)."""
    if path == Path.cwd():
        shutil.rmtree(path)
    else:
        os.rename(path, path.with_name(path.name + ".removed"))


def _after_round(monkeypatch, when, path: Path) -> list[int]:
    """``path`` removed after the first round for which ``when(run, round)`` holds."""
    done: list[int] = []
    on_round = callbacks.Progress.on_round

    def hook(self, run, round_, metrics):
        if not done and when(run, round_):
            _remove(path)
            done.append(round_)
        on_round(self, run, round_, metrics)

    monkeypatch.setattr(callbacks.Progress, "on_round", hook)
    return done


def _ours(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("fedray run:")]


def test_a_working_directory_removed_while_the_store_opens_is_said_so(setup, monkeypatch,
                                                                       capsys):
    """The tester's case: MLflow's FileNotFoundError (its Path.cwd()) was "tracking store ...
    cannot be opened ... pass --tracking-uri", with --tracking-uri passed."""
    scenario, _, uri, cwd = setup
    real = tracking._open_store

    def open_store(u):
        _remove(cwd)
        return real(u)

    monkeypatch.setattr(tracking, "_open_store", open_store)
    code = main(["run", scenario(), "--tracking-uri", uri])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert _ours(err) == [(
        f"fedray run: the working directory {cwd} was removed while the run went on; what the "
        "run kept there (.fedray/checkpoints/, .fedray/pending/) went with it; run fedray from a "
        "folder that lasts")], err
    assert "cannot be opened" not in err and "pass --tracking-uri" not in err


def test_a_ray_jobs_working_directory_removed_names_the_temp_dir(tmp_path, monkeypatch):
    """A `ray job submit --working-dir` folder: the line says why Ray removes it."""
    job = tmp_path / "raytmp" / SESSION / "runtime_resources" / "working_dir_files" / "_ray_pkg_1"
    job.mkdir(parents=True)
    monkeypatch.chdir(job)
    needs = Needs("sqlite:////srv/mlflow.db")
    job.rmdir()
    e = needs.explain(FileNotFoundError(2, "No such file or directory"))
    assert isinstance(e, Removed) and e.what == Removed.WORKING_DIRECTORY
    assert str(e).startswith(f"the working directory {job} was removed while the run went on (a "
                             "`ray job submit --working-dir` folder, in Ray's temporary folder "
                             f"{tmp_path / 'raytmp' / SESSION}: Ray removes it with the job, and "
                             "so does a second Ray node on this machine started without its own "
                             "--temp-dir; docs/cluster.md)")


@pytest.mark.parametrize("load_how", ["all", "cohort"])
def test_a_data_file_removed_before_it_is_read_is_said_so(setup, monkeypatch, capsys,
                                                          load_how):
    """Removed between the scenario's checks and its load: the guard's "no such file" was
    the user's mistake (exit 2); removed while the rounds read it a cohort at a time, a
    pyarrow traceback."""
    scenario, data, uri, _ = setup
    if load_how == "all":
        from simulator.sim import engine

        real = engine.prefetch_data

        def prefetch(sc):
            _remove(data / "train.parquet")
            return real(sc)

        monkeypatch.setattr(engine, "prefetch_data", prefetch)
    else:
        _after_round(monkeypatch, lambda run, r: r == 0, data / "train.parquet")
    code = main(["run", scenario(load=load_how), "--tracking-uri", uri])
    err = capsys.readouterr().err
    lines = _ours(err)
    assert code == 1 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(
        f"fedray run: data.dataset.path: {data / 'train.parquet'} was removed while the run "
        "went on (it was there when the scenario was checked); put it back; seed=0 (")
    assert "marked FAILED" in lines[0] and "; continue with `fedray resume " in lines[0]


def test_the_stores_folder_removed_before_the_runs_open_is_said_so(setup, monkeypatch, capsys):
    """SQLite's "disk I/O error" (and MLflow's logged traceback) while the parent run opened."""
    scenario, _, uri, _ = setup
    store = Path(uri.removeprefix("sqlite:///")).parent
    real = tracking._open_store

    def open_store(u):
        real(u)
        _remove(store)

    monkeypatch.setattr(tracking, "_open_store", open_store)
    code = main(["run", scenario(), "--tracking-uri", uri])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert _ours(err) == [(
        f"fedray run: the tracking store {store / 'mlflow.db'} was removed while the run went "
        f"on (its folder {store} is gone), and the runs it held with it; run again with "
        "--tracking-uri a store in a folder that lasts (or put the store back, then `fedray "
        "sync`)")], err


def test_the_stores_folder_removed_under_open_runs_is_survived_and_said_so(setup, monkeypatch,
                                                                           capsys, caplog):
    """The runs go on (their rounds journaled), and neither the warning nor the journal's
    note calls it an outage that `fedray sync` will mend by itself."""
    scenario, _, uri, cwd = setup
    store = Path(uri.removeprefix("sqlite:///")).parent
    done = _after_round(monkeypatch, lambda run, r: run.is_open(), store)
    code = main(["run", scenario(rounds=200), "--tracking-uri", uri, "--quiet"])
    err = capsys.readouterr().err + "\n".join(r.getMessage() for r in caplog.records)
    assert done and done[0] < 199, "the runs did not open before the last round"
    assert code == 0 and "Traceback" not in err, err
    gone = (f"the tracking store {store / 'mlflow.db'} was removed while the run went on (its "
            f"folder {store} is gone)")
    assert f"fedray: {gone}; what the run logs is kept in {cwd / '.fedray' / 'pending'} (put "\
           "the store back, then `fedray sync`)" in err
    assert "MLflow log_batch failed" not in err
    notes = [line for line in err.splitlines() if line.startswith("fedray: run ")]
    assert len(notes) == 2 and all(line.endswith(
        f"its tracking store {store / 'mlflow.db'} was removed while it ran: put it back, then "
        "`fedray sync`") for line in notes), err


def test_only_file_system_errors_are_explained_and_only_while_something_is_gone(tmp_path,
                                                                                monkeypatch):
    """Unit: a trace file and an edge list are needed like a data file; an error that is
    not the file system's (a bug, a lost worker, an interrupt) keeps its own report."""
    trace, edges = tmp_path / "trace.json", tmp_path / "edges.txt"
    trace.write_text("{}")
    edges.write_text("0 1\n")
    monkeypatch.chdir(tmp_path)
    sc = load(str(Path(__file__).parents[2] / "scenarios" / "quickstart.yaml")).scenario
    sc = Scenario.model_validate(sc.model_dump(mode="json") | {"speeds": {"trace": str(trace)}})
    needs = Needs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    needs.add(sc)
    assert needs.paths == {trace: "speeds.trace"}
    needs.paths[edges] = "topology.params.path"
    lost = FileNotFoundError(2, "No such file or directory", str(trace))
    assert needs.explain(lost) is None  # nothing is gone: a bug's error stays itself
    trace.unlink()
    for error in (lost, DataError("x"), OSError("disk I/O"), RuntimeError("x")):
        wrapped = RuntimeError("wrapped")
        wrapped.__cause__ = error
        found = needs.explain(wrapped)
        if isinstance(error, RuntimeError):
            assert found is None
        else:
            assert isinstance(found, Removed) and found.what == "speeds.trace"
            assert str(found).startswith(f"speeds.trace: {trace} was removed while the run")
    for error in (KeyError("x"), WorkerLost("ActorDiedError"), KeyboardInterrupt()):
        assert needs.explain(error) is None
    trace.write_text("{}")
    edges.unlink()
    assert needs.explain(lost).what == "topology.params.path"
