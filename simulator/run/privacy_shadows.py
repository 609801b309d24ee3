"""``fedray privacy shadows``: a shadow-run membership attack (LiRA, ``privacy_attacks:
[{name: lira, runs: R}]``) combined over its finished runs. Each run scored the same
candidates on its final model and trained on half of them (``privacy/attack_<name>.parquet``:
candidate, label, included, score); here each run in turn is the target and the others its
shadows (the attack's ``combine``), and the target's membership scores are measured against
what it trained on: AUC, TPR at 0.1 % and 1 % FPR (Carlini et al.'s low-FPR measure) and the
advantage (TPR - FPR of a threshold chosen on half the candidates, measured on the others),
logged on the target run as ``<name>_shadows_<measure>`` beside its ``<name>_advantage_bound``
(the largest advantage its DP allows)."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MEASURES = ("auc", "advantage", "tpr_at_fpr_0.001", "tpr_at_fpr_0.01")
MIN_RUNS = 3  # a target and two shadows at least (one that trained on a candidate, one not)


def shadow_point(name: str, tags: Any) -> str:
    """A run's point label (its ``name``, or the name less its seed), without the ``run=K``
    of a shadow-run attack's run (``tags``' ``fedray.shadow_run``: the runs of one point are
    its samples, as its seeds are); ``shadow runs`` when nothing else is left; ``name`` as
    it is for another run."""
    run = tags.get("fedray.shadow_run")
    if run is None:
        return name
    return " ".join(w for w in name.split() if w != f"run={run}") or "shadow runs"


@dataclass
class ShadowGroup:
    """The finished runs of one shadow-run attack (one point and seed): its ``label`` (the
    runs' name without their run), the attack's ``name``, each run's name, id and measures
    as a target, and the largest advantage its DP allows (``bound``; 1 without DP)."""

    label: str
    name: str
    runs: list[tuple[str, str, dict[str, float]]] = field(default_factory=list)
    bound: float = math.nan
    skipped: str = ""  # why the group was not combined (too few runs), or ""

    def summary(self, measure: str) -> tuple[float, float]:
        """The mean and standard deviation over the targets of ``measure``."""
        values = np.array([m[measure] for _, _, m in self.runs], dtype=np.float64)
        if not len(values):
            return math.nan, math.nan
        return float(values.mean()), float(values.std(ddof=1)) if len(values) > 1 else 0.0


def combine_runs(attack: Any, scores: np.ndarray, included: np.ndarray, seed: int
                 ) -> list[dict[str, float]]:
    """Each run of ``scores`` ``(r, m)`` (its candidates' scores) with ``included`` ``(r, m)``
    as the target, the others its shadows: the measures of the attack's combined scores
    against what the target trained on (``MEASURES``), the advantage's halves drawn from
    ``seed`` and the target's index."""
    from simulator.seeding import numpy_rng
    from strategies.privacy_attacks import auc_advantage, tpr_at_fpr

    out = []
    for t in range(len(scores)):
        others = np.arange(len(scores)) != t
        s = attack.combine(scores[t], scores[others], included[others])
        member = included[t]
        m = auc_advantage(s, member, numpy_rng(seed, "privacy_shadows", t))
        m["tpr_at_fpr_0.001"] = tpr_at_fpr(s, member, 0.001)
        m["tpr_at_fpr_0.01"] = tpr_at_fpr(s, member, 0.01)
        out.append(m)
    return out


def shadow_groups(targets: Sequence[str], tracking_uri: str | None = None,
                  log: bool = True) -> list[ShadowGroup]:
    """Every shadow-run attack among the finished runs ``targets`` name (experiment names:
    their latest scenario run's runs; scenario run ids; run ids), combined
    (:func:`combine_runs`) and, with ``log``, its measures logged on each target run at its
    last round. A group of fewer than ``MIN_RUNS`` finished runs is listed, not combined."""
    from mlflow.tracking import MlflowClient

    from simulator.run.tracking import default_uri, ensure_store

    uri = tracking_uri or default_uri()
    ensure_store(uri)
    client = MlflowClient(uri)
    return [_combine_group(client, runs, log) for runs in _grouped(client, targets, uri)]


def _grouped(client: Any, targets: Sequence[str], uri: str) -> list[list[Any]]:
    """The finished runs of shadow-run attacks the targets name, by attack (point and seed),
    each group in run-name order; UsageError when there are none."""
    from simulator.errors import UsageError
    from simulator.run.privacy_compare import runs_of

    groups: dict[str, list[Any]] = {}
    seen: set[str] = set()
    for target in targets:
        for run in runs_of(client, target, uri, ""):
            tags = run.data.tags
            if run.info.run_id in seen or "fedray.shadow_group" not in tags or \
                    run.info.status != "FINISHED":
                continue
            seen.add(run.info.run_id)
            groups.setdefault(tags["fedray.shadow_group"], []).append(run)
    if not groups:
        raise UsageError(f"{', '.join(map(repr, targets))}: no finished run of an attack with "
                         "shadow runs (privacy_attacks: [{name: lira, runs: R}])")
    return [sorted(runs, key=lambda r: r.info.run_name) for runs in groups.values()]


def _combine_group(client: Any, runs: list[Any], log: bool) -> ShadowGroup:
    """One attack's runs combined (``shadow_groups``)."""
    import yaml

    from simulator import registry
    from simulator.errors import UsageError
    from simulator.run.reductions import from_mlflow

    first = runs[0]
    name = first.data.tags["fedray.shadow_attack"]
    label = shadow_point(first.info.run_name, first.data.tags)
    group = ShadowGroup(label, name)
    bound = first.data.metrics.get(f"{name}_advantage_bound")
    group.bound = math.nan if bound is None else from_mlflow(bound)
    if len(runs) < MIN_RUNS:
        group.skipped = f"{len(runs)} finished run(s); at least {MIN_RUNS}"
        return group
    with tempfile.TemporaryDirectory() as tmp:
        sc = yaml.safe_load(Path(client.download_artifacts(
            first.info.run_id, "scenario.yaml", tmp)).read_text())
        spec = next(a for a in sc["privacy_attacks"] if a["name"] == name)
        tables = [_table(client, r.info.run_id, name, tmp) for r in runs]
    if any(not np.array_equal(t[0], tables[0][0]) for t in tables):
        raise UsageError(f"{label}: the runs of {name} scored different candidates "
                         "(a run of another data split?); run them again together")
    attack = registry.instantiate("privacy_attacks", spec)
    measures = combine_runs(attack, np.stack([t[1] for t in tables]),
                            np.stack([t[2] for t in tables]),
                            int(first.data.params.get("seed", 0)))
    last = int(first.data.params.get("rounds", 1)) - 1  # the last round's step (0-based)
    for r, m in zip(runs, measures, strict=True):
        group.runs.append((r.info.run_name, r.info.run_id, m))
        if log:
            for k, v in m.items():
                client.log_metric(r.info.run_id, f"{name}_shadows_{k}", v, step=last)
    return group


def _table(client: Any, run_id: str, name: str, tmp: str
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A run's candidate labels, scores and inclusion from its attack table."""
    import pyarrow.parquet as pq

    t = pq.read_table(client.download_artifacts(run_id, f"privacy/attack_{name}.parquet", tmp),
                      columns=["label", "score", "included"])
    return (t.column("label").to_numpy(), t.column("score").to_numpy().astype(np.float64),
            t.column("included").to_numpy().astype(bool))


def group_lines(group: ShadowGroup) -> list[str]:
    """A group as ``fedray privacy shadows`` prints it: each target run's measures, then
    their mean ± std beside the bound."""
    head = f"{group.label}: {group.name}"
    if group.skipped:
        return [f"{head}: not combined ({group.skipped})"]
    lines = [f"{head}, {len(group.runs)} runs, each the target of the others:"]
    for run_name, run_id, m in group.runs:
        lines.append(f"  {run_name} ({run_id}): AUC {m['auc']:.4f}, advantage "
                     f"{m['advantage']:.4f}, TPR {m['tpr_at_fpr_0.001']:.4f} at 0.1 % FPR, "
                     f"{m['tpr_at_fpr_0.01']:.4f} at 1 %")
    auc, adv = group.summary("auc"), group.summary("advantage")
    lo, one = group.summary("tpr_at_fpr_0.001"), group.summary("tpr_at_fpr_0.01")
    lines.append(f"  mean ± std: AUC {auc[0]:.4f} ± {auc[1]:.4f}, advantage {adv[0]:.4f} ± "
                 f"{adv[1]:.4f} (DP allows at most {group.bound:.4f}), TPR {lo[0]:.4f} at "
                 f"0.1 % FPR, {one[0]:.4f} at 1 %")
    return lines
