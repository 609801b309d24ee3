"""Populations read a cohort at a time (``data.load: cohort``): the same samples as the
in-memory path, memory that grows with the cohort and not with the population."""

from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import simulator.data as fdata
from simulator.config import ScenarioError
from simulator.data.datasets import ParquetDataset, Synthetic
from simulator.errors import DataError
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine
from tests.simulator.test_engine import point

GENERATED = """\
name: population
rounds: 3
data:
  dataset: {name: synthetic, alpha: 1.0, beta: 1.0, dimension: 10, max_samples: 120}
  partitioner: {name: natural}
model: {name: logreg}
clients: {total: 25, per_round: 8}
local: {steps: 3, batch_size: 8, lr: 0.05}
"""


def _same_rows(a: fdata.FederatedData, b: fdata.FederatedData, clients: list[int]) -> None:
    for (xa, ya), (xb, yb) in zip(a.source.train(clients), b.source.train(clients), strict=True):
        assert len(ya) > 0
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)


@pytest.mark.parametrize("dataset", [
    {"name": "synthetic", "alpha": 0.5, "beta": 0.5, "dimension": 7, "max_samples": 80},
    {"name": "linear_regression", "dimension": 5, "samples": 30},
])
def test_a_generated_cohort_holds_the_samples_the_whole_load_gives(dataset):
    natural = {"name": "natural"}
    whole = fdata.build(dataset, natural, 40, seed=3, test_fraction=0.25)
    cohort = fdata.build(dataset, natural, 40, seed=3, test_fraction=0.25, load="cohort")
    assert isinstance(whole.source, fdata.TableSource)
    np.testing.assert_array_equal(whole.client_sizes(), cohort.client_sizes())
    _same_rows(whole, cohort, [0, 7, 39, 7])
    # 40 clients: every client evaluates, the same test samples in the same order
    np.testing.assert_array_equal(whole.x_test, cohort.x_test)
    np.testing.assert_array_equal(whole.c_test, cohort.c_test)
    # another seed, other samples; a client's samples do not depend on the population
    other = fdata.build(dataset, natural, 40, seed=4, test_fraction=0.25, load="cohort")
    assert not np.array_equal(other.source.train([5])[0][0][:3], cohort.source.train([5])[0][0][:3])
    more = fdata.build(dataset, natural, 400, seed=3, test_fraction=0.25, load="cohort")
    if dataset["name"] == "linear_regression":  # equal sizes: the same client, the same rows
        _same_rows(more, cohort, [5, 39])


def test_synthetic_clients_are_heterogeneous_with_the_authors_counts():
    pop = Synthetic(alpha=1.0, beta=1.0).population(200, seed=0, test_fraction=0.2)
    counts = Synthetic(alpha=1.0, beta=1.0)._counts(0, 200)
    assert counts.min() >= 50 and counts.max() <= 1000
    np.testing.assert_array_equal(pop.sizes, counts - np.round(counts * 0.2).astype(np.int64))
    (x0, y0), (x1, y1) = pop.train([0, 1])
    assert x0.shape == (pop.sizes[0], 60) and x0.dtype == np.float32
    # each client has its own model and inputs: their class histograms and means differ
    assert abs(float(x0.mean()) - float(x1.mean())) > 0.05
    assert not np.array_equal(np.bincount(y0, minlength=10), np.bincount(y1, minlength=10))


def test_a_run_reads_the_same_numbers_a_cohort_at_a_time(tmp_path):
    whole = Engine(point(tmp_path, GENERATED), InlineBackend(), workers=2).run()
    cohort = Engine(point(tmp_path, GENERATED, ["data.load=cohort"]), InlineBackend(),
                    workers=2).run()
    assert whole.metrics == cohort.metrics  # 25 clients: every one evaluates in both
    np.testing.assert_array_equal(whole.final_params, cohort.final_params)
    assert 0.0 < cohort.final("train_loss") < whole.metrics[0]["train_loss"] * 1.5


def _client_parquet(tmp_path, rng, clients: int = 12):
    """A Parquet directory partitioned by client (three files, ids in blocks, rows of a
    client spread over row groups) and a test file with the client column."""
    root = tmp_path / "train"
    root.mkdir()
    ids = rng.permutation(1000)[:clients] * 7 + 3  # sparse, unsorted client ids
    rows = []
    for block in range(3):
        mine = ids[block::3]
        n = 40 * len(mine)
        owner = rng.choice(mine, n)
        t = pa.table({"pixels": pa.FixedSizeListArray.from_arrays(
                          pa.array(rng.integers(0, 256, n * 4).astype(np.uint8)), 4),
                      "label": rng.integers(0, 3, n), "user": owner})
        pq.write_table(t, root / f"part-{block}.parquet", row_group_size=16)
        rows.append(t)
    m = 60
    pq.write_table(pa.table({"pixels": pa.FixedSizeListArray.from_arrays(
                                 pa.array(rng.integers(0, 256, m * 4).astype(np.uint8)), 4),
                             "label": rng.integers(0, 3, m), "user": rng.choice(ids, m)}),
                   tmp_path / "test.parquet")
    return root, pa.concat_tables(rows)


