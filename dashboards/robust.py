"""The robust-FL reading of a sweep, as ByzFL's benchmark views read it (González et al.,
"ByzFL: Research Framework for Robust Federated Learning", 2025): each run evaluates a
SETTING (the aggregation rule, its hyperparameters and any other swept value that is not the
threat) under a CONDITION (the number of Byzantine clients and the attack).

A run with no Byzantine client, or with no attack, is the "no attack" condition whatever attack
its scenario names: the reference beside the attacks, never a rule's worst case. A cell (a
setting under a condition) whose runs diverged reads "diverged" and ranks below every finite
accuracy; it is never averaged with the runs that did not.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dashboards.rundata import RunData

NO_ATTACK = "no attack"
# the paths of a scenario that make the threat (the condition), not the setting
CONDITION_PATHS = ("clients.byzantine", "attack")
IGNORED = ("seed", "seeds", "name", "description")


def plugin_name(run: RunData, kind: str) -> str:
    """The name of the run's ``kind`` plugin (``aggregator``, ``attack``): its tag, else its
    param, else ``none``."""
    return run.tags.get(kind) or run.params.get(f"{kind}.name") or "none"


def plugin_labels(runs: Sequence[RunData], kind: str,
                  keep: set[str] | None = None) -> dict[str, str]:
    """run id -> ``name(k=v, ...)``: the plugin's name and those of its params that differ
    between runs of that name (``gaussian(sigma=10.0)`` only when another gaussian run has
    another sigma), so a label names what varies and nothing else. ``keep``: the only param
    paths that may be named (default: all)."""
    by_name: dict[str, list[RunData]] = {}
    for r in runs:
        by_name.setdefault(plugin_name(r, kind), []).append(r)
    out = {}
    for name, members in by_name.items():
        keys = sorted({k for r in members for k in r.params
                       if k.startswith(kind + ".") and k != f"{kind}.name"})
        varying = [k for k in keys if len({r.params.get(k) for r in members}) > 1
                   and (keep is None or k in keep)]
        for r in members:
            args = ", ".join(f"{k[len(kind) + 1:]}={r.params.get(k, 'null')}" for k in varying)
            out[r.run_id] = f"{name}({args})" if args else name
    return out


def _f(run: RunData) -> int:
    """The run's number of Byzantine clients; -1 when it does not say (then its attack alone
    tells whether it was attacked)."""
    raw = run.tags.get("f") or run.params.get("clients.byzantine") or ""
    try:
        return int(raw)
    except ValueError:
        return -1


@dataclass(frozen=True)
class Condition:
    """The threat a run was under: ``f`` Byzantine clients (-1: not known) running ``attack``
    (its label), or NO_ATTACK."""

    f: int
    attack: str

    @property
    def clean(self) -> bool:
        return self.attack == NO_ATTACK


@dataclass
class Cell:
    """The runs of one setting under one condition (every seed; for "no attack", every attack
    name the scenario gave its f = 0 runs)."""

    runs: list[RunData] = field(default_factory=list)

    @property
    def diverged(self) -> int:
        return sum(1 for r in self.runs if r.diverged)

    @property
    def values(self) -> list[float]:
        return [v for r in self.runs if math.isfinite(v := r.final("test_accuracy"))]

    @property
    def mean(self) -> float:
        """Mean final test accuracy; nan when a run diverged or none logged it."""
        vals = self.values
        return statistics.fmean(vals) if vals and not self.diverged else math.nan

    @property
    def std(self) -> float:
        vals = self.values
        return statistics.stdev(vals) if len(vals) > 1 and not self.diverged else \
            (0.0 if vals and not self.diverged else math.nan)

    @property
    def rank(self) -> float:
        """For the worst case: a diverged cell below every accuracy; nan for no data."""
        return -math.inf if self.diverged else self.mean

    def text(self) -> str:
        if not self.runs:
            return "-"
        if self.diverged:
            return f"diverged ({self.diverged} of {len(self.runs)} runs)"
        return f"{self.mean:.4g}" if math.isfinite(self.mean) else "-"


@dataclass
class Robust:
    """A sweep read as settings x conditions (see the module's docstring)."""

    runs: list[RunData]
    extra: list[str]  # swept paths of the setting besides the aggregator (local.lr, ...)
    condition_of: dict[str, Condition]
    setting_of: dict[str, tuple[str, ...]]  # (aggregator label, *extra values)
    rule_of: dict[str, str]  # the aggregator's name
    conditions: list[Condition]
    settings: list[tuple[str, ...]]
    hyper: bool  # whether some rule's hyperparameters differ between its runs

    @property
    def attacked(self) -> list[Condition]:
        return [c for c in self.conditions if not c.clean]

    @property
    def clean(self) -> list[Condition]:
        return [c for c in self.conditions if c.clean]

    def label(self, c: Condition, with_f: bool | None = None) -> str:
        """``sign_flip``; ``sign_flip f=3`` when the attacked conditions differ in f;
        ``no attack``, ``no attack (f=3)`` when the clean ones do."""
        same = self.clean if c.clean else self.attacked
        if with_f is None:
            with_f = len({d.f for d in same}) > 1
        if c.clean:
            return f"{NO_ATTACK} (f={c.f})" if with_f else NO_ATTACK
        return f"{c.attack} f={c.f}" if with_f else c.attack

    def cell(self, setting: tuple[str, ...], c: Condition) -> Cell:
        return Cell([r for r in self.runs if self.setting_of[r.run_id] == setting
                     and self.condition_of[r.run_id] == c])

    def worst(self, setting: tuple[str, ...]) -> tuple[Cell, Condition] | None:
        """The setting's worst attacked condition (a diverged one first); None without
        one it ran under."""
        found = [(self.cell(setting, c), c) for c in self.attacked]
        found = [(cell, c) for cell, c in found if cell.runs and not math.isnan(cell.rank)]
        return min(found, key=lambda cc: cc[0].rank) if found else None

    def best_under_worst(self) -> list[tuple[tuple[str, ...], Cell, Condition]]:
        """Per rule (aggregator name), the setting whose worst attacked condition is the
        best, ranked best first; rules with no attacked run are left out."""
        best: dict[str, tuple[tuple[str, ...], Cell, Condition]] = {}
        for s in self.settings:
            w = self.worst(s)
            if w is None:
                continue
            rule = next(self.rule_of[r.run_id] for r in self.runs if self.setting_of[r.run_id] == s)
            if rule not in best or w[0].rank > best[rule][1].rank:
                best[rule] = (s, *w)
        return sorted(best.values(), key=lambda b: -b[1].rank)


def _follows_condition(runs: Sequence[RunData], key: str, condition_of: dict[str, Condition]
                       ) -> bool:
    """Whether ``key`` is set by the condition: one value for each rule under each condition,
    and for some rule different values under different conditions (an aggregator's f zipped
    with the Byzantine count)."""
    seen: dict[tuple[str, Condition], set[str | None]] = {}
    for r in runs:
        seen.setdefault((plugin_name(r, "aggregator"), condition_of[r.run_id]), set()).add(
            r.params.get(key))
    if any(len(v) > 1 for v in seen.values()):
        return False
    per_rule: dict[str, set[str | None]] = {}
    for (rule, _), v in seen.items():
        per_rule.setdefault(rule, set()).update(v)
    return any(len(v) > 1 for v in per_rule.values())


def robust(runs: Sequence[RunData]) -> Robust:
    """The settings x conditions reading of ``runs``. A swept value that follows the
    condition (an aggregator's f zipped with the Byzantine count) is part of the condition,
    not of the setting."""
    runs = list(runs)
    attack_label = plugin_labels(runs, "attack")
    condition_of = {}
    for r in runs:
        f = _f(r)
        clean = f == 0 or plugin_name(r, "attack") == "none"
        condition_of[r.run_id] = Condition(f, NO_ATTACK if clean else attack_label[r.run_id])
    keys = sorted(set().union(*(r.params for r in runs))) if runs else []
    varying = [k for k in keys if len({r.params.get(k) for r in runs}) > 1
               and k not in IGNORED
               and not any(k == p or k.startswith(p + ".") for p in CONDITION_PATHS)
               and not _follows_condition(runs, k, condition_of)]
    rule_keys = {k for k in varying if k.startswith("aggregator.")}
    extra = [k for k in varying if k not in rule_keys]
    rule_label = plugin_labels(runs, "aggregator", keep=rule_keys)
    setting_of = {r.run_id: (rule_label[r.run_id], *(r.params.get(k, "null") for k in extra))
                  for r in runs}
    attacked_order = list(dict.fromkeys(c.attack for c in condition_of.values() if not c.clean))
    conditions = sorted(set(condition_of.values()), key=lambda c: (
        not c.clean, c.f, attacked_order.index(c.attack) if not c.clean else 0))
    return Robust(runs, extra, condition_of, setting_of,
                  {r.run_id: plugin_name(r, "aggregator") for r in runs}, conditions,
                  list(dict.fromkeys(setting_of[r.run_id] for r in runs)),
                  any(label != rule for label, rule in
                      ((rule_label[r.run_id], plugin_name(r, "aggregator")) for r in runs)))
