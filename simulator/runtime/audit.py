"""An empirical privacy audit (``audit:``; docs/privacy.md): canary clients whose update is
a fixed random direction, appended to a round's rows on the server as the clients they are
(client-level DP, or none), or under sample-level DP canary examples that the clients'
DP-SGD adds to its clipped per-example gradients; and the audit's statistics from the
model's change since the start.

A canary is a client of the population that owns no data: ``audit.canaries`` of them, each
inserted with probability ``audit.inserted`` (seeded, once), an inserted one sampled each
round with the clients' sampling rate ``clients.sampled / clients.total`` (its own seeded
stream, so the honest clients' sampling is untouched). Its update is its direction (a
random unit vector of the model's size, seeded per canary) times ``audit.norm``: client-level
DP's clip, else the median norm of the round's honest rows. Canary rows go through the
server's half of the message path as a client's would (DP-FedAvg clips them and counts them
in the noised mean); they are no honest client's row, so the robust metrics
(``aggregation_error``, ``honest_update_norm``) leave them out.

Under sample-level DP (``dp_sgd``) a canary is an example instead (Steinke, Nasr, Jagielski's
gradient canaries): owned by a client drawn for it (seeded), inserted with probability
``audit.inserted``, it is Poisson-sampled in each of that client's DP-SGD steps at the
examples' rate, and its per-example gradient is ``-clip`` times its direction, clipped like
the others' and noised with them (``ClientData.canaries``; the worker holds them).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from simulator.config.plan import Plan, build_privacy
from simulator.seeding import numpy_rng, torch_generator
from strategies.audit import one_run_epsilon, one_shot_epsilon, unit_directions

DEFAULT_DELTA = 1e-5
CHUNK = 1 << 24  # floats of canary directions drawn at once when scoring (64 MB)
KEEP = 1 << 26  # inserted canaries' directions kept between rounds up to this many floats


class CanaryAudit:
    """Canaries of one run point: who is inserted, who is sampled each round, their rows,
    and the audit's statistics (see the module docstring)."""

    def __init__(self, plan: Plan, x0: torch.Tensor | None = None) -> None:
        sc = plan.scenario
        audit = sc.audit
        assert audit is not None
        self.audit, self.seed = audit, plan.seed
        # the model the run starts from (the server's; a worker scores nothing)
        self.x0 = x0.clone() if x0 is not None else torch.zeros(0)
        self.inserted = numpy_rng(plan.seed, "audit", "inserted").random(audit.canaries) \
            < audit.inserted
        # sample-level DP: canary examples, each held by a client drawn for it
        self.examples = plan.privacy_level == "sample"
        self.owners = numpy_rng(plan.seed, "audit", "owners").integers(
            sc.clients.total, size=audit.canaries)
        self.rate = min(1.0, sc.clients.sampled / sc.clients.total)
        privacy = build_privacy(plan)
        client_dp = privacy is not None and plan.privacy_level == "client"
        self.norm = audit.norm if audit.norm is not None else \
            (float(privacy.clip) if client_dp else None)
        self.delta = audit.delta if audit.delta is not None else \
            (float(privacy.delta) if privacy is not None else DEFAULT_DELTA)
        self._directions: dict[int, torch.Tensor] = {}  # the inserted ones, once drawn

    def sampled(self, round_: int) -> np.ndarray:
        """The inserted canaries sampled in round ``round_`` (sorted ids)."""
        ids = np.flatnonzero(self.inserted)
        draw = numpy_rng(self.seed, "audit", "round", round_).random(len(self.inserted))
        return ids[draw[ids] < self.rate]

    def directions(self, ids: np.ndarray | list[int], d: int) -> torch.Tensor:
        """The unit directions of canaries ``ids`` (k, d), each from its own seeded
        stream."""
        return unit_directions([torch_generator(self.seed, "audit", "canary", int(i))
                                for i in ids], d)

    def held_by(self, client: int) -> np.ndarray:
        """The inserted canary examples client ``client`` holds (sample-level DP)."""
        return np.flatnonzero(self.inserted & (self.owners == client))

    def rows(self, round_: int, honest: torch.Tensor) -> torch.Tensor:
        """Round ``round_``'s canary rows (k, width): their directions times the norm, in
        the model-delta columns ``honest`` rows start with (none for canary examples)."""
        ids = self.sampled(round_) if not self.examples else np.zeros(0, np.int64)
        d = int(self.x0.numel())
        out = torch.zeros((len(ids), honest.shape[1]), dtype=honest.dtype)
        if not len(ids):
            return out
        norm = self.norm
        if norm is None:  # as loud as the round's median honest client
            norm = float(torch.linalg.vector_norm(honest[:, :d], dim=1).median()) \
                if len(honest) else 0.0
        if int(self.inserted.sum()) * d > KEEP:  # drawn again each round
            out[:, :d] = norm * self.directions(ids, d)
            return out
        missing = [int(i) for i in ids if int(i) not in self._directions]
        if missing:
            self._directions.update(zip(missing, self.directions(missing, d), strict=True))
        out[:, :d] = norm * torch.stack([self._directions[int(i)] for i in ids])
        return out

    def cosines(self, x: torch.Tensor) -> np.ndarray:
        """The cosine of the model's change ``x - x0`` with every canary's direction (0 for
        no change), drawn CHUNK floats' worth of canaries at a time."""
        change = (x - self.x0).to(torch.float64)
        size = float(torch.linalg.vector_norm(change))
        m, d = len(self.inserted), int(change.numel())
        out = np.zeros(m)
        if size == 0.0:
            return out
        step = max(1, CHUNK // d)
        for start in range(0, m, step):
            ids = np.arange(start, min(start + step, m))
            out[ids] = (self.directions(ids, d).to(torch.float64) @ change).numpy() / size
        return out

    def statistics(self, x: torch.Tensor) -> tuple[dict[str, float], np.ndarray]:
        """The audit's metrics for the model ``x`` and the canaries' cosines:
        ``audit_epsilon`` (Andrew et al.'s estimate), ``audit_epsilon_lower`` (Steinke et
        al.'s bound, at ``inserted: 0.5``), the cosines' means and standard deviations in
        and out."""
        cos = self.cosines(x)
        d = int(x.numel())
        ins, out = cos[self.inserted], cos[~self.inserted]

        def moments(v: np.ndarray) -> tuple[float, float]:
            return (float(v.mean()) if len(v) else math.nan,
                    float(v.std(ddof=1)) if len(v) > 1 else math.nan)

        metrics = {"audit_epsilon": one_shot_epsilon(ins, d, self.delta),
                   "audit_canaries_inserted": float(len(ins))}
        (metrics["audit_cosine_in_mean"], metrics["audit_cosine_in_std"]) = moments(ins)
        (metrics["audit_cosine_out_mean"], metrics["audit_cosine_out_std"]) = moments(out)
        if self.audit.inserted == 0.5:
            m = len(cos)
            guesses = max(1, round(self.audit.guesses * m))
            metrics["audit_epsilon_lower"] = one_run_epsilon(
                cos, self.inserted, guesses, self.delta, self.audit.confidence)[0]
        return metrics, cos

    def table(self, cos: np.ndarray) -> dict[str, list]:
        """Every canary's id, whether it was inserted and its cosine ``cos`` (an
        artifact)."""
        return {"canary": list(range(len(cos))), "inserted": self.inserted.tolist(),
                "cosine": cos.tolist()}
