"""The rows a server step aggregates, as the run's ``server.mode`` makes them
(``ModeRows``, held by the Server): FedAsync's mixing, staleness scales, Dahan & Levy's table
of every client's latest row, BASGD's buffer means. The mode's transforms act on the model
delta (a message's first part); its other parts ride beside it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from simulator.config.plan import Plan
from simulator.messages import ClientRows, StepLayout
from strategies.geometry import group_means


class ModeRows:
    """The step's rows from its honest and Byzantine rows, by the Plan's ``mode``; keeps the
    latest table (``server.mode: latest``) between steps."""

    def __init__(self, plan: Plan, d: int, width: int) -> None:
        self.mode = plan.mode
        self.d, self.width = d, width  # the model's size, a whole message's
        self.basgd_buffers = plan.asynchrony.buffers if plan.asynchrony is not None else 0
        self.latest: dict[int, torch.Tensor] = {}  # each client's last row (mode latest)

    def on_delta(self, rows: torch.Tensor, op: Callable[[torch.Tensor], torch.Tensor]
                 ) -> torch.Tensor:
        """``op`` applied to the model-delta part of ``rows``, the other parts as they are."""
        if rows.shape[1] == self.d:
            return op(rows)
        return torch.cat([op(rows[:, :self.d]), rows[:, self.d:]], dim=1)

    def build(self, layout: StepLayout, honest: torch.Tensor, byz: np.ndarray | None,
              gaps: Callable[[list[int]], torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(the step's rows, its honest rows, their weights): FedAsync's row of an update is
        the client's model minus the server's (``x_v + update - x``, ``gaps(versions)`` the
        ``x_v - x`` of each row, so that a step of 1 replaces the model by the client's);
        rows scaled by their staleness; the latest table's rows; BASGD's buffers' means."""
        rows = honest if byz is None else torch.cat(
            [honest, torch.from_numpy(np.array(byz, dtype=np.float32))]  # writable copy
        )
        if self.mode.mixing:
            gap = gaps(layout.honest_versions + [v for _, v in layout.byzantine])
            rows = self.on_delta(rows, lambda r: r + gap)
        if layout.scales is not None:
            scales = torch.tensor(layout.scales, dtype=torch.float64)[:, None].to(rows.dtype)
            rows = self.on_delta(rows, lambda r: r * scales)
        honest_rows = rows[:honest.shape[0]]
        if layout.table is not None:  # Dahan & Levy: every client's latest row
            ids = [c for _, clients, _ in layout.groups for c in clients] + \
                [c for c, _ in layout.byzantine]
            for c, row in zip(ids, rows):
                self.latest[c] = row.clone()
            rows = torch.stack([self.latest[c] for c in layout.table])
            byz_ids = set(layout.table_byzantine)
            honest_rows = rows[[i for i, c in enumerate(layout.table) if c not in byz_ids]]
        if layout.buffer_of is not None:  # BASGD: each buffer's mean (as bucketing's)
            rows = group_means(rows, torch.tensor(layout.buffer_of, dtype=torch.int64),
                               self.basgd_buffers)
        weights = (torch.tensor(layout.weights, dtype=torch.float64)
                   if layout.weights is not None else None)
        return rows, honest_rows, weights

    def latest_rows(self, clients: list[int]) -> ClientRows:
        """The latest rows of ``clients``, as one train call's results: what an omniscient
        attack sees of the honest clients there."""
        rows = np.stack([self.latest[c].numpy() for c in clients]) if clients else \
            np.empty((0, self.width), dtype=np.float32)
        return ClientRows(np.asarray(clients, dtype=np.int64), rows, np.zeros(len(clients)))


def with_means(agg: torch.Tensor, rest: torch.Tensor, weights: torch.Tensor | None
               ) -> torch.Tensor:
    """The aggregate of the row parts followed by the (weighted) mean of the message's other
    parts (``rest``: their columns of every row); ``agg`` alone without any."""
    if not rest.shape[1]:
        return agg
    if weights is None:
        means = rest.mean(dim=0)
    else:
        w = weights.to(rest.dtype)
        means = (w[:, None] * rest).sum(dim=0) / w.sum()
    return torch.cat([agg, means.to(agg.dtype)])
