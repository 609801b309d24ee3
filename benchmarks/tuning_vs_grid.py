"""A ``fedray tune`` search against the full grid of the same values (docs/tuning.md).

Reads one MLflow experiment that holds both: the search (``fedray tune SCENARIO``, its
parent tagged ``fedray.kind=tune``) and the grid (``fedray sweep SCENARIO --set tune=null
--set 'sweep={..., KEY: [every choice], ...}'``, a sweep parent whose points set the
searched keys). Per search (``per`` value, e.g. each aggregator):

- the grid's best setting: for each setting of the searched keys, the worst over the
  ``--worst-over`` tag (the attack) of the mean over seeds of the final ``--metric``; the
  setting with the highest such score (ties named);
- the search's best: the trial tagged ``fedray.best=true``, its worst attack and score
  (from its own points), and the rank of that setting in the grid;
- trials (finished, stopped by ASHA) and CPU-seconds: the sum over the search's trial
  runs (resp. the grid's point runs) of (end - start) x ``runtime.num_cpus``.

A trial's points and the grid's points of the same setting have the same seeds, hence the
same numbers (fedray's numbers do not depend on the backend or the worker count); the
script checks it.

Run: ``python benchmarks/tuning_vs_grid.py EXPERIMENT [--tracking-uri URI]``
(``MLFLOW_TRACKING_URI`` otherwise).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from collections import defaultdict

from mlflow.entities import Run
from mlflow.tracking import MlflowClient


def runs_of(client: MlflowClient, exp_id: str, filt: str) -> list[Run]:
    out: list[Run] = []
    token = None
    while True:
        page = client.search_runs([exp_id], filter_string=filt, max_results=1000,
                                  page_token=token)
        out.extend(page)
        token = page.token
        if not token:
            return out


def seconds(r: Run) -> float:
    return (r.info.end_time - r.info.start_time) / 1000 * float(
        r.data.params.get("runtime.num_cpus", "1") or 1)


def final(r: Run, metric: str) -> float:
    v = r.data.metrics.get(metric, math.nan)
    return v


def scores(points: list[Run], keys: list[str], worst_over: str, metric: str
           ) -> dict[tuple, tuple[float, str, dict[str, float]]]:
    """(setting) -> (score, worst attack, mean over seeds per attack)."""
    cells: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in points:
        setting = tuple(float(r.data.params[k]) for k in keys)
        v = final(r, metric)
        cells[setting][r.data.tags[worst_over]].append(-math.inf if math.isnan(v) else v)
    out = {}
    for setting, by in cells.items():
        means = {a: statistics.fmean(v) for a, v in by.items()}
        worst = min(means, key=means.__getitem__)
        out[setting] = (means[worst], worst, means)
    return out


def find(client: MlflowClient, eid: str) -> tuple[Run, list[Run], list[str], list[Run]]:
    """The newest search, its trials, the searched keys, and the finished points of the
    newest sweep that varies every searched key (the grid)."""
    searches = runs_of(client, eid, "tags.`fedray.kind` = 'tune'")
    if not searches:
        raise SystemExit("no search (fedray tune) in this experiment")
    search = searches[0]
    trials = runs_of(client, eid, f"tags.`mlflow.parentRunId` = '{search.info.run_id}'")
    keys = sorted(k for k in trials[0].data.params if not k.startswith("search."))
    for parent in runs_of(client, eid, "tags.`fedray.kind` = 'scenario'"):
        kids = [k for k in runs_of(client, eid,
                                   f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
                if k.data.tags.get("fedray.kind") == "point" and k.info.status == "FINISHED"]
        if kids and all(len({k.data.params.get(key) for k in kids}) > 1 for key in keys):
            return search, trials, keys, kids
    raise SystemExit("no grid sweep over " + ", ".join(keys) + " in this experiment")


def compare(client: MlflowClient, eid: str, group: str, ts: list[Run], points: list[Run],
            keys: list[str], args: argparse.Namespace) -> tuple[str, str, list[str]]:
    """One search against its grid: the table row, a note (trials, CPU-seconds) and any
    number the search and the grid disagree on."""
    fmt = "{:.3f}".format
    grid = scores(points, keys, args.worst_over, args.metric)
    ranked = sorted(grid.items(), key=lambda kv: -kv[1][0])
    tied = [s for s, v in ranked if v[0] == ranked[0][1][0]]
    best = [t for t in ts if t.data.tags.get("fedray.best") == "true"]
    row, where, bad = f"| {group} | ", "-", []
    if best:
        pts = runs_of(client, eid, f"tags.`mlflow.parentRunId` = '{best[0].info.run_id}'")
        ((ss, sw, _),) = scores(pts, keys, args.worst_over, args.metric).values()
        setting = tuple(float(best[0].data.params[k]) for k in keys)
        row += " | ".join(f"{x:g}" for x in setting) + f" | {sw} | {fmt(ss)} | "
        if setting not in grid:
            where = "not in the grid"
        else:
            rank = 1 + sum(v[0] > grid[setting][0] for v in grid.values())
            where = "the grid's best" if setting in tied else f"rank {rank} of {len(grid)}"
            if abs(ss - grid[setting][0]) > 1e-9:
                bad.append(f"MISMATCH {group} {setting}: search {ss} vs grid {grid[setting][0]}")
    else:
        row += " | ".join("-" for _ in keys) + " | - | no finished trial | "
    g_set, (g_score, g_worst, _) = ranked[0]
    row += " | ".join(f"{x:g}" for x in g_set) + f" | {g_worst} | {fmt(g_score)}"
    if len(tied) > 1:
        row += " (tied: " + ", ".join("/".join(f"{x:g}" for x in s) for s in tied) + ")"
    ends = [t.data.tags.get("fedray.trial_end", "") for t in ts]
    distinct = len({tuple(t.data.params[k] for k in keys) for t in ts})
    note = (f"{group}: search {len(ts)} trials ({distinct} distinct settings; "
            f"{sum(e == 'finished' for e in ends)} finished, "
            f"{sum(e.startswith('stopped') for e in ends)} stopped by ASHA), "
            f"{sum(seconds(t) for t in ts):.0f} CPU-s; grid {len(grid)} settings, "
            f"{len(points)} points, {sum(seconds(p) for p in points):.0f} CPU-s")
    return row + f" | {where} |", note, bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment")
    ap.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"))
    ap.add_argument("--metric", default="eval/test_accuracy")
    ap.add_argument("--worst-over", default="attack", help="the tag that names the swept value")
    ap.add_argument("--per", default="aggregator", help="the tag that names each search")
    args = ap.parse_args()
    client = MlflowClient(args.tracking_uri)
    exp = client.get_experiment_by_name(args.experiment)
    if exp is None:
        raise SystemExit(f"{args.experiment}: no such experiment in {args.tracking_uri}")
    eid = exp.experiment_id
    search, trials, keys, grid_points = find(client, eid)

    by_group: dict[str, list[Run]] = defaultdict(list)
    for t in trials:
        by_group[t.data.tags["fedray.search"]].append(t)
    grid_by: dict[str, list[Run]] = defaultdict(list)
    for p in grid_points:
        grid_by[p.data.tags[args.per]].append(p)

    print(f"search run {search.info.run_id}, grid parent "
          f"{grid_points[0].data.tags['mlflow.parentRunId']}; score: the worst "
          f"{args.worst_over} of the mean over seeds of the final {args.metric}\n")
    side = [k.split(".")[-1] for k in keys] + [f"worst {args.worst_over}", "score"]
    print(f"| {args.per} | " + " | ".join(f"search: {c}" for c in side) + " | "
          + " | ".join(f"grid: {c}" for c in side) + " | the search's setting in the grid |")
    print("|---|" + "---:|" * len(keys) + "---|---:|" + "---:|" * len(keys) + "---|---:|---|")
    notes, bad = [], []
    for group in sorted(by_group, key=lambda g: min(t.info.start_time for t in by_group[g])):
        if group not in grid_by:
            print(f"| {group} | (no grid points yet) |")
            continue
        row, note, wrong = compare(client, eid, group, by_group[group], grid_by[group], keys,
                                   args)
        print(row)
        notes.append(note)
        bad += wrong
    searched = [t for g in grid_by for t in by_group.get(g, [])]
    s_s = sum(seconds(t) for t in searched)
    g_s = sum(seconds(p) for p in grid_points)
    print("\n" + "\n".join(notes) + "\n")
    print(f"search: {len(searched)} trials, {s_s:.0f} CPU-seconds")
    print(f"grid: {len(grid_points)} point runs, {g_s:.0f} CPU-seconds")
    print(f"search / grid CPU-seconds: {s_s / g_s:.2f}")
    print("\n".join(bad))


if __name__ == "__main__":
    main()
