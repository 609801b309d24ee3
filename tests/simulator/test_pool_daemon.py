"""``fedray up`` / ``fedray down`` and the warm pool (``fedray.pool``, ``fedray.pool_client``):
commands on the pool give what they give in their own process (numbers, output, exit codes),
a busy pool or a strict run leaves the command to its client, signals and a client's death
end the command as they end it in its own process, and the pool serves on."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from fedray.pool_client import lock_if_free
from simulator.metric_names import mlflow_name

ROOT = Path(__file__).resolve().parents[2]
QUICK = str(ROOT / "scenarios" / "quickstart.yaml")
FEDRAY = [sys.executable, "-m", "fedray"]
ON_POOL = "fedray: running on the warm pool (pid "
TIMEOUT = 600


class Pool:
    """A pool in this test's own XDG_RUNTIME_DIR; the commands' environment."""

    def __init__(self, tmp_path: Path) -> None:
        runtime = tmp_path / "xdg"
        runtime.mkdir(mode=0o700)
        self.folder = runtime / "fedray"
        self.env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "FEDRAY_POOL": "1"}
        self.cwd = tmp_path

    def fedray(self, *args: str, pool: bool = True) -> subprocess.CompletedProcess[str]:
        env = self.env if pool else {**self.env, "FEDRAY_POOL": "0"}
        return subprocess.run([*FEDRAY, *args], capture_output=True, text=True, cwd=self.cwd,
                              env=env, timeout=TIMEOUT, check=False)

    def start(self, *args: str, out: Path) -> subprocess.Popen[bytes]:
        """``fedray ARGS`` in the background, its stdout and stderr in ``out``.out/.err."""
        with open(out.with_suffix(".out"), "wb") as o, open(out.with_suffix(".err"), "wb") as e:
            return subprocess.Popen([*FEDRAY, *args], stdout=o, stderr=e, cwd=self.cwd,
                                    env=self.env, start_new_session=True,
                                    # a background job's children would inherit SIG_IGN
                                    preexec_fn=lambda: signal.signal(signal.SIGINT,  # noqa: PLW1509
                                                                     signal.SIG_DFL))

    def pid(self) -> int:
        return int((self.folder / "pool.pid").read_text())

    def log(self) -> str:
        return (self.folder / "pool.log").read_text()


@pytest.fixture()
def pool(tmp_path, _mlflow_template):  # new stores are copies of the template, as in a cold run
    p = Pool(tmp_path)
    r = p.fedray("up")
    assert r.returncode == 0, r.stderr
    assert "fedray up: a warm pool is up (pid " in r.stdout
    yield p
    pid = p.pid() if (p.folder / "pool.pid").exists() else None
    p.fedray("down", "--force")
    if pid is not None:
        _wait_gone(p, pid)


def _wait_gone(p: Pool, pid: int) -> None:
    """Until the pool's process ``pid`` has ended: its lock is free (all its threads have
    exited: the main thread alone can be a zombie while the others still hold its fds)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with lock_if_free(p.folder) as free:
            if free:
                return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def _wait_for(path: Path, text: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if text in path.read_text(errors="replace"):
            return
        assert proc.poll() is None, path.read_text(errors="replace")
        time.sleep(0.1)
    raise AssertionError(f"{text!r} never came: {path.read_text(errors='replace')}")


def _statuses(uri: str) -> dict[str, str]:
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("quickstart")
    assert exp is not None
    return {r.info.run_id: r.info.status for r in client.search_runs([exp.experiment_id])}


def _points(uri: str) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Each point run's every metric, its whole history, by the run's label."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("quickstart")
    assert exp is not None
    out = {}
    for r in client.search_runs([exp.experiment_id], "tags.`fedray.kind` = 'point'"):
        out[r.info.run_name] = {k: [(m.step, m.value) for m in client.get_metric_history(
            r.info.run_id, k)] for k in r.data.metrics}
    return out


IDS = re.compile(r"\b[0-9a-f]{32}\b")
ELAPSED = re.compile(r"\(\d+:\d\d(:\d\d)? elapsed[^)]*\)|\d+(\.\d+)?\s?(s|it)/(it|s)|"
                     r"\d+:\d\d(:\d\d)?")
MEMORY = re.compile(r"within a quarter of the [0-9.]+ [KMG]iB available")


def _plain(text: str) -> list[str]:
    """Output less what differs between any two runs: run ids, times, free memory."""
    return [MEMORY.sub("MEM", ELAPSED.sub("T", IDS.sub("ID", line)))
            for line in text.splitlines()]


def test_a_run_on_the_pool_gives_the_numbers_and_output_of_its_own_process(pool, tmp_path):
    args = ["run", QUICK, "--set", "rounds=2", "--backend", "inline", "-v"]
    warm_uri = f"sqlite:///{tmp_path / 'warm.db'}"
    cold_uri = f"sqlite:///{tmp_path / 'cold.db'}"
    warm = pool.fedray(*args, "--tracking-uri", warm_uri)
    cold = pool.fedray(*args, "--tracking-uri", cold_uri, pool=False)
    assert warm.returncode == cold.returncode == 0, (warm.stderr, cold.stderr)
    said = warm.stderr.splitlines()
    assert said[0].startswith(ON_POOL) and f"{pool.pid()}, " in said[0]
    assert ON_POOL not in cold.stderr
    assert "command: fedray run " in pool.log()
    # the same lines, on each stream, but for the pool's line, run ids, times
    assert _plain(warm.stdout) == _plain(cold.stdout.replace(cold_uri, warm_uri))
    assert _plain("\n".join(said[1:])) == _plain(cold.stderr)
    # the numbers, to the bit: every metric's whole history
    warm_points, cold_points = _points(warm_uri), _points(cold_uri)
    assert warm_points == cold_points
    (point,) = warm_points.values()
    assert [step for step, _ in point[mlflow_name("test_accuracy")]] == [0, 1]  # 2 rounds
    assert point[mlflow_name("test_accuracy")][-1][1] > 0.3
    # a second command on the same pool: the same numbers again (nothing carried over)
    again_uri = f"sqlite:///{tmp_path / 'again.db'}"
    again = pool.fedray(*args, "--tracking-uri", again_uri)
    assert again.returncode == 0 and again.stderr.startswith(ON_POOL), again.stderr
    assert _points(again_uri) == cold_points
    assert _plain(again.stderr) == _plain(warm.stderr)


def test_a_user_mistake_on_the_pool_is_its_one_line_and_exit_2(pool, tmp_path):
    args = ["run", QUICK, "--set", "no_such_key=1", "--backend", "inline", "-v"]
    warm = pool.fedray(*args)
    cold = pool.fedray(*args, pool=False)
    assert warm.returncode == cold.returncode == 2
    assert warm.stderr.startswith(ON_POOL)
    assert warm.stderr.splitlines()[1:] == cold.stderr.splitlines()
    assert len(cold.stderr.splitlines()) == 1 and "no_such_key" in cold.stderr
    assert warm.stdout == cold.stdout == ""
    # argparse's own errors (SystemExit in the pool) too
    bad = pool.fedray("run", QUICK, "--workers", "0")
    assert bad.returncode == 2 and "--workers" in bad.stderr and "Traceback" not in bad.stderr
    assert "command: fedray run " + QUICK + " --workers 0" in pool.log()


def test_a_busy_pool_leaves_the_second_command_to_its_client(pool, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = pool.start("run", QUICK, "--set", "rounds=3000", "--backend", "inline", "--quiet",
                       "-v", "--tracking-uri", uri, out=tmp_path / "first")
    try:
        _wait_for(tmp_path / "first.err", "/3000 acc", first)
        second = pool.fedray("run", QUICK, "--set", "rounds=1", "--backend", "inline", "-v",
                             "--tracking-uri", f"sqlite:///{tmp_path / 'second.db'}")
        assert second.returncode == 0, second.stderr
        assert "did not take the command (busy: it runs another command); running here" \
            in second.stderr.splitlines()[0]
        assert ON_POOL not in second.stderr and "final test accuracy" in second.stdout
        assert pool.log().count("command: fedray run") == 1
    finally:
        first.send_signal(signal.SIGINT)
        first.wait(TIMEOUT)
    assert first.returncode == 130


def test_ctrl_c_on_the_client_ends_the_run_killed_and_the_pool_serves_on(pool, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = pool.start("run", QUICK, "--set", "rounds=3000", "--backend", "inline", "--quiet",
                      "-v", "--tracking-uri", uri, out=tmp_path / "run")
    _wait_for(tmp_path / "run.err", "/3000 acc", proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(TIMEOUT) == 128 + signal.SIGINT
    err = (tmp_path / "run.err").read_text()
    assert err.startswith(ON_POOL) and "Traceback" not in err
    ours = [line for line in err.splitlines() if line.startswith("fedray run:")]
    assert len(ours) == 1 and "interrupted by SIGINT" in ours[0] and "marked KILLED" in ours[0]
    assert sorted(_statuses(uri).values()) == ["KILLED", "KILLED"]
    # SIGTERM too: Terminated, exit 143
    proc = pool.start("run", QUICK, "--set", "rounds=3000", "--backend", "inline", "--quiet",
                      "-v", "--tracking-uri", uri, out=tmp_path / "term")
    _wait_for(tmp_path / "term.err", "/3000 acc", proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(TIMEOUT) == 128 + signal.SIGTERM
    assert "interrupted by SIGTERM" in (tmp_path / "term.err").read_text()
    after = pool.fedray("run", QUICK, "--set", "rounds=1", "--backend", "inline", "-v",
                        "--tracking-uri", uri)
    assert after.returncode == 0 and after.stderr.startswith(ON_POOL), after.stderr
    assert sorted(_statuses(uri).values()) == ["FINISHED", "FINISHED"] + ["KILLED"] * 4


def test_a_client_killed_mid_run_ends_its_command_and_the_pool_serves_on(pool, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = pool.start("run", QUICK, "--set", "rounds=3000", "--backend", "inline", "--quiet",
                      "-v", "--tracking-uri", uri, out=tmp_path / "run")
    _wait_for(tmp_path / "run.err", "/3000 acc", proc)
    proc.kill()
    proc.wait(TIMEOUT)
    deadline = time.monotonic() + TIMEOUT
    while "done: " not in pool.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "the client went away: SIGTERM to its command" in pool.log()
    assert sorted(_statuses(uri).values()) == ["KILLED", "KILLED"]
    after = pool.fedray("run", QUICK, "--set", "rounds=1", "--backend", "inline", "-v",
                        "--tracking-uri", uri)
    assert after.returncode == 0 and after.stderr.startswith(ON_POOL), after.stderr


def test_a_killed_pool_leaves_a_stale_socket_that_up_and_the_client_clean(pool, tmp_path):
    old = pool.pid()
    os.kill(old, signal.SIGKILL)
    _wait_gone(pool, old)
    assert (pool.folder / "pool.sock").exists()  # what kill -9 leaves
    r = pool.fedray("run", QUICK, "--set", "rounds=1", "--backend", "inline", "-v",
                    "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert r.returncode == 0, r.stderr
    assert "no warm pool answers" in r.stderr and ON_POOL not in r.stderr
    assert not (pool.folder / "pool.sock").exists()  # the client removed it
    os.symlink("/nonexistent", pool.folder / "pool.sock")  # stale again, before `up`
    up = pool.fedray("up")
    assert up.returncode == 0 and "a warm pool is up (pid " in up.stdout, up.stderr
    assert pool.pid() != old
    r = pool.fedray("run", QUICK, "--set", "rounds=1", "--backend", "inline", "-v",
                    "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert r.returncode == 0 and r.stderr.startswith(ON_POOL), r.stderr


def test_up_twice_down_twice(pool):
    again = pool.fedray("up")
    assert again.returncode == 0 and "a warm pool is up already (pid " in again.stdout
    pid = pool.pid()
    down = pool.fedray("down")
    assert down.returncode == 0 and f"fedray down: the warm pool (pid {pid}) stopped" in down.stdout
    _wait_gone(pool, pid)
    assert not (pool.folder / "pool.sock").exists() and not (pool.folder / "pool.pid").exists()
    again = pool.fedray("down")
    assert again.returncode == 0 and again.stdout == "fedray down: no warm pool is up\n"
    assert "Traceback" not in again.stderr


def test_down_when_nothing_was_ever_up(tmp_path):
    r = Pool(tmp_path).fedray("down")
    assert r.returncode == 0 and r.stdout == "fedray down: no warm pool is up\n" and not r.stderr


def test_a_strict_run_is_handed_back_and_restarts_pinned_in_its_client(pool, tmp_path):
    args = ["run", QUICK, "--set", "rounds=1", "--set", "runtime.deterministic=strict",
            "--backend", "inline", "-v"]
    warm_uri = f"sqlite:///{tmp_path / 'warm.db'}"
    warm = pool.fedray(*args, "--tracking-uri", warm_uri)
    assert warm.returncode == 0, warm.stderr
    assert "the warm pool handed the command back (runtime.deterministic: strict" in warm.stderr
    assert "restarting with ATEN_CPU_CAPABILITY=default" in warm.stderr
    cold_uri = f"sqlite:///{tmp_path / 'cold.db'}"
    cold = pool.fedray(*args, "--tracking-uri", cold_uri, pool=False)
    assert _points(warm_uri) == _points(cold_uri)
    # what the client prints is the command's own output once, not twice
    assert _plain(warm.stdout) == _plain(cold.stdout.replace(cold_uri, warm_uri))


def test_runs_on_ray_keep_its_instance_and_actors_with_the_numbers_of_a_cold_run(pool, tmp_path):
    args = ["run", QUICK, "--set", "rounds=2", "--backend", "ray", "-v"]
    uris = [f"sqlite:///{tmp_path / f'{name}.db'}" for name in ("first", "second", "cold")]
    first = pool.fedray(*args, "--tracking-uri", uris[0])
    second = pool.fedray(*args, "--tracking-uri", uris[1])
    cold = pool.fedray(*args, "--tracking-uri", uris[2], pool=False)
    for r in (first, second, cold):
        assert r.returncode == 0, r.stderr
    assert first.stderr.startswith(ON_POOL) and second.stderr.startswith(ON_POOL)
    # the second run found Ray and the first run's actors in the pool
    assert "Started a local Ray instance" in first.stderr
    assert "Started a local Ray instance" not in second.stderr
    assert _points(uris[0]) == _points(uris[1]) == _points(uris[2])


def test_a_command_with_address_runs_in_its_client(pool):
    r = pool.fedray("run", QUICK, "--address", "127.0.0.1:notaport", "--set", "rounds=1", "-v")
    assert r.returncode == 2
    assert "did not take the command (it keeps a local Ray instance; a command with " \
        "--address runs in its client)" in r.stderr.splitlines()[0]
    assert "--address 127.0.0.1:notaport: expected HOST:PORT" in r.stderr
    assert "command: " not in pool.log()


def test_down_waits_for_the_command_it_runs_and_force_interrupts_it(pool, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = pool.start("run", QUICK, "--set", "rounds=3000", "--backend", "inline", "--quiet",
                      "--tracking-uri", uri, out=tmp_path / "run")
    _wait_for(tmp_path / "run.err", "/3000 acc", proc)
    pid = pool.pid()
    down = subprocess.Popen([*FEDRAY, "down"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, env=pool.env)
    assert down.stderr is not None
    line = down.stderr.readline()
    assert line == (f"fedray down: the pool (pid {pid}) runs `fedray run {QUICK} --set "
                    f"rounds=3000 --backend inline --quiet --tracking-uri {uri}`: waiting for "
                    "it to end (fedray down --force interrupts it)\n")
    assert proc.poll() is None and down.poll() is None  # the command goes on; down waits
    # a command the stopping pool is asked for runs in its client
    r = pool.fedray("run", QUICK, "--set", "rounds=1", "--backend", "inline", "-v",
                    "--tracking-uri", f"sqlite:///{tmp_path / 'other.db'}")
    assert r.returncode == 0 and "did not take the command (busy: " in r.stderr
    force = pool.fedray("down", "--force")  # interrupts it, as SIGTERM would
    assert force.returncode == 0, force.stderr
    assert "interrupting it (SIGTERM)" in force.stderr
    assert proc.wait(TIMEOUT) == 128 + signal.SIGTERM
    assert "interrupted by SIGTERM" in (tmp_path / "run.err").read_text()
    out, _ = down.communicate(timeout=TIMEOUT)
    assert down.returncode == 0 and out == f"fedray down: the warm pool (pid {pid}) stopped\n"
    assert sorted(_statuses(uri).values()) == ["KILLED", "KILLED"]
    assert not (pool.folder / "pool.sock").exists()
