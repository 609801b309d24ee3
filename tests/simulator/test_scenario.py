from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from simulator import scenario
from simulator.scenario import ScenarioError, load

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
def test_shipped_scenarios_are_valid(path: Path):
    loaded = load(path)
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

    m = scenario.plugin_params_model(CoordinateWiseTrimmedMean)
    assert list(m.model_fields) == ["f"]
    with pytest.raises(ValidationError):
        m.model_validate({"f": -1})


def test_json_schema_lists_top_level_fields():
    schema = scenario.json_schema()
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
