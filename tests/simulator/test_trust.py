"""Issue 44, items 1-3: the tracking store checked by class before anything runs and awaited
before round 0; credentials never printed; one exit-code rule (2 for a user's mistake, in
one line). Each class is tried on several generated instances, not only the issue's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedray.cli import main
from simulator.errors import UsageError, redact
from simulator.run.store_uri import SCHEMES, check_store_uri

ROOT = Path(__file__).resolve().parents[2]
QUICK = str(ROOT / "scenarios" / "quickstart.yaml")
SCHEME_LIST = "http, https, sqlite, postgresql, mysql, mssql, databricks, file"
KNOWN = (f"MLflow opens {SCHEME_LIST} (e.g. sqlite:////ABSOLUTE/PATH/mlflow.db or "
         "http://HOST:5000)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _refused(uri: str) -> str:
    with pytest.raises(UsageError) as e:
        check_store_uri(uri, "--tracking-uri")
    line = str(e.value)
    assert len(line.splitlines()) == 1
    return line


@pytest.fixture()
def clean_env(monkeypatch, tmp_path):
    for k in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE", "DATABRICKS_HOST"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("DATABRICKS_CONFIG_FILE", str(tmp_path / "no-databrickscfg"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ------------------------------------------------------------ 1. the URI's class

def test_the_scheme_table_is_mlflows_registry():
    """fedray's table of classes has exactly the schemes MLflow's tracking-store registry
    knows: a scheme MLflow adds or drops shows up here."""
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    assert set(SCHEMES) == set(_tracking_store_registry._registry)


@pytest.mark.parametrize("uri", ["bogus://x", "ftp://127.0.0.1/db", "s3://bucket/mlflow",
                                 "redis://127.0.0.1:6379", "sqlite3:///m.db",
                                 "postgres://u@127.0.0.1/db", "HTTPX://h:5000"])
def test_an_unknown_scheme_is_refused_naming_the_known_ones(clean_env, uri):
    scheme = uri.split("://")[0].lower()
    assert _refused(uri) == f"--tracking-uri {uri}: unknown scheme {scheme!r}; {KNOWN}"


@pytest.mark.parametrize("uri, module", [
    ("postgresql://u@127.0.0.1:1/db", "psycopg"), ("postgresql+psycopg2://h/db", "psycopg2"),
    ("mysql://h/db", "MySQLdb"), ("mysql+pymysql://h:3306/db", "pymysql"),
    ("mssql://h/db", "pyodbc"), ("mssql+pymssql://h/db", "pymssql"),
    ("postgresql:///mlflow?host=/run/postgresql", "psycopg")])  # a local socket: no host
def test_a_database_uri_needs_its_driver(clean_env, uri, module):
    import importlib.util

    if importlib.util.find_spec(module) is not None:
        check_store_uri(uri)  # installed: the URI's class is fine (the store answers later)
        return
    dialect = uri.split(":")[0].split("+")[0]
    assert _refused(uri).startswith(f"--tracking-uri {uri}: its database driver {module!r} "
                                    f"(SQLAlchemy's {dialect}+")
    assert _refused(uri).endswith(f"is not installed; install it, or name an installed "
                                  f"driver ({dialect}+DRIVER://...)")


@pytest.mark.parametrize("uri", ["postgresql+nosuch://h/db", "mysql+xyz://h/db",
                                 "mssql+foo://h/db"])
def test_a_driver_sqlalchemy_does_not_know_is_refused(clean_env, uri):
    assert _refused(uri) == f"--tracking-uri {uri}: SQLAlchemy has no driver " \
        f"{uri.split(':')[0]!r}"


@pytest.mark.parametrize("uri, why", [
    ("http://[::1", ("not a URI that parses (an IPv6 host is written [ADDRESS], with both "
     "brackets)")),
    ("https://[fe80::1:5000/x", ("not a URI that parses (an IPv6 host is written [ADDRESS], "
     "with both brackets)")),
    ("http://:5000", "it names no host (scheme://HOST:PORT)"),
    ("https://", "it names no host (scheme://HOST:PORT)"),
    ("http://h:0", "its port is not a number from 1 to 65535"),
    ("http://h:99999", "its port is not a number from 1 to 65535"),
    ("https://h:abc", "its port is not a number from 1 to 65535"),
    ("http://h!st:5000", "its host 'h!st' is neither an IP address nor a host name"),
    ("http://bad host:5000", "its host 'bad host' is neither an IP address nor a host name"),
    ("postgresql://u@h:70000/db", "its port is not a number from 1 to 65535"),
])
def test_a_host_or_port_that_does_not_parse_is_one_line(clean_env, uri, why):
    assert _refused(uri) == f"--tracking-uri {uri}: {why}"


@pytest.mark.parametrize("uri", ["sqlite:///a\nb.db", "http://h\t:5000", "bogus://\x1b[2J",
                                 " ", ""])
def test_control_characters_and_empty_uris_are_refused(clean_env, uri):
    assert _refused(uri) == (f"--tracking-uri {uri!r}: empty or holding control characters; "
                             f"give a URI of one of {SCHEME_LIST}")


def _special_files(tmp: Path) -> dict[str, tuple[Path, str]]:
    """Paths that are no regular file, each with what the message calls it."""
    fifo = tmp / "fifo.db"
    os.mkfifo(fifo)
    loop = tmp / "loop.db"
    loop.symlink_to(loop)
    folder = tmp / "folder.db"
    folder.mkdir()
    sock = tmp / "s.db"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock))
    return {"null": (Path("/dev/null"), "is a device, pipe or socket, not a regular file"),
            "zero": (Path("/dev/zero"), "is a device, pipe or socket, not a regular file"),
            "fifo": (fifo, "is a device, pipe or socket, not a regular file"),
            "socket": (sock, "is a device, pipe or socket, not a regular file"),
            "folder": (folder, "is a folder, not a regular file"),
            "loop": (loop, "cannot be read (Too many levels of symbolic links)")}


def test_an_sqlite_path_that_is_no_regular_file_is_refused_and_nothing_is_created(clean_env):
    tmp = clean_env
    for name, (path, why) in _special_files(tmp).items():
        before = set(path.parent.iterdir())
        uri = f"sqlite:///{path}"
        line = _refused(uri)
        assert line.startswith(f"--tracking-uri {uri}: the database {path} "), name
        assert line.endswith((f"{why}; give a file path", why)), (name, line)
        assert set(path.parent.iterdir()) == before, name  # no lock, no journal file
    assert not Path("/dev/null.lock").exists() and not Path("/dev/null-journal").exists()


@pytest.mark.parametrize("uri", ["sqlite://", "sqlite:///", "sqlite:///:memory:",
                                 "sqlite:///file::memory:?cache=shared",
                                 "sqlite:///x.db?mode=memory&cache=shared"])
def test_an_in_memory_store_is_refused(clean_env, uri):
    assert _refused(uri) == (
        f"--tracking-uri {uri}: an in-memory database, whose runs vanish when the command "
        "ends (and a journal kept for them could never be sent); give a file: "
        "sqlite:////ABSOLUTE/PATH/mlflow.db")


@pytest.mark.parametrize("sub", ["missing", "missing/deeper"])
def test_an_sqlite_store_in_a_missing_folder_is_refused(clean_env, sub):
    db = clean_env / sub / "m.db"
    assert _refused(f"sqlite:///{db}").endswith(
        f": the folder {db.parent} does not exist; create it, or give a path in an existing "
        "folder (fedray creates the database file, not its folder)")
    assert not (clean_env / "missing").exists()


@pytest.mark.parametrize("uri", ["file:///", "file:///dev/null", "file:///tmp/mlruns",
                                 "./mlruns", "/abs/mlruns", "mlruns"])
def test_a_file_store_is_refused_as_mlflow_does(clean_env, uri):
    assert _refused(uri) == (
        f"--tracking-uri {uri}: a file store (a path or file:), which MLflow 3 no longer "
        "opens; use sqlite:///PATH/mlflow.db (`mlflow migrate-filestore` moves its runs "
        "there), or set MLFLOW_ALLOW_FILE_STORE=true")


def test_an_allowed_file_store_must_be_a_folder(clean_env, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    (clean_env / "f").write_text("x")
    for uri, root in (("file:///dev/null", "/dev/null"), (f"{clean_env}/f", f"{clean_env}/f")):
        assert _refused(uri) == f"--tracking-uri {uri}: the file store {root} is not a folder"
    check_store_uri(f"file://{clean_env}/mlruns")  # a new folder in an existing one


@pytest.mark.parametrize("uri, profile", [("databricks", "DEFAULT"),
                                          ("databricks://lab", "lab"),
                                          ("databricks-uc", "DEFAULT"), ("uc", "DEFAULT")])
def test_databricks_without_a_workspace_is_one_line(clean_env, monkeypatch, uri, profile):
    cfg = clean_env / "no-databrickscfg"
    assert _refused(uri) == (
        f"--tracking-uri {uri}: a Databricks workspace, and none is configured here (no "
        f"DATABRICKS_HOST and DATABRICKS_TOKEN, no profile [{profile}] in {cfg}); configure "
        "one, or use a local store: sqlite:////ABSOLUTE/PATH/mlflow.db")
    cfg.write_text(f"[{profile}]\nhost = https://example.org\n")
    check_store_uri(uri)  # configured: the workspace's first answer decides


def test_good_uris_of_each_class_pass(clean_env):
    (clean_env / "there.db").write_bytes(b"")
    (clean_env / "with space").mkdir()
    for uri in (f"sqlite:///{clean_env}/m.db", f"sqlite:///{clean_env}/there.db",
                f"sqlite:///{clean_env}/with space/m.db",
                "sqlite:///relative.db", "http://127.0.0.1:5000", "https://example.org",
                "http://[::1]:5000/prefix", "http://mlflow-server.lab.example:80"):
        check_store_uri(uri)


BAD_URIS = ["bogus://x", "sqlite:///:memory:", "sqlite:////dev/null", "http://[::1",
            "mssql://u@h/db"]


@pytest.mark.parametrize("argv", [
    ["run", QUICK, "--backend", "inline"], ["sweep", QUICK], ["tune", QUICK],
    ["resume", "0123abc"], ["sync"], ["report", "x"], ["table", "x", "--by", "seed"], ["ui"]],
    ids=lambda a: a[0])
def test_every_command_that_takes_a_tracking_uri_checks_it_the_same_way(clean_env, capsys,
                                                                       argv):
    for uri in BAD_URIS:
        assert main([*argv, "--tracking-uri", uri]) == 2, uri
        expected = f"fedray {argv[0]}: {_refused(uri)}"
        assert capsys.readouterr().err.strip().splitlines() == [expected]
    assert sorted(p.name for p in clean_env.iterdir()) == []  # no store, no journal


def test_the_uri_from_the_environment_is_named_as_such(clean_env, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "bogus://env")
    assert main(["report", "x"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"fedray report: MLFLOW_TRACKING_URI bogus://env: unknown scheme 'bogus'; {KNOWN}")


# ------------------------------------------------------------ 1. the store's first answer

class _Answers500:
    """A server on 127.0.0.1 that answers every request with an HTTP 500."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_error(500, "broken")

            do_POST = do_GET

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_nothing_trains_before_the_store_has_answered(clean_env, capsys, monkeypatch):
    """A store that does not answer, or answers wrongly, is one line, exit 2, before round 0:
    no round printed, nothing journaled."""
    from simulator.run.tracking import HTTP_DEFAULTS

    for k in HTTP_DEFAULTS:
        monkeypatch.delenv(k, raising=False)
    (clean_env / "garbage.db").write_bytes(b"not a database at all" * 100)
    broken = _Answers500()
    try:
        cases = {f"http://127.0.0.1:{_free_port()}": "cannot be reached",
                 f"https://127.0.0.1:{_free_port()}": "cannot be reached",
                 f"http://127.0.0.1:{broken.port}": "cannot be reached",
                 f"sqlite:///{clean_env}/garbage.db": "is not an SQLite database"}
        for uri, why in cases.items():
            t0 = time.monotonic()
            code = main(["run", QUICK, "--backend", "inline", "--quiet", "--set", "rounds=3",
                         "--tracking-uri", uri])
            out = capsys.readouterr()
            (line,) = out.err.strip().splitlines()
            assert code == 2 and why in line and line.startswith("fedray run: tracking store ")
            assert "round" not in out.err + out.out and out.out == ""
            assert time.monotonic() - t0 < 30
            assert not (clean_env / ".fedray").exists()
    finally:
        broken.close()


