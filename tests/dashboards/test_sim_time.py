"""Simulated time in the dashboards (#30, "time in the results"): ``fedray table``'s
``time_toX`` (the run's ``sim_time`` at the first step where a metric reaches X, matched by
step, never by position), its cells (a seed that never reaches X is counted, never averaged
in), and the report's accuracy against simulated time. Hand-made MLflow histories (written
through MlflowClient, some out of step order, some evaluated every other step) with
hand-computed answers, and one small run with speeds end to end."""

from __future__ import annotations

import math
import re
import shutil
import statistics

import pytest
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from dashboards.cells import reach_cell
from dashboards.tables import collect_rows, paired_difference, table
from fedray.cli import main
from simulator.metric_names import mlflow_name
from simulator.run.reductions import parse_metrics, time_to
from tests.conftest import own_lines

ACC, LOSS = "test_accuracy", "test_loss"
# server.mode -> seed -> metric -> [(step, value)], in the order they are logged
RUNS: dict[str, dict[str, dict[str, list[tuple[int, float]]]]] = {
    "fedasync": {
        # reaches 0.9 at step 3 of 5 (6.25 s), its loss 0.5 at step 3 too; logged out of order
        "0": {"sim_time": [(1, 3.0), (3, 6.25), (0, 1.5), (4, 8.0), (2, 4.5)],
              ACC: [(4, 0.95), (2, 0.7), (0, 0.2), (3, 0.92), (1, 0.5)],
              LOSS: [(4, 0.3), (2, 0.6), (0, 2.0), (3, 0.45), (1, 1.0)]},
        # never reaches 0.9 nor 0.5
        "1": {"sim_time": [(0, 1.0), (1, 2.0), (2, 3.0), (3, 4.0), (4, 5.0)],
              ACC: [(0, 0.1), (1, 0.3), (2, 0.5), (3, 0.6), (4, 0.7)],
              LOSS: [(0, 2.0), (1, 1.5), (2, 1.2), (3, 1.0), (4, 0.9)]},
        # 0.91 at step 2 (4.0 s), then below, then above: the first step counts; loss at step 1
        "2": {"sim_time": [(0, 0.5), (1, 1.0), (2, 4.0), (3, 4.5), (4, 5.5)],
              ACC: [(0, 0.3), (1, 0.6), (2, 0.91), (3, 0.8), (4, 0.95)],
              LOSS: [(0, 1.0), (1, 0.45), (2, 0.4), (3, 0.5), (4, 0.2)]},
    },
    "fedbuff": {  # evaluated every other step, the clock logged every step
        "0": {"sim_time": [(0, 1.0), (1, 2.0), (2, 5.0), (3, 6.0), (4, 7.0)],
              ACC: [(0, 0.4), (2, 0.93), (4, 0.97)], LOSS: [(0, 0.9), (2, 0.5), (4, 0.3)]},
        "1": {"sim_time": [(0, 1.0), (1, 2.0), (2, 3.0), (3, 4.0), (4, 7.0)],
              ACC: [(0, 0.2), (2, 0.6), (4, 0.9)], LOSS: [(0, 1.2), (2, 0.8), (4, 0.6)]},
        "2": {"sim_time": [(0, 0.5), (1, 1.0), (2, 3.0), (3, 4.0), (4, 5.0)],
              ACC: [(0, 0.5), (2, 0.95), (4, 0.96)], LOSS: [(0, 0.6), (2, 0.45), (4, 0.2)]},
    },
    "sync": {s: {"sim_time": [(i, 2.0 * (i + 1)) for i in range(5)],
                 ACC: list(enumerate([0.2, 0.4, 0.6, 0.8, 0.85])),
                 LOSS: list(enumerate([2.0, 1.5, 1.0, 0.8, 0.6]))} for s in "012"},
}