def test_a_client_partitioned_parquet_directory_is_read_per_cohort(tmp_path):
    root, whole_table = _client_parquet(tmp_path, np.random.default_rng(0))
    spec = {"name": "parquet", "path": str(root), "test_path": str(tmp_path / "test.parquet"),
            "client": "user", "label": "label", "shape": [1, 2, 2]}
    whole = fdata.build(spec, {"name": "natural"}, 12, seed=0, test_fraction=0.2)
    cohort = fdata.build(spec, {"name": "natural"}, 12, seed=0, test_fraction=0.2, load="cohort")
    np.testing.assert_array_equal(whole.client_sizes(), cohort.client_sizes())
    assert cohort.client_sizes().sum() == whole_table.num_rows
    _same_rows(whole, cohort, [11, 0, 4, 5])
    (x, y), = cohort.source.train([2])
    assert x.dtype == np.uint8 and x.shape[1:] == (1, 2, 2)  # pixels stay uint8
    # client 2 is the third smallest id; its rows in file order
    key = np.unique(whole_table.column("user").to_numpy())[2]
    mine = whole_table.filter(pa.compute.equal(whole_table.column("user"), key))
    np.testing.assert_array_equal(y, mine.column("label").to_numpy())
    # every client's held-out rows are the test file's rows of its id
    assert sum(len(t[1]) for t in cohort.source.test(list(range(12)))) == 60
    assert len(pickle.dumps(cohort.source)) < 10_000  # the paths and the ids, no samples


def test_a_parquet_cohort_needs_its_client_column_in_a_test_file(tmp_path):
    root, _ = _client_parquet(tmp_path, np.random.default_rng(1))
    with pytest.raises(DataError, match="^test_path: data.load cohort needs a test file"):
        ParquetDataset(str(root), client="user").population(12, 0, 0.2)
    with pytest.raises(DataError, match="^client: data.load cohort reads the file's clients"):
        ParquetDataset(str(root), test_path=str(tmp_path / "test.parquet")).population(12, 0, 0.2)
    with pytest.raises(DataError, match="must equal the dataset's 12 natural clients"):
        ParquetDataset(str(root), client="user",
                       test_path=str(tmp_path / "test.parquet")).population(13, 0, 0.2)


def test_a_scenario_refuses_a_cohort_the_data_cannot_give(tmp_path):
    pq.write_table(pa.table({"a": [0.0, 1, 2, 3], "label": [0, 1, 0, 1], "user": [0, 0, 1, 1]}),
                   tmp_path / "d.parquet")
    text = GENERATED.replace("{name: synthetic, alpha: 1.0, beta: 1.0, dimension: 10, "
                             "max_samples: 120}", "{name: parquet, path: d.parquet, client: user}")
    with pytest.raises(ScenarioError) as e:
        point(tmp_path, text, ["data.load=cohort", "clients.total=2", "clients.per_round=2"])
    assert len(e.value.lines) == 1
    assert e.value.lines[0].endswith("data.dataset.test_path: data.load cohort needs a test "
                                     "file with the client column 'user' (each client's "
                                     "held-out rows)")


def test_a_million_client_population_holds_the_cohort_not_the_population(tmp_path):
    """1,000,000 generated clients (93 M samples, 3.7 GB in memory as float32): what a
    run holds of the data is the clients' sample counts, the evaluation clients' samples and
    one call's cohort."""
    sc = point(tmp_path, GENERATED, ["clients.total=1000000", "clients.per_round=50",
                                     "data.load=cohort", "rounds=2"])
    eng = Engine(sc, InlineBackend(), workers=1)
    data = eng.data
    population = int(Synthetic(dimension=10, max_samples=120)._counts(0, 1_000_000).sum())
    assert population > 90_000_000
    held = (len(pickle.dumps(data.source)) + data.x_test.nbytes + data.x_train_eval.nbytes)
    assert held < 30e6  # two int64 counts per client (16 MB) and 20,000 samples
    assert held < population * 10 * 4 / 200  # against the samples as float32
    assert len(data.y_test) <= fdata.TEST_MAX and len(data.y_train_eval) <= fdata.TRAIN_EVAL_MAX
    assert len(np.unique(data.c_test)) > 500  # held-out samples of ~1,000 clients
    res = eng.run()
    assert len(res.metrics) == 2 and np.isfinite(res.final("train_loss"))
    worker = eng.pool.workers[0].actor
    assert worker.cohort == {}  # each client's samples dropped once trained


