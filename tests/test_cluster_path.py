"""The cluster path (docs/cluster.md): `ray job submit` against a real `ray start --head`,
a store in Ray's temporary folders refused, a working directory removed under a running
driver, and Ray's raylet-death block left out of the driver's output."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedray.cli import _pending_note, main
from simulator.run import checkpoint
from simulator.runtime.backend import RAYLET_DIED_BLOCK, ray_temporary_folder

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SESSION = "session_2026-12-04_10-35-12_345678_12345"  # the shape of a Ray session's folder

SCENARIO = """\
name: cluster-job
rounds: 4
data:
  dataset: {name: digits}
model: {name: mlp, hidden: [32]}
clients: {total: 6, per_round: 3}
aggregator: {name: mean}
local: {steps: 10, batch_size: 32, lr: 0.3}
runtime: {backend: ray, workers: 1}
"""

REFUSED = "--tracking-uri: the MLflow store "


def _job_folder(base: Path) -> Path:
    """Where `ray job submit --working-dir` unpacks a job (on a head started with
    --temp-dir ``base``)."""
    d = base / SESSION / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123abcd"
    d.mkdir(parents=True)
    return d


# --- Ray's temporary folders -------------------------------------------------------------

def test_ray_temporary_folder_finds_sessions_job_folders_and_rays_default_root(tmp_path,
                                                                              monkeypatch):
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    monkeypatch.delenv("TMPDIR", raising=False)
    job = _job_folder(tmp_path / "raytmp")
    assert ray_temporary_folder(job) == tmp_path / "raytmp" / SESSION
    assert ray_temporary_folder(job / "mlflow.db") == tmp_path / "raytmp" / SESSION
    # a runtime_resources folder whose session folder Ray named differently
    assert ray_temporary_folder(Path("/x/runtime_resources/working_dir_files/p")) == \
        Path("/x/runtime_resources")
    assert ray_temporary_folder(Path("/tmp/ray/session_latest/x")) == Path("/tmp/ray")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "rt"))
    assert ray_temporary_folder(tmp_path / "rt" / "ray" / "a") == tmp_path / "rt" / "ray"
    assert ray_temporary_folder(Path("/tmp/ray/a")) is None  # Ray's root is elsewhere now
    # folders that only look alike
    assert ray_temporary_folder(tmp_path / "session_notes" / "ray") is None
    assert ray_temporary_folder(Path("/tmp/rays/a")) is None
    assert ray_temporary_folder(tmp_path) is None


@pytest.mark.parametrize("command", [["run", "{s}"], ["sweep", "{s}"], ["resume", "0123abcd"]])
def test_a_run_in_a_ray_job_folder_without_tracking_uri_is_refused_in_one_line(
        tmp_path, monkeypatch, capsys, command):
    """Before anything runs: no store, no .fedray folder, one line naming --tracking-uri."""
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SCENARIO.replace("backend: ray", "backend: inline"))
    job = _job_folder(tmp_path / "raytmp")
    monkeypatch.chdir(job)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    code = main([c.format(s=scenario) for c in command])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [(
        f"fedray {command[0]}: {REFUSED}{job / 'mlflow.db'} would be in Ray's temporary folder "
        f"{tmp_path / 'raytmp' / SESSION} (a `ray job submit --working-dir` job runs there), "
        "removed with the job; pass --tracking-uri http://HOST:5000 (a shared MLflow server, "
        "docs/cluster.md) or --tracking-uri sqlite:////ABSOLUTE/PATH/mlflow.db in a folder "
        "that lasts")]
    assert sorted(p.name for p in job.iterdir()) == []

    # MLFLOW_TRACKING_URI's relative SQLite store is the same store; one elsewhere is not refused
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
    assert main([c.format(s=scenario) for c in command]) == 2
    assert REFUSED in capsys.readouterr().err


def test_a_lasting_store_is_not_refused_in_a_ray_job_folder(tmp_path, monkeypatch, capsys):
    """With --tracking-uri elsewhere the next check answers (too many workers for --workers)."""
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SCENARIO)
    monkeypatch.chdir(_job_folder(tmp_path / "raytmp"))
    code = main(["run", str(scenario), "--workers", "64",
                 "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"])
    err = capsys.readouterr().err
    assert code == 2 and REFUSED not in err and err.startswith("fedray run: --workers: 64 ")


@pytest.mark.parametrize("command", [["run", "{s}"], ["sweep", "{s}"],
                                     ["resume", "0123abcd", "--backend", "ray"]])
def test_a_ray_job_without_address_is_refused_in_one_line(tmp_path, monkeypatch, capsys,
                                                          command):
    """Inside `ray job submit` (its job config in the environment) a new local Ray instance
    inherits the job's runtime environment, and every actor failed with a traceback."""
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SCENARIO)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", '{"runtime_env": {"working_dir": '
                       '"gcs://_ray_pkg_0123abcd.zip"}}')
    store = ["--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    assert main([c.format(s=scenario) for c in command] + store) == 2
    assert capsys.readouterr().err.splitlines() == [(
        f"fedray {command[0]}: --address: this runs as a Ray job (ray job submit); pass "
        "--address auto to run on the job's cluster, or --backend inline")]
    assert not (tmp_path / "mlflow.db").exists()


# --- the closing hint -------------------------------------------------------------------

@pytest.mark.parametrize("uri,ui", [
    ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
    ("https://mlflow.lab.example:8443/", "https://mlflow.lab.example:8443"),
    ("http://alice:s3cretpass@10.0.0.5:5000", "http://alice:***@10.0.0.5:5000"),
])
def test_after_a_run_on_a_tracking_server_the_hint_is_the_servers_own_ui(capsys, monkeypatch,
                                                                         uri, ui):
    """Not `fedray ui` (a second UI, on the port the server itself often holds): the
    server's UI at its address, the experiment's runs view, no credential."""
    from fedray.cli import _closing, build_parser

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    args = build_parser().parse_args(["run", "s.yaml", "--tracking-uri", uri])
    _closing(args, "cluster-job", uri, "7")
    out = capsys.readouterr().out.splitlines()
    assert out[1] == (f"open the MLflow UI of the tracking server: {ui}/#/experiments/7"
                      "?workflowType=machine_learning")
    assert "fedray ui" not in "\n".join(out) and "s3cretpass" not in "\n".join(out)
    args = build_parser().parse_args(["run", "s.yaml", "--tracking-uri", "sqlite:////s/m.db"])
    _closing(args, "cluster-job", "sqlite:////s/m.db", "7")
    assert capsys.readouterr().out.splitlines()[1] == (
        "open the MLflow UI with: fedray ui --tracking-uri sqlite:////s/m.db   "
        "(then http://127.0.0.1:5000)")


# --- a working directory removed under the command ---------------------------------------

def test_checkpoints_in_a_removed_working_directory_are_one_line(tmp_path, monkeypatch):
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(checkpoint.WorkingDirectoryGone,
                       match=r"^the working directory was removed while the run went on; what "
                             r"the run kept there \(.fedray/checkpoints/, .fedray/pending/\) "
                             r"went with it; run fedray from a folder that lasts$"):
        checkpoint.save("r1", 0, {"x": 1})
    assert checkpoint.remove("r1") is None  # nothing to forget: it went with the folder
    assert checkpoint.latest("r1", base=tmp_path) is None  # an explicit base still answers


def test_the_pending_note_of_a_removed_working_directory_is_one_line(tmp_path, monkeypatch,
                                                                     capsys):
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    _pending_note("run", gone)
    assert capsys.readouterr().err.splitlines() == [(
        f"fedray run: the working directory {gone} was removed while it ran; what it held "
        "(.fedray/pending/, .fedray/checkpoints/) went with it")]
    code = main(["run", str(tmp_path / "s.yaml")])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [(
        "fedray run: the working directory no longer exists; cd to an existing folder and run "
        "it again")]


# fedray run, whose working directory is removed after round `when` (0-based)
_REMOVE_CWD = """\
import shutil, sys
from pathlib import Path
from simulator.run import callbacks
on_round = callbacks.Progress.on_round
def remove_cwd(self, run, round_, metrics):
    if round_ == int(sys.argv[1]):
        shutil.rmtree(Path.cwd())
    on_round(self, run, round_, metrics)
callbacks.Progress.on_round = remove_cwd
from fedray.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_working_directory_removed_under_a_running_driver_is_one_line(tmp_path,
                                                                        _mlflow_template):
    """A driver whose folder disappears (as a Ray job's may): checkpoints every round meet
    the removed folder, the run stops and says so in one line, with no traceback."""
    store = tmp_path / "store"
    store.mkdir()
    shutil.copy(_mlflow_template, store / "mlflow.db")
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SCENARIO.replace("backend: ray, workers: 1",
                                         "backend: inline, checkpoint_every: 1"))
    cwd = tmp_path / "job"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", _REMOVE_CWD, "1", "run", str(scenario),
                        "--tracking-uri", f"sqlite:///{store / 'mlflow.db'}"], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=300, check=False)
    assert not cwd.exists(), r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("fedray run:")]
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"fedray run: the working directory {cwd} was removed while "
                               "the run went on; what the run kept there")
    assert "marked FAILED" in lines[0] and "; continue with `fedray resume " in lines[0]


# --- Ray's raylet-death block ------------------------------------------------------------

_PRINT_ERRORS = """\
from simulator.runtime.backend import import_ray
ray = import_ray()
from ray._private.worker import print_to_stdstream
for message in ["Raylet is terminated. Termination is unexpected. Possible reasons include: "
                "(1) SIGKILL.\\n    [state-dump] line 1\\n    [state-dump] line 2",
                "The node with node id: abc has been marked dead because the detector has "
                "missed too many heartbeats from it."]:
    print_to_stdstream({"lines": [message], "pid": "raylet", "is_err": False},
                       ignore_prefix=False)
"""


def test_the_driver_prints_rays_other_errors_but_not_the_raylet_death_block():
    """Through the printer of the driver's error listener (what Ray's agents publish when a
    raylet dies): the block is left out, the node's death is still said, once."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_DEDUP_LOGS_SKIP_REGEX"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", _PRINT_ERRORS], env=env, capture_output=True,
                       text=True, timeout=120, check=True)
    assert "Raylet is terminated" not in r.stdout and "state-dump" not in r.stdout
    assert r.stdout.count("has been marked dead because the detector") == 1, r.stdout
    # a pattern of the user's is kept beside fedray's
    env["RAY_DEDUP_LOGS_SKIP_REGEX"] = "marked dead"
    r = subprocess.run([sys.executable, "-c", _PRINT_ERRORS], env=env, capture_output=True,
                       text=True, timeout=120, check=True)
    assert "Raylet is terminated" not in r.stdout and "marked dead" not in r.stdout
    assert RAYLET_DIED_BLOCK == r"^Raylet is terminated\."


