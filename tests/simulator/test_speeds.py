"""Simulated device speeds and availability (simulator/sim/speeds.py): FedScale's two trace
formats written here from their description (benchmark/dataset/data/device_info/README.md)
and read back as pickle, JSON and Parquet, with task times and next starts checked against
numbers computed by hand; the parametric factors against their distributions; the files a
reader must refuse, refused in one line naming the file and the client."""

from __future__ import annotations

import json
import math
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scipy import special

from simulator.config.schema import Speeds
from simulator.seeding import numpy_rng
from simulator.sim import speeds
from simulator.sim.speeds import Availability, TraceError, check_speeds, profiles, read_trace

NONE = np.array([], dtype=np.int64)

# device capacity: {client: {computation: ms per sample (inference), communication: kbit/s}}
CAPACITY = {1: {"computation": 162.0, "communication": 5648.109619499134},
            2: {"computation": 50.0, "communication": 1000.0},
            3: {"computation": 20.0, "communication": 250.0}}

# availability: FedScale's own test case (tests/cloud/internal/test_client_metadata.py), an
# entry of FedScale's shipped trace as a derived project quotes it (duration = the sum of its
# windows' lengths), and an entry with no window
FEDSCALE_TEST = {"active": [1, 3, 6, 9], "inactive": [1, 4, 7, 10], "finish_time": 10}
SHIPPED = {"duration": 211625, "finish_time": 518400, "model": "CPH1801",
           "active": [12788, 100044, 188992, 271372, 276663, 352625, 356267, 441193],
           "inactive": [65881, 133574, 208292, 276575, 295006, 356236, 400906, 475099]}
NEVER = {"active": [], "inactive": [], "finish_time": 100, "duration": 0}
AVAILABILITY = {1: FEDSCALE_TEST, 3834: SHIPPED, 9: NEVER}


def write(path: Path, content: object) -> str:
    """``content`` (``{client: entry}``) in the format ``path``'s suffix names."""
    if path.suffix == ".json":
        path.write_text(json.dumps({str(k): v for k, v in content.items()}))  # type: ignore[attr-defined]
    elif path.suffix == ".parquet":
        rows = [{"client": k, **v} for k, v in content.items()]  # type: ignore[attr-defined]
        names = list(dict.fromkeys(name for row in rows for name in row))
        pq.write_table(pa.Table.from_pylist([{n: r.get(n) for n in names} for r in rows]), path)
    else:
        path.write_bytes(pickle.dumps(content))
    return str(path)


# ------------------------------------------------------------------ device capacity


def test_capacity_trace_gives_fedscale_task_times(tmp_path):
    trace = write(tmp_path / "client_device_capacity", CAPACITY)
    prof = profiles(Speeds(trace=trace), 5, seed=0, byzantine=NONE)
    # client c takes entry c % 3 in the file's order; 3 x (ms / 1000) s per sample; x1024 bit/s
    assert prof.sample_seconds.tolist() == pytest.approx([0.486, 0.15, 0.06, 0.486, 0.15])
    assert prof.bandwidth.tolist() == pytest.approx(
        [5648.109619499134 * 1024, 1024000, 256000, 5648.109619499134 * 1024, 1024000])
    # 32 samples at 0.15 s + an 8 Mbit model down and up at 1000 kbit/s (FedScale's kbit)
    assert prof.task_seconds(1, 32, 8e6, task=0) == pytest.approx(4.8 + 15.625)
    assert prof.task_seconds(4, 32, 8e6, task=7) == pytest.approx(20.425)  # wraps onto entry 1
    assert prof.task_seconds(2, 10, 1.024e6, task=0) == pytest.approx(0.6 + 8.0)


