"""fedray from Python (#48; fedray/api.py): load a scenario from a file, a mapping or text;
run it and read the runs back as DataFrames and a torch model; plugins defined in a script,
registered for the session, on the inline backend and on Ray from ``__main__``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import fedray
from simulator import registry
from simulator.registry import BadPlugin
from strategies.protocols import Aggregator, Traits

ROOT = Path(__file__).resolve().parents[1]

SMALL = {
    "name": "api",
    "rounds": 3,
    "data": {"dataset": {"name": "digits"}, "partitioner": {"name": "iid"}},
    "model": {"name": "logreg"},
    "clients": {"total": 6, "per_round": 3},
    "local": {"steps": 2, "batch_size": 16, "lr": 0.2},
    "runtime": {"backend": "inline"},
}


def test_load_takes_a_file_a_mapping_or_text_and_overrides_as_a_mapping():
    quick = fedray.load(ROOT / "scenarios" / "quickstart.yaml", {"rounds": 5})
    assert quick.scenario.rounds == 5 and quick.scenario.name == "quickstart"
    assert fedray.load(str(ROOT / "scenarios" / "quickstart.yaml")).scenario.rounds == 30
    sc = fedray.load(SMALL, {"aggregator.name": "median", "seeds": [0, 1]})
    assert sc.scenario.aggregator["name"] == "median" and len(sc.points) == 2
    text = "name: t\nrounds: 2\ndata: {dataset: {name: digits}}\nmodel: {name: logreg}\n" \
           "clients: {total: 4, per_round: 2}\n"
    assert fedray.load(text, ["rounds=4"]).scenario.rounds == 4
    assert fedray.load({k: v for k, v in SMALL.items() if k != "name"}, name="x").scenario.name \
        == "x"


def test_load_raises_one_exception_with_every_problem():
    with pytest.raises(fedray.ScenarioError) as e:
        fedray.load({**SMALL, "rounds": 0, "aggregator": {"name": "meen"}})
    lines = e.value.lines
    assert lines[0] == "<mapping>: rounds: must be > 0, got 0"
    assert lines[1].startswith("<mapping>: aggregator.name: unknown aggregator 'meen' (did you "
                               "mean 'mean'?)") and len(lines) == 2
    with pytest.raises(fedray.ScenarioError) as e:
        fedray.load("name: t\nrounds: 0\n")
    assert e.value.lines[0].startswith("<text>:2: rounds: must be > 0, got 0")


def test_run_gives_the_runs_final_metrics_curves_and_model(mlflow_uri):
    """The final test accuracy of the result object is the run's; the long table holds
    every round of it; the model, evaluated on the test samples here, gives that accuracy;
    results() reads the same runs back from MLflow."""
    from simulator.sim.engine import load_data

    res = fedray.run(SMALL, tracking_uri=mlflow_uri)
    assert len(res.runs) == 1 and res.runs[0].seed == 0 and res.runs[0].values == {}
    final = res.final()
    acc = float(final.loc[0, "test_accuracy"])
    assert 0.1 < acc <= 1.0  # 3 rounds of 2 steps: above chance (0.1)
    long = res.metrics()
    assert list(long.columns) == ["seed", "run_id", "round", "metric", "value"]
    curve = long[long["metric"] == "test_accuracy"]
    assert curve["round"].tolist() == [0, 1, 2] and curve["value"].iloc[-1] == acc
    model = res.model()
    data = load_data(fedray.load(SMALL).points[0].scenario)
    with torch.no_grad():
        x = torch.from_numpy(np.asarray(data.x_test, dtype=np.float32))
        hits = (model(x).argmax(dim=1).numpy() == data.y_test).mean()
    assert hits == pytest.approx(acc, abs=1e-12)
    again = fedray.results("api", mlflow_uri)
    assert again.run_ids == res.run_ids and again.parent_run_id == res.parent_run_id
    table = res.table(metrics=["test_accuracy:final", "train_loss:mean"])
    assert table.loc[0, "n"] == 1 and table.loc[0, "test_accuracy (final) mean"] == acc
    with pytest.raises(fedray.ScenarioError):
        fedray.run({**SMALL, "rounds": -1}, tracking_uri=mlflow_uri)


def test_a_sweeps_values_come_back_per_run(mlflow_uri):
    sweep = {**SMALL, "name": "api-sweep", "seeds": [0, 1],
             "sweep": {"aggregator": [{"name": "mean"}, {"name": "cwtm", "f": 1}],
                       "local.lr": [0.1]}}
    res = fedray.run(sweep, tracking_uri=mlflow_uri)
    got = [(r.values["aggregator"]["name"], r.values["local.lr"], r.seed) for r in res.runs]
    assert got == [("mean", 0.1, 0), ("mean", 0.1, 1), ("cwtm", 0.1, 0), ("cwtm", 0.1, 1)]
    assert res.runs[2].values["aggregator"] == {"name": "cwtm", "f": 1}
    long = res.metrics()
    assert list(long.columns[:2]) == ["aggregator", "local.lr"]
    assert set(long["seed"]) == {0, 1} and len(set(long["run_id"])) == 4
    table = res.table(by=["aggregator.name"])
    assert table["aggregator.name"].tolist() == ["mean", "cwtm"] and table["n"].tolist() == [2, 2]
    with pytest.raises(fedray.api.UsageError, match="4 runs; name one"):
        res.model()
    assert isinstance(res.model(3), torch.nn.Module)
    # the report's figures as matplotlib figures, and the report itself
    from matplotlib.figure import Figure

    figures = res.figures()
    titles = [f.axes[0].get_title() for f in figures]
    assert figures and all(isinstance(f, Figure) for f in figures)
    assert any("test accuracy" in t for t in titles), titles
    page = res.report(mlflow_uri.removeprefix("sqlite:///").rsplit("/", 1)[0] + "/report")
    assert page.name == "report.html" and "cwtm" in page.read_text()


class MyMean(Aggregator):
    """The mean, registered from a test: the same numbers as the built-in."""

    traits = Traits(averaging=True)

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        return x.mean(dim=0)


@pytest.fixture()
def my_mean():
    fedray.register("aggregators", "my_mean")(MyMean)
    yield "my_mean"
    registry.unregister("aggregators", "my_mean")


def test_a_registered_plugin_runs_as_an_installed_one(mlflow_uri, my_mean):
    assert "my_mean" in registry.available("aggregators")
    mine = fedray.run({**SMALL, "name": "mine", "aggregator": {"name": "my_mean"}},
                      tracking_uri=mlflow_uri).final()
    theirs = fedray.run({**SMALL, "name": "theirs"}, tracking_uri=mlflow_uri).final()
    assert mine.loc[0, "test_accuracy"] == theirs.loc[0, "test_accuracy"]
    with pytest.raises(fedray.ScenarioError, match="unknown key for aggregator 'my_mean'"):
        fedray.load({**SMALL, "aggregator": {"name": "my_mean", "f": 1}})


def test_registering_a_class_that_breaks_its_contract_is_one_line():
    class NotARule:
        pass

    with pytest.raises(BadPlugin, match=r"aggregator 'bad' \(.*NotARule, registered in this "
                       r"session\) does not subclass strategies.protocols.Aggregator"):
        fedray.register("aggregators", "bad")(NotARule)
    with pytest.raises(BadPlugin, match="'mean' is an installed plugin"):
        fedray.register("aggregators", "mean")(MyMean)
    with pytest.raises(ValueError, match="unknown plugin kind 'aggregator'"):
        fedray.register("aggregator", "x")(MyMean)
    assert "bad" not in registry.available("aggregators")


SCRIPT = '''\
import sys

import torch

import fedray
from strategies.protocols import Aggregator, Traits


@fedray.register("aggregators")
class HalfMean(Aggregator):
    """Half the mean: a rule only this script knows."""

    traits = Traits(averaging=True)

    def __call__(self, x, generator=None):
        return 0.5 * x.mean(dim=0)


scenario = {
    "name": "script", "rounds": 3,
    "data": {"dataset": {"name": "digits"}, "partitioner": {"name": "iid"}},
    "model": {"name": "logreg"}, "clients": {"total": 6, "per_round": 3},
    "local": {"steps": 2, "batch_size": 16, "lr": 0.2},
    "aggregator": {"name": "half_mean"},
}
if sys.argv[2] == "tune":  # the rule reaches Ray Tune's trial processes too
    search = fedray.tune({**scenario, "name": "tuned", "tune": {
        "space": {"local.lr": {"choice": [0.2]}}, "trials": 1, "scheduler": "none",
        "parallel": 1, "metric": "test_accuracy:final"}}, tracking_uri=sys.argv[1])
    inline = fedray.run({**scenario, "name": "inline"}, backend="inline",
                        tracking_uri=sys.argv[1])
    print(search.table().loc[0, "score"], inline.final().loc[0, "test_accuracy"])
    sys.exit(0)
address = None
if sys.argv[2] == "cluster":  # a head without CPUs and two worker nodes of one CPU each
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 200 * 1024**2, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1, object_store_memory=200 * 1024**2)
    cluster.wait_for_nodes()
    address = cluster.address
ray = fedray.run(scenario, backend="ray", workers=2, address=address, tracking_uri=sys.argv[1])
inline = fedray.run({**scenario, "name": "inline"}, backend="inline", tracking_uri=sys.argv[1])
print(ray.final().loc[0, "test_accuracy"], inline.final().loc[0, "test_accuracy"])
if address is not None:
    cluster.shutdown()
'''


@pytest.mark.parametrize("where", ["local", "tune",
                                   pytest.param("cluster", marks=pytest.mark.cluster)])
def test_a_plugin_defined_in_a_script_runs_on_ray(tmp_path, _mlflow_template, where):
    """A class of ``__main__`` reaches Ray's worker and server processes with the run's plan:
    the run on Ray (2 workers; on a cluster of two worker nodes, one ClientWorker on each)
    gives the inline run's numbers; a ``fedray.tune`` trial (its own Ray Tune process) scores
    the inline run's final accuracy."""
    import shutil

    db = tmp_path / "mlflow.db"
    shutil.copy(_mlflow_template, db)
    script = tmp_path / "mine.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, str(script), f"sqlite:///{db}", where], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    on_ray, inline = map(float, done.stdout.split()[-2:])
    assert on_ray == inline and 0.0 < on_ray <= 1.0


