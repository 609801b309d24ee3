from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from simulator import registry
from simulator.config import ScenarioError
from simulator.config.load import json_schema, load

ROOT = Path(__file__).resolve().parents[2]
INVALID = sorted((ROOT / "tests" / "scenarios" / "invalid").glob("*.yaml"))
SHIPPED = sorted((ROOT / "scenarios").glob("*.yaml"))

BASE = """\
name: t
rounds: 3
data:
  dataset: {name: digits}
model: {name: logreg}
clients: {total: 10, per_round: 8}
"""


def test_at_least_ten_invalid_files_ship():
    assert len(INVALID) >= 10


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_file_gives_its_one_line_error(path: Path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: ")
    expected = f"{path}:" + first[len("# expect: "):].replace("{dir}", str(path.parent))
    with pytest.raises(ScenarioError) as e:
        load(path)
    assert e.value.lines == [expected]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_scenarios_are_valid(path: Path, tmp_path):
    """Every shipped scenario validates; one that reads a data set from files is validated
    against small files in that data set's real format (the full-size command is in its
    header)."""
    import yaml

    from tests import formats

    name = yaml.safe_load(path.read_text())["data"]["dataset"]["name"]
    overrides = []
    total = yaml.safe_load(path.read_text())["clients"]["total"]
    if name == "femnist":  # as many writers as the scenario's clients
        formats.write_leaf(tmp_path, writers=total, per_writer=32, files=3)
        overrides = [f"data.dataset.root={tmp_path}"]
    elif name == "shakespeare":  # as many roles as the scenario's clients
        formats.write_shakespeare(tmp_path, roles=total, per_role=60)
        overrides = [f"data.dataset.root={tmp_path}"]
    elif name == "cifar10":  # enough images for every client of a Dirichlet split
        formats.write_cifar10(tmp_path, per_batch=4 * total)
        overrides = [f"data.dataset.root={tmp_path}"]
    elif name in formats.WRITERS:
        formats.WRITERS[name](tmp_path)
        overrides = [f"data.dataset.{formats.FOLDER_KEY.get(name, 'root')}={tmp_path}"]
    loaded = load(path, overrides)
    assert loaded.points


def test_defaults_are_filled_in_resolved_plugins(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(BASE + "aggregator: {name: cwtm}\n")
    sc = load(p).scenario
    assert sc.aggregator == {"name": "cwtm", "f": 0}
    assert sc.server.optimizer == {"name": "sgd", "lr": 1.0, "momentum": 0.0}
    assert sc.data.partitioner == {"name": "iid"}
    assert sc.model == {"name": "logreg"}
    assert sc.clients.sampled == 8


def test_every_error_is_reported_not_just_the_first(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(BASE.replace("rounds: 3", "rounds: -1") + "aggregatr: {}\nlocal: {lr: 0}\n")
    with pytest.raises(ScenarioError) as e:
        load(p)
    text = "\n".join(e.value.lines)
    assert f"{p}:2: rounds: must be > 0, got -1" in e.value.lines
    assert "aggregatr: unknown key; did you mean 'aggregator'?" in text
    assert "local.lr: must be > 0.0, got 0" in text
    assert len(e.value.lines) == 3


def test_sweep_grid_times_seeds(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(BASE + "seeds: [0, 1, 2]\nsweep:\n  aggregator.name: [mean, median]\n"
                 "  local.lr: [0.1, 0.2]\n")
    loaded = load(p)
    assert len(loaded.points) == 2 * 2 * 3
    labels = [pt.label for pt in loaded.points]
    assert labels[0] == "mean lr=0.1 seed=0"
    assert labels[-1] == "median lr=0.2 seed=2"
    assert len(set(labels)) == 12
    pt = loaded.points[5]
    assert pt.scenario.seeds == [pt.seed] and pt.scenario.sweep == {}
    assert pt.scenario.aggregator["name"] == pt.values["aggregator.name"]
    assert loaded.scenario.sweep == {"aggregator.name": ["mean", "median"], "local.lr": [0.1, 0.2]}


def test_sweep_into_plugin_params(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(BASE + "aggregator: {name: cwtm}\nsweep:\n  aggregator.f: [1, 2, 3]\n")
    fs = [pt.scenario.aggregator["f"] for pt in load(p).points]
    assert fs == [1, 2, 3]


def test_sweep_with_a_problem_at_every_point_reports_it_once(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(BASE.replace("per_round: 8", "per_round: 11") + "sweep:\n  local.lr: [0.1, 0.2]\n")
    with pytest.raises(ScenarioError) as e:
        load(p)
    assert e.value.lines == [f"{p}:6: clients.per_round: must be <= clients.total (10), got 11"]


def test_set_overrides_by_dotted_path(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(BASE)
    sc = load(p, ["rounds=50", "aggregator={name: cwtm, f: 2}", "local.lr=0.5"]).scenario
    assert sc.rounds == 50 and sc.aggregator == {"name": "cwtm", "f": 2} and sc.local.lr == 0.5
    with pytest.raises(ScenarioError, match="clients.per_round: must be <= clients.total"):
        load(p, ["clients.per_round=20"])


def test_name_defaults_to_file_stem(tmp_path):
    p = tmp_path / "my-study.yaml"
    p.write_text(BASE.replace("name: t\n", ""))
    assert load(p).scenario.name == "my-study"


def test_yaml_cannot_construct_python_objects(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(BASE + "description: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load(p)


def test_plugin_params_model_from_signature():
    from strategies.aggregators import CoordinateWiseTrimmedMean

    m = registry.params_model(CoordinateWiseTrimmedMean)
    assert list(m.model_fields) == ["f"]
    with pytest.raises(ValidationError):
        m.model_validate({"f": -1})


def test_json_schema_lists_top_level_fields():
    schema = json_schema()
    for key in ("rounds", "data", "clients", "aggregator", "sweep", "seeds"):
        assert key in schema["properties"]


B_HAT = """\
name: t
rounds: 3
data:
  dataset: {name: digits}
model: {name: logreg}
clients: {total: 30, per_round: 20, byzantine: 6, b_hat: {rule: hypergeometric, level: 0.05}}
attack: {name: sign_flip}
preaggregators: [{name: nnm}]
aggregator: {name: cwtm}
"""


def test_b_hat_rule_sets_f_of_every_trimming_rule(tmp_path):
    from strategies.subsampling import b_hat

    p = tmp_path / "s.yaml"
    p.write_text(B_HAT)
    sc = load(p).scenario
    expect = b_hat(30, 6, 20, "hypergeometric", 0.05)
    assert expect == 6
    assert sc.clients.b_hat.value == expect
    assert sc.aggregator == {"name": "cwtm", "f": expect}
    assert sc.preaggregators == [{"name": "nnm", "f": expect}]
    kl = load(p, ["clients.b_hat.rule=kl"]).scenario
    assert kl.aggregator["f"] == kl.clients.b_hat.value == 6  # capped by f: B <= f always
    kl16 = load(p, ["clients.b_hat.rule=kl", "clients.per_round=16"]).scenario
    exact16 = load(p, ["clients.per_round=16"]).scenario
    assert (exact16.aggregator["f"], kl16.aggregator["f"]) == (5, 6)


def test_b_hat_errors_name_the_field(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(B_HAT)
    with pytest.raises(ScenarioError) as e:
        load(p, ["aggregator={name: cwtm, f: 2}"])
    assert e.value.lines == [f"{p}:9: aggregator.f: set by clients.b_hat (= 6); remove it, got 2"]
    with pytest.raises(ScenarioError) as e:
        load(p, ["clients.per_round=6"])
    assert len(e.value.lines) == 1
    assert e.value.lines[0].startswith(f"{p}:6: clients.b_hat.level: no b_hat < s/2 = 3 has")
    clamped = load(p, ["clients.per_round=6", "clients.b_hat.clamp=true"]).scenario
    assert clamped.aggregator["f"] == 2  # ceil(6/2) - 1
    with pytest.raises(ScenarioError) as e:
        load(p, ["clients.b_hat={rule: fixed}"])
    assert e.value.lines == [f"{p}:6: clients.b_hat.value: required with rule 'fixed'"]
    fixed = load(p, ["clients.b_hat={rule: fixed, value: 3}"]).scenario
    assert fixed.aggregator["f"] == 3 and fixed.preaggregators[0]["f"] == 3


def test_zipped_sweep_keys_vary_together(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(BASE + "sweep:\n  'local.steps, local.lr': [[1, 0.4], [4, 0.1]]\n"
                 "  aggregator.name: [mean, median]\n")
    points = load(p).points
    assert [(pt.scenario.local.steps, pt.scenario.local.lr, pt.scenario.aggregator["name"])
            for pt in points] == [(1, 0.4, "mean"), (1, 0.4, "median"), (4, 0.1, "mean"),
                                  (4, 0.1, "median")]
    assert points[2].label == "steps=4 lr=0.1 mean seed=0"
    p.write_text(BASE + "sweep:\n  'local.steps, local.lr': [[1, 0.4], [4]]\n")
    with pytest.raises(ScenarioError) as e:
        load(p)
    assert e.value.lines == [(f"{p}:8: sweep.local.steps, local.lr: zips 2 paths: each value "
                              "must be a list of 2 values, one per path, got [4]")]


# ----------------------------------------------------------------------------- bad input


def test_inf_is_kept_where_it_means_something_and_survives_json(tmp_path):
    """``.inf`` is refused where the maths needs a finite number and kept where it means
    "no threshold" (clipping c, centered clipping's tau): it reaches the plugin unchanged
    (it used to turn into null on its way through JSON)."""
    import json

    from simulator.run.tracking import flatten
    from simulator.runtime.backend import InlineBackend
    from simulator.sim.engine import Engine

    p = tmp_path / "s.yaml"
    p.write_text(BASE + "preaggregators: [{name: clipping, c: .inf}]\naggregator: {name: cc, tau: .inf}\n")
    sc = load(p).points[0].scenario
    assert sc.preaggregators[0]["c"] == float("inf") and sc.aggregator["tau"] == float("inf")
    dumped = sc.model_dump(mode="json")
    assert dumped["preaggregators"][0]["c"] == float("inf")
    assert json.loads(json.dumps(dumped))["aggregator"]["tau"] == float("inf")
    assert flatten(dumped)["preaggregators"] == '[{"name": "clipping", "c": Infinity}]'
    # no clipping at all: the run is the plain mean's (cc with tau = inf moves to the mean)
    plain = tmp_path / "plain.yaml"
    plain.write_text(BASE)
    a = Engine(sc.model_copy(update={"rounds": 2}), InlineBackend()).run()
    b = Engine(load(plain).points[0].scenario.model_copy(update={"rounds": 2}),
                    InlineBackend()).run()
    assert [m["test_accuracy"] for m in a.metrics] == pytest.approx(
        [m["test_accuracy"] for m in b.metrics], abs=1e-6)


def test_messages_bound_every_value_they_print(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(BASE + "aggregator: " + str(list(range(20000))) + "\n")
    with pytest.raises(ScenarioError) as e:
        load(p)
    (line,) = e.value.lines
    assert "aggregator: must be a mapping with a 'name', got [0, 1, 2, 3, 4, 5, ...]" in line
    assert len(line) < 300


def test_edge_list_errors_never_echo_the_file(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("db_password hunter2 extra words\n")
    p = tmp_path / "s.yaml"
    p.write_text(BASE.replace("clients: {total: 10, per_round: 8}", "clients: {total: 6}")
                 + f"topology: {{name: edge_list, path: {secret}}}\n")
    with pytest.raises(ScenarioError) as e:
        load(p)
    (line,) = e.value.lines
    assert "secret.txt:1: expected 'i j' or 'i j weight', got 4 fields" in line
    assert "hunter2" not in line and "db_password" not in line


def test_a_sweep_too_large_is_refused_before_expansion(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(BASE + "sweep:\n  local.lr: " + str([0.1] * 200) + "\n  rounds: "
                 + str(list(range(1, 201))) + "\n")
    with pytest.raises(ScenarioError, match="sweep: 40,000 points; at most 10,000"):
        load(p)


def _parquet_scenario(tmp_path, table) -> Path:
    import pyarrow.parquet as pq

    pq.write_table(table, tmp_path / "d.parquet")
    p = tmp_path / "s.yaml"
    p.write_text("rounds: 2\ndata:\n  dataset: {name: parquet, path: d.parquet}\n"
                 "model: {name: logreg}\nclients: {total: 2}\n")
    return p


@pytest.mark.parametrize("case,expected", [
    ("not_parquet", "data.dataset.path: not a Parquet file"),
    ("no_label", "data.dataset.label: column 'label' not in"),
    ("negative_label", "data.dataset.label: column 'label' holds -1"),
    ("float_label", "data.dataset.label: column 'label' must hold integers, got double"),
    ("nan_feature", "data.dataset.features: "),
    ("one_class", "data.dataset: the labels name 1 class"),
], ids=lambda v: v if " " not in v else "")
def test_parquet_problems_are_found_before_anything_runs(tmp_path, case, expected):
    import numpy as np
    import pyarrow as pa

    x = np.arange(6.0)
    table = {
        "no_label": pa.table({"a": x, "y": [0, 1, 0, 1, 0, 1]}),
        "negative_label": pa.table({"a": x, "label": [0, 1, -1, 1, 0, 1]}),
        "float_label": pa.table({"a": x, "label": [0.0, 1, 0, 1, 0, 1]}),
        "nan_feature": pa.table({"a": [0.0, np.nan, 2, 3, 4, 5], "label": [0, 1, 0, 1, 0, 1]}),
        "one_class": pa.table({"a": x, "label": [0] * 6}),
    }.get(case, pa.table({"a": x, "label": [0, 1, 0, 1, 0, 1]}))
    p = _parquet_scenario(tmp_path, table)
    if case == "not_parquet":
        (tmp_path / "d.parquet").write_text("a,label\n1,0\n")
    with pytest.raises(ScenarioError) as e:
        load(p)
    assert len(e.value.lines) == 1 and expected in e.value.lines[0], e.value.lines


def test_parquet_list_feature_width_and_classes_are_read_without_loading(tmp_path):
    import numpy as np
    import pyarrow as pa

    from simulator.data.datasets import ParquetDataset

    feats = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(24, dtype=np.float32)), 4)
    p = _parquet_scenario(tmp_path, pa.table({"x": feats, "label": [0, 3, 1, 2, 0, 1]}))
    info = ParquetDataset(str(tmp_path / "d.parquet")).describe(2, 0, 0.5)
    assert (info.train_samples, info.input_shape, info.num_classes) == (3, (4,), 4)
    assert load(p).points


def test_a_model_too_large_for_this_machine_is_refused(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(BASE.replace("model: {name: logreg}",
                              "model: {name: mlp, hidden: [200000, 200000, 200000]}"))
    with pytest.raises(ScenarioError) as e:
        load(p)
    (line,) = e.value.lines
    assert "model: mlp has 80,015,400,010 parameters" in line and "GiB available here" in line


def test_a_model_that_cannot_be_built_on_meta_tensors_is_checked_on_the_cpu(tmp_path,
                                                                           monkeypatch):
    """The shape check builds a model of up to 1 GiB on the CPU, as the run does (the meta
    device is for larger ones): a constructor that needs real tensors (numpy in __init__)
    is not refused."""
    from simulator import registry
    from simulator.models import MLP

    class NumpyInit(MLP):
        def __init__(self, input_shape, num_classes, hidden: list[int] = [8]):  # noqa: B006
            super().__init__(input_shape, num_classes, hidden)
            self.first_row = self.net[1].weight.detach().numpy()[0].copy()  # fails on meta

    real = registry.get
    monkeypatch.setattr(registry, "get", lambda kind, name: NumpyInit
                        if (kind, name) == ("models", "mlp") else real(kind, name))
    p = tmp_path / "s.yaml"
    p.write_text(BASE.replace("model: {name: logreg}", "model: {name: mlp}"))
    assert load(p).scenario.model == {"name": "mlp", "hidden": [8]}
    p.write_text(BASE.replace("model: {name: logreg}", "model: {name: mlp}").replace(
        "dataset: {name: digits}", "dataset: {name: gaussian-mixture, dimension: 3}"))
    assert load(p).points  # (3,) inputs: fine for an MLP