def test_capacity_trace_equals_fedscale_completion_time(tmp_path):
    """FedScale's ClientMetadata.get_completion_time (client_metadata.py:56-63) with its
    model size in kbits (aggregator.py:423-425), written out: the same seconds."""
    trace = write(tmp_path / "cap", CAPACITY)
    prof = profiles(Speeds(trace=trace), 3, seed=0, byzantine=NONE)
    model_bytes, batch_size, local_steps = 250_000, 20, 3
    for client, entry in enumerate(CAPACITY.values()):
        kbits = model_bytes / 1024.0 * 8.0
        fedscale = (3.0 * batch_size * local_steps * entry["computation"] / 1000.0
                    + (kbits + kbits) / entry["communication"])
        ours = prof.task_seconds(client, batch_size * local_steps, 8.0 * model_bytes, 0)
        assert ours == pytest.approx(fedscale, rel=1e-12)


def test_byzantine_factor_scales_time_and_bandwidth(tmp_path):
    trace = write(tmp_path / "cap", CAPACITY)
    prof = profiles(Speeds(trace=trace, byzantine_factor=0.5), 5, seed=0,
                    byzantine=np.array([2, 4]))
    assert prof.sample_seconds.tolist() == pytest.approx([0.486, 0.15, 0.03, 0.486, 0.075])
    assert prof.bandwidth[[2, 4]].tolist() == [512000.0, 2048000.0]
    assert prof.task_seconds(2, 10, 1.024e6, 0) == pytest.approx(0.3 + 4.0)
    par = profiles(Speeds(sample_seconds=0.01, bandwidth=1e6, byzantine_factor=4.0), 4, 0,
                   np.array([True, False, False, True]))  # a mask works as well as ids
    assert par.sample_seconds.tolist() == [0.04, 0.01, 0.01, 0.04]
    assert par.bandwidth.tolist() == [250000.0, 1e6, 1e6, 250000.0]


def test_numpy_scalars_in_a_pickle_are_numbers(tmp_path):
    trace = write(tmp_path / "cap", {1: {"computation": np.float64(162.0),
                                         "communication": np.float32(1000.0)},
                                     np.int64(2): {"computation": np.int64(20),
                                                   "communication": 250.0}})
    prof = profiles(Speeds(trace=trace), 2, seed=0, byzantine=NONE)
    assert prof.sample_seconds.tolist() == pytest.approx([0.486, 0.06])
    assert prof.bandwidth.tolist() == [1024000.0, 256000.0]


# ------------------------------------------------------------------ availability


def test_fedscale_is_active_case(tmp_path):
    """FedScale's own is_active test: windows [1,1], [3,4], [6,7], [9,10], period 10."""
    avail = speeds.read_availability(write(tmp_path / "behave", AVAILABILITY))
    expected = {2: False, 6: True, 8: False, 9: True, 10: False, 15: False}
    assert {t: avail.active(0, t) for t in expected} == expected
    # half-open windows; the empty [1, 1) never; time wraps at finish_time
    assert [avail.next_start(0, t) for t in (0, 2, 3.5, 4, 7.5, 9.5, 10, 10.5, 26)] == \
        [3, 3, 3.5, 6, 9, 9.5, 13, 13, 26]
    assert avail.next_start(3, 4) == 6  # client 3 wraps onto the first entry


def test_shipped_trace_entry(tmp_path):
    avail = speeds.read_availability(write(tmp_path / "behave", AVAILABILITY))
    period = 518400
    assert avail.next_start(1, 0) == 12788
    assert avail.next_start(1, 12788) == 12788
    assert avail.next_start(1, 65881) == 100044  # at inactive[0] it has left
    assert avail.next_start(1, 276600) == 276663  # the 88 s gap between two windows
    assert avail.next_start(1, 480000) == period + 12788  # past the last window: next cycle
    assert avail.next_start(1, 2 * period + 300000) == 2 * period + 352625
    assert avail.active(1, 2 * period + 50000)
    assert not avail.active(1, 2 * period + 80000)
    assert avail.next_start(2, 5.0) == math.inf  # no window: never
    for t in np.linspace(0, 3 * period, 301):  # a start is a fixed point
        s = avail.next_start(1, float(t))
        assert s >= t and avail.next_start(1, s) == s