_KILL_RAYLET = """\
import glob, os, signal, sys, time
from simulator.runtime.backend import RayBackend, import_ray
ray = import_ray()
from ray.cluster_utils import Cluster
from simulator.errors import WorkerLost
cluster = Cluster(initialize_head=True, head_node_args={
    "num_cpus": 0, "include_dashboard": False, "object_store_memory": 100 * 1024**2,
    "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 2,
                       "health_check_initial_delay_ms": 0}})
node = cluster.add_node(num_cpus=1, object_store_memory=100 * 1024**2)
cluster.wait_for_nodes()
backend = RayBackend(cluster.address)
class Sleeper:
    def nap(self):
        time.sleep(60)
actor = backend.spawn(Sleeper, role="worker")
ray.get(actor.__ray_ready__.remote())
ref = backend.call(actor, Sleeper.nap)
os.kill(node.all_processes["raylet"][0].process.pid, signal.SIGKILL)
try:
    backend.get(ref)
except WorkerLost as e:
    print("lost:", e, file=sys.stderr, flush=True)
logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
deadline = time.monotonic() + 60  # until the killed node's agents have published the block
while not any("Raylet is terminated" in open(f, errors="replace").read()
              for f in glob.glob(os.path.join(logs, "*agent*.log"))):
    assert time.monotonic() < deadline, "no agent reported the raylet's death"
    time.sleep(0.5)
time.sleep(3)  # the driver's error listener polls the published errors
print("published", file=sys.stderr, flush=True)
ray.shutdown()
cluster.shutdown()
"""


