"""``data.load: auto`` (the default): the data set whole where its estimated size is within a
quarter of the memory available, a cohort at a time otherwise; an explicit ``all`` that
cannot fit, and an ``auto`` that needs a cohort the data cannot give, refused in one line.
The memory available is set through ``FEDRAY_MEMORY_AVAILABLE``; nothing here allocates
what it pretends to have."""

from __future__ import annotations

import re

import pytest

from fedray.cli import main
from simulator.config import ScenarioError
from simulator.config.data_load import COMFORT, MEMORY_ENV, available_memory, data_bytes
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine
from strategies.protocols import DatasetInfo
from tests.simulator.test_engine import point

POPULATION = """\
name: population
rounds: 2
data:
  dataset: {name: synthetic, alpha: 1.0, beta: 1.0, dimension: 10, max_samples: 120}
  partitioner: {name: natural}
model: {name: logreg}
clients: {total: 25, per_round: 8}
local: {steps: 3, batch_size: 8, lr: 0.05}
"""

POOLED = """\
name: pooled
rounds: 2
data:
  dataset: {name: gaussian-mixture, samples: 4000, dimension: 20}
model: {name: logreg}
clients: {total: 40, per_round: 8}
local: {steps: 3, batch_size: 8, lr: 0.05}
"""


def _estimate(sc) -> int:
    """The size validation estimates for ``sc``'s data held whole."""
    from simulator.registry import instantiate

    info = instantiate("datasets", sc.data.dataset).describe(sc.clients.total, sc.seeds[0],
                                                             sc.data.test_fraction)
    return data_bytes(info, sc.data.test_fraction)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:,.1f} MiB"


def test_the_estimate_is_each_sample_s_values_label_and_client_id():
    # 100 training samples of 64 uint8 pixels: the table holds 64 + 8 (label) + 4 (client)
    # bytes each; 25 held-out ones (a fifth of 125) 64 + 8
    info = DatasetInfo(100, (1, 8, 8), 10, value_bytes=1)
    assert data_bytes(info, 0.2) == 100 * 76 + 25 * 72
    info = DatasetInfo(1000, (60,), 10)  # float32 features
    assert data_bytes(info, 0.5) == 1000 * 252 + 1000 * 248


@pytest.mark.parametrize("given, got", [("1000", 1000), ("512MiB", 512 * 2**20),
                                        ("2.5 GiB", int(2.5 * 2**30)), ("3kib", 3072)])
def test_the_memory_to_assume_comes_from_the_environment(monkeypatch, given, got):
    monkeypatch.setenv(MEMORY_ENV, given)
    assert available_memory() == got