def test_windows_clipped_sorted_and_merged():
    avail = Availability([([8, 0, 3, 20], [9, 5, 6, 30])], [10])
    assert avail.windows(0) == ((0.0, 8.0), (6.0, 9.0), 10.0)
    assert avail.next_start(0, 5.5) == 5.5 and avail.next_start(0, 7) == 8
    assert avail.next_start(0, 9.5) == 10


@pytest.mark.parametrize("suffix", [".json", ".parquet"])
def test_json_and_parquet_give_identical_profiles(tmp_path, suffix):
    def both(directory: Path, ext: str) -> tuple[str, str]:
        directory.mkdir()
        return (write(directory / f"cap{ext}", CAPACITY),
                write(directory / f"behave{ext}", AVAILABILITY))

    cap, behave = both(tmp_path / "pickle", "")
    cap2, behave2 = both(tmp_path / "other", suffix)
    assert read_trace(behave2) == ({str(k): v for k, v in AVAILABILITY.items()} if
                                   suffix == ".json" else
                                   {k: {**dict.fromkeys(("active", "inactive", "finish_time",
                                                         "duration", "model")), **v}
                                    for k, v in AVAILABILITY.items()})
    a = profiles(Speeds(trace=cap, availability=behave, jitter=0.2), 7, 3, np.array([5]))
    b = profiles(Speeds(trace=cap2, availability=behave2, jitter=0.2), 7, 3, np.array([5]))
    assert np.array_equal(a.sample_seconds, b.sample_seconds)
    assert np.array_equal(a.bandwidth, b.bandwidth)
    assert a.availability == b.availability and a.availability is not None
    assert [a.task_seconds(c, 9, 1e5, 2) for c in range(7)] == \
        [b.task_seconds(c, 9, 1e5, 2) for c in range(7)]


def test_profiles_pickle(tmp_path):
    behave = write(tmp_path / "behave", AVAILABILITY)
    prof = profiles(Speeds(distribution="lognormal", availability=behave, jitter=0.1), 5, 1,
                    NONE)
    back = pickle.loads(pickle.dumps(prof))
    assert np.array_equal(back.sample_seconds, prof.sample_seconds)
    assert back.availability == prof.availability
    assert back.task_seconds(3, 10, 0.0, 4) == prof.task_seconds(3, 10, 0.0, 4)


# ------------------------------------------------------------------ refused files


class Executes:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class Evaluates:
    def __reduce__(self):
        return (eval, ("1 + 1",))


