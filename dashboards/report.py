"""``fedray report``: a self-contained HTML report of an experiment (its latest scenario run,
or its latest search) or of one run, built from what MLflow holds; no server needed for the
embedded store.

Sections, each present when the runs have what it needs: a summary table (final accuracy,
mean ± std over seeds, per sweep point); curves per sweep point with the spread over seeds
(min-max band); for runs with a simulated clock (a ``speeds:`` block: ``sim_time``), test
accuracy against simulated seconds; ByzFL's views (worst case over attacks, best setting
under the worst attack; see dashboards/robust.py: the Byzantine count and the attack are the
condition, "no attack" a column beside the attacks); heat maps of final accuracy,
aggregator x attack and aggregator x f, every map on one colour range, titles naming only
what varies, diverged cells marked; for D-SGD, a topology table (spectral gap, accuracy,
generalization gap, consensus distance). For DP runs, the f-DP trade-off curve of each
mechanism and, for an audited run (``audit:``), the curves (epsilon, delta)-DP implies for its
audit's estimate and lower bound beside it, with the accountant's epsilon, the audit's
numbers and its canaries in a table (dashboards/audit.py). For runs with privacy attacks
(``privacy_attacks:``), a table per attack (its measured success or advantage beside the
bound the run's DP implies, PSNR, SSIM, label accuracy or AUC; mean ± std over seeds per
sweep point) and, for a reconstruction attack, the first seed's attacked client's samples
beside their reconstructions (dashboards/attacks.py). For a search (``fedray tune``), the
runs are the points of each search's best trial, and a section draws the search
(dashboards/search.py):
each search at its best setting under each ``worst_over`` value, the score of every trial
against each searched key, and the ASHA rungs. The report is logged as ``report/report.html`` on
the scenario's parent run; its figures and tables go to ``figures/`` (PDF, SVG: see
dashboards/export.py) and ``tables/``.
"""

from __future__ import annotations

import bisect
import html
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dashboards.attacks import (
    MAX_SAMPLES,
    attack_kind,
    attack_metrics,
    attack_names,
    read_reconstruction,
    reconstruction_svg,
)
from dashboards.audit import dp_curve
from dashboards.draw import MAX_SERIES, PALETTE, Drawing, heat, lines, pick_series
from dashboards.robust import NO_ATTACK, Cell, Robust, robust
from dashboards.rundata import RunData
from dashboards.search import search_section
from dashboards.stats import Summary, summarize
from simulator.metric_names import SIM_TIME, mlflow_name
from simulator.run.privacy_compare import AUDIT_METRICS, AuditFacts, audit_facts
from simulator.run.privacy_shadows import shadow_point
from simulator.run.reductions import from_mlflow

if TYPE_CHECKING:
    from dashboards.export import Exports
    from dashboards.search import Search

CURVES = [("test_accuracy", "test accuracy"), ("test_loss", "test loss"),
          ("aggregation_error", "aggregation error ||aggregate - honest mean||"),
          ("generalization_gap", "generalization gap (test - train loss)"),
          ("consensus_distance", "consensus distance"),
          ("epsilon", "privacy spent: epsilon at the scenario's delta")]


def _group(name: str) -> str:
    head, sep, tail = name.rpartition(" seed=")
    return head if sep and tail.isdigit() else name


def collect(target: str, tracking_uri: str | None = None) -> tuple[str, str | None, list[RunData]]:
    """(title, parent run id or None, runs) for an experiment name or a run id."""
    from mlflow.tracking import MlflowClient

    from simulator.run.tracking import default_uri, ensure_store

    uri = tracking_uri or default_uri()
    ensure_store(uri)  # a store that cannot be used: one line
    client = MlflowClient(uri)
    title, parent, runs = _collect(client, uri, target)
    _load_reconstructions(client, runs)
    return title, parent, runs


def _collect(client: Any, uri: str, target: str) -> tuple[str, str | None, list[RunData]]:
    from simulator.run.tracking import child_runs, latest_scenario_run

    exp = client.get_experiment_by_name(target)
    search = _search_runs(client, target, exp)
    if search is not None:
        return search
    if exp is not None:
        found = latest_scenario_run(client, exp.experiment_id, False,
                                    lambda runs: any(r.data.metrics for r in runs))
        if found is None:
            raise ValueError(f"experiment {target!r} has no fedray scenario run")
        parent, children, logged = found
        if logged is not parent:  # a failed last attempt: no round
            raise ValueError(
                f"the latest scenario run of {target!r}, {parent.info.run_id} "
                f"({parent.info.status}), logged no round; " +
                (f"the latest that did: fedray report {logged.info.run_id}" if logged else
                 "no earlier one did either"))
    else:
        try:
            parent = client.get_run(target)
        except Exception:  # noqa: BLE001 - MLflow raises its own types for a missing run
            raise ValueError(f"{target!r} is neither an experiment nor a run in {uri}") from None
        if parent.data.tags.get("fedray.kind") != "scenario":
            return parent.info.run_name, None, [_load(client, parent)]
        children = child_runs(client, parent.info.experiment_id, parent.info.run_id)
    return parent.info.run_name, parent.info.run_id, [_load(client, r) for r in children]


def _search_runs(client: Any, target: str, exp: Any) -> tuple[str, str, list[RunData]] | None:
    """When ``target`` is a search (``fedray tune``: the experiment's newest parent run, or
    the run ``target``, is a search's): (title, its run id, the points of each search's best
    trial); None otherwise."""
    from dashboards.search import best_points, find_search, load_search

    if exp is not None:
        parent = find_search(client, exp.experiment_id, None)
    else:
        parent = find_search(client, "", target)
    if parent is None:
        return None
    return parent.info.run_name, parent.info.run_id, [
        _load(client, r) for r in best_points(client, load_search(client, parent))]