def test_the_run_waits_for_the_stores_answer_before_round_0(tmp_path, mlflow_uri, monkeypatch):
    """The wait sits just before round 0 (after the engine's start): the store still opens
    while the engine starts; the first round starts once it has answered."""
    from simulator.config.load import load
    from simulator.run import layout
    from simulator.run.runner import run_loaded
    from simulator.run.tracking import Tracker
    from simulator.sim.engine import Engine

    events: list[tuple[str, float]] = []

    class SlowTracker(Tracker):
        def __init__(self, *args, **kwargs):
            time.sleep(1.0)
            super().__init__(*args, **kwargs)
            events.append(("answered", time.perf_counter()))

    real_start = Engine.start

    def start(self):
        events.append(("engine starts", time.perf_counter()))
        real_start(self)

    monkeypatch.setattr(layout, "Tracker", SlowTracker)
    monkeypatch.setattr(Engine, "start", start)
    out = run_loaded(load(QUICK, ["rounds=2"]), "inline", tracking_uri=mlflow_uri, quiet=True)
    assert [e[0] for e in events] == ["engine starts", "answered"]
    assert out.runs[0]["rounds"] == 2


# ------------------------------------------------------------ 2. credentials

MARK = "Zq7marker"
SECRET_URIS = [f"postgresql://u:{MARK}@127.0.0.1:1/db",
               f"postgresql+psycopg2://admin:{MARK}@db.lab.example:5432/mlflow",
               f"mysql+pymysql://u:{MARK}@127.0.0.1/db", f"mssql://sa:{MARK}@h/db",
               f"http://u:{MARK}@127.0.0.1:{{dead}}", f"https://u:{MARK}@127.0.0.1:{{dead}}",
               f"http://u:{MARK}%40x%2F@127.0.0.1:{{dead}}",  # special characters, encoded
               f"postgresql://u:{MARK}/#?@127.0.0.1/db",  # ... and raw
               f"postgresql://u:{MARK}@x@127.0.0.1/db", f"http://u:{MARK}@[::1",
               f"bogus://u:{MARK}@h", f"https://{MARK}@127.0.0.1:{{dead}}"]