def test_pickle_with_a_class_is_refused_unexecuted(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "cap"
    path.write_bytes(pickle.dumps({1: {"computation": Executes(marker), "communication": 1}}))
    with pytest.raises(TraceError, match=r"system is not allowed in a trace file"):
        read_trace(path)
    assert not marker.exists()
    path.write_bytes(pickle.dumps({1: np.arange(3)}))  # an array rebuilds through a global
    with pytest.raises(TraceError, match=r"_reconstruct is not allowed"):
        read_trace(path)
    path.write_bytes(pickle.dumps({1: Evaluates()}))
    with pytest.raises(TraceError, match=r"builtins.eval is not allowed"):
        read_trace(path)


CAPACITY_REFUSED = [
    ({7: {"computation": -1, "communication": 5}},
     "client 7: computation must be a positive number, got -1"),
    ({7: {"computation": 1.0}}, "client 7: communication is missing"),
    ({7: [1, 2]}, ("client 7: a device-capacity entry must be a mapping with computation, "
     "communication, got [1, 2]")),
    ({7: {"computation": True, "communication": 1}},
     "client 7: computation must be a positive number, got True"),
    ({7: {"computation": "5", "communication": 1}},
     "client 7: computation must be a positive number, got '5'"),
    ({7: {"computation": math.inf, "communication": 1}}, "client 7: computation must be finite"),
    ({7: {"computation": 1, "communication": 0.0}},
     "client 7: communication must be a positive number, got 0.0"),
    ({(1, 2): {"computation": 1, "communication": 1}},
     "keys must be client ids (integers or text), got (1, 2)"),
    ([1, 2], "is not a FedScale trace: expected a mapping of client ids to entries, got list"),
    ({}, "holds no clients"),
    ({7: FEDSCALE_TEST}, ("client 7: computation is missing (a device-capacity entry has "
     "computation, communication; got keys active, inactive, finish_time)")),
]


@pytest.mark.parametrize(("content", "message"), CAPACITY_REFUSED)
def test_capacity_refused(tmp_path, content, message):
    path = tmp_path / "cap.pkl"
    path.write_bytes(pickle.dumps(content))
    with pytest.raises(TraceError) as e:
        speeds.read_capacity(path)
    assert str(e.value).startswith(str(path))
    assert message in str(e.value)
    assert "\n" not in str(e.value)


AVAILABILITY_REFUSED = [
    ({4: {**FEDSCALE_TEST, "inactive": [1, 4, 7]}},
     "client 4: active has 4 times and inactive 3; they pair up"),
    ({4: {**FEDSCALE_TEST, "inactive": [1, 2, 7, 10]}},
     "client 4: window 1 ends before it starts (active[1] = 3, inactive[1] = 2)"),
    ({4: {**FEDSCALE_TEST, "finish_time": 0}},
     "client 4: finish_time must be a positive number, got 0"),
    ({4: {**FEDSCALE_TEST, "active": [1, "x", 6, 9]}},
     "client 4: active[1] must be a finite number of seconds, got 'x'"),
    ({4: {**FEDSCALE_TEST, "active": [1, math.nan, 6, 9]}},
     "client 4: active[1] must be a finite number of seconds, got nan"),
    ({4: {**FEDSCALE_TEST, "active": 3}}, "client 4: active must be a list of times (s), got 3"),
    ({4: {**FEDSCALE_TEST, "duration": -1}}, "client 4: duration must be a number >= 0, got -1"),
    ({4: {"active": [], "inactive": []}}, "client 4: finish_time is missing"),
]


@pytest.mark.parametrize(("content", "message"), AVAILABILITY_REFUSED)
def test_availability_refused(tmp_path, content, message):
    path = tmp_path / "behave"
    path.write_bytes(pickle.dumps(content))
    with pytest.raises(TraceError) as e:
        speeds.read_availability(path)
    assert str(e.value) == f"{path}: {message}" or str(e.value).startswith(f"{path}: {message}")


def test_unreadable_files_refused(tmp_path, monkeypatch):
    missing = tmp_path / "nope.pkl"
    with pytest.raises(TraceError, match=f"^no such file: {missing}; expected a regular file"):
        read_trace(missing)
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"\x00\x01 not a pickle")
    with pytest.raises(TraceError, match="is not a pickle this reader accepts"):
        read_trace(garbage)
    twice = tmp_path / "twice.json"
    twice.write_text('{"7": {"computation": 1, "communication": 1}, "7": {}}')
    with pytest.raises(TraceError, match="'7' appears twice in one object"):
        read_trace(twice)
    nested = tmp_path / "deep.json"
    nested.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(TraceError, match="deep.json"):
        read_trace(nested)
    no_client = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": [1], "computation": [1.0], "communication": [1.0]}),
                   no_client)
    with pytest.raises(TraceError, match="'client' column; got columns id, computation"):
        read_trace(no_client)
    dup = tmp_path / "dup.parquet"
    pq.write_table(pa.table({"client": [1, 1], "computation": [1.0, 2.0],
                             "communication": [1.0, 1.0]}), dup)
    with pytest.raises(TraceError, match="client 1 has more than one row"):
        read_trace(dup)
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_bytes(b"PAR1 nothing")
    with pytest.raises(TraceError, match="is not a readable Parquet file"):
        read_trace(not_parquet)
    big = tmp_path / "big"
    big.write_bytes(pickle.dumps(CAPACITY))
    monkeypatch.setattr(speeds, "MAX_TRACE_BYTES", 64)
    with pytest.raises(TraceError, match=r"big holds \d+ bytes, more than the 64 bytes"):
        read_trace(big)


