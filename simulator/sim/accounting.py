"""A run's privacy accounting: the DP mechanism its rounds compose, the epsilon spent after
each evaluated round, and the final epsilon, privacy profile and trade-off curve."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from simulator import registry
from simulator.config.plan import Plan, build_codecs, build_privacy


def seen_privacy(plan: Plan) -> Any:
    """The privacy plugin whose mechanism the server's view composes: the scenario's, or
    under secure aggregation over groups of ``g`` of a round's ``m`` rows with client-level
    DP, the same plugin at noise multiplier ``z * sqrt(g / m)``: each group sum carries
    ``g`` of the ``m`` noise shares, and each client is in one group (None without
    privacy)."""
    privacy = build_privacy(plan)
    if privacy is None or plan.privacy_level != "client":
        return privacy
    c = plan.scenario.clients
    m = min(c.sampled, c.total)
    hiding = [codec for codec in build_codecs(plan) if codec.hides_rows()]
    groups = hiding[0].output_rows(m) if hiding else 1
    if groups <= 1:  # one sum of the round: the central mechanism's noise
        return privacy
    size = math.ceil(m / groups)  # the largest group: the least noise a sum carries
    assert plan.privacy is not None
    return registry.instantiate("privacy", {
        **plan.privacy, "noise_multiplier": privacy.noise_multiplier * math.sqrt(size / m)})


class PrivacyAccountant:
    """What a run's privacy plugin spends (nothing without one; under secure aggregation
    over groups, what the group sums the server sees spend: :func:`seen_privacy`)."""

    def __init__(self, plan: Plan, client_sizes: np.ndarray, local_steps: np.ndarray) -> None:
        self.plan = plan
        self.privacy = seen_privacy(plan)
        self.client_sizes, self.local_steps = client_sizes, local_steps
        self._mechanism: tuple[int, Any] = (-1, None)  # (rounds, mechanism) last composed

    def mechanism(self, rounds: int) -> Any:
        """The run's DP mechanism after ``rounds`` rounds, as a composition of subsampled
        Gaussians (None without privacy); the plugin says what is composed, from the
        client-sampling rate, the largest per-example rate batch_size / size over the clients
        and the most local steps any client takes in a round."""
        if self.privacy is None:
            return None
        if self._mechanism[0] != rounds:  # the last one is kept: the final round's epsilon
            sc = self.plan.scenario  # and the run's privacy outputs share one composition
            c = sc.clients
            sizes = np.maximum(self.client_sizes, 1)
            self._mechanism = (rounds, self.privacy.mechanism(
                rounds, min(1.0, c.sampled / c.total),
                float(min(1.0, sc.local.batch_size / sizes.min())),
                int(self.local_steps.max())))
        return self._mechanism[1]

    def spent(self, rounds: int) -> dict[str, float]:
        """``{"epsilon": ...}``: the privacy spent after ``rounds`` rounds at the scenario's
        delta ({} without privacy)."""
        if self.privacy is None:
            return {}
        return {"epsilon": self.mechanism(rounds).epsilon(self.privacy.delta,
                                                          self.privacy.accountant)}

    def reconstruction_bound(self, target: str, kappa: float) -> float:
        """Hayes, Mahloujifar, Balle (NeurIPS 2023): under f-DP a reconstruction succeeds
        with probability at most 1 - f(kappa), kappa its success probability from the prior
        alone; f here is one round's mechanism with the target known to take part (client
        rate 1): sample-level DP's on a client's update, client-level DP's on the round's
        release. 1 where DP does not cover what the attack sees (no privacy, or client-level
        DP and the client's own row, which its server sees in the clear)."""
        p = self.privacy
        covered = p is not None and (self.plan.privacy_level == "sample" or target == "release")
        if not covered:
            return 1.0
        sc = self.plan.scenario
        sizes = np.maximum(self.client_sizes, 1)
        mech = p.mechanism(1, 1.0, float(min(1.0, sc.local.batch_size / sizes.min())),
                           int(self.local_steps.max()))
        alpha = np.linspace(0.0, 1.0, 10001)
        return float(1.0 - np.interp(kappa, alpha, mech.tradeoff(alpha)))

    def advantage_bound(self) -> float:
        """The largest membership advantage (TPR - FPR) the run's whole mechanism allows
        (1 without privacy)."""
        from strategies.privacy import advantage

        mech = self.mechanism(self.plan.scenario.rounds)
        if mech is None:
            return 1.0
        alpha = np.linspace(0.0, 1.0, 10001)
        return advantage(alpha, mech.tradeoff(alpha))

    def outputs(self) -> tuple[dict[str, str], dict[str, dict[str, list[float]]]]:
        """Final epsilon as a param, the privacy profile and trade-off curve as tables."""
        mech = self.mechanism(self.plan.scenario.rounds)
        if mech is None or self.privacy is None:
            return {}, {}
        p = self.privacy
        eps = mech.epsilon(p.delta, p.accountant)
        grid = np.linspace(0.0, max(2 * eps, 1.0) if math.isfinite(eps) else 10.0, 101)
        alpha = np.linspace(0.0, 1.0, 1001)
        return ({"privacy.epsilon": f"{eps:.6g}", "privacy.steps": str(mech.steps),
                 "privacy.sampling_rate": f"{mech.q:.6g}"},
                {"privacy_profile": {"epsilon": grid.tolist(), "delta": mech.profile(grid).tolist()},
                 "tradeoff": {"alpha": alpha.tolist(), "beta": mech.tradeoff(alpha).tolist()}})