def test_no_error_path_prints_a_password(clean_env, monkeypatch, capfd):
    """Every command that takes --tracking-uri, with the URI's password a marker, in several
    URI forms (and misspelt options that echo it): the marker is in nothing the process
    writes to stdout or stderr (file descriptors captured: the CLI's lines, its log lines,
    anything a library writes). The passwords remembered so far are forgotten before each
    case, so each form is redacted on its own."""
    from simulator import errors
    from simulator.run.tracking import HTTP_DEFAULTS

    for k, v in HTTP_DEFAULTS.items():
        monkeypatch.setenv(k, v)
    dead = _free_port()
    runs = [["run", QUICK, "--backend", "inline", "--set", "rounds=1"], ["report", "x"],
            ["sync"], ["table", "x", "--by", "seed"], ["resume", "abc"],
            ["ui", "--port", str(_free_port())]]  # every URI here fails: ui never starts
    for i, uri in enumerate(u.format(dead=dead) for u in SECRET_URIS):
        for args in ([*runs[i % len(runs)], "--tracking-uri", uri],
                     [*runs[i % len(runs)], "--tracking-urj", uri]):
            monkeypatch.setattr(errors, "_SECRETS", set())
            try:
                code = main(args)
            except SystemExit as e:  # argparse's error
                code = e.code
            out = capfd.readouterr()
            assert code == 2, (args, out.err)
            assert MARK not in out.out + out.err, (args, out.err)
            assert len(out.err.strip().splitlines()) == 1 and "***" in out.err, out.err