def test_profiles_names_the_scenario_key(tmp_path):
    bad = tmp_path / "cap.pkl"
    bad.write_bytes(pickle.dumps({7: {"computation": -1, "communication": 5}}))
    with pytest.raises(ValueError) as e:
        profiles(Speeds(trace=str(bad)), 4, 0, NONE)
    assert str(e.value) == (f"speeds.trace: {bad}: client 7: computation must be a "
                            "positive number, got -1")
    with pytest.raises(ValueError, match="^speeds.availability: no such file: .*none; expected"):
        profiles(Speeds(availability=str(tmp_path / "none")), 4, 0, NONE)
    with pytest.raises(ValueError, match=r"^speeds.a: zipf needs a > 1 .* got 1$"):
        profiles(Speeds(distribution="zipf", a=1.0), 4, 0, NONE)


def test_check_speeds(tmp_path):
    assert check_speeds(Speeds(), 10) == []
    cap = write(tmp_path / "cap", CAPACITY)
    behave = write(tmp_path / "behave", AVAILABILITY)
    assert check_speeds(Speeds(trace=cap, availability=behave), 10) == []
    bad = tmp_path / "bad.pkl"
    bad.write_bytes(pickle.dumps({7: {"computation": -1, "communication": 5}}))
    never = write(tmp_path / "never", {1: NEVER, 2: FEDSCALE_TEST})
    problems = check_speeds(Speeds(distribution="zipf", a=0.9,
                                   availability=str(tmp_path / "missing")), 10)
    assert problems == [
        (("speeds", "a"),
         "zipf needs a > 1 (its normalising sum diverges at a <= 1), got 0.9"),
        (("speeds", "availability"), (f"no such file: {tmp_path / 'missing'}; expected a "
         "regular file (files of at most 256 MiB)"))]
    assert check_speeds(Speeds(trace=str(bad), availability=cap), 10) == [
        (("speeds", "trace"),
         f"{bad}: client 7: computation must be a positive number, got -1"),
        (("speeds", "availability"),  # the other file where this one belongs
         (f"{cap}: client 1: active is missing (an availability entry has active, inactive, "
         "finish_time; got keys computation, communication)"))]
    assert check_speeds(Speeds(availability=never), 1) == [
        (("speeds", "availability"), (f"{never}: none of the 1 clients is ever "
         "active (entries 0..0 have no window of positive length)"))]
    assert check_speeds(Speeds(availability=never), 2) == []  # client 1 has windows
    assert check_speeds(Speeds(distribution="zipf", a=1.0, trace=cap), 3) == []  # no draws


# ------------------------------------------------------------------ parametric factors


def factors(distribution: Any, total: int = 20_000, seed: int = 11, **kw) -> np.ndarray:
    prof = profiles(Speeds(distribution=distribution, sample_seconds=1.0, **kw), total, seed,
                    NONE)
    return np.asarray(prof.sample_seconds)


DISTRIBUTIONS = [("exponential", {}), ("lognormal", {"sigma": 0.5}), ("zipf", {"a": 1.2}),
                 ("zipf", {"a": 2.0}), ("pareto", {"a": 3.0}), ("pareto", {"a": 1.2})]


@pytest.mark.parametrize(("distribution", "kw"), DISTRIBUTIONS)
def test_factors_seeded_and_independent_of_total(distribution, kw):
    f = factors(distribution, **kw)
    assert np.array_equal(f, factors(distribution, **kw))
    assert not np.array_equal(f, factors(distribution, seed=12, **kw))
    assert np.array_equal(factors(distribution, total=10, **kw), f[:10])
    assert np.array_equal(factors(distribution, total=20_001, **kw)[:20_000], f)
    assert np.all(f > 0) and np.all(np.isfinite(f))


