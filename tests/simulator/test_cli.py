from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from fedray.cli import main, ui_command

ROOT = Path(__file__).resolve().parents[2]
FEDRAY = [sys.executable, "-m", "fedray"]
INVALID = ROOT / "tests" / "scenarios" / "invalid"


def fedray(*args, cwd=None, env=None):
    return subprocess.run([*FEDRAY, *args], capture_output=True, text=True, cwd=cwd, check=False,
                          env={**os.environ, **(env or {})}, timeout=600)


def test_validate_exit_codes_and_every_error_printed():
    ok = fedray("validate", str(ROOT / "scenarios" / "quickstart.yaml"))
    assert ok.returncode == 0 and "quickstart.yaml: ok (1 run)" in ok.stdout
    files = sorted(INVALID.glob("*.yaml"))
    bad = fedray("validate", str(ROOT / "scenarios" / "quickstart.yaml"), *map(str, files))
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == len(files)  # one line per invalid file, none dropped
    for f in files:
        assert any(line.startswith(f"{f}:") for line in lines)


def test_commands_that_run_nothing_import_neither_ray_nor_mlflow():
    """validate, show and list import no runner, tracking module, Ray or MLflow; a bare list
    not even torch (validate, show and a kind's keys load plugin classes: torch's)."""
    quick = str(ROOT / "scenarios" / "quickstart.yaml")
    code = ("import sys\nfrom fedray.cli import main\n"
            "assert main(sys.argv[1:]) == 0\n"
            "heavy = ('ray', 'mlflow', 'torch', 'simulator.run.runner', 'simulator.run.tracking')\n"
            "print('imported:', *(m for m in heavy if m in sys.modules))")
    for args, allowed in ((["validate", quick], ["torch"]), (["show", quick], ["torch"]),
                          (["list"], []), (["list", "-v", "aggregators"], ["torch"])):
        out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                             text=True, check=True, timeout=120).stdout.strip().splitlines()
        assert out[-1].split() == ["imported:", *allowed], args