def write_runs(uri: str, experiment: str,
               runs: dict[str, dict[str, dict[str, list[tuple[int, float]]]]]) -> str:
    """A scenario run of ``experiment`` with a FINISHED child per (server.mode, seed), each
    metric entry logged on its own in the order given (timestamps in that order); the
    parent's id."""
    client = MlflowClient(uri)
    exp = client.create_experiment(experiment)
    t0 = 1_700_000_000_000
    parent = client.create_run(exp, start_time=t0, tags={"fedray.kind": "scenario"},
                               run_name=experiment).info.run_id
    i = 0
    for mode, seeds in runs.items():
        for seed, metrics in seeds.items():
            i += 1
            run = client.create_run(exp, start_time=t0 + i, run_name=f"{mode} seed={seed}",
                                    tags={"fedray.kind": "point", "mlflow.parentRunId": parent,
                                          "seed": seed}).info.run_id
            client.log_batch(run, params=[Param("server.mode", mode), Param("seed", seed)])
            ts = t0
            for key, entries in metrics.items():
                for step, value in entries:
                    ts += 1
                    client.log_batch(run, metrics=[Metric(mlflow_name(key), value, ts, step)])
            client.set_terminated(run, "FINISHED")
    client.set_terminated(parent, "FINISHED")
    return parent


@pytest.fixture(scope="module")
def store(tmp_path_factory, _mlflow_template):
    tmp = tmp_path_factory.mktemp("simtime")
    shutil.copy(_mlflow_template, tmp / "mlflow.db")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    write_runs(uri, "timed", RUNS)
    untimed = {"fedbuff": {"0": RUNS["fedbuff"]["0"]},
               "sync": {"1": {ACC: RUNS["sync"]["1"][ACC]}}}  # no speeds: no sim_time
    write_runs(uri, "untimed", untimed)
    return {"uri": uri, "tmp": tmp}


def test_time_to_is_the_clock_at_the_first_step_that_reaches_the_threshold():
    clock = [(2, 4.5), (0, 1.5), (1, 3.0), (3, 6.25), (4, 8.0)]
    acc = [(4, 0.95), (0, 0.2), (3, 0.92), (1, 0.5), (2, 0.7)]
    assert time_to(acc, clock, 0.9) == 6.25  # step 3 of 5, whatever the order given
    assert time_to(acc, clock, 0.92) == 6.25  # reached by equality
    assert time_to(acc, clock, 0.96) == math.inf  # never
    loss = [(0, 2.0), (1, 1.0), (2, 0.6), (3, 0.45), (4, 0.3)]
    assert time_to(loss, clock, 0.5, lower=True) == 6.25
    assert time_to(loss, clock, 0.5) == 1.5  # as a higher-is-better metric: step 0
    # evaluated at steps 0, 2, 4 only: step 2's clock, not the second entry's
    assert time_to([(0, 0.4), (2, 0.93), (4, 0.97)], [(i, t) for i, t in
                                                     enumerate([1.0, 2.0, 5.0, 6.0, 7.0])],
                   0.9) == 5.0
    assert time_to([(0, math.nan), (1, 0.95)], [(0, 1.0), (1, 2.0)], 0.9) == 2.0
    with pytest.raises(ValueError, match="reaches 0.9 at step 3, where no sim_time was logged"):
        time_to([(3, 0.95)], [(0, 1.0), (1, 2.0)], 0.9)


def test_time_to_cells_count_the_seeds_that_never_reach():
    assert reach_cell([6.25, math.inf, 4.0]) == \
        f"5.125 ± {statistics.stdev([6.25, 4.0]):.3f} (2 of 3 reached; 1 never)"
    assert reach_cell([6.25, math.nan]) == "6.250 (1 of 1 reached)"  # nan: not logged
    assert reach_cell([math.inf, math.inf]) == "never (0 of 2 reached)"
    assert reach_cell([math.nan]) == "-"


def test_time_to_parses_with_the_shorthand_and_the_loss_direction():
    assert parse_metrics(["time_to:0.9", "test_loss:time_to0.50", "test_accuracy:final"]) == [
        (ACC, "time_to0.9"), (LOSS, "time_to0.5"), (ACC, "final")]
    assert parse_metrics(["test_accuracy:time_to:0.9"]) == [(ACC, "time_to0.9")]
    with pytest.raises(ValueError, match="test_accuracy:time_to0.90: given twice"):
        parse_metrics(["time_to:0.9", "test_accuracy:time_to0.90"])
    for bad in ("time_to", "test_accuracy:time_to", "test_accuracy:time_toabc",
                "time_to:inf"):
        with pytest.raises(ValueError, match=f"--metrics {bad}: time_toX needs a number X"):
            parse_metrics([bad])


