"""``fedray privacy compare``: the DP mechanisms of scenario files side by side."""

from __future__ import annotations

from typing import Any

import numpy as np

from simulator.config.load import load
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine
from strategies.privacy import advantage, delta_divergence, excess_bayes_vulnerability


def privacy_compare(paths: list[str], overrides: list[str] | None = None,
                    delta: float | None = None) -> list[dict[str, Any]]:
    """Every distinct DP mechanism of the scenarios (a sweep over, say, the noise multiplier
    gives one per value; points that differ only in the aggregator share one): its epsilon at
    ``delta`` (default: the scenario's own), the best attacker's advantage, and the
    Delta-divergence between every ordered pair of their trade-off curves with the prior at
    which it binds. A mechanism is named by its file, plus the sweep values that set it when
    the file has more than one."""
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