def _load(client: Any, run: Any) -> RunData:
    name = run.info.run_name
    data = RunData(run.info.run_id, name, shadow_point(_group(name), run.data.tags),
                   run.data.tags.get("seed", ""), dict(run.data.tags), dict(run.data.params))
    for key in dict.fromkeys([k for k, _ in CURVES] + [
            "nonfinite_aggregate", SIM_TIME, *AUDIT_METRICS,
            *attack_metrics(attack_names(data.params))]):  # plain names here, MLflow's
        # (eval/test_accuracy) there
        if mlflow_name(key) in run.data.metrics:
            hist = sorted(client.get_metric_history(run.info.run_id, mlflow_name(key)),
                          key=lambda m: m.step)
            data.history[key] = [(m.step, from_mlflow(m.value)) for m in hist]
    if "privacy.epsilon" in run.data.params and data.seed in ("", "0"):
        import tempfile

        import pyarrow.parquet as pq

        try:
            with tempfile.TemporaryDirectory() as tmp:
                t = pq.read_table(client.download_artifacts(run.info.run_id,
                                                            "privacy/tradeoff.parquet", tmp))
                data.tradeoff = (t.column("alpha").to_pylist(), t.column("beta").to_pylist())
        except Exception:  # noqa: BLE001 - a run that logged no trade-off: no curve
            data.tradeoff = None
    return data


def _seed_order(r: RunData) -> tuple[int, str]:
    return (int(r.seed), "") if r.seed.isdigit() else (1 << 62, r.seed)


def _load_reconstructions(client: Any, runs: list[RunData]) -> None:
    """Each reconstruction attack's first ``MAX_SAMPLES`` samples
    (``privacy/attack_<name>.parquet``) into ``RunData.reconstructions``, for the first seed
    of each sweep point that ran the attack (to keep the report short). An attack without
    its table (its client dropped out) has none."""
    import tempfile

    groups: dict[str, list[RunData]] = {}
    for r in runs:
        groups.setdefault(r.group, []).append(r)
    for members in groups.values():
        for name in dict.fromkeys(n for r in members for n in attack_names(r.params)):
            ran = [r for r in members if attack_kind(r.history, name) == "reconstruction"]
            if not ran:
                continue
            first = min(ran, key=_seed_order)
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    rec = read_reconstruction(client.download_artifacts(
                        first.run_id, f"privacy/attack_{name}.parquet", tmp))
            except Exception:  # noqa: BLE001 - no table (no reconstruction): no images
                rec = None
            if rec is not None:
                first.reconstructions[name] = rec


DASHES = ["", "7 4", "2 3", "10 3 2 3", "4 2 1 2", "1 5"]


def styles(runs: list[RunData]) -> dict[str, dict[str, str]]:
    """A stable style per sweep point for every chart of the report: the colour of its
    aggregator and the dash of its attack (in order of first appearance), so one aggregator
    is one colour in every panel; when a single aggregator is swept over other values, each
    point gets its own colour."""
    aggs = list(dict.fromkeys(r.tags.get("aggregator", "") for r in runs))
    attacks = list(dict.fromkeys(r.tags.get("attack", "none") for r in runs))
    groups = list(dict.fromkeys(r.group for r in runs))
    pairs = {(r.tags.get("aggregator", ""), r.tags.get("attack", "none")) for r in runs}
    # colour = aggregator while (aggregator, attack) tells the points apart, else one each
    by_agg = len(aggs) > 1 and len(pairs) == len(groups)
    out: dict[str, dict[str, str]] = {}
    for r in runs:
        if r.group in out:
            continue
        i = aggs.index(r.tags.get("aggregator", "")) if by_agg else groups.index(r.group)
        dash = DASHES[attacks.index(r.tags.get("attack", "none")) % len(DASHES)] \
            if len(attacks) > 1 else ""
        out[r.group] = {"color": PALETTE[i % len(PALETTE)], "dash": dash}
    return out


def _series(groups: dict[str, list[RunData]], key: str,
            style: dict[str, dict[str, str]] | None = None) -> list[dict]:
    out = []
    for label, runs in groups.items():
        steps = sorted({s for r in runs for s, _ in r.history.get(key, [])})
        if not steps:
            continue
        by_run = [dict(r.history.get(key, [])) for r in runs]
        mean, lo, hi = [], [], []
        for s in steps:
            vals = [h[s] for h in by_run if s in h and math.isfinite(h[s])]
            mean.append(statistics.fmean(vals) if vals else math.nan)
            lo.append(min(vals) if vals else math.nan)
            hi.append(max(vals) if vals else math.nan)
        bad = sum(1 for h in by_run if not all(math.isfinite(v) for v in h.values()))
        series = {"label": label, "x": steps, "mean": mean, "lo": lo, "hi": hi,
                  **(style or {}).get(label, {})}
        if bad:  # the curve is over the finite values; say whose are missing
            series["label"] = f"{label} ({bad} of {len(runs)} runs not finite)"
        out.append(series)
    return out