def test_table_time_to_from_hand_made_histories(store):
    metrics = parse_metrics(["time_to:0.9", "test_loss:time_to0.5"])
    rows = collect_rows("timed", ["server.mode"], metrics, store["uri"])
    acc, loss = "test_accuracy (simulated s to ≥ 0.9)", "test_loss (simulated s to ≤ 0.5)"
    got = {r.key["server.mode"]: {s: (v[acc], v[loss]) for s, v in r.by_seed.items()}
           for r in rows}
    assert got == {
        # out of step order in the store; the first step that reaches counts
        "fedasync": {"0": (6.25, 6.25), "1": (math.inf, math.inf), "2": (4.0, 1.0)},
        # the metric every other step: step 2's and step 4's clock, not the list position's
        "fedbuff": {"0": (5.0, 5.0), "1": (7.0, math.inf), "2": (3.0, 3.0)},
        "sync": {s: (math.inf, math.inf) for s in "012"}}
    head, body = table(rows, ["server.mode"], metrics, ("server.mode", "fedasync"))
    assert head == ["server.mode", "seeds", acc, loss, f"Δ {acc} vs server.mode=fedasync",
                    f"Δ {loss} vs server.mode=fedasync"]
    sd = statistics.stdev
    assert body[0] == ["fedasync", "3", f"5.125 ± {sd([6.25, 4.0]):.3f} (2 of 3 reached; 1 never)",
                       f"3.625 ± {sd([6.25, 1.0]):.3f} (2 of 3 reached; 1 never)",
                       "baseline", "baseline"]
    # fedbuff - fedasync seed by seed: seed 1 has a never (fedasync's), left out and counted
    d = paired_difference(rows[1], rows[0], acc)
    assert (d.mean, d.n, d.unpaired, d.infinite) == (pytest.approx(-1.125), 2, 0, 1)
    assert body[1] == ["fedbuff", "3", "5.000 ± 2.000 (3 of 3 reached)",
                       f"4.000 ± {sd([5.0, 3.0]):.3f} (2 of 3 reached; 1 never)",
                       f"-1.125 ± {sd([-1.25, -1.0]):.3f} (2 pairs; 1 left out: never reached)",
                       f"0.375 ± {sd([-1.25, 2.0]):.3f} (2 pairs; 1 left out: never reached)"]
    assert body[2] == ["sync", "3", "never (0 of 3 reached)", "never (0 of 3 reached)",
                       "- (0 pairs; 3 left out: never reached)",
                       "- (0 pairs; 3 left out: never reached)"]


def test_fedray_table_time_to_markdown_latex_pivot_and_refusals(store, capsys):
    args = ["table", "timed", "--by", "server.mode", "--tracking-uri", store["uri"],
            "--metrics", "time_to:0.9"]
    assert main(args) == 0
    md = capsys.readouterr().out.splitlines()
    assert md == ["| server.mode | seeds | test_accuracy (simulated s to ≥ 0.9) |",
                  "|---|---:|---:|",
                  (f"| fedasync | 3 | 5.125 ± {statistics.stdev([6.25, 4.0]):.3f} (2 of 3 "
                   "reached; 1 never) |"),
                  "| fedbuff | 3 | 5.000 ± 2.000 (3 of 3 reached) |",
                  "| sync | 3 | never (0 of 3 reached) |"]
    assert main([*args, "--format", "latex"]) == 0
    assert "test\\_accuracy (simulated s to $\\geq$ 0.9)" in capsys.readouterr().out
    assert main([*args, "--pivot", "server.mode"]) == 0
    assert capsys.readouterr().out.splitlines()[2] == (
        f"| 5.125 ± {statistics.stdev([6.25, 4.0]):.3f} (2 of 3 reached; 1 never) | "
        "5.000 ± 2.000 (3 of 3 reached) | never (0 of 3 reached) |")
    # a run without the simulated clock: one line naming it, and what to add
    client = MlflowClient(store["uri"])
    exp = client.get_experiment_by_name("untimed").experiment_id
    (bare,) = client.search_runs([exp], "attributes.run_name = 'sync seed=1'")
    assert main(["table", "untimed", "--by", "server.mode", "--tracking-uri", store["uri"],
                 "--metrics", "time_to:0.9"]) == 2
    assert "\n".join(own_lines(capsys.readouterr().err)) == (
        f"fedray table: --metrics test_accuracy:time_to0.9: run sync seed=1 "
        f"({bare.info.run_id}) logged no sim_time (simulated time); add a speeds: block to "
        "its scenario")
    assert main(["table", "untimed", "--by", "server.mode", "--tracking-uri", store["uri"],
                 "--metrics", "test_accuracy:final"]) == 0  # other summaries still work
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*args[:-1], "test_accuracy:time_to"])
    assert "time_toX needs a number X" in capsys.readouterr().err