@pytest.mark.parametrize("text, shown", [
    ("postgresql://u:pw1234@h/db cannot", "postgresql://u:***@h/db cannot"),
    ("(url 'http://me:p%40ss@h:5000/api')", "(url 'http://me:***@h:5000/api')"),
    ("mysql+pymysql://u:a/b#c?d@h/db", "mysql+pymysql://u:***@h/db"),
    ("https://ghp_token123@example.org/x", "https://***@example.org/x"),
    ("host=h password=hunter22 dbname=d", "host=h password=*** dbname=d"),
    ("http://127.0.0.1:5000/api/2.0 and sqlite:////x/m.db", None),
])
def test_redact(text, shown):
    assert redact(text) == (text if shown is None else shown)


def test_a_password_seen_once_is_redacted_wherever_it_appears_later():
    redact("postgresql://u:Decoded%40Pass@h/db")
    assert redact("FATAL: password Decoded@Pass rejected") == "FATAL: password *** rejected"


def test_log_lines_tags_and_params_are_redacted(mlflow_uri, capsys):
    """The log handler and the tracker's tags and params (a scenario value that is a URI)."""
    from mlflow.tracking import MlflowClient

    from simulator.log import logger, to_stderr
    from simulator.run.tracking import Tracker

    with to_stderr():
        logger.warning("sending to %s", f"https://u:{MARK}@h:5000")
    assert capsys.readouterr().err == "sending to https://u:***@h:5000\n"
    tracker = Tracker(mlflow_uri, "redacted")
    run = tracker.create_run("r", {"store": f"postgresql://u:{MARK}@h/db"},
                             description=f"from mysql://u:{MARK}@h/db")
    tracker.log_params(run, {"data.url": f"https://u:{MARK}@h/x.csv"})
    tracker.end(run)
    data = MlflowClient(mlflow_uri).get_run(run).data
    assert data.params["data.url"] == "https://u:***@h/x.csv"
    assert data.tags["store"] == "postgresql://u:***@h/db"
    assert data.tags["mlflow.note.content"] == "from mysql://u:***@h/db"