def _time_series(groups: dict[str, list[RunData]], key: str,
                 style: dict[str, dict[str, str]] | None = None) -> list[dict]:
    """Per sweep point, ``key`` against simulated time: each run's evaluations placed at
    its ``sim_time`` of the same step (matched by step; steps without one are left out).
    At every time one of the point's runs was evaluated, the mean, min and max over the
    runs of the value each last logged at or before it (the model its server then held;
    of two steps at one time, the later), over the span every run covers (from the latest
    first evaluation to the earliest last one), so each point averages every seed. One
    seed: its own points."""
    out = []
    for label, runs in groups.items():
        tracks = []  # per run: times and values, in step order
        for r in runs:
            clock = dict(r.history.get(SIM_TIME, []))
            pts = sorted((clock[s], s, v) for s, v in r.history.get(key, []) if s in clock)
            if pts:
                tracks.append(([t for t, _, _ in pts], [v for _, _, v in pts]))
        if not tracks:
            continue
        start, end = max(t[0] for t, _ in tracks), min(t[-1] for t, _ in tracks)
        times = sorted({x for t, _ in tracks for x in t if start <= x <= end})
        mean, lo, hi = [], [], []
        for x in times:
            held = [v[bisect.bisect_right(t, x) - 1] for t, v in tracks]
            vals = [y for y in held if math.isfinite(y)]
            mean.append(statistics.fmean(vals) if vals else math.nan)
            lo.append(min(vals) if vals else math.nan)
            hi.append(max(vals) if vals else math.nan)
        bad = sum(1 for _, v in tracks if not all(math.isfinite(y) for y in v))
        series = {"label": label, "x": times, "mean": mean, "lo": lo, "hi": hi,
                  **(style or {}).get(label, {})}
        if not times:
            series["label"] = f"{label} (its runs' simulated times do not overlap)"
        elif bad:
            series["label"] = f"{label} ({bad} of {len(tracks)} runs not finite)"
        out.append(series)
    return out


class SeriesOf(Protocol):
    def __call__(self, groups: dict[str, list[RunData]], key: str,
                 style: dict[str, dict[str, str]] | None = None) -> list[dict]: ...