def test_tune_returns_each_searchs_best_and_its_trials_runs(mlflow_uri, shared_ray):
    """fedray.tune: two trials of local.lr, two rounds each; the best trial's point runs as
    Results, its lr the one the search reports."""
    scenario = {**SMALL, "name": "api-tune", "rounds": 2,
                "tune": {"space": {"local.lr": {"choice": [0.05, 0.4]}}, "trials": 2,
                         "scheduler": "none", "parallel": 1, "metric": "test_accuracy:final"}}
    search = fedray.tune(scenario, tracking_uri=mlflow_uri)
    table = search.table()
    assert list(table.columns) == ["search", "score", "local.lr", "trials", "run_id"]
    assert table.loc[0, "trials"] == 2 and table.loc[0, "local.lr"] in (0.05, 0.4)
    best = search.trial()
    assert len(best.runs) == 1
    final = best.final()
    assert final.loc[0, "test_accuracy"] == pytest.approx(table.loc[0, "score"], abs=1e-12)
    with pytest.raises(fedray.api.UsageError, match="no tune block"):
        fedray.tune(SMALL, tracking_uri=mlflow_uri)


def test_importing_the_package_loads_no_api_until_a_name_is_used():
    """Every ``fedray`` command imports the package (the warm pool's client first, which
    otherwise imports only the standard library): the API's names load on first use."""
    code = ("import sys, fedray.launch, fedray\n"
            "print('fedray.api' in sys.modules, 'pydantic' in sys.modules)\n"
            "fedray.run\n"
            "print('fedray.api' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    assert out == ["False", "False", "True"]