def test_ui_keeps_a_credential_off_its_command_line():
    from fedray.cli import ui_command

    cmd = ui_command(f"postgresql://u:{MARK}@h/db", "127.0.0.1", 5000)
    assert MARK not in " ".join(cmd) and "--backend-store-uri" not in cmd
    plain = ui_command("sqlite:////x/mlflow.db", "127.0.0.1", 5000)
    assert plain[plain.index("--backend-store-uri") + 1] == "sqlite:////x/mlflow.db"


# ------------------------------------------------------------ 3. exit codes, one line

@pytest.mark.parametrize("argv", [
    ["run"], ["run", QUICK, "--bogus"], ["run", QUICK, "--backend", "gpu"],
    ["run", QUICK, "--workers"], ["sweep", QUICK, "--parallel", "x"], ["tune"],
    ["resume"], ["report"], ["sync", "extra"], ["ui", "--port", "http"],
    ["list", "nosuchkind"], ["privacy", "compare"], ["privacy"], ["data", "convert", QUICK],
    ["validate"], ["show", QUICK, "--set"], ["nosuchcommand"], [], ["table"],
    ["table", "x", "--format", "pdf"]], ids=lambda a: " ".join(a[:2]) or "nothing")
def test_every_argument_error_is_one_line_with_a_pointer_to_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    prog = line.split(": error: ")[0]
    assert prog.startswith("fedray") and line.endswith(f"; see `{prog} --help`")


@pytest.mark.parametrize("address", ["127.0.0.1:{port}", "localhost:{port}", "[::1]:{port}",
                                     "ray://127.0.0.1:{port}", "nohost.invalid:6379"])
@pytest.mark.parametrize("cmd", ["run", "sweep", "resume"])
def test_an_address_nothing_answers_at_is_one_line_before_any_store(clean_env, capsys, address,
                                                                      cmd):
    address = address.format(port=_free_port())
    target = ["resume", "0123abc"] if cmd == "resume" else [cmd, QUICK]
    t0 = time.monotonic()
    assert main([*target, "--address", address,
                 "--tracking-uri", f"sqlite:///{clean_env}/m.db"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"fedray {cmd}: --address {address}: nothing answers there (")
    assert line.endswith("); start the cluster (`ray start --head`), or give the address `ray "
                         "start` printed (`ray status` on the head shows whether it runs)")
    assert time.monotonic() - t0 < 5
    assert list(clean_env.iterdir()) == []  # no store


@pytest.mark.parametrize("host, why", [
    ("bad host", "not an address of this machine"), ("256.1.1.1", "not an address of this"),
    ("no-such-host.invalid", "not an address of this machine"),
    ("192.0.2.77", "this machine cannot listen there"),  # TEST-NET-1: not this machine's
])
def test_ui_refuses_a_host_it_cannot_listen_on(host, why):
    from fedray.cli import _bindable

    with pytest.raises(UsageError, match=f"^--host {host}: {why}"):
        _bindable(host, _free_port())


def test_ui_refuses_a_port_in_use_and_a_bad_host_from_the_command(tmp_path):
    from fedray.cli import _bindable

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(UsageError, match=f"^--port {port}: in use on 127.0.0.1"):
            _bindable("127.0.0.1", port)
    r = subprocess.run([sys.executable, "-m", "fedray", "ui", "--host", "bad host",
                        "--tracking-uri", f"sqlite:///{tmp_path}/m.db"], capture_output=True,
                       text=True, cwd=ROOT, timeout=60, check=False)
    assert (r.returncode, r.stderr.splitlines()) == (2, [
        ("fedray ui: --host bad host: not an address of this machine (Name or service not "
        "known); give one it can listen on (default 127.0.0.1, this machine only)")])
    assert list(tmp_path.iterdir()) == []


def test_resume_of_a_run_fedray_did_not_make_is_one_line_exit_2(mlflow_uri, capsys):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri)
    exp = client.create_experiment("foreign")
    plain = client.create_run(exp).info.run_id
    other = client.create_run(exp, tags={"fedray.kind": "trial-of-something"}).info.run_id
    done = client.create_run(exp, tags={"fedray.kind": "point"}, run_name="p").info.run_id
    client.set_terminated(done, "FINISHED")
    for run_id, tail in ((plain, f"run {plain} is not a fedray run"),
                         (other, f"run {other} is not a fedray run"),
                         (done, f"run p ({done}) is FINISHED: nothing to resume")):
        assert main(["resume", run_id, "--tracking-uri", mlflow_uri, "--backend",
                     "inline"]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"fedray resume: {tail}")