def _panels(runs: list[RunData], key: str,
            series_of: SeriesOf = _series) -> list[tuple[str, list[dict]]] | None:
    """The exported figure of a chart with too many curves for one plot, as small multiples:
    one panel per condition ("no attack", then each attack), in each a curve per setting,
    in the same colour and dash in every panel (so one legend reads them all); the runs of a
    setting with no attack (every attack name its f = 0 runs were given) make one curve. None
    when the runs are not settings under conditions. ``series_of``: the curves against
    rounds (``_series``) or against simulated time (``_time_series``)."""
    rb = robust(runs)
    if len(rb.conditions) < 2 or len(rb.settings) < 2:
        return None
    style = {_setting_text(rb, s): {"color": PALETTE[i % len(PALETTE)],
                                    "dash": DASHES[i // len(PALETTE) % len(DASHES)]}
             for i, s in enumerate(rb.settings)}
    out = []
    for c in rb.conditions:
        groups = {_setting_text(rb, s): cell.runs for s in rb.settings
                  if (cell := rb.cell(s, c)).runs}
        series = series_of(groups, key, style)
        if series:
            out.append((rb.label(c), series))
    return out if len(out) > 1 else None


def _setting_text(rb: Robust, setting: tuple[str, ...]) -> str:
    """A setting in one line: ``cwtm(f=3), local.lr=0.1``."""
    return ", ".join([setting[0], *(f"{k}={v}" for k, v in zip(rb.extra, setting[1:]))])


def _time_section(page: Page, runs: list[RunData], groups: dict[str, list[RunData]],
                  style: dict[str, dict[str, str]]) -> list[str]:
    """Test accuracy (or, without it, test loss) against simulated time, a curve per sweep
    point, when some run logged ``sim_time`` (a ``speeds:`` block); none otherwise."""
    if not any(SIM_TIME in r.history for r in runs):
        return []
    key = next((k for k in ("test_accuracy", "test_loss") if any(k in r.history for r in runs)),
               None)
    if key is None:
        return []
    label = dict(CURVES)[key]
    series, note = pick_series(_time_series(groups, key, style))
    if not series:
        return []
    untimed = [g for g, members in groups.items()
               if not any(SIM_TIME in r.history for r in members)]
    return ["<h2>Simulated time</h2>",
            ('<p class="note">The model\'s ' + html.escape(label) + " against the simulated "
             "clock (seconds since the start, set by the devices' speeds of the scenario's "
             "speeds: block, never by the computation's real time): at each time a run was "
             "evaluated, the mean over seeds of the value each seed last logged at or before "
             "it, over the span all of a point's seeds cover; bands span min to max over "
             "seeds." +
             (" Without simulated time (no speeds: block), not drawn: " +
              html.escape(", ".join(untimed)) + "." if untimed else "") + "</p>"),
            page.chart(f"{label} against simulated time", series, "simulated time (s)", key,
                       note, _panels(runs, key, _time_series) if len(series) > MAX_SERIES
                       else None)]


def _heat_maps(page: Page, runs: list[RunData]) -> tuple[list[str], list[str]]:
    """(aggregator x attack maps, aggregator x f maps) of the final test accuracy. Rows are the
    rules (with the hyperparameters that differ between runs of a rule), columns the
    conditions ("no attack" beside the attacks) or the Byzantine counts (one map per attack);
    one map per value of the other swept paths, named in its title (only what varies). Every
    map of the report takes one colour range, which its colour bar says; a diverged cell is
    marked, not averaged."""
    rb = robust(runs)
    maps: list[tuple[str, list[dict]]] = []  # (section, specs)
    contexts = list(dict.fromkeys(s[1:] for s in rb.settings))
    rows_all = list(dict.fromkeys(s[0] for s in rb.settings))
    fs = list(dict.fromkeys(c.f for c in rb.attacked))
    multi_f = len(fs) > 1

    def values(cells: dict[tuple[str, str], Cell]) -> dict:
        return {k: (c.mean, c.std, len(c.runs), c.diverged) for k, c in cells.items() if c.runs}

    def where(ctx: tuple[str, ...], more: list[str]) -> str:
        named = [f"{k}={v}" for k, v in zip(rb.extra, ctx)] + more
        return f" ({', '.join(named)})" if named else ""

    cols_all = [rb.label(c) for c in rb.clean] + \
        list(dict.fromkeys(rb.label(c, with_f=False) for c in rb.attacked))
    if len(rows_all) >= 2 or len(cols_all) >= 2:
        specs = []
        for ctx in contexts:
            rows = [s[0] for s in rb.settings if s[1:] == ctx]
            for f in fs if multi_f else [None]:
                conds = rb.clean + [c for c in rb.attacked if f is None or c.f == f]
                cols = [rb.label(c, with_f=None if c.clean else False) for c in conds]
                cells = {(row, col): rb.cell((row, *ctx), c) for row in rows
                         for col, c in zip(cols, conds)}
                specs.append({"title": "final test accuracy: aggregator x attack" + where(
                    ctx, [f"f={f}"] if f is not None else []), "rows": rows, "cols": cols,
                    "values": values(cells), "row_label": "aggregator", "col_label": "attack"})
        maps.append(("attack", specs[:24]))
    all_f = sorted({c.f for c in rb.conditions})
    if len(all_f) > 1 and rb.attacked:
        specs = []
        zero = [c for c in rb.clean if c.f == 0]
        for ctx in contexts:
            rows = [s[0] for s in rb.settings if s[1:] == ctx]
            for attack in dict.fromkeys(c.attack for c in rb.attacked):
                conds = zero + [c for c in rb.attacked if c.attack == attack]
                cells = {(row, str(c.f)): rb.cell((row, *ctx), c) for row in rows
                         for c in conds}
                specs.append({"title": "final test accuracy: aggregator x f (Byzantine clients)"
                              + where(ctx, [f"attack={attack}"]), "rows": rows,
                              "cols": [str(c.f) for c in conds], "values": values(cells),
                              "row_label": "aggregator", "col_label": "f (Byzantine clients)"})
        maps.append(("f", specs[:24]))
    finite = [v[0] for _, specs in maps for spec in specs for v in spec["values"].values()
              if math.isfinite(v[0])]
    lo, hi = min(finite, default=0.0), max(finite, default=1.0)
    shared = sum(len(specs) for _, specs in maps)
    drawn = {section: [page.heat(**spec, lo=lo, hi=hi, shared=shared) for spec in specs]
             for section, specs in maps}
    return drawn.get("attack", []), drawn.get("f", [])


@dataclass
class Page:
    """The figures and tables of one report as it is rendered: each figure is drawn once
    (``dashboards.draw``) and inlined as SVG; when the report is exported, the drawings and
    the tables are also collected into ``exports`` (for ``figures/`` and ``tables/``)."""

    exports: Exports | None = None
    drawn: int = 0  # figures so far: each one's SVG ids get a prefix of its own

    def chart(self, title: str, series: list[dict], x_label: str, y_label: str,
              note: str = "", panels: list[tuple[str, list[dict]]] | None = None,
              log_x: bool = False, log: bool | None = None) -> str:
        """A line chart; ``note`` (how to read the page's chart: its faded curves) goes
        under it as page text, not into the figure; ``panels`` (title, series): small
        multiples, drawn instead of ``series`` (every curve shown: no note); ``log_x``: a log
        x axis; ``log``: a log y axis (default: ``draw.wants_log``)."""
        return self._figure(lines({"title": title, "series": series, "x_label": x_label,
                                   "y_label": y_label, "panels": panels, "log_x": log_x,
                                   "log": log}), "" if panels else note)

    def heat(self, title: str, rows: list[str], cols: list[str], values: dict, row_label: str,
             col_label: str, lo: float | None = None, hi: float | None = None,
             shared: int = 1) -> str:
        return self._figure(heat({"title": title, "rows": rows, "cols": cols,
                                  "values": values, "row_label": row_label,
                                  "col_label": col_label, "lo": lo, "hi": hi,
                                  "shared": shared}))

    def _figure(self, drawing: Drawing, note: str = "") -> str:
        if self.exports is not None:
            self.exports.figures.append(drawing)
        self.drawn += 1
        out = drawing.svg(f"f{self.drawn}")
        return out + (f'<p class="note">{html.escape(note)}</p>' if note else "")

    def table(self, head: Sequence[str], rows: Sequence[Sequence[str]], cls: str) -> str:
        if self.exports is not None:
            self.exports.tables.append((cls, list(head), [list(r) for r in rows]))
        h = "".join(f"<th>{html.escape(c)}</th>" for c in head)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                       for row in rows)
        return f'<table class="{cls}"><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>'


def _cell(m: Summary) -> str:
    if not m.n:
        return "-"
    if m.diverged:
        return f"diverged ({m.diverged} of {m.n} runs)"
    return f"{m.mean:.4g}" if m.n == 1 else f"{m.mean:.4g} ± {m.std:.2g}"  # one: no spread


CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}th{background:#f4f4f4}
td:first-child,th:first-child{text-align:left}
svg{margin:6px 12px 6px 0;background:#fff}
.tick{font-size:11px;fill:#444}svg *{stroke-linejoin:round;stroke-linecap:butt}
.legend,.legend-key{cursor:pointer}.off{opacity:.15}svg.heatmap text{pointer-events:none}
.note{color:#666;font-size:13px}.context{font-size:14px}h3{font-size:15px;margin-top:18px}
.recon image{image-rendering:pixelated}
"""

JS = """
document.querySelectorAll('svg.chart').forEach(function (svg) {
  svg.querySelectorAll('.legend, .legend-key').forEach(function (item) {
    item.addEventListener('click', function () {
      var i = item.getAttribute('data-series');
      svg.querySelectorAll('[data-series="' + i + '"]').forEach(function (el) {
        el.classList.toggle('off');  // its curves, bands and markers in every panel, its entry
      });
    });
  });
});
"""


def _mechanism_key(r: RunData) -> tuple:
    """A run's privacy block: the privacy params it logged but the epsilon spent."""
    return tuple(sorted((k, v) for k, v in r.params.items()
                        if k.startswith("privacy.") and k != "privacy.epsilon"))


def _mechanism_runs(runs: list[RunData]) -> dict[tuple, tuple[str, RunData]]:
    """Each distinct privacy block among the runs with a trade-off curve (runs that differ
    only in, say, the aggregator share one mechanism): its name (the privacy params that vary
    between mechanisms) and a run of it; at most MAX_SERIES."""
    by_mech: dict[tuple, RunData] = {}
    for r in runs:
        if r.tradeoff is not None:
            by_mech.setdefault(_mechanism_key(r), r)
    varying = sorted({k for key in by_mech for k, _ in key
                      if len({dict(other).get(k) for other in by_mech}) > 1})
    out = {}
    for key, r in list(by_mech.items())[:MAX_SERIES]:
        name = ", ".join(f"{k.removeprefix('privacy.')}={dict(key).get(k)}" for k in varying)
        out[key] = (name or r.group, r)
    return out


def _mechanisms(runs: list[RunData]) -> dict[str, tuple[list[float], list[float]]]:
    """The trade-off curve (alpha, beta) of each mechanism of ``_mechanism_runs``, by name."""
    out = {}
    for name, r in _mechanism_runs(runs).values():
        assert r.tradeoff is not None  # kept there
        out[name] = r.tradeoff
    return out


def _audits(groups: dict[str, list[RunData]]) -> dict[str, list[AuditFacts]]:
    """Per sweep point with an audit (``audit:``), the ``AuditFacts`` of its audited runs
    (one per seed), from the final values they logged."""
    out = {}
    for label, members in groups.items():
        facts = [audit_facts(r.params, {k: r.final(k) for k in AUDIT_METRICS})
                 for r in members]
        if any(f.audited for f in facts):
            out[label] = [f for f in facts if f.audited]
    return out


def _audit_curves(groups: dict[str, list[RunData]], audits: dict[str, list[AuditFacts]],
                  mechanisms: dict[tuple, tuple[str, RunData]]) -> list[dict]:
    """Per audited sweep point, the trade-off curves of (epsilon, delta)-DP at its audit's
    delta for the audit's estimate (dashed) and its lower bound (dotted), each the mean over
    seeds of the final value, in the colour of the point's mechanism curve (its own colour
    when several audited points share a mechanism), on that curve's alpha grid."""
    keys = list(mechanisms)
    point_key = {label: _mechanism_key(groups[label][0]) for label in audits}
    shared = {k for k in point_key.values() if list(point_key.values()).count(k) > 1}
    out, extra = [], len(keys)
    for label, facts in audits.items():
        key = point_key[label]
        if key in keys and key not in shared:
            colour = PALETTE[keys.index(key) % len(PALETTE)]
        else:
            colour, extra = PALETTE[extra % len(PALETTE)], extra + 1
        drawn = mechanisms[key][1].tradeoff if key in keys else None
        grid = drawn[0] if drawn is not None else None
        delta = facts[0].audit_delta
        for what, dash, values in (("audit estimate", "7 4", [f.estimate for f in facts]),
                                   ("audit lower bound", "2 3", [f.lower for f in facts])):
            m = summarize(values)
            if not m.n or not m.mean >= 0:  # not logged (the bound: inserted != 0.5)
                continue
            alpha, beta = dp_curve(m.mean, delta, grid)
            seeds = f", mean of {m.n} seeds" if m.n > 1 else ""
            out.append({"label": f"{label}: {what}, epsilon {m.mean:.3g} at delta "
                                 f"{delta:g}{seeds}",
                        "x": alpha, "mean": beta, "color": colour, "dash": dash})
    return out


def _audit_table(page: Page, audits: dict[str, list[AuditFacts]]) -> list[str]:
    """Per audited sweep point: the accountant's final epsilon, the audit's estimate and
    lower bound (mean ± std over seeds), the canaries inserted, and the deltas."""
    if not audits:
        return []
    rows = []
    for label, facts in audits.items():
        measured = [f for f in facts if f.measured]
        accountant = summarize([f.epsilon for f in facts])
        lower = summarize([f.lower for f in facts])
        lower_text = _cell(lower) if lower.n else "-"
        above = sum(f.exceeded for f in facts)
        if above:
            lower_text += f" (above the accountant's in {above} of {len(facts)} runs)"
        inserted = summarize([f.inserted for f in facts])
        deltas = dict.fromkeys(f"{f.delta:g}" for f in facts if f.private)
        audit_deltas = dict.fromkeys(f"{f.audit_delta:g}" for f in facts)
        rows.append([label, f"{len(measured)} of {len(facts)}",
                     _cell(accountant) if accountant.n else "- (no privacy block)",
                     _cell(summarize([f.estimate for f in facts])), lower_text,
                     f"{_cell(inserted)} of {facts[0].canaries}",
                     ", ".join(deltas) or "-", ", ".join(audit_deltas)])
    return [('<p class="note">The empirical privacy audit (<code>audit:</code>): canary clients '
             "whose updates are random directions, the cosines of the model's change with "
             "them giving Andrew et al.'s estimate of epsilon (ICLR 2024) and, at "
             "<code>inserted: 0.5</code>, Steinke, Nasr and Jagielski's lower bound (NeurIPS "
             "2023), final values, mean ± std over seeds, beside the accountant's final "
             "epsilon. In the trade-off chart, dashed: the curve (epsilon, delta)-DP implies "
             "for the estimate, dotted: for the lower bound, at the audit's delta (Kairouz et "
             "al. 2015; Dong, Roth, Su 2022). No sound accountant's curve lies above the lower "
             "bound's everywhere; an estimate's curve far above the accountant's says the "
             "analysis is loose for this run (or its canaries weak).</p>"),
            page.table(["sweep point", "seeds audited", "accountant epsilon",
                        "audit estimate", "audit lower bound", "canaries inserted",
                        "delta", "audit delta"], rows, "audit")]


def _mechanism_table(page: Page, curves: dict[str, tuple[list[float], list[float]]]
                     ) -> list[str]:
    """Each mechanism's best attacker's advantage, and the Delta-divergence between every
    ordered pair (Kaissis et al. 2024; see docs/privacy.md): Delta(row || column) is the
    worst-case excess vulnerability of choosing the column's mechanism over the row's."""
    import numpy as np

    from strategies.privacy import advantage, delta_divergence

    if len(curves) < 2:
        return []
    names = list(curves)
    rows = []
    for a in names:
        alpha, f = np.asarray(curves[a][0]), np.asarray(curves[a][1])
        cells = [f"{delta_divergence(alpha, f, np.interp(alpha, *curves[b])):.4f}" for b in names]
        rows.append([a, f"{advantage(alpha, f):.4f}", *cells])
    return [('<p class="note">Delta(row || column): the worst-case excess vulnerability of '
            "choosing the column's mechanism over the row's (0: the column is at least as "
            "private everywhere); advantage: the best attacker's max TPR - FPR.</p>"),
            page.table(["mechanism", "advantage", *names], rows, "mechanisms")]


def _privacy_section(page: Page, runs: list[RunData], groups: dict[str, list[RunData]]
                     ) -> list[str]:
    """The trade-off curve of each mechanism with, for an audited sweep point, the curves
    (epsilon, delta)-DP implies for its audit's estimate and lower bound (the audit curves
    past MAX_SERIES faded); the Delta table; the audit's numbers. None without a mechanism's
    curve or an audit."""
    mech_runs = _mechanism_runs(runs)
    mechanisms = _mechanisms(runs)
    audits = _audits(groups)
    if not mechanisms and not audits:
        return []
    trade: list[dict[str, Any]] = [{"label": name, "x": ab[0], "mean": ab[1]}
                                   for name, ab in mechanisms.items()]
    audited = _audit_curves(groups, audits, mech_runs)
    trade += [{**s, "hidden": len(trade) + i >= MAX_SERIES} for i, s in enumerate(audited)]
    faded = sum(1 for s in trade if s.get("hidden"))
    title = ("f-DP trade-off curve of each mechanism (an attacker's type II error beta "
             "against type I error alpha; higher is more private)")
    if audited:
        title += ("; dashed and dotted: the (epsilon, delta)-DP curves of the audit's "
                  "estimate and lower bound")
    note = (f"{faded} audit curves faded; click a faded legend entry to show its curve."
            if faded else "")
    return ["<h2>Privacy</h2>", page.chart(title, trade, "alpha", "beta", note, log=False),
            *_mechanism_table(page, mechanisms), *_audit_table(page, audits)]


ATTACK_COLUMNS = {
    "reconstruction": [("success", "success"), ("success_bound", "success bound"),
                       ("psnr", "PSNR (dB)"), ("ssim", "SSIM"),
                       ("label_accuracy", "label accuracy")],
    "membership": [("advantage", "advantage"), ("advantage_bound", "advantage bound"),
                   ("auc", "AUC")],
    "shadow runs": [("shadows_advantage", "advantage"), ("advantage_bound", "advantage bound"),
                    ("shadows_auc", "AUC"), ("shadows_tpr_at_fpr_0.001", "TPR at 0.1 % FPR"),
                    ("shadows_tpr_at_fpr_0.01", "TPR at 1 % FPR"),
                    ("auc", "AUC without shadows"),
                    ("tpr_at_fpr_0.01", "TPR at 1 % FPR without shadows")],
}


def _attacks_section(page: Page, groups: dict[str, list[RunData]]) -> list[str]:
    """Per privacy attack (``privacy_attacks:``), a row per sweep point that ran it: its
    final metrics, mean ± std over the seeds, the measured success or advantage beside the
    bound the run's DP implies; and for a reconstruction attack, the samples of each point's
    first seed beside their reconstructions. None without an attack."""
    ran: dict[str, tuple[str, dict[str, list[RunData]]]] = {}  # name -> (kind, points)
    for label, members in groups.items():
        for r in members:
            for name in attack_names(r.params):
                kind = attack_kind(r.history, name)
                if kind is not None and ran.setdefault(name, (kind, {}))[0] == kind:
                    ran[name][1].setdefault(label, []).append(r)
    if not ran:
        return []
    out = ["<h2>Privacy attacks</h2>",
           ('<p class="note">Each attack\'s final values, mean ± std over seeds. A '
            "reconstruction attack (the server's view of one client's update in its round): "
            "success is the fraction of the client's samples whose reconstruction's nearest "
            "among the attack's candidates is the sample (Hayes, Mahloujifar, Balle, NeurIPS "
            "2023), beside the bound one round's DP implies (1 - f(1 / candidates); 1 without "
            "DP or where the server sees the row in the clear); PSNR, SSIM and label accuracy "
            "of the reconstructions matched to the client's samples. A membership attack on "
            "the final model: its AUC and its advantage (TPR - FPR at a threshold chosen on "
            "half the queries, measured on the other half) beside the largest the run's "
            "mechanism allows (1 without DP). A membership attack with shadow runs (LiRA, "
            "combined by fedray privacy shadows): each run the target of the point's others, "
            "mean ± std over the runs and seeds, and the score's AUC without the shadows. "
            "A reconstruction attack's samples are drawn "
            f"for the first seed of each sweep point, at most {MAX_SAMPLES}.</p>")]
    for name, (kind, points) in ran.items():
        cols = ATTACK_COLUMNS[kind]
        rows = [[label, str(len(members)),
                 *(_cell(summarize([r.final(f"{name}_{key}") for r in members]))
                   for key, _ in cols)]
                for label, members in points.items()]
        out += [f"<h3>{html.escape(name)} ({kind})</h3>",
                page.table(["sweep point", "seeds x runs" if kind == "shadow runs" else
                            "seeds", *(head for _, head in cols)], rows,
                           f"attack_{name}")]
        if kind == "reconstruction":
            out += _reconstruction_figures(name, points)
    return out


def _reconstruction_figures(name: str, points: dict[str, list[RunData]]) -> list[str]:
    """Per sweep point, the samples of reconstruction attack ``name`` its first seed loaded
    (``_load_reconstructions``): a caption and the drawing (dashboards/attacks.py)."""
    out = []
    for label, members in points.items():
        for r in members:
            rec = r.reconstructions.get(name)
            if rec is None or not rec.rows:
                continue
            where = f"{label} (seed {r.seed})" if r.seed else label
            svg = reconstruction_svg(rec)
            if not svg:
                out.append(f'<p class="note">{html.escape(where)}: the inputs are not images; '
                           "no drawing.</p>")
                continue
            client = rec.rows[0].get("client")
            shown = (f"the first {len(rec.rows)} of its {rec.total} samples"
                     if rec.total > len(rec.rows) else
                     f"its {rec.total} sample" + ("s" if rec.total != 1 else ""))
            out += [(f'<p class="note">{html.escape(where)}, client {client}: {shown} (left '
                     "of each pair) beside the reconstruction (right), the PSNR under each "
                     "pair; one range for all (the true samples' min to max), scaled up "
                     "without smoothing.</p>"), svg]
    return out


def _topology_section(page: Page, runs: list[RunData]) -> list[str]:
    """The D-SGD runs' table: spectral gap, accuracy, generalization gap, consensus."""
    by_topo: dict[str, list[RunData]] = {}
    for r in runs:
        if r.tags.get("topology", "none") != "none":
            by_topo.setdefault(r.group, []).append(r)
    if not by_topo:
        return []
    rows = []
    for label, members in by_topo.items():
        gap = summarize([float(r.params.get("spectral_gap", "nan")) for r in members])
        rows.append([label, members[0].tags.get("topology", ""), _cell(gap),
                     _cell(summarize([r.final("test_accuracy") for r in members])),
                     _cell(summarize([r.final("generalization_gap") for r in members])),
                     _cell(summarize([r.final("consensus_distance") for r in members]))])
    return ["<h2>Topologies (D-SGD)</h2>", page.table(
        ["sweep point", "topology", "spectral gap", "peers' test accuracy",
         "generalization gap", "consensus distance"], rows, "topologies")]


CONTEXT = [("model", "model.name"), ("data", "data.dataset.name"),
           ("partition", "data.partitioner.name"), ("clients", "clients.total"),
           ("per round", "clients.per_round"), ("Byzantine", "clients.byzantine"),
           ("aggregator", "aggregator.name"), ("attack", "attack.name"), ("rounds", "rounds"),
           ("local steps", "local.steps"), ("local epochs", "local.epochs"), ("lr", "local.lr")]


def context(runs: list[RunData]) -> str:
    """The scenario in one line: model, data, clients, Byzantine count, rounds, ...; a value
    that differs between runs reads "swept"."""
    parts = []
    for label, key in CONTEXT:
        values = list(dict.fromkeys(r.params.get(key, "null") for r in runs))
        if values in (["null"], ["None"]):
            continue
        shown = values[0] if len(values) == 1 else f"swept ({', '.join(values)})"
        parts.append(f"<b>{html.escape(label)}</b> {html.escape(shown)}")
    seeds = sorted({r.seed for r in runs if r.seed})
    if seeds:
        parts.append(f"<b>seeds</b> {html.escape(', '.join(seeds))}")
    return f'<p class="context">{" · ".join(parts)}</p>'


def byzfl_views(runs: list[RunData], page: Page | None = None) -> list[str]:
    """ByzFL's benchmark views (González et al., 2025): per setting (a rule, its
    hyperparameters and the other swept values) the accuracy with no attack and under each
    attack, and the worst attack; and per rule the setting that is best under its worst
    attack. The Byzantine count and the attack are the condition: a run with no Byzantine
    client or no attack is the "no attack" column, never a worst case. Drawn on ``page``
    (default: a page that exports nothing)."""
    page = page or Page()
    rb = robust(runs)
    if not rb.attacked or len(rb.conditions) < 2:
        return []
    cols = [rb.label(c) for c in rb.conditions]
    rows = []
    for s in rb.settings:
        w = rb.worst(s)
        rows.append([*s, *(rb.cell(s, c).text() for c in rb.conditions),
                     w[0].text() if w else "-", rb.label(w[1]) if w else "-"])
    head = ["aggregator", *rb.extra, *cols, "worst", "worst attack"]
    out = ["<h2>Worst case over attacks</h2>",
           ('<p class="note">Mean final test accuracy over seeds with no attack (no Byzantine '
            "client, or no attack) and under each attack, and the worst attack per setting "
            "(ByzFL's benchmark view). The number of Byzantine clients and the attack are the "
            "condition; the rule, its hyperparameters and the other swept values the setting. "
            "A run diverged when its loss or aggregate became non-finite; its cell says so and "
            "ranks below every accuracy.</p>"),
           page.table(head, rows, "worst-case")]
    best = rb.best_under_worst()
    clean = rb.clean[0] if len(rb.clean) == 1 else None
    out += ["<h2>Best setting under the worst attack</h2>",
            ('<p class="note">Per rule, the setting whose worst attack leaves the highest '
             "accuracy, best first" + (f"; {NO_ATTACK}: the same setting's accuracy with no "
                                       "attack" if clean else "") + ".</p>"),
            page.table(["aggregator", *(["hyperparameters"] if rb.hyper else []), *rb.extra,
                        "worst-case accuracy", "worst attack",
                        *([NO_ATTACK] if clean else [])],
                       [[rb.rule_of[next(r.run_id for r in rb.runs
                                         if rb.setting_of[r.run_id] == s)],
                         *([s[0]] if rb.hyper else []), *s[1:], cell.text(), rb.label(c),
                         *([rb.cell(s, clean).text()] if clean else [])]
                        for s, cell, c in best], "best-under-worst")]
    return out


def _summary(page: Page, groups: dict[str, list[RunData]]) -> list[str]:
    """The summary table: per sweep point, its final test accuracy and aggregation error."""
    rows = []
    for label, members in groups.items():
        acc = summarize([r.final("test_accuracy") for r in members])
        err = summarize([r.final("aggregation_error") for r in members])
        rows.append([label, str(len(members)), _cell(acc), _cell(err)])
    return ["<h2>Summary</h2>", page.table(["sweep point", "seeds", "final test accuracy",
                                         "final aggregation error"], rows, "summary")]


def render(title: str, runs: list[RunData], exports: Exports | None = None,
           searches: Sequence[tuple[Search, list[str], list[list[str]]]] = ()) -> str:
    """The report as one HTML document (inline CSS, SVG and a few lines of script);
    ``exports`` collects its figures and tables. ``searches``: each search (``fedray
    tune``) with its best-setting table (dashboards/search.py), drawn after the summary;
    ``runs`` are then its best trials' points."""
    page = Page(exports)
    groups: dict[str, list[RunData]] = {}
    for r in runs:
        groups.setdefault(r.group, []).append(r)
    parts = [f"<h1>fedray report: {html.escape(title)}</h1>", context(runs),
             (f'<p class="note">{len(runs)} run(s), {len(groups)} sweep point(s); mean ± '
             "standard deviation over seeds; bands span min to max over seeds. A sweep point "
             "keeps its colour and dash in every chart (colour: its aggregator, dash: its "
             "attack, where those tell the points apart).</p>")]
    if exports is not None:
        parts.append('<p class="note">Every figure as PDF and SVG is in <code>figures/</code> '
                     "beside this file, every table as Markdown and LaTeX in "
                     "<code>tables/</code>.</p>")
    parts += _summary(page, groups)
    for search, head, body in searches:
        parts += search_section(page, search, head, body)
    charts = []
    style = styles(runs)
    for key, label in CURVES:
        series, note = pick_series(_series(groups, key, style))
        if series:
            charts.append(page.chart(label, series, "round", key, note,
                                     _panels(runs, key) if len(series) > MAX_SERIES else None))
    if charts:
        parts += ["<h2>Curves</h2>", *charts]
    parts += _time_section(page, runs, groups, style)
    parts += _privacy_section(page, runs, groups)
    parts += _attacks_section(page, groups)
    parts += byzfl_views(runs, page)
    by_attack, by_f = _heat_maps(page, runs)
    if by_attack:
        parts += ["<h2>Aggregator x attack</h2>", *by_attack]
    if by_f:
        parts += ["<h2>Aggregator x f</h2>", *by_f]
    parts += _topology_section(page, runs)
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>fedray report: {html.escape(title)}</title><style>{CSS}</style></head>"
            f"<body>{''.join(parts)}<script>{JS}</script></body></html>")


def _search_of(run_id: str, tracking_uri: str | None
               ) -> tuple[Search, list[str], list[list[str]]] | None:
    """The search of a parent run and its best-setting table; None for a sweep's run."""
    from mlflow.tracking import MlflowClient

    from dashboards.search import best_rows, best_table, find_search, load_search
    from simulator.run.tracking import default_uri

    client = MlflowClient(tracking_uri or default_uri())
    parent = find_search(client, "", run_id)
    if parent is None:
        return None
    search = load_search(client, parent)
    return (search, *best_table(search, best_rows(client, search)))


def build_report(target: str | Sequence[str], out_dir: Path | None = None,
                 tracking_uri: str | None = None, log: bool = True) -> Path:
    """Write ``report.html`` (with ``figures/`` and ``tables/``) for one or several
    experiments or runs into ``out_dir`` (default ``./fedray-report/<target>``, the targets
    joined by ``+``) and log it on each scenario's parent run; returns its path. Across
    experiments every sweep point is named after its experiment too."""
    targets = [target] if isinstance(target, str) else list(target)
    collected = [collect(t, tracking_uri) for t in targets]
    title = " + ".join(c[0] for c in collected)
    runs: list[RunData] = []
    for name, _, members in collected:
        for r in members:
            if len(collected) > 1:
                r.group, r.name = f"{name}: {r.group}", f"{name}: {r.name}"
            runs.append(r)
    out = (out_dir or Path("fedray-report") / "+".join(targets))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.html"
    from dashboards.export import Exports, write_figures, write_tables

    exports = Exports()
    searches = [found for _, parent, _ in collected if parent is not None
                and (found := _search_of(parent, tracking_uri)) is not None]
    path.write_text(render(title, runs, exports, searches), encoding="utf-8")
    write_figures(exports, out / "figures")
    write_tables(exports, out / "tables")
    if log:
        from simulator.run.tracking import Tracker, default_uri

        for _, parent, _ in collected:
            if parent is not None:
                Tracker.of_run(tracking_uri or default_uri(), parent).log_artifact(
                    parent, path, "report")
    return path
