"""``fedray privacy compare``: the DP mechanisms of scenario files side by side, and the
privacy of finished runs: each run's accountant epsilon beside its empirical audit's estimate
and lower bound (``audit:``, docs/privacy.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def privacy_compare(paths: list[str], overrides: list[str] | None = None,
                    delta: float | None = None) -> list[dict[str, Any]]:
    """Every distinct DP mechanism of the scenarios (a sweep over, say, the noise multiplier
    gives one per value; points that differ only in the aggregator share one): its epsilon at
    ``delta`` (default: the scenario's own), the best attacker's advantage, and the
    Delta-divergence between every ordered pair of their trade-off curves with the prior at
    which it binds. A mechanism is named by its file, plus the sweep values that set it when
    the file has more than one."""
    # here, not above: the report reads runs' audits from this module without the engine
    from simulator.config.load import load
    from simulator.runtime.backend import InlineBackend
    from simulator.sim.engine import Engine
    from strategies.privacy import advantage, delta_divergence, excess_bayes_vulnerability

    alpha = np.linspace(0.0, 1.0, 2001)
    out = []
    for path in paths:
        found: dict[tuple, tuple[Any, Any]] = {}  # mechanism key -> (point, mechanism)
        for point in load(path, overrides).points:
            sc = point.scenario
            if sc.privacy is None:
                continue
            mech = Engine(sc, InlineBackend()).privacy_mechanism(sc.rounds)
            at = sc.privacy["delta"] if delta is None else delta
            found.setdefault((mech, at, sc.privacy["accountant"]), (point, mech))
        if not found:
            raise ValueError(f"{path}: has no privacy block")
        reps = [p for p, _ in found.values()]
        varying = [k for k in reps[0].values if len({str(p.values[k]) for p in reps}) > 1]
        for (mech, at, accountant), (point, _) in found.items():
            where = " ".join(f"{k.split('.')[-1]}={point.values[k]}" for k in varying)
            beta = mech.tradeoff(alpha)
            out.append({"path": f"{path} [{where}]" if where else path, "mechanism": mech,
                        "delta": at, "epsilon": mech.epsilon(at, accountant), "beta": beta,
                        "advantage": advantage(alpha, beta)})
    for a in out:
        a["divergence"] = {b["path"]: delta_divergence(alpha, a["beta"], b["beta"]) for b in out}
        a["binding_prior"] = {b["path"]: excess_bayes_vulnerability(alpha, a["beta"], b["beta"])[1]
                              for b in out if a["divergence"][b["path"]] > 0}  # printed only then
    return out


DEFAULT_AUDIT_DELTA = 1e-5  # an audit's delta without audit.delta or a privacy plugin's
# (simulator/runtime/audit.py's DEFAULT_DELTA, kept here so reading runs imports no torch)
AUDIT_METRICS = ("epsilon", "audit_epsilon", "audit_epsilon_lower", "audit_canaries_inserted")
_UNSET = ("", "null", "None")


@dataclass(frozen=True)
class AuditFacts:
    """A run's privacy as it logged it: the accountant's final ``epsilon`` at ``delta`` (nan
    without a privacy block), and for an audited run its audit's final estimate (Andrew et
    al., ICLR 2024), lower bound (Steinke, Nasr, Jagielski, NeurIPS 2023; nan when not
    logged, which ``lower_expected`` False explains: only at ``audit.inserted: 0.5``), the
    canaries inserted of ``canaries``, at ``audit_delta``."""

    private: bool
    epsilon: float
    delta: float
    audited: bool
    canaries: int
    inserted: float
    estimate: float
    lower: float
    lower_expected: bool
    audit_delta: float

    @property
    def measured(self) -> bool:
        """Whether the audit logged a statistic (a run that ended before its first audit
        did not)."""
        return self.audited and not (math.isnan(self.estimate) and math.isnan(self.lower))

    @property
    def exceeded(self) -> bool:
        """Whether the audit's lower bound is above the accountant's epsilon at the same delta:
        the run leaks more than its guarantee allows (at the audit's confidence)."""
        return (self.private and self.audited and self.delta == self.audit_delta
                and self.lower > self.epsilon)


def _param_float(params: Mapping[str, str], key: str) -> float:
    value = params.get(key)
    if value is None or value in _UNSET:
        return math.nan
    try:
        return float(value)
    except ValueError:
        return math.nan


def audit_delta(params: Mapping[str, str]) -> float:
    """The delta of a run's audit from its logged params: ``audit.delta``, else the privacy
    plugin's ``privacy.delta``, else 1e-5 (as the server resolves it,
    simulator/runtime/audit.py)."""
    for key in ("audit.delta", "privacy.delta"):
        value = _param_float(params, key)
        if not math.isnan(value):
            return value
    return DEFAULT_AUDIT_DELTA


def audit_facts(params: Mapping[str, str], final: Mapping[str, float]) -> AuditFacts:
    """A run's ``AuditFacts`` from its logged params (the resolved scenario, flattened) and
    the final values of its metrics by plain name (``AUDIT_METRICS``; nan or absent: not
    logged). The accountant's epsilon is the last one logged, else the ``privacy.epsilon``
    param (the whole run's)."""
    def last(key: str) -> float:
        value = final.get(key, math.nan)
        return math.nan if value is None else float(value)

    private = params.get("privacy.name", "null") not in _UNSET
    epsilon = last("epsilon")
    if math.isnan(epsilon):
        epsilon = _param_float(params, "privacy.epsilon")
    audited = params.get("audit.canaries", "null") not in _UNSET
    return AuditFacts(
        private=private, epsilon=epsilon if private else math.nan,
        delta=_param_float(params, "privacy.delta") if private else math.nan,
        audited=audited,
        canaries=int(_param_float(params, "audit.canaries")) if audited else 0,
        inserted=last("audit_canaries_inserted"), estimate=last("audit_epsilon"),
        lower=last("audit_epsilon_lower"),
        lower_expected=audited and _param_float(params, "audit.inserted") == 0.5,
        audit_delta=audit_delta(params) if audited else math.nan)


def runs_of(client: Any, target: str, uri: str, flag: str = "--runs ") -> list[Any]:
    """The runs ``target`` names: an experiment (its latest scenario run's point runs), a
    scenario run (its point runs) or a run; a problem names the target after ``flag``."""
    from simulator.errors import UsageError, redact
    from simulator.run.tracking import child_runs, latest_scenario_run

    exp = client.get_experiment_by_name(target)
    if exp is not None:
        found = latest_scenario_run(client, exp.experiment_id, False,
                                    lambda runs: any(r.data.metrics for r in runs))
        if found is None:
            raise UsageError(f"{flag}{target!r}: experiment {target!r} has no fedray "
                             "scenario run")
        _, children, logged = found
        if logged is not None and logged is not found[0]:  # a failed last attempt: no round
            children = child_runs(client, exp.experiment_id, logged.info.run_id)
        return children
    try:
        run = client.get_run(target)
    except Exception:  # noqa: BLE001 - MLflow raises its own types for a missing run
        raise UsageError(f"{flag}{target!r}: neither an experiment nor a run in "
                         f"{redact(uri)}") from None
    if run.data.tags.get("fedray.kind") == "scenario":
        return child_runs(client, run.info.experiment_id, run.info.run_id)
    return [run]


def audited_runs(targets: Sequence[str], tracking_uri: str | None = None
                 ) -> list[tuple[str, str, AuditFacts]]:
    """(run name, run id, its ``AuditFacts``) of every run the ``targets`` name (experiment
    names, scenario run ids, run ids; see ``runs_of``), in order, each run once, from the
    final values it logged."""
    from mlflow.tracking import MlflowClient

    from simulator.metric_names import mlflow_name
    from simulator.run.reductions import from_mlflow
    from simulator.run.tracking import default_uri, ensure_store

    uri = tracking_uri or default_uri()
    ensure_store(uri)
    client = MlflowClient(uri)
    out, seen = [], set()
    for target in targets:
        for run in runs_of(client, target, uri):
            if run.info.run_id in seen:
                continue
            seen.add(run.info.run_id)
            metrics = run.data.metrics
            final = {k: from_mlflow(metrics[mlflow_name(k)]) for k in AUDIT_METRICS
                     if mlflow_name(k) in metrics}
            out.append((run.info.run_name, run.info.run_id,
                        audit_facts(dict(run.data.params), final)))
    return out


def audit_line(name: str, run_id: str, facts: AuditFacts) -> str:
    """One run of ``fedray privacy compare --runs`` in a line: its accountant epsilon, then
    its audit's estimate and lower bound, or why there are none."""
    head = f"{name} ({run_id}): "
    if facts.private:
        head += f"accountant epsilon {facts.epsilon:.4g} at delta {facts.delta:g}"
    else:
        head += "no privacy block (no accountant epsilon)"
    if not facts.audited:
        return head + "; not audited (no audit: block)"
    if not facts.measured:
        return head + (f"; audited with {facts.canaries} canaries, but no audit statistic "
                       "logged (the run ended before its first audit)")
    lower = f"{facts.lower:.4g}" if not math.isnan(facts.lower) else \
        "none (only at audit.inserted 0.5)" if not facts.lower_expected else "not logged"
    inserted = f"{facts.inserted:.0f}" if math.isfinite(facts.inserted) else "?"
    estimate = "undefined (fewer than 2 canaries inserted)" if math.isnan(facts.estimate) \
        else f"{facts.estimate:.4g}"
    return head + (f"; audited at delta {facts.audit_delta:g} ({inserted} of {facts.canaries} "
                   f"canaries inserted): estimate {estimate}, lower bound {lower}"
                   + ("  (the lower bound is above the accountant's epsilon: the run leaks "
                      "more than its guarantee)" if facts.exceeded else ""))