def test_leaf_json_converted_once_trains_on_the_same_numbers(tmp_path):
    from simulator.data.convert import convert
    from tests.formats import write_leaf

    write_leaf(tmp_path / "leaf", writers=6, per_writer=16, files=2)
    femnist = {"name": "femnist", "root": str(tmp_path / "leaf"), "min_samples": 1}
    out = convert(femnist, {"name": "natural"}, 6, seed=0, test_fraction=0.2,
                  out=tmp_path / "parquet")
    assert (out.clients, out.train_samples, out.test_samples) == (6, 72, 24)
    assert pq.ParquetFile(out.train).schema_arrow.field("x").type == pa.binary(784)
    text = f"""\
name: femnist
rounds: 2
data:
  dataset: {{name: femnist, root: {tmp_path / "leaf"}}}
  partitioner: {{name: natural}}
model: {{name: logreg}}
clients: {{total: 6, per_round: 3}}
local: {{steps: 2, batch_size: 4, lr: 0.1}}
"""
    leaf = Engine(point(tmp_path, text), InlineBackend()).run()
    parquet = text.replace(f"{{name: femnist, root: {tmp_path / 'leaf'}}}",
                           f"{{name: parquet, path: {out.train}, test_path: {out.test}, "
                           "client: client, features: [x], shape: [1, 28, 28], classes: 62}")
    assert out.block().splitlines()[1].startswith(f'  dataset: {{name: parquet, path: "{out.train}"')
    # the same training, bit for bit; the evaluation sums the same samples in client order
    # (LEAF's pooled order is file by file), equal to float rounding
    for run in (Engine(point(tmp_path, parquet), InlineBackend()).run(),
                Engine(point(tmp_path, parquet, ["data.load=cohort"]), InlineBackend()).run()):
        np.testing.assert_array_equal(run.final_params, leaf.final_params)
        for mine, theirs in zip(run.metrics, leaf.metrics, strict=True):
            assert mine == pytest.approx(theirs, rel=1e-9, abs=1e-12)
    with pytest.raises(DataError, match="^data.partitioner: convert writes the data set's own"):
        convert(femnist, {"name": "iid"}, 6, 0, 0.2, tmp_path / "x")
    with pytest.raises(DataError, match="^data.dataset: linear_regression has real-valued"):
        convert({"name": "linear_regression"}, {"name": "natural"}, 6, 0, 0.2, tmp_path / "x")


@pytest.mark.parametrize("name", ["synthetic", "linear_regression"])
def test_a_whole_population_loads_chunk_by_chunk_into_the_table_the_split_gives(name, monkeypatch):
    """``data.load: all`` writes a population's clients straight into the table's buffers,
    CHUNK clients at a time; the result is the partition table of the gathered split."""
    from simulator.data.partitioners import Natural
    from simulator.registry import instantiate

    monkeypatch.setattr(fdata, "CHUNK", 7)  # several chunks, the last one short
    spec = {"name": name}
    data = fdata.build(spec, {"name": "natural"}, 30, seed=5, test_fraction=0.3)
    split = instantiate("datasets", spec).load(30, 5, 0.3)
    parts = Natural()(split.y_train, 30, np.random.default_rng(0), split.clients_train)
    table, offsets = fdata.partition_table(split.x_train, split.y_train, parts)
    assert data.source.table.equals(table)
    np.testing.assert_array_equal(data.source.offsets, offsets)
    np.testing.assert_array_equal(data.x_test, split.x_test)
    np.testing.assert_array_equal(data.y_test, split.y_test)
    np.testing.assert_array_equal(data.c_test, split.clients_test)
    pick = np.sort(np.random.default_rng([5, 0xE7]).permutation(len(split.y_train))[:10_000])
    np.testing.assert_array_equal(data.x_train_eval, split.x_train[pick])
    assert data.x_train_eval.dtype == split.x_train.dtype


def test_fedray_data_convert_prints_the_block_that_reads_the_files_back(tmp_path, capsys):
    from fedray.cli import main
    from tests.formats import write_leaf

    write_leaf(tmp_path / "leaf", writers=5, per_writer=12, files=1)
    tmp_path = tmp_path / "a folder: {with} spaces"  # the printed block quotes its paths
    tmp_path.mkdir()
    (tmp_path.parent / "leaf").rename(tmp_path / "leaf")
    scenario = tmp_path / "femnist.yaml"
    scenario.write_text("name: femnist\nrounds: 2\ndata:\n  dataset: {name: femnist, root: leaf}\n"
                        "  partitioner: {name: natural}\nmodel: {name: logreg}\n"
                        "clients: {total: 5, per_round: 2}\n")
    assert main(["data", "convert", str(scenario), str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("5 clients, 45 training and 15 test samples: ")
    block = "\n".join(out[1:])
    assert block.startswith('data:\n  dataset: {name: parquet, path: "') and "classes: 62" in block
    converted = tmp_path / "converted.yaml"
    converted.write_text("name: femnist\nrounds: 2\n" + block +
                         "\nmodel: {name: logreg}\nclients: {total: 5, per_round: 2}\n")
    sc = point(tmp_path, converted.read_text())
    assert sc.data.load == "cohort" and Engine(sc, InlineBackend()).run().final("train_loss") > 0
    # a folder that holds files is refused in one line; so is a partition of other clients
    assert main(["data", "convert", str(scenario), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().endswith("is not empty; give a new or empty folder")
    assert main(["data", "convert", str(scenario), str(tmp_path / "iid"), "--set",
                 "data.partitioner={name: iid}"]) == 2
    assert "convert writes the data set's own clients" in capsys.readouterr().err
