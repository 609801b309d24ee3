"""Per-client state in a worker (``ClientStateStore``): momenta, control variates, personal
models, a client's own buffers."""

from __future__ import annotations

from collections.abc import Iterator

import torch


class ClientStateStore:
    """Per-client state (``{name: (d,) tensor}`` per client) in a few large blocks of rows
    instead of one allocation per client and round: 10,000 clients' momenta are 10,000 rows
    of a handful of ``(BLOCK_ROWS, d)`` tensors, written in place, so the allocator does not
    fragment (measured in benchmarks/scale.py). Rows are kept in ``dtype``."""

    BLOCK_ROWS = 256

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.rows: dict[int, int] = {}  # client -> row
        self.blocks: dict[str, list[torch.Tensor]] = {}

    def __contains__(self, client: int) -> bool:
        return int(client) in self.rows

    def __len__(self) -> int:
        return len(self.rows)

    def _row(self, name: str, r: int) -> torch.Tensor:
        return self.blocks[name][r // self.BLOCK_ROWS][r % self.BLOCK_ROWS]

    def get(self, client: int) -> dict[str, torch.Tensor]:
        """The client's state as float32 copies ({} for a client without state)."""
        r = self.rows.get(int(client))
        return {} if r is None else {k: self._row(k, r).float() for k in self.blocks}

    def set(self, client: int, state: dict[str, torch.Tensor]) -> None:
        r = self.rows.setdefault(int(client), len(self.rows))
        for name, value in state.items():
            blocks = self.blocks.setdefault(name, [])
            while len(blocks) * self.BLOCK_ROWS <= r:
                blocks.append(torch.empty((self.BLOCK_ROWS, value.numel()), dtype=self.dtype))
            self._row(name, r).copy_(value.reshape(-1))

    def items(self) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        for c, r in self.rows.items():
            yield c, {k: self._row(k, r) for k in self.blocks}

    def nbytes(self) -> int:
        """Bytes of the rows in use."""
        return sum(self._row(k, 0).numel() * self._row(k, 0).element_size()
                   for k in self.blocks) * len(self.rows)