@pytest.mark.cluster
def test_a_killed_raylet_is_our_one_line_not_rays_block(tmp_path):
    """A worker node's raylet killed (SIGKILL) under an actor call: Ray's agents publish the
    "Raylet is terminated" block (20 lines of a raylet log; twice before); the driver prints
    none of it, and the run's line says the node died."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_DEDUP_LOGS_SKIP_REGEX")}
    env.update(PYTHONPATH=str(ROOT), RAY_AUTH_MODE="disabled")
    r = subprocess.run([sys.executable, "-c", _KILL_RAYLET], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "published" in r.stderr
    assert "lost: ActorDiedError, its node died" in r.stderr
    assert "Raylet is terminated" not in r.stdout + r.stderr
    assert "state-dump" not in r.stdout + r.stderr


# --- ray job submit against a local head -------------------------------------------------

def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _processes_of(folder: Path, gcs: int) -> set[int]:
    """The processes whose command line names ``folder`` (a head's --temp-dir) or the head's
    GCS port ``gcs`` as their address (Ray's client server names only that), and all
    their descendants (dashboard modules, agents, workers, a job's driver), less this
    process and its ancestors."""
    parents: dict[int, int] = {}
    found: set[int] = set()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            parents[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if str(folder) in cmd or re.search(rf"--address=\S+:{gcs}(?!\d)", cmd):
            found.add(int(p.name))
    grown = True
    while grown:
        more = {pid for pid, ppid in parents.items() if ppid in found} - found
        found |= more
        grown = bool(more)
    mine, pid = set(), os.getpid()  # never this process or those that started it
    while pid > 1 and pid not in mine:
        mine.add(pid)
        pid = parents.get(pid, 1)
    return found - mine


def _stop(folder: Path, gcs: int) -> None:
    """Stop the head started with --temp-dir ``folder``: `ray stop` would stop every Ray
    instance of this user on the machine, others' tests included."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
        for pid in _processes_of(folder, gcs):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while _processes_of(folder, gcs) and time.monotonic() < deadline:
            time.sleep(0.2)


# --- the page's two nodes ----------------------------------------------------------------

PAGE = ROOT / "docs" / "cluster.md"
# what every Ray node on one machine needs of its own (docs/cluster.md, "Start the nodes"),
# and what a head needs besides (a second cluster on the machine); --block: stopped alone
NODE_PORTS = ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
              "--runtime-env-agent-port", "--metrics-export-port", "--node-manager-port",
              "--object-manager-port")
HEAD_PORTS = ("--port", "--dashboard-port", "--ray-client-server-port")
PER_NODE = ("--temp-dir", *NODE_PORTS, "--block")
RAY_WORKER_PORTS = (10002, 19999)  # `ray start`'s --min-worker-port/--max-worker-port


def _shell_lines(text: str) -> list[str]:
    """The command lines of the page's plain code blocks (continuations joined, comments
    and empty lines left out)."""
    out = []
    for block in re.findall(r"^```\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def _ray_start(line: str) -> list[str]:
    """``ray start``'s arguments on a page line (its environment, ``nohup``, redirections
    and ``&`` left out)."""
    words = shlex.split(line)
    while words and ("=" in words[0] or words[0] in ("nohup", "timeout")):
        words.pop(0)
    assert words[:2] == ["ray", "start"], line
    args = []
    for w in words[2:]:
        if w.startswith(">") or w in ("&", "2>&1"):
            break
        args.append(w)
    return args


def _flags(args: list[str]) -> dict[str, str | None]:
    """``{--flag: value}`` (None for a flag without a value) of a ``ray start`` line."""
    out: dict[str, str | None] = {}
    for i, a in enumerate(args):
        if a.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else None
            out[a] = nxt if nxt is not None and not nxt.startswith("--") else None
    return out


def page_nodes() -> dict[str, tuple[list[str], Path, str]]:
    """The page's head and second node on one machine: ``{"head" | "node2": (ray start's
    arguments, the file their pid goes to, the page's command that stops them)}``."""
    lines = _shell_lines(PAGE.read_text())
    found = {}
    for i, line in enumerate(lines):
        if " ray start --head " in f" {line} ":
            name = "head"
        elif re.search(r"ray start --address 127\.0\.0\.1:\d+ ", line):
            name = "node2"
        else:
            continue
        pid = re.fullmatch(r"echo \$! > (\S+)", lines[i + 1])
        assert pid, f"docs/cluster.md: the {name}'s pid is not kept after {line!r}"
        stop = f"kill $(cat {pid[1]})"
        assert stop in lines, f"docs/cluster.md: no `{stop}` stops the {name}"
        found[name] = (_ray_start(line), Path(pid[1]), stop)
    assert sorted(found) == ["head", "node2"], "docs/cluster.md: head or second node missing"
    return found


def _worker_range(flags: dict[str, str | None]) -> range:
    low = int(flags.get("--min-worker-port") or RAY_WORKER_PORTS[0])
    high = int(flags.get("--max-worker-port") or RAY_WORKER_PORTS[1])
    return range(low, high + 1)


def test_the_pages_two_nodes_on_one_machine_have_their_own_folders_and_ports():
    """The page's commands themselves: each node its own --temp-dir and node ports, none in
    a worker range, the head its own head ports, both under --block (stopped one at a time),
    and every flag one that this Ray's `ray start --help` lists."""
    nodes = {name: _flags(args) for name, (args, _, _) in page_nodes().items()}
    head, node2 = nodes["head"], nodes["node2"]
    for flag in PER_NODE:
        assert flag in head and flag in node2, f"docs/cluster.md: {flag} missing"
    for flag in HEAD_PORTS:
        assert flag in head, f"docs/cluster.md: the head's {flag} missing"
    assert head["--temp-dir"] != node2["--temp-dir"]
    ports = [int(str(f[k])) for f in (head, node2) for k in (*NODE_PORTS, *HEAD_PORTS)
             if k in f]
    assert len(ports) == len(set(ports)) == len(NODE_PORTS) * 2 + len(HEAD_PORTS)
    for f in (head, node2):
        assert not [p for p in ports if p in _worker_range(f)]
    assert node2["--address"] == f"127.0.0.1:{head['--port']}"
    help_text = subprocess.run([str(BIN / "ray"), "start", "--help"], capture_output=True,
                               text=True, timeout=120, check=True).stdout
    known = set(re.findall(r"(--[a-z][a-z-]+)", help_text))
    assert set(head) | set(node2) <= known, (set(head) | set(node2)) - known


def _as_here(args: list[str], temp: Path, ports: dict[str, int], head_port: int) -> list[str]:
    """The page's ``ray start`` arguments with this test's folder and free ports in place of
    the page's values; every flag stays."""
    out = list(args)
    for i, a in enumerate(out[:-1]):
        if a == "--temp-dir":
            out[i + 1] = str(temp)
        elif a in ports:
            out[i + 1] = str(ports[a])
        elif a == "--address":
            out[i + 1] = f"127.0.0.1:{head_port}"
    # this machine's share: one CPU each, a small object store, no usage report
    return out + ["--num-cpus", "1", "--object-store-memory", str(100 * 1024**2),
                  "--disable-usage-stats"]


class PageCluster:
    """The page's head and second node, started here (``ray start --block``, each in its
    own process group), and stopped the page's way (``stop``) or, whatever happened, by
    ``clean``."""

    def __init__(self, base: Path, env: dict[str, str]) -> None:
        self.env, self.procs, self.temps = env, {}, {}
        nodes = page_nodes()
        names = [*NODE_PORTS, *HEAD_PORTS]
        free = iter(_free_ports(len(names) * 2))
        ports = {name: {k: next(free) for k in names} for name in nodes}
        self.gcs = ports["head"]["--port"]
        self.dashboard = f"http://127.0.0.1:{ports['head']['--dashboard-port']}"
        self.stops = {name: stop for name, (_, _, stop) in nodes.items()}
        for name in ("head", "node2"):
            self.temps[name] = base / name  # short: Ray's socket paths fit in 107 chars
            argv = [str(BIN / "ray"), "start",
                    *_as_here(nodes[name][0], self.temps[name], ports[name], self.gcs)]
            with open(base / f"{name}.log", "w") as log:  # as the page's > /tmp/ray-*.log
                self.procs[name] = subprocess.Popen(
                    argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True)
            self._wait_started(name, base / f"{name}.log", 120)

    def _wait_started(self, name: str, log: Path, seconds: float) -> None:
        """Until ``ray start`` says the node runs (it has joined the cluster)."""
        deadline = time.monotonic() + seconds
        while "Ray runtime started." not in log.read_text(errors="replace"):
            p = self.procs[name]
            assert p.poll() is None, f"ray start ({name}) exited {p.returncode}: " + \
                log.read_text(errors="replace")[-2000:]
            assert time.monotonic() < deadline, f"ray start ({name}) did not start"
            time.sleep(0.3)

    def alive(self, name: str) -> set[int]:
        """The processes of node ``name`` still running (zombies waiting for their parent
        left out): its process group, and what names its --temp-dir (with their
        children)."""
        self.procs[name].poll()  # ray start itself, once it has exited
        group = {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                 and _pgid(int(p.name)) == self.procs[name].pid}
        found = group | _processes_of(self.temps[name], self.gcs if name == "head" else -1)
        return {pid for pid in found if _state(pid) not in (None, "Z")}

    def stop(self, name: str) -> None:
        """The page's ``kill $(cat PIDFILE)``: SIGTERM to its ``ray start --block``."""
        assert self.stops[name].startswith("kill $(cat ")
        self.procs[name].send_signal(signal.SIGTERM)

    def clean(self) -> None:
        for name in ("node2", "head"):
            p = self.procs.get(name)
            if p is None:
                continue
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(20)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            _stop(self.temps[name], self.gcs if name == "head" else -1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)


def _state(pid: int) -> str | None:
    """A process's state letter (``Z``: a zombie), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


@pytest.fixture(scope="module")
def page_cluster(tmp_path_factory):
    """docs/cluster.md's head (the Jobs API on loopback) and second node on this machine,
    with token authentication off, the page's flags with this test's folders and free ports.
    Its environment is the one a job inherits: this venv's bin first on PATH (the job's
    `fedray`), no MLFLOW_TRACKING_URI."""
    pytest.importorskip(
        "ray.dashboard.optional_deps",
        reason="the cluster extra is not installed (pip install -e '.[cluster]'): "
               "the page's head has the dashboard, which needs its packages")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "RAY_DEDUP_LOGS_SKIP_REGEX")}
    env.update(RAY_AUTH_MODE="disabled", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    cluster = None
    try:
        cluster = PageCluster(tmp_path_factory.mktemp("ray"), env)
        yield cluster
    finally:
        if cluster is not None:
            cluster.clean()


def _submit(address: str, env: dict, working_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ray"), "job", "submit", "--address", address,
                           "--working-dir", str(working_dir), "--", "fedray", "run", *args],
                          env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.cluster
def test_ray_job_submit_runs_on_the_cluster_and_lands_in_the_given_store(
        page_cluster, tmp_path, _mlflow_template):
    """The page's job on the page's two nodes, a ClientWorker on each: every round lands in
    the given store, with the numbers of the same scenario on the inline backend."""
    from mlflow.tracking import MlflowClient

    address, env = page_cluster.dashboard, page_cluster.env
    work = tmp_path / "job"
    work.mkdir()
    (work / "tiny.yaml").write_text(SCENARIO.replace("workers: 1", "workers: 2"))
    uris = {}
    for how in ("job", "inline"):
        (tmp_path / how / "store").mkdir(parents=True)
        shutil.copy(_mlflow_template, tmp_path / how / "store" / "mlflow.db")
        uris[how] = f"sqlite:///{tmp_path / how / 'store' / 'mlflow.db'}"
    r = _submit(address, env, work, "tiny.yaml", "--address", "auto", "--tracking-uri",
                uris["job"])
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "Traceback" not in out
    assert main(["run", str(work / "tiny.yaml"), "--backend", "inline", "--quiet",
                 "--tracking-uri", uris["inline"]]) == 0
    got = {}
    for how, uri in uris.items():
        client = MlflowClient(uri)
        exp = client.get_experiment_by_name("cluster-job")
        runs = client.search_runs([exp.experiment_id],
                                  filter_string="tags.mlflow.parentRunId != ''")
        assert len(runs) == 1 and runs[0].info.status == "FINISHED"
        got[how] = {k: sorted((m.step, m.value) for m in client.get_metric_history(
            runs[0].info.run_id, k)) for k in ("eval/test_accuracy", "eval/test_loss")}
        if how == "job":
            assert runs[0].data.tags["ray_nodes"] == "2"  # both nodes, one CPU each
            run_id = runs[0].info.run_id
    history = got["job"]["eval/test_accuracy"]
    assert [step for step, _ in history] == [0, 1, 2, 3]  # every round, once
    assert got["job"] == got["inline"]
    final = history[-1][1]
    assert final > 0.7
    assert f"seed=0: final test accuracy {final:.4f}  (run {run_id})" in out
    assert f"tracking URI: {uris['job']}" in out


@pytest.mark.cluster
def test_ray_job_submit_without_tracking_uri_fails_in_one_line(page_cluster, tmp_path):
    address, env = page_cluster.dashboard, page_cluster.env
    work = tmp_path / "job"
    work.mkdir()
    (work / "tiny.yaml").write_text(SCENARIO)
    r = _submit(address, env, work, "tiny.yaml", "--address", "auto")
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "Job entrypoint command failed with exit code 2" in out, out[-3000:]
    ours = {line for line in out.splitlines() if line.startswith("fedray run:")}
    assert len(ours) == 1, out[-3000:]
    line = ours.pop()
    assert line.startswith(f"fedray run: {REFUSED}")
    assert "runtime_resources/working_dir_files/_ray_pkg_" in line
    assert "Traceback" not in out and "seed=0: round" not in out


@pytest.mark.cluster
def test_stopping_the_pages_cluster_the_pages_way_leaves_another_ray_running(page_cluster,
                                                                            ray_backend):
    """The page's `kill $(cat PIDFILE)` for each node (last in this module: it stops the
    module's cluster): every process of both nodes is gone within 30 s, and the session's
    own Ray instance still runs a task. `ray stop` would have stopped it too."""
    ray = ray_backend.ray
    assert page_cluster.alive("head") and page_cluster.alive("node2")
    for name in ("node2", "head"):
        page_cluster.stop(name)
    deadline = time.monotonic() + 30
    while page_cluster.alive("head") | page_cluster.alive("node2"):
        assert time.monotonic() < deadline, {n: page_cluster.alive(n) for n in page_cluster.procs}
        time.sleep(0.3)
    for p in page_cluster.procs.values():
        assert p.wait(5) is not None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", page_cluster.gcs), timeout=1).close()
    assert ray.get(ray.remote(lambda: 42).remote(), timeout=60) == 42
    assert ray_backend.num_nodes() == 1
