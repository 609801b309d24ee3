"""Bounded work at validation: a trace file's entries capped (a JSON trace parsed entry by
entry, so memory follows the entries read, never the whole file first), and a sweep's
distinct points validated once, each with the shared work (the model's forward pass, the
plugins' key models, the schema's path keys) done once for all of them."""

from __future__ import annotations

import json
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from simulator import registry
from simulator.config import sweep as sweep_module
from simulator.config import validate as validate_module
from simulator.config.load import load
from simulator.sim import speeds
from simulator.sim.speeds import TraceError, read_trace

ENTRY = {"computation": 1.5, "communication": 300.0}


def _capacity(n: int) -> dict[str, dict]:
    return {str(i): {**ENTRY, "computation": 1.0 + i % 5} for i in range(n)}


@pytest.mark.parametrize("cap", [1, 7, 50])
@pytest.mark.parametrize("fmt", ["json", "json-indented", "pickle", "parquet"])
def test_a_trace_of_more_entries_than_the_cap_is_refused(tmp_path, monkeypatch, cap, fmt):
    monkeypatch.setattr(speeds, "MAX_TRACE_ENTRIES", cap)
    for n, refused in ((cap, False), (cap + 1, True), (3 * cap + 2, True)):
        data = _capacity(n)
        path = tmp_path / f"t{n}.{'parquet' if fmt == 'parquet' else fmt.split('-')[0]}"
        if fmt == "parquet":
            pq.write_table(pa.table({"client": list(range(n)),
                                     "computation": [e["computation"] for e in data.values()],
                                     "communication": [300.0] * n}), path)
        elif fmt == "pickle":
            path.write_bytes(pickle.dumps(data))
        else:
            path.write_text(json.dumps(data, indent=2 if fmt == "json-indented" else None))
        if not refused:
            assert len(read_trace(path)) == n
            continue
        with pytest.raises(TraceError) as e:
            read_trace(path)
        # JSON stops reading at the first entry past the cap: it cannot say how many more
        held = "more than the" if fmt.startswith("json") else f"{n:,} entries, more than the"
        assert str(e.value) == (f"{path} holds {held} {cap:,} entries a trace may hold "
                                "(client c follows entry c mod the entries: a longer trace "
                                "describes no more clients)")


VALID_JSON = [
    '{"0": {"computation": 1, "communication": 2}}',
    (' \n{ "a\\u00e9" : {"computation": 1e3, "communication": 2.5} ,\n "b\\"q" : '
    '{"computation": 0.5, "communication": 1, "extra": [1, {"x": null}]} }\n '),
    ('{"1": {"computation": 1, "communication": 2}, "2": {"computation": 3, '
    '"communication": 4, "nested": {"deep": [[], {}, "}"]}}}'),
]


@pytest.mark.parametrize("text", VALID_JSON)
def test_the_entry_by_entry_parse_reads_what_json_reads(tmp_path, text):
    path = tmp_path / "t.json"
    path.write_text(text)
    assert read_trace(path) == json.loads(text)


@pytest.mark.parametrize(("text", "why"), [
    ('{"a": 1,}', "expected a key (text) at character 8"),
    ('{"a": 1 "b": 2}', "expected ',' at character 8"),
    ('{"a": 1}{}', "extra data after character 7"),
    ('{1: 2}', "expected a key (text) at character 1"),
    ('{"a" 1}', "expected ':' at character 5"),
    ('{"a": }', "Expecting value"),
])
def test_malformed_json_traces_are_one_line(tmp_path, text, why):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(TraceError) as e:
        read_trace(path)
    assert str(e.value).startswith(f"{path} is not JSON this reader accepts (")
    assert why in str(e.value)


def test_a_repeated_top_level_key_is_refused(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"3": {"computation": 1, "communication": 2}, "3": {}}')
    with pytest.raises(TraceError, match="the key '3' appears twice in one object"):
        read_trace(path)


def _sweep(tmp_path, lrs: list[float], per_round: list[int], seeds: int = 1) -> str:
    path = tmp_path / "sweep.yaml"
    path.write_text(f"""\
name: big
rounds: 2
seeds: {list(range(seeds))}
data: {{dataset: {{name: digits}}}}
model: {{name: logreg}}
clients: {{total: 20}}
sweep:
  local.lr: {lrs}
  clients.per_round: {per_round}
""")
    return str(path)


@pytest.mark.parametrize(("lrs", "per_round", "seeds", "distinct"), [
    ([0.1, 0.2, 0.3], [1, 2], 1, 6),
    ([0.1, 0.1, 0.2], [5, 5, 5], 2, 2),  # repeated values: equal points
    ([0.5] * 4, [3, 4], 3, 2),
])
def test_each_distinct_sweep_point_is_validated_once(tmp_path, monkeypatch, lrs, per_round,
                                                     seeds, distinct):
    calls: list[dict] = []
    real = validate_module.validate_point

    def counted(raw):
        calls.append(raw)
        return real(raw)

    monkeypatch.setattr(sweep_module, "validate_point", counted)
    loaded = load(_sweep(tmp_path, lrs, per_round, seeds))
    assert len(calls) == distinct
    assert len(loaded.points) == len(lrs) * len(per_round) * seeds
    assert sorted({(p.scenario.local.lr, p.scenario.clients.per_round, p.seed)
                   for p in loaded.points}) == sorted(
        {(lr, k, s) for lr in lrs for k in per_round for s in range(seeds)})


def test_shared_work_is_done_once_for_the_points_of_a_sweep(tmp_path, monkeypatch):
    """The model is built and run once for 60 points, each plugin's key model built once."""
    from simulator import models

    builds = []
    real_build = models.build_model
    monkeypatch.setattr(models, "build_model", lambda *a, **k: builds.append(a) or
                        real_build(*a, **k))
    from simulator.config import checks

    checks._forward_once.cache_clear()
    registry._params_model.cache_clear()
    made = []
    real_create = registry.create_model
    monkeypatch.setattr(registry, "create_model", lambda *a, **k: made.append(a[0]) or
                        real_create(*a, **k))
    loaded = load(_sweep(tmp_path, [0.01 * i for i in range(1, 13)], [1, 2, 3, 4, 5]))
    assert len(loaded.points) == 60
    assert len(builds) == 1
    assert len(made) == len(set(made))  # one key model per plugin class


def test_a_parquet_block_is_checked_once_while_its_files_stay(tmp_path, monkeypatch):
    """A sweep's points share the Parquet check; a file rewritten since is checked again."""
    import numpy as np

    from simulator.data import datasets

    folder = tmp_path / "parts"
    folder.mkdir()
    for i in range(3):
        pq.write_table(pa.table({"x": np.zeros(20, np.float32), "label": np.arange(20) % 2}),
                       folder / f"p{i}.parquet")
    checked = []
    real = datasets.ParquetDataset._check_files
    monkeypatch.setattr(datasets.ParquetDataset, "_check_files",
                        lambda self: checked.append(1) or real(self))
    path = tmp_path / "s.yaml"
    path.write_text(f"""\
rounds: 1
data: {{dataset: {{name: parquet, path: '{folder}'}}}}
model: {{name: logreg}}
clients: {{total: 4}}
sweep: {{local.lr: [0.1, 0.2, 0.3, 0.4, 0.5]}}
""")
    assert len(load(path).points) == 5
    assert len(checked) == 1
    pq.write_table(pa.table({"x": np.zeros(20, np.float64), "label": np.arange(20) % 2}),
                   folder / "p2.parquet")
    from simulator.config import ScenarioError

    with pytest.raises(ScenarioError, match="p2.parquet holds column 'x' as double"):
        load(path)