def test_a_bad_memory_setting_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(MEMORY_ENV, "lots")
    (tmp_path / "s.yaml").write_text(POOLED)
    assert main(["validate", str(tmp_path / "s.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [(f"fedray validate: {MEMORY_ENV}: the memory to assume, in bytes (or with "
                    "KiB, MiB, GiB, TiB), got 'lots'")]


def test_the_memory_read_here_is_this_machine_s(monkeypatch):
    monkeypatch.delenv(MEMORY_ENV, raising=False)
    have = available_memory()
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert have is not None and 0 < have <= total


@pytest.mark.parametrize("text, sets", [
    (POPULATION, ["clients.total=25"]),
    (POPULATION, ["clients.total=5000", "data.dataset.dimension=60"]),
    (POPULATION, ["clients.total=200000", "data.dataset.max_samples=60"]),
    (POPULATION.replace("{name: synthetic, alpha: 1.0, beta: 1.0, dimension: 10, "
                        "max_samples: 120}", "{name: linear_regression, samples: 40}")
     .replace("{name: logreg}", "{name: mlp, hidden: [8]}")
     .replace("name: population", "name: regression\ntask: {name: regression}"),
     ["clients.total=3000"]),
])
def test_auto_loads_whole_up_to_a_quarter_of_the_memory_and_a_cohort_past_it(
        monkeypatch, tmp_path, text, sets):
    """At the boundary, one byte either side: the population's own estimate decides."""
    monkeypatch.delenv(MEMORY_ENV, raising=False)
    size = _estimate(point(tmp_path, text, sets))
    monkeypatch.setenv(MEMORY_ENV, str(int(size / COMFORT)))
    whole = point(tmp_path, text, sets)
    assert whole.data.load == "all"
    assert whole.data.load_reason == (
        f"auto: the data set held whole is about {_gib(size)} "
        f"({whole.data.load_reason.split('(')[1].split(')')[0]}), within a quarter of the "
        f"{_gib(int(size / COMFORT))} available")
    monkeypatch.setenv(MEMORY_ENV, str(int(size / COMFORT) - 4))
    cohort = point(tmp_path, text, sets)
    assert cohort.data.load == "cohort"
    assert cohort.data.load_reason.startswith(f"auto: the data set held whole is about {_gib(size)}")
    assert cohort.data.load_reason.endswith("more than a quarter of the "
                                            f"{_gib(int(size / COMFORT) - 4)} available")


def test_auto_loads_the_quickstart_whole_on_this_machine(monkeypatch, tmp_path):
    from tests.simulator.test_engine import ROOT

    monkeypatch.delenv(MEMORY_ENV, raising=False)
    text = (ROOT / "scenarios" / "quickstart.yaml").read_text()
    sc = point(tmp_path, text)
    assert sc.data.load == "all"
    assert sc.data.load_reason.startswith("auto: the data set held whole is about 0.5 MiB "
                                          "(1,438 training samples of 64 values), within a "
                                          "quarter of the ")


@pytest.mark.parametrize("text, sets", [
    (POOLED, []),
    (POOLED, ["data.dataset.samples=2000000", "clients.total=100000"]),
    (POPULATION, ["data.partitioner.name=iid", "clients.total=3000"]),
    (POPULATION, ["data.partitioner.name=dirichlet", "clients.total=400"]),
])
def test_auto_refuses_data_too_large_that_cannot_be_read_a_cohort_at_a_time(
        monkeypatch, tmp_path, text, sets):
    monkeypatch.delenv(MEMORY_ENV, raising=False)
    size = _estimate(point(tmp_path, text, sets))
    for have, hint in [(size * 2, "set data.load: all to load it whole anyway, or "),
                       (size // 2, "")]:
        monkeypatch.setenv(MEMORY_ENV, str(have))
        with pytest.raises(ScenarioError) as e:
            point(tmp_path, text, sets)
        assert len(e.value.lines) == 1
        line = e.value.lines[0]
        assert re.search(rf"data\.load: auto: the data set held whole is about "
                         rf"{re.escape(_gib(size))} \(.* training samples of .* values\), more "
                         rf"than a quarter of the {re.escape(_gib(have))} available, and it "
                         r"cannot be read a cohort at a time \(data\.(load|partitioner): ",
                         line), line
        assert line.endswith(f"; {hint}use fewer clients or a smaller data set")
        # an explicit all: loaded whole where the data fits at all
        if have > size:
            assert point(tmp_path, text, [*sets, "data.load=all"]).data.load == "all"


@pytest.mark.parametrize("text, sets, way", [
    (POOLED, ["data.dataset.samples=50000"], "use fewer clients or a smaller data set"),
    (POPULATION, ["clients.total=40000"], ("use load: cohort (or auto, the default), which "
                                           "reads a cohort at a time")),
    (POPULATION, ["clients.total=2000", "data.partitioner.name=iid"],
     "use fewer clients or a smaller data set"),
])
def test_an_explicit_all_that_cannot_fit_is_refused_with_the_estimate(
        monkeypatch, tmp_path, capsys, text, sets, way):
    monkeypatch.delenv(MEMORY_ENV, raising=False)
    size = _estimate(point(tmp_path, text, sets))
    have = size - 1
    monkeypatch.setenv(MEMORY_ENV, str(have))
    with pytest.raises(ScenarioError) as e:
        point(tmp_path, text, [*sets, "data.load=all"])
    assert len(e.value.lines) == 1
    assert re.search(rf"data\.load: all: the data set held whole is about "
                     rf"{re.escape(_gib(size))} \([\d,]+ training samples of \d+ values\), "
                     rf"more than the {re.escape(_gib(have))} available here; "
                     rf"{re.escape(way)}$", e.value.lines[0]), e.value.lines[0]
    # the command: exit 2, one line, no store created
    (tmp_path / "s.yaml").write_text(text)
    args = [a for s in sets for a in ("--set", s)] + ["--set", "data.load=all"]
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(tmp_path / "s.yaml"), "--backend", "inline", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "more than the" in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "mlflow.db").exists()
    # with one byte more it fits: accepted
    monkeypatch.setenv(MEMORY_ENV, str(size))
    assert point(tmp_path, text, [*sets, "data.load=all"]).data.load == "all"


def test_a_million_client_population_runs_by_default_a_cohort_at_a_time(monkeypatch, tmp_path):
    """The default on the population that exhausts memory loaded whole (1 M FedProx
    Synthetic clients, 98 M training samples of 60 values: 28.7 GiB held whole) with
    16 GiB available: auto reads it a cohort at a time, and two rounds run."""
    monkeypatch.setenv(MEMORY_ENV, "16GiB")
    sets = ["clients.total=1000000", "clients.per_round=20", "data.dataset.dimension=60",
            "data.dataset.max_samples=200"]
    sc = point(tmp_path, POPULATION, sets)
    assert sc.data.load == "cohort"
    assert re.fullmatch(r"auto: the data set held whole is about 2\d\.\d GiB \(98,283,493 "
                        r"training samples of 60 values\), more than a quarter of the 16\.0 "
                        r"GiB available", sc.data.load_reason), sc.data.load_reason
    eng = Engine(sc, InlineBackend(), workers=1)
    res = eng.run()
    assert len(res.metrics) == 2
    assert 0 < res.final("test_accuracy") <= 1
    # loaded whole, it is refused before anything runs
    with pytest.raises(ScenarioError, match=r"data\.load: all: the data set held whole is "
                                            r"about 2\d\.\d GiB .* more than the 16\.0 GiB"):
        point(tmp_path, POPULATION, [*sets, "data.load=all"])


def test_show_and_the_run_say_what_auto_chose(monkeypatch, tmp_path, capsys, mlflow_uri):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv(MEMORY_ENV, raising=False)
    size = _estimate(point(tmp_path, POPULATION))
    monkeypatch.setenv(MEMORY_ENV, str(size * 2))  # more than a quarter: a cohort at a time
    p = tmp_path / "s.yaml"
    p.write_text(POPULATION)
    assert main(["show", str(p)]) == 0
    out = capsys.readouterr().out
    assert "\n  load: cohort\n" in out
    reason = (f"auto: the data set held whole is about {_gib(size)} (1,941 training samples "
              f"of 10 values), more than a quarter of the {_gib(size * 2)} available")
    assert f"\n# data.load: cohort, chosen by {reason}\n" in out
    # show loaded the data to estimate the run's work (runtime.backend: auto); the run, in a
    # process of its own, builds it again
    monkeypatch.setattr("simulator.sim.engine._data_cache", {})
    assert main(["run", str(p), "--backend", "inline", "--quiet", "-v",
                 "--tracking-uri", mlflow_uri]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err.count(f"fedray: data.load cohort ({reason})") == 1  # the debug line, once
    client = MlflowClient(mlflow_uri)
    exp = client.get_experiment_by_name("population")
    child = client.search_runs([exp.experiment_id], "tags.`fedray.kind` = 'point'")[0]
    assert child.data.params["data.load"] == "cohort"
    assert child.data.params["data.load_reason"] == reason
    # given, not chosen: no reason
    assert main(["show", str(p), "--set", "data.load=all"]) == 0
    out = capsys.readouterr().out
    assert "\n  load: all\n" in out and "chosen by" not in out


def test_the_conformance_checks_hold_value_bytes_to_what_load_gives():
    """A data set that understates (or overstates) its stored values' bytes sizes its data
    wrong for ``auto``: fedray.testing refuses it."""
    import dataclasses

    from fedray.testing import check_plugin
    from simulator.data.datasets import GaussianMixture
    from simulator.data.published import MNIST5k

    def lying(base: type, wrong: int) -> type:
        class Lying(base):  # type: ignore[valid-type, misc]
            def describe(self, *args):
                return dataclasses.replace(super().describe(*args), value_bytes=wrong)
        return Lying

    for base, wrong, dtype in [(MNIST5k, 4, "uint8"), (GaussianMixture, 1, "float32")]:
        with pytest.raises(AssertionError, match=rf"describe\(\)'s value_bytes {wrong}: the "
                                                 rf"samples are {dtype}"):
            check_plugin("datasets", lying(base, wrong))
        check_plugin("datasets", base)