def test_report_draws_accuracy_against_simulated_time(store):
    """Each point: at a time some seed was evaluated, the mean (band min..max) over seeds of
    the value each last logged at or before it, over the span every seed covers."""
    from dashboards.export import Exports
    from dashboards.report import build_report, collect, render

    title, _, runs = collect("timed", store["uri"])
    exports = Exports()
    text = render(title, runs, exports)
    section = text.split("<h2>Simulated time</h2>")[1].split("<h2>")[0]
    assert section.count('<g class="curve"') == 3
    (spec,) = [d.spec for d in exports.figures
                if d.title == "test accuracy against simulated time"]
    assert spec["x_label"] == "simulated time (s)"
    series = {s["label"]: s for s in spec["series"]}
    # fedasync: seeds at (1.5 .2, 3 .5, 4.5 .7, 6.25 .92, 8 .95), (1 .1, 2 .3, 3 .5, 4 .6,
    # 5 .7), (.5 .3, 1 .6, 4 .91, 4.5 .8, 5.5 .95); span 1.5 .. 5
    a = series["fedasync"]
    assert a["x"] == [1.5, 2.0, 3.0, 4.0, 4.5, 5.0]
    held = [(0.2, 0.1, 0.6), (0.2, 0.3, 0.6), (0.5, 0.5, 0.6), (0.5, 0.6, 0.91),
            (0.7, 0.6, 0.8), (0.7, 0.7, 0.8)]
    assert a["mean"] == pytest.approx([sum(h) / 3 for h in held])
    assert a["lo"] == pytest.approx([min(h) for h in held])
    assert a["hi"] == pytest.approx([max(h) for h in held])
    # fedbuff, evaluated at steps 0, 2, 4: (1 .4, 5 .93, 7 .97), (1 .2, 3 .6, 7 .9),
    # (.5 .5, 3 .95, 5 .96); span 1 .. 5
    b = series["fedbuff"]
    assert b["x"] == [1.0, 3.0, 5.0]
    assert b["mean"] == pytest.approx([(0.4 + 0.2 + 0.5) / 3, (0.4 + 0.6 + 0.95) / 3,
                                       (0.93 + 0.6 + 0.96) / 3])
    assert series["sync"]["x"] == [2.0, 4.0, 6.0, 8.0, 10.0]  # the seeds share a clock
    assert series["sync"]["mean"] == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.85])
    path = build_report("timed", store["tmp"] / "report", store["uri"], log=False)
    assert "<h2>Simulated time</h2>" in path.read_text()
    names = sorted(p.name for p in (path.parent / "figures").glob("*simulated-time*"))
    assert [n.split("-", 1)[1] for n in names] == ["test-accuracy-against-simulated-time.pdf",
                                                   "test-accuracy-against-simulated-time.svg"]


def test_report_time_view_one_seed_its_own_points_and_absent_without_a_clock():
    from dashboards.export import Exports
    from dashboards.report import RunData, render

    def run(group: str, seed: str, history: dict) -> RunData:
        return RunData(f"{group}{seed}", f"{group} seed={seed}", group, seed, {}, {}, history)

    timed = [run("fedbuff", "0", {ACC: [(0, 0.3), (2, 0.5), (4, 0.7)],
                                  "sim_time": [(i, 0.5 * (i + 1)) for i in range(5)]}),
             run("sync", "0", {ACC: [(i, 0.1 * i) for i in range(5)]})]
    exports = Exports()
    text = render("t", timed, exports)
    (spec,) = [d.spec for d in exports.figures if "simulated time" in d.title]
    (only,) = spec["series"]  # the run without a clock has no curve, and is named
    assert (only["label"], only["x"], only["mean"]) == ("fedbuff", [0.5, 1.5, 2.5],
                                                         [0.3, 0.5, 0.7])
    assert "Without simulated time (no speeds: block), not drawn: sync." in text
    plain = Exports()
    text = render("t", [run("sync", s, {ACC: [(i, 0.1 * i) for i in range(5)]}) for s in "01"],
                  plain)
    assert "simulated time" not in text.lower()
    assert [d.title for d in plain.figures] == ["test accuracy"]


