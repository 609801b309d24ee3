"""The semi-synchronous server (``server.mode: deadline``, simulator/sim/rounds/deadline.py): who
is late by hand from the devices' speeds, the round's simulated time, a deadline nobody
misses equal to synchronous rounds, late updates dropped or carried, checkpoints, and what
validation refuses."""

from __future__ import annotations

import numpy as np
import pytest

from simulator.config import ScenarioError
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine
from simulator.sim.rounds.deadline import CARRIED_SCALE
from simulator.sim.sampling import sample_clients
from simulator.sim.speeds import profiles
from tests.simulator.test_checkpoint import _roundtrip
from tests.simulator.test_engine import point as engine_point

BASE = """\
name: deadline
rounds: 5
data:
  dataset: {name: digits}
model: {name: logreg}
clients: {total: 12, per_round: 6}
local: {steps: 2, batch_size: 8, lr: 0.2}
speeds: {distribution: exponential, sample_seconds: 0.01}
"""


def point(tmp_path, extra: str = "", overrides=()):
    return engine_point(tmp_path, BASE + extra, overrides)


def run(sc, **kw):
    return Engine(sc, InlineBackend(), workers=2).run(**kw)


def test_late_clients_and_the_rounds_simulated_time_by_hand(tmp_path):
    sc = point(tmp_path, "server: {mode: deadline, deadline: 0.2}\n")
    res = run(sc)
    assert sc.speeds is not None
    prof = profiles(sc.speeds, 12, 0, np.zeros(0, dtype=np.int64))
    clock, lates = 0.0, []
    for r, m in enumerate(res.metrics):
        times = {c: prof.task_seconds(c, 2 * 8, 0.0, r) for c in
                 sample_clients(0, r, 12, 6).tolist()}
        late = [c for c, t in times.items() if t > 0.2]
        clock += 0.2 if late else max(times.values())
        lates.append(len(late))
        assert (m["late"], m["participants"], m["carried"]) == (len(late), 6 - len(late), 0)
        assert m["sim_time"] == pytest.approx(clock, rel=1e-12)
    assert 0 < sum(lates) < 30  # the deadline binds, but not always


def test_a_deadline_nobody_misses_is_synchronous_rounds(tmp_path):
    sync = run(point(tmp_path))
    relaxed = run(point(tmp_path, "server: {mode: deadline, deadline: 1.0e9}\n"))
    np.testing.assert_array_equal(relaxed.final_params, sync.final_params)
    assert [m["sim_time"] for m in relaxed.metrics] == [m["sim_time"] for m in sync.metrics]
    assert all(m["late"] == 0 for m in relaxed.metrics)


def test_late_updates_dropped_or_carried_one_round(tmp_path):
    drop = run(point(tmp_path, "server: {mode: deadline, deadline: 0.2}\n"))
    carry = run(point(tmp_path, "server: {mode: deadline, deadline: 0.2, late: carry}\n"))
    late = [m["late"] for m in carry.metrics]
    assert [m["late"] for m in drop.metrics] == late
    assert [m["carried"] for m in carry.metrics] == [0.0, *late[:-1]]
    assert all(m["carried"] == 0 for m in drop.metrics)
    # the first round is the same; a later one with a carried update is not
    assert drop.metrics[0]["aggregate_norm"] == carry.metrics[0]["aggregate_norm"]
    assert not np.array_equal(drop.final_params, carry.final_params)
    # uploads: every trained client's message, on time or late
    assert carry.metrics[0]["bytes_up"] == 6 * 4 * (64 * 10 + 10)
    assert drop.metrics[0]["bytes_up"] == (6 - late[0]) * 4 * (64 * 10 + 10)
    assert CARRIED_SCALE == pytest.approx(2 ** -0.5)


def test_late_clients_send_the_steps_they_finished_by_hand(tmp_path):
    """``late: partial``: a client of 2 local steps whose task takes t > 0.2 s finishes
    floor(2 * 0.2 / t) of them by the deadline (at most 1): those with t <= 0.4 send one step,
    the others nothing (FedProx's rule, the one clients.stragglers applies)."""
    sc = point(tmp_path, "server: {mode: deadline, deadline: 0.2, late: partial}\n")
    res = run(sc)
    assert sc.speeds is not None
    prof = profiles(sc.speeds, 12, 0, np.zeros(0, dtype=np.int64))
    sent_some = 0
    for r, m in enumerate(res.metrics):
        times = {c: prof.task_seconds(c, 2 * 8, 0.0, r) for c in
                 sample_clients(0, r, 12, 6).tolist()}
        late = [c for c, t in times.items() if t > 0.2]
        partial = [c for c in late if np.floor(2 * 0.2 / times[c]) >= 1]
        assert (m["late"], m["partial_work"]) == (len(late), len(partial))
        assert m["participants"] == 6 - len(late) + len(partial)
        sent_some += len(partial)
    assert sent_some > 0
    drop = run(point(tmp_path, "server: {mode: deadline, deadline: 0.2}\n"))
    assert not np.array_equal(res.final_params, drop.final_params)


def test_a_deadline_everybody_misses_skips_the_step(tmp_path):
    res = run(point(tmp_path, "server: {mode: deadline, deadline: 1.0e-6}\n",
                    ["rounds=2"]))
    assert [m["aggregation_skipped"] for m in res.metrics] == [1.0, 1.0]
    assert [m["sim_time"] for m in res.metrics] == pytest.approx([1e-6, 2e-6])


def test_resume_with_carried_updates_gives_the_uninterrupted_numbers(tmp_path):
    sc = point(tmp_path, "server: {mode: deadline, deadline: 0.2, late: carry}\n"
               "runtime: {checkpoint_every: 2}\n")
    saved: dict[int, dict] = {}
    full = run(sc, on_checkpoint=lambda r, st: saved.__setitem__(r, _roundtrip(st)))
    assert any("carried" in st for st in saved.values())  # a late update held over
    for r, state in saved.items():
        resumed = run(sc, resume={**state, "round": r})
        assert resumed.metrics == full.metrics
        np.testing.assert_array_equal(resumed.final_params, full.final_params)


@pytest.mark.parametrize("extra, line", [
    ("server: {mode: deadline}\n", "server.deadline: required with server.mode deadline"),
    ("server: {deadline: 0.5}\n", "server.deadline: used by server.mode deadline only"),
    ("server: {mode: fedbuff, late: carry}\n", "server.late: used by server.mode deadline"),
    (("server: {mode: deadline, deadline: 1}\nclients: {total: 12, per_round: 6, "
      "stragglers: {deadline: 2}}\n"), "clients.stragglers: not used by server.mode deadline"),
    ("server: {mode: deadline, deadline: 1}\nasynchrony: {concurrency: 3}\n",
     "asynchrony: used by the asynchronous modes only"),
])
def test_what_the_deadline_mode_refuses(tmp_path, extra, line):
    text = BASE.replace("clients: {total: 12, per_round: 6}\n", "") if "clients:" in extra \
        else BASE
    with pytest.raises(ScenarioError) as e:
        engine_point(tmp_path, text + extra)
    assert any(line in got for got in e.value.lines), e.value.lines