def test_list_kinds(capsys):
    assert main(["list", "partitioners"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "dirichlet  (alpha=0.5, min_size=1)", "iid", "natural", "pathological  (k=2)",
        "shards  (k=2)", "sizes  (alpha=1.0, min_size=1)"]
    assert main(["list", "datasets"]) == 0
    assert "mnist  (root, download=False, mirror=None, deadline=600.0)" in capsys.readouterr().out.splitlines()
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert ("aggregators: bulyan, caf, cc, cwtm, dnc, flame, fltrust, foolsgold, geomed, krum, "
            "majority_vote, mda, meamed, mean, median, monna, multikrum, norm_bound, "
            "smea") in out
    assert "codecs: float16, powersgd, qsgd, quantize, rand_k, secagg, sign, top_k" in out
    assert ("topologies: complete, edge_list, erdos_renyi, exponential, hypercube, "
            "one_peer_exponential, random_regular, ring, small_world, star, torus") in out
    assert "client_optimizers: ditto, fednova, fedprox, momentum, sgd" in out


def test_list_verbose_shows_paper_types_and_defaults(capsys):
    assert main(["list", "-v", "aggregators"]) == 0
    out = capsys.readouterr().out
    # the paper a rule follows, each key with its type and default
    assert "Bulyan (El Mhamdi, Guerraoui, Rouault" in out and "    f: int >= 0 = 0" in out
    assert main(["list", "-v", "models"]) == 0
    out = capsys.readouterr().out
    assert "    norm: 'none' | 'batch' | 'group' = 'none'" in out
    assert "    channels: list[int >= 1] length 1..4 = [16, 32]" in out
    assert main(["list", "-v", "datasets"]) == 0
    assert "    root: str  (required)" in capsys.readouterr().out
    assert main(["list", "-v"]) == 2
    assert "name a kind" in capsys.readouterr().err


def test_show_prints_the_resolved_scenario_and_its_points(tmp_path, capsys):
    import yaml

    p = tmp_path / "s.yaml"
    p.write_text("rounds: 2\nseeds: [0, 1]\ndata: {dataset: {name: digits}}\n"
                 "model: {name: logreg}\nclients: {total: 6}\n"
                 "sweep: {aggregator.name: [mean, median], attack: [null]}\n")
    assert main(["show", str(p), "--set", "local.lr=0.2"]) == 0
    out = capsys.readouterr().out
    head, points = out.split("# 4 runs: 2 points x 2 seeds\n")
    resolved = yaml.safe_load(head)
    assert resolved["local"]["lr"] == 0.2 and resolved["local"]["batch_size"] == 32  # default
    assert resolved["server"]["optimizer"] == {"name": "sgd", "lr": 1.0, "momentum": 0.0}
    assert points.splitlines() == [
        "mean attack=none seed=0    aggregator.name=mean, attack=null",
        "mean attack=none seed=1    aggregator.name=mean, attack=null",
        "median attack=none seed=0    aggregator.name=median, attack=null",
        "median attack=none seed=1    aggregator.name=median, attack=null"]
    p.write_text("rounds: 0\n")
    assert main(["show", str(p)]) == 2


def test_run_inline_prints_accuracy_run_id_and_ui_hint(tmp_path, mlflow_uri):
    r = fedray("run", str(ROOT / "scenarios" / "quickstart.yaml"), "--backend", "inline",
               "--set", "rounds=3", "--quiet", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "seed=0: final test accuracy 0." in r.stdout
    assert "MLflow parent run: " in r.stdout and "fedray ui" in r.stdout
    assert "figures and tables: fedray report quickstart\n" in r.stdout
    assert "seed=0: round 3/3 acc" in r.stderr  # plain progress lines without a TTY
    assert (tmp_path / "mlflow.db").is_file()  # the embedded default store in the cwd
    from mlflow.tracking import MlflowClient

    exp = MlflowClient(mlflow_uri).get_experiment_by_name("quickstart")
    assert len(MlflowClient(mlflow_uri).search_runs([exp.experiment_id])) == 2


def test_run_invalid_exits_2_without_running(tmp_path):
    r = fedray("run", str(INVALID / "rounds_zero.yaml"), cwd=tmp_path)
    assert r.returncode == 2 and "rounds: must be > 0, got 0" in r.stderr
    assert not (tmp_path / "mlflow.db").exists()


def test_tracking_uri_from_environment(tmp_path, mlflow_uri):
    other = tmp_path / "elsewhere.db"
    import shutil

    shutil.copy(mlflow_uri[len("sqlite:///"):], other)
    r = fedray("run", str(ROOT / "scenarios" / "quickstart.yaml"), "--backend", "inline",
               "--set", "rounds=1", "--quiet", cwd=tmp_path,
               env={"MLFLOW_TRACKING_URI": f"sqlite:///{other}"})
    assert r.returncode == 0, r.stderr
    assert f"tracking URI: sqlite:///{other}" in r.stdout


def test_ui_command_binds_loopback_by_default():
    cmd = ui_command("sqlite:////x/mlflow.db", "127.0.0.1", 5000)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--default-artifact-root") + 1] == "file:///x/mlartifacts"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening_addresses(port: int) -> set[str]:
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.rsplit(":", 1)
            if int(p, 16) == port and state == "0A":
                out.add(addr)
    return out


def test_fedray_ui_serves_on_127_0_0_1_only(mlflow_uri, tmp_path):
    """``fedray ui`` binds the loopback only and prints each experiment's link to MLflow's
    ML view, where a browser sees the runs table (MLflow 3 opens on its GenAI view)."""
    from simulator.config.load import load
    from simulator.run.runner import run_loaded

    run_loaded(load(ROOT / "scenarios" / "quickstart.yaml", ["rounds=1"]), "inline",
               tracking_uri=mlflow_uri, quiet=True)
    port = _free_port()
    log = tmp_path / "ui.log"
    with log.open("w") as err:
        proc = subprocess.Popen([*FEDRAY, "ui", "--port", str(port)], cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        deadline = time.time() + 90
        body = None
        while time.time() < deadline and body is None:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            except OSError:
                time.sleep(0.5)
        assert body == b"OK"
        assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1, nothing else
        links = [line.split(": ", 1)[1] for line in log.read_text().splitlines()
                 if line.startswith("  quickstart: ")]
        assert links and links[0].startswith(f"http://127.0.0.1:{port}/#/experiments/")
        assert links[0].endswith("?workflowType=machine_learning")
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        if chromium is not None:  # what a person sees by the printed link: the runs table
            dom = subprocess.run([chromium, "--headless=new", "--no-sandbox", "--disable-gpu",
                                  "--no-first-run", "--disable-dev-shm-usage",
                                  "--virtual-time-budget=15000", "--dump-dom", links[0]],
                                 capture_output=True, text=True, timeout=120, check=True).stdout
            assert "Run Name" in dom and "matching runs" in dom and "quickstart" in dom
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


def test_set_with_invalid_yaml_is_one_line_exit_2(tmp_path):
    r = fedray("validate", str(ROOT / "scenarios" / "quickstart.yaml"), "--set", "rounds=[1, ",
               cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "--set rounds: not valid YAML" in line
    r = fedray("run", str(ROOT / "scenarios" / "quickstart.yaml"), "--set", "local={lr: ",
               cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "mlflow.db").exists()


def test_sweep_prints_each_result_once_and_names_the_report(tmp_path, shared_ray, mlflow_uri,
                                                            capfd):
    p = tmp_path / "s.yaml"
    p.write_text("name: twice\nrounds: 1\ndata: {dataset: {name: digits}}\n"
                 "model: {name: logreg}\nclients: {total: 4}\n"
                 "sweep: {aggregator.name: [mean, median]}\n")
    assert main(["sweep", str(p), "--tracking-uri", mlflow_uri]) == 0
    out, err = capfd.readouterr()
    both = out + err
    for label in ("mean seed=0", "median seed=0"):
        assert both.count(f"{label}: final test accuracy") == 1, both
    assert f"figures and tables: fedray report twice --tracking-uri {mlflow_uri}" in out


def test_progress_shows_elapsed_time_left_and_the_pace_after_the_first_round():
    import io

    from simulator.run.progress import ProgressLine

    t = [100.0]
    out = io.StringIO()
    bar = ProgressLine("mean seed=0", 10, stream=out, now=lambda: t[0], start=90.0)
    t[0] = 100.0
    bar.update(0, {"test_accuracy": 0.5})  # round 1 ends 10 s after the start (start-up)
    t[0] = 104.0
    bar.update(1, {})  # plain lines every round here: 10 rounds // 10
    t[0] = 108.0
    bar.update(2, {"test_loss": 0.3, "test_accuracy": 0.75})
    lines = out.getvalue().splitlines()
    assert lines[0] == "mean seed=0: round 1/10 acc 0.5000 (0:10 elapsed)"
    # 2 rounds in 8 s after the first: 0.25 rounds/s, 7 rounds left: 28 s
    assert lines[2] == "mean seed=0: round 3/10 acc 0.7500 (0:18 elapsed, 0:28 left, " \
                       "0.25 rounds/s)"
    loss = ProgressLine("reg seed=0", 1, stream=out, now=lambda: t[0], start=t[0])
    loss.update(0, {"test_loss": 0.125})  # a task without accuracy shows its loss
    assert out.getvalue().splitlines()[-1] == "reg seed=0: round 1/1 loss 0.1250 (0:00 elapsed)"


def test_on_a_terminal_the_progress_is_a_tqdm_bar_with_our_pace():
    """A terminal gets tqdm's bar (in a notebook, tqdm.auto's widget): the label, the rounds
    done, the score and the times of the plain lines (the pace after the first round); the
    bar ends with its run. Two bars of points run at once take two lines."""
    import io

    from simulator.run.progress import ProgressLine

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    t = [0.0]
    out = Terminal()
    bar = ProgressLine("mean seed=0", 4, stream=out, now=lambda: t[0], start=0.0)
    for r in range(4):
        t[0] = 10.0 + 2 * r
        bar.update(r, {"test_accuracy": 0.5 + r / 10})
    text = out.getvalue()
    assert "round 1/4" not in text  # no plain line
    last = text.rstrip("\n").rsplit("\r", 1)[-1]
    assert last.startswith("mean seed=0 ") and "4/4" in last
    assert last.endswith("acc 0.8000 | 0:16 elapsed, 0.50 rounds/s")
    assert bar._tqdm is None and text.endswith("\n")  # closed at the last round
    quiet = Terminal()
    ProgressLine("q", 1, quiet=True, stream=quiet).update(0, {})
    assert quiet.getvalue().startswith("q: round 1/1 (")


def test_a_sweep_point_reports_its_progress(tmp_path, capsys):
    """The Ray task of a sweep point prints its progress lines (Ray forwards them to the
    driver's terminal, prefixed with the task's pid)."""
    from simulator.config.load import load
    from simulator.run.executors import _simulate

    p = tmp_path / "s.yaml"
    p.write_text("rounds: 2\ndata: {dataset: {name: digits}}\nmodel: {name: logreg}\n"
                 "clients: {total: 4}\n")
    _simulate(load(p).points[0].scenario, "mean seed=0")
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("mean seed=0: round 1/2 acc ") and "elapsed" in err[0]
    assert err[1].startswith("mean seed=0: round 2/2 acc ") and "rounds/s" in err[1]


def test_a_malformed_address_is_one_line_before_ray_starts():
    """--address that is not HOST:PORT, auto or ray://: Ray raised a ValueError with its
    traceback; now one line, exit 2. The port is checked too (0 < port < 65536)."""
    from simulator.errors import UsageError
    from simulator.runtime.backend import _check_listening

    quick = str(ROOT / "scenarios" / "quickstart.yaml")
    r = fedray("run", quick, "--address", "127.0.0.1:notaport", "--set", "rounds=1")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "fedray run: --address 127.0.0.1:notaport: expected HOST:PORT (the head's port, 6379 "
        "unless `ray start --port` said otherwise), auto, or ray://HOST:PORT")
    for bad in ("somehost", ":6379", "127.0.0.1:0", "127.0.0.1:70000", "[::1]:x"):
        with pytest.raises(UsageError, match=r"expected HOST:PORT"):
            _check_listening(bad)
    for left_to_ray in ("auto", "local", "ray://127.0.0.1:10001"):
        _check_listening(left_to_ray)  # no probe, no error


@pytest.mark.parametrize("args, line", [
    (["run", "Q", "--workers", "-1"], "run: error: argument --workers: must be {n}, got -1"),
    (["run", "Q", "--workers", "0"], "run: error: argument --workers: must be {n}, got 0"),
    (["run", "Q", "--workers", "two"], "run: error: argument --workers: must be {n}, got 'two'"),
    (["sweep", "Q", "--parallel", "0"], "sweep: error: argument --parallel: must be {n}, got 0"),
    (["resume", "abc", "--workers", "-2"], "resume: error: argument --workers: must be {n}, got -2"),
    (["ui", "--port", "99999"], "ui: error: argument --port: must be {port}, got 99999"),
])
def test_counts_and_ports_out_of_range_are_one_line_exit_2(args, line, tmp_path, capsys):
    """--workers -1 died in an IndexError traceback after MLflow runs were opened, --workers 0
    (and --parallel 0) silently meant the default, ui --port 99999 an OverflowError."""
    quick = str(ROOT / "scenarios" / "quickstart.yaml")
    with pytest.raises(SystemExit) as e:
        main([quick if a == "Q" else a for a in args])
    assert e.value.code == 2
    expected = "fedray " + line.format(n="an integer >= 1", port="an integer from 1 to 65535") \
        + f"; see `fedray {args[0]} --help`"
    assert capsys.readouterr().err.strip().splitlines() == [expected]  # one line


def test_the_api_refuses_worker_and_parallel_counts_below_one(tmp_path):
    from simulator.config.load import load
    from simulator.errors import UsageError
    from simulator.run.runner import run_sweep
    from simulator.runtime.backend import InlineBackend
    from simulator.sim.engine import Engine

    loaded = load(ROOT / "scenarios" / "quickstart.yaml", ["rounds=1"])
    for bad in (0, -1):
        with pytest.raises(UsageError, match=f"workers: must be an integer >= 1, got {bad}"):
            Engine(loaded.points[0].scenario, InlineBackend(), workers=bad)
        with pytest.raises(UsageError, match=f"parallel: must be an integer >= 1, got {bad}"):
            run_sweep(loaded, tracking_uri=f"sqlite:///{tmp_path}/m.db", parallel=bad)
    assert not (tmp_path / "m.db").exists()  # refused before the store opened


def test_the_process_ends_without_teardown_but_with_every_thread_and_exit_handler(tmp_path):
    """``fedray`` ends its process with ``os._exit`` once the command returned: the threads
    the interpreter would join (a thread still writing, a pool's worker) and the ``atexit``
    handlers run first, and the command's exit status is kept."""
    code = f"""
import atexit, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import fedray.cli as cli
out = Path({str(tmp_path)!r})

def command(argv=None):
    def late(name):
        time.sleep(0.3)
        (out / name).write_text("written")
    threading.Thread(target=late, args=("thread",)).start()
    pool = ThreadPoolExecutor(1)
    pool.submit(late, "pool")
    pool.shutdown(wait=False)
    atexit.register(lambda: (out / "atexit").write_text("written"))
    return 3

cli.main = command
cli.entry()
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 3, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atexit", "pool", "thread"]
