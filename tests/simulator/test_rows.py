"""The server's update matrix: ``stack_groups`` puts every worker's rows in client order in one
copy, and ``RowBuffer`` lends the same matrix round after round unless something still holds
the last one (then a new one: kept rows are never overwritten)."""

from __future__ import annotations

import numpy as np
import torch

from simulator.messages import ClientRows, RowBuffer, stack_groups, stack_rows


def _rows(clients: list[int], d: int) -> ClientRows:
    ids = np.asarray(clients, dtype=np.int64)
    return ClientRows(ids, np.stack([np.full(d, c, np.float32) for c in clients]),
                      ids.astype(np.float64) / 10)


def test_stack_groups_orders_rows_by_client_whichever_worker_sent_them():
    d = 5
    a, b = _rows([3, 7, 9], d), _rows([8, 1], d)  # b out of order: row by row
    got = stack_rows([1, 3, 7, 8, 9], (a, b), d)
    np.testing.assert_array_equal(got[:, 0], [1, 3, 7, 8, 9])
    np.testing.assert_array_equal(stack_rows([1, 3, 7, 8, 9], (a, b), 0, "losses"),
                                  [0.1, 0.3, 0.7, 0.8, 0.9])
    # two groups (two model versions), the second holding a client of the first again
    c = _rows([3], d)
    two = stack_groups([([1, 3, 7, 8, 9], 2), ([3], 1)], (a, b, c), d)
    np.testing.assert_array_equal(two[:, 0], [1, 3, 7, 8, 9, 3])
    assert stack_rows([], (), d).shape == (0, d)


def test_row_buffer_reuses_its_matrix_unless_something_kept_it():
    d, buf = 4, RowBuffer()
    a, b = _rows([0, 1], d), _rows([2], d)
    first = stack_groups([([0, 1, 2], 2)], (a, b), d, into=buf)
    where = first.__array_interface__["data"][0]
    del first
    second = stack_groups([([0, 1, 2], 2)], (a, b), d, into=buf)
    assert second.__array_interface__["data"][0] == where  # the same pages again
    np.testing.assert_array_equal(second[:, 0], [0, 1, 2])
    kept = torch.from_numpy(second)[1:]  # an aggregator keeping a view of its rows
    del second
    third = stack_groups([([0, 2], 2)], (_rows([0], d), b), d, into=buf)
    assert third.__array_interface__["data"][0] != where  # a new matrix...
    np.testing.assert_array_equal(kept[:, 0].numpy(), [1, 2])  # ...and the kept rows intact
    np.testing.assert_array_equal(third[:, 0], [0, 2])
    # fewer rows than the kept matrix holds: its first rows; wider: a new one
    del third
    fewer = stack_groups([([1], 1)], (_rows([1], d),), d, into=buf)
    assert fewer.shape == (1, d) and fewer[0, 0] == 1
    wider = stack_groups([([2], 1)], (_rows([2], d + 1),), d + 1, into=buf)
    assert wider.shape == (1, d + 1) and wider[0, 0] == 2