def test_constant_factors_draw_nothing(monkeypatch):
    def no_draw(*args):
        raise AssertionError(f"a draw from {args}")

    monkeypatch.setattr(speeds, "numpy_rng", no_draw)
    prof = profiles(Speeds(sample_seconds=0.002, bandwidth=1e6), 3, 0, NONE)
    assert prof.sample_seconds.tolist() == [0.002] * 3
    assert prof.task_seconds(2, 100, 5e5, task=3) == pytest.approx(0.2 + 1.0)  # jitter 0


def test_factor_distributions():
    e = factors("exponential")
    assert e.mean() == pytest.approx(1.0, abs=0.03)
    assert np.median(e) == pytest.approx(math.log(2), abs=0.02)
    ln = factors("lognormal", sigma=0.5)
    assert np.median(ln) == pytest.approx(1.0, abs=0.02)
    assert ln.mean() == pytest.approx(math.exp(0.125), abs=0.02)
    assert np.log(ln).std() == pytest.approx(0.5, abs=0.01)
    for a in (1.2, 2.0):  # P(k) = k^-a / zeta(a), k = 1, 2, ...
        z = factors("zipf", a=a)
        assert np.all(z == np.round(z)) and z.min() == 1
        assert np.mean(z == 1) == pytest.approx(1 / special.zeta(a), abs=0.012)
        assert np.mean(z == 2) == pytest.approx(2**-a / special.zeta(a), abs=0.012)
    assert np.median(factors("zipf", a=2.0)) == 1
    p = factors("pareto", a=3.0)  # shape a, minimum 1: mean a / (a - 1), median 2^(1/a)
    assert p.min() >= 1 and p.mean() == pytest.approx(1.5, abs=0.03)
    assert np.median(p) == pytest.approx(2 ** (1 / 3), abs=0.02)
    assert np.median(factors("pareto", a=1.2)) == pytest.approx(2 ** (1 / 1.2), abs=0.05)
    assert factors("constant", total=5).tolist() == [1.0] * 5


def test_jitter_draw_per_client_and_task():
    prof = profiles(Speeds(sample_seconds=0.01, bandwidth=1e6, jitter=0.3), 4, 5, NONE)
    for client, task in [(0, 0), (3, 0), (3, 1)]:
        e = numpy_rng(5, "speed-jitter", client, task).standard_normal()
        assert prof.task_seconds(client, 50, 1e5, task) == \
            pytest.approx(50 * 0.01 * math.exp(0.3 * e) + 0.2, rel=1e-12)
    assert prof.task_seconds(3, 50, 1e5, 1) == prof.task_seconds(3, 50, 1e5, 1)
    assert prof.task_seconds(3, 50, 1e5, 1) != prof.task_seconds(3, 50, 1e5, 2)
    assert prof.task_seconds(2, 50, 1e5, 1) != prof.task_seconds(3, 50, 1e5, 1)
    times = np.array([prof.task_seconds(0, 1, 0.0, t) for t in range(4000)]) / 0.01
    assert np.log(times).std() == pytest.approx(0.3, abs=0.015)


def test_max_factor_caps_the_heavy_tail():
    """Zipf(1.2) draws factors in the millions; max_factor caps them, the rest unchanged."""
    from simulator.config.schema import Speeds
    from simulator.sim.speeds import factors

    free = factors(Speeds(distribution="zipf", a=1.2), 2000, 0)
    capped = factors(Speeds(distribution="zipf", a=1.2, max_factor=30), 2000, 0)
    assert free.max() > 1000 and capped.max() == 30
    np.testing.assert_array_equal(capped, np.minimum(free, 30))