def test_run_figure_adds_accuracy_against_simulated_time():
    from dashboards.figures import figure_panels

    rows = [{"sim_time": 0.5, "participants": 3.0}, {"sim_time": 1.25, ACC: 0.4, LOSS: 1.0},
            {"sim_time": 2.0}, {"sim_time": 3.5, ACC: 0.6, LOSS: 0.8}]
    panels = figure_panels(rows)
    assert [(name, x) for name, x, _ in panels] == [
        ("accuracy", "round"), ("loss", "round"),
        ("accuracy against simulated time", "simulated time (s)")]
    assert panels[0][2] == {ACC: [(2.0, 0.4), (4.0, 0.6)]}
    assert panels[2][2] == {ACC: [(1.25, 0.4), (3.5, 0.6)]}
    untimed = [{k: v for k, v in r.items() if k != "sim_time"} for r in rows]
    assert [name for name, _, _ in figure_panels(untimed)] == ["accuracy", "loss"]


SPEEDS = """\
name: time-e2e
rounds: 6
seeds: [0, 1]
data: {dataset: {name: digits}}
model: {name: logreg}
clients: {total: 12, per_round: 6}
local: {steps: 2, batch_size: 8, lr: 0.2}
speeds: {distribution: lognormal, sigma: 1.0, jitter: 0.2}
evaluation: {every: 2}
sweep:
  server.mode: [sync, fedbuff]
runtime: {backend: inline}
"""


def test_a_run_with_speeds_end_to_end(tmp_path, _mlflow_template):
    """A sync and a FedBuff sweep point with speeds, evaluated every other round: the table's
    time_to is each run's logged sim_time at the step its logged accuracy first reaches X,
    and the report draws both points against simulated time."""
    from dashboards.report import build_report
    from simulator.config.load import load
    from simulator.run.runner import run_loaded

    shutil.copy(_mlflow_template, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "s.yaml").write_text(SPEEDS)
    out = run_loaded(load(tmp_path / "s.yaml"), tracking_uri=uri, quiet=True)
    client = MlflowClient(uri)
    logged = {}
    for r in out.runs:
        acc = {m.step: m.value for m in client.get_metric_history(r["run_id"],
                                                                 mlflow_name(ACC))}
        clock = {m.step: m.value for m in client.get_metric_history(r["run_id"],
                                                                   mlflow_name("sim_time"))}
        assert sorted(acc) == [1, 3, 5] and sorted(clock) == list(range(6))
        logged[(r["values"]["server.mode"], str(r["seed"]))] = (acc, clock)
    x = statistics.median(v for acc, _ in logged.values() for v in acc.values())
    rows = collect_rows("time-e2e", ["server.mode"], parse_metrics([f"time_to:{x}"]), uri)
    col = f"test_accuracy (simulated s to ≥ {x:.12g})"
    for row in rows:
        for seed, cols in row.by_seed.items():
            acc, clock = logged[(row.key["server.mode"], seed)]
            first = next((s for s in sorted(acc) if acc[s] >= x), None)
            assert cols[col] == (clock[first] if first is not None else math.inf)
    text = build_report("time-e2e", tmp_path / "out", uri, log=False).read_text()
    section = text.split("<h2>Simulated time</h2>")[1].split("<h2>")[0]
    # both modes named in the legend; a curve for each whose seeds' clocks overlap (a mode
    # whose do not is named, with why, and not drawn)
    legend = re.findall(r'<g class="legend" data-series="\d+" data-label="([^"]+)"', section)
    assert sorted(label.split(" ")[0] for label in legend) == ["mode=fedbuff", "mode=sync"]
    drawn = [label for label in legend if "do not overlap" not in label]
    assert section.count('<g class="curve"') == len(drawn) >= 1
