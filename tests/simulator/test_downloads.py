"""``download: true`` is bounded and happens before any MLflow run exists: http(s) mirrors
only (a ``file://`` or malformed mirror is one line at validation), an overall deadline (a
server that drips bytes cannot hang the run), the published size as a cap (an endless body
cannot fill the disk), and ``simulator.data.prepare.fetch`` fetches and checks everything before the
runner opens a run. Every server here is on 127.0.0.1, started by the test."""

from __future__ import annotations

import http.server
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fedray.cli import main
from simulator.data import download
from simulator.data.published import MNIST
from tests import formats
from tests.conftest import own_lines

NAMES = list(MNIST.FILES)


class _Handler(http.server.BaseHTTPRequestHandler):
    """``/files/NAME``: the served folder's file (``/slow/NAME``: after 0.8 s); ``/drip/``: a byte every 0.3 s after the
    headers; ``/dripheaders/``: the status line a byte at a time; ``/endless/``: zeros until
    the client goes; ``/huge/``: a Content-Length of a terabyte; ``/tofile/``: a redirect
    to ``file:///dev/zero``."""

    folder: Path = Path()

    def do_GET(self) -> None:  # noqa: C901 (one branch per kind of server)
        kind, _, name = self.path.strip("/").partition("/")
        try:
            if kind == "slow":
                time.sleep(0.8)
                kind = "files"
            if kind == "files" and (self.folder / name).is_file():
                body = (self.folder / name).read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            elif kind == "drip":
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                for _ in range(1000):
                    self.wfile.write(b"\0")
                    self.wfile.flush()
                    time.sleep(0.3)
            elif kind == "dripheaders":
                for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello":
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.3)
            elif kind == "endless":
                self.send_response(200)
                self.end_headers()
                while True:
                    self.wfile.write(b"\0" * 65536)
            elif kind == "huge":
                self.send_response(200)
                self.send_header("Content-Length", str(10**12))
                self.end_headers()
            elif kind == "tofile":
                self.send_response(302)
                self.send_header("Location", "file:///dev/zero")
                self.end_headers()
            else:
                self.send_error(404)
        except OSError:
            pass  # the client went away (cut off, as it should be)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def server(tmp_path):
    """(served folder, base URL) of a loopback server of the kinds ``_Handler`` serves."""
    served = tmp_path / "served"
    served.mkdir()
    handler = type("Handler", (_Handler,), {"folder": served})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    srv.block_on_close = False
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield served, f"http://127.0.0.1:{srv.server_address[1]}/"
    srv.shutdown()
    srv.server_close()


def run_line(tmp_path: Path, mlflow_uri: str, capsys, mirror: str, model: str = "{name: logreg}",
             root: str = "fetched", dataset: str = "mnist", keys: str = "") -> str:
    """``fedray run`` of an MNIST scenario with ``download: true`` from ``mirror``: exit 2,
    one line on stderr (returned, the scenario's path as SCENARIO, the folder as TMP), and no
    MLflow run in the store."""
    from mlflow.tracking import MlflowClient

    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(f"""\
        rounds: 2
        data: {{dataset: {{name: {dataset}, root: {root}, download: true, mirror: '{mirror}'{keys}}}}}
        model: {model}
        clients: {{total: 4}}
        local: {{steps: 2, batch_size: 4}}
    """))
    capsys.readouterr()
    rc = main(["run", str(p), "--backend", "inline", "--tracking-uri", mlflow_uri, "--quiet"])
    lines = own_lines(capsys.readouterr().err)
    assert rc == 2 and len(lines) == 1, (rc, lines)
    client = MlflowClient(mlflow_uri)
    assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []
    return lines[0].replace(str(p), "SCENARIO").replace(str(tmp_path), "TMP")


@pytest.mark.parametrize(("kind", "dataset", "seconds"), [
    ("drip", "mnist", 1.5), ("dripheaders", "mnist", 0.7), ("drip", "fashion-mnist", 1),
    ("drip", "cifar10", 0.5), ("dripheaders", "cifar100", 1.2)])
def test_a_server_that_drips_bytes_is_cut_at_the_deadline(tmp_path, mlflow_uri, capsys, server,
                                                          kind, dataset, seconds):
    """A byte every 0.3 s (in the body, or in the headers) never trips the 60 s read timeout;
    the data set's ``deadline`` key (seconds for all its files) ends it."""
    _, url = server
    start = time.monotonic()
    line = run_line(tmp_path, mlflow_uri, capsys, f"{url}{kind}/", dataset=dataset,
                    keys=f", deadline: {seconds}")
    assert time.monotonic() - start < seconds + 10
    first = NAMES[0] if "mnist" in dataset else \
        f"{dataset.replace('cifar', 'cifar-')}-python.tar.gz"
    assert line == (f"fedray run: download: {url}{kind}/{first}: not complete after {seconds:g} "
                    "s (the download deadline); nothing was kept")
    assert not list((tmp_path / "fetched").glob("*"))


def test_the_deadline_key_defaults_to_minutes_and_is_bounded(tmp_path):
    from simulator.config import ScenarioError
    from simulator.config.load import load

    assert MNIST("x").deadline == download.DEADLINE == 600
    p = tmp_path / "s.yaml"
    p.write_text("rounds: 1\nmodel: {name: logreg}\nclients: {total: 2}\n"
                 "data: {dataset: {name: mnist, root: r, download: true, deadline: 0}}\n")
    with pytest.raises(ScenarioError, match=r"data.dataset.deadline: must be > 0.0, got 0$"):
        load(p)


def test_the_deadline_is_one_for_all_the_files_of_a_data_set(tmp_path, mlflow_uri, capsys,
                                                             server, monkeypatch):
    """Four files of 0.8 s each, within a 2 s deadline each but not together: the third is
    cut, and the two fetched stay (each is whole and checked)."""
    from simulator.data.download import md5

    served, url = server
    formats.write_mnist(served)
    monkeypatch.setattr(MNIST, "FILES", {n: md5(served / n) for n in NAMES})
    assert run_line(tmp_path, mlflow_uri, capsys, f"{url}slow/", keys=", deadline: 2") == (
        f"fedray run: download: {url}slow/{NAMES[2]}: not complete after 2 s (the download "
        "deadline); nothing was kept")
    assert sorted(p.name for p in (tmp_path / "fetched").iterdir()) == sorted(NAMES[:2])


def test_an_endless_body_is_cut_at_the_published_size(tmp_path, mlflow_uri, capsys, server,
                                                      monkeypatch):
    _, url = server
    monkeypatch.setattr(MNIST, "SIZES", {name: 5000 for name in NAMES})
    monkeypatch.setattr(download, "SIZE_MARGIN", 1000)
    assert run_line(tmp_path, mlflow_uri, capsys, f"{url}endless/") == (
        f"fedray run: download: {url}endless/{NAMES[0]}: more than 6,000 bytes, more than the "
        "published size allows; nothing was kept")
    assert not list((tmp_path / "fetched").glob("*"))
    assert run_line(tmp_path, mlflow_uri, capsys, f"{url}huge/") == (
        f"fedray run: download: {url}huge/{NAMES[0]}: the server announces "
        "1,000,000,000,000 bytes, more than the published size allows (6,000 bytes); nothing "
        "was kept")


@pytest.mark.parametrize("mirror, why", [
    ("file:///dev/zero", ("must be an http:// or https:// URL, got 'file:///dev/zero' (a file:// "
                         "mirror is not fetched)")),
    ("ftp://127.0.0.1/mnist/", ("must be an http:// or https:// URL, got 'ftp://127.0.0.1/mnist/' "
                               "(a ftp:// mirror is not fetched)")),
    ("not a url", ("must be an http:// or https:// URL without spaces or control characters, "
                  "got 'not a url'")),
    ("mirror.example/mnist", "must be an http:// or https:// URL, got 'mirror.example/mnist'"),
    ("http:///mnist/", ("must be an http:// or https:// URL with a host (and a port 1-65535, if "
                       "any), got 'http:///mnist/'")),
    ("http://127.0.0.1:99999/", ("must be an http:// or https:// URL with a host (and a port "
                                "1-65535, if any), got 'http://127.0.0.1:99999/'")),
])
def test_a_mirror_must_be_an_http_url(tmp_path, mlflow_uri, capsys, mirror, why):
    """A mirror that is not a URL was a 58-line traceback after runs existed; file:// read
    local files (file:///dev/zero forever)."""
    assert run_line(tmp_path, mlflow_uri, capsys, mirror) == \
        f"SCENARIO:2: data.dataset.mirror: {why}"


def test_a_redirect_to_another_scheme_is_refused(tmp_path, mlflow_uri, capsys, server):
    _, url = server
    assert run_line(tmp_path, mlflow_uri, capsys, f"{url}tofile/") == (
        f"fedray run: download: {url}tofile/{NAMES[0]}: redirected to a URL that is not fetched "
        "(redirect: must be an http:// or https:// URL, got 'file:///dev/zero' (a file:// "
        "mirror is not fetched)); nothing was kept")


def test_downloads_and_their_checks_come_before_any_run(tmp_path, mlflow_uri, capsys, server,
                                                        monkeypatch):
    """A failed download, downloaded data that contradicts itself, and a model that does not
    fit the downloaded data: each one line before any run (they came after runs existed,
    since the files were fetched when the engine loaded them). ``fetch`` returns the files,
    downloaded once."""
    from simulator.config.load import load
    from simulator.data.download import md5
    from simulator.data.prepare import fetch

    served, url = server
    written = formats.write_mnist(served)
    y = written["y_test"].astype(np.uint8)
    y[7] = 200
    formats.write_idx(served / "t10k-labels-idx1-ubyte", y, gz=True)
    sums = {p.name: md5(p) for p in served.iterdir()}
    monkeypatch.setattr(MNIST, "FILES", {**sums, NAMES[0]: "0" * 32})
    assert run_line(tmp_path, mlflow_uri, capsys, f"{url}files/") == (
        f"fedray run: download: {url}files/{NAMES[0]} has MD5 {sums[NAMES[0]]}, the published "
        f"file {'0' * 32}; nothing was kept (a wrong mirror, or a truncated transfer)")
    monkeypatch.setattr(MNIST, "FILES", sums)
    assert run_line(tmp_path, mlflow_uri, capsys, f"{url}files/", root="a") == (
        "fedray run: root: TMP/a/t10k-labels-idx1-ubyte.gz: label 200 at row 7; expected 0..9 "
        "(MNIST's 10 classes)")
    formats.write_idx(served / "t10k-labels-idx1-ubyte", written["y_test"].astype(np.uint8),
                      gz=True)
    monkeypatch.setattr(MNIST, "FILES", {p.name: md5(p) for p in served.iterdir()})
    assert run_line(tmp_path, mlflow_uri, capsys, f"{url}files/",
                    "{name: char_lstm, hidden: 8, layers: 1}", root="b") == (
        "fedray run: SCENARIO: once its data was fetched: model: char_lstm takes token ids; "
        "the data gives values (images or features)")
    (tmp_path / "s.yaml").write_text((tmp_path / "s.yaml").read_text().replace(
        "{name: char_lstm, hidden: 8, layers: 1}", "{name: logreg}").replace("root: b", "root: c"))
    loaded = load(tmp_path / "s.yaml")
    first = fetch(loaded)
    assert sorted((f.path.name, f.downloaded) for f in first) == sorted((n, True) for n in NAMES)
    assert all(f.size == (served / f.path.name).stat().st_size for f in first)
    assert all(not f.downloaded for f in fetch(loaded))  # there: checked, not fetched again


def test_a_sweep_fetches_before_its_store_or_ray(tmp_path, mlflow_uri, server, monkeypatch):
    """``run_sweep`` fetches first: a failed download is its DataError before the tracking
    store is opened and before Ray starts."""
    from mlflow.tracking import MlflowClient

    from simulator.config.load import load
    from simulator.errors import DataError
    from simulator.run.runner import run_sweep

    _, url = server
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(f"""\
        rounds: 2
        data: {{dataset: {{name: mnist, root: fetched, download: true, mirror: '{url}none/'}}}}
        model: {{name: logreg}}
        clients: {{total: 4}}
        sweep: {{local.lr: [0.1, 0.2]}}
    """))
    started: list[object] = []
    monkeypatch.setattr("simulator.runtime.backend.RayBackend",
                        lambda *a, **k: started.append(a))
    with pytest.raises(DataError, match=rf"^download: {url}none/{NAMES[0]}: the server answered "
                                        r"404 Not Found; nothing was kept$"):
        run_sweep(load(p), tracking_uri=mlflow_uri)
    assert started == []  # Ray was never asked for
    client = MlflowClient(mlflow_uri)
    assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []


def test_resume_fetches_before_it_opens_a_run_again(tmp_path, mlflow_uri, server, monkeypatch):
    """A resumed run whose data must be fetched again (another machine, a cleaned folder):
    a failed download is one DataError before the parent or the point is opened again; their
    statuses and the runs stay as they were."""
    import shutil

    from mlflow.tracking import MlflowClient

    from simulator.config.load import load
    from simulator.data.download import md5
    from simulator.errors import DataError
    from simulator.run.resume import resume_run
    from simulator.run.runner import run_loaded

    served, url = server
    formats.write_mnist(served)
    sums = {n: md5(served / n) for n in NAMES}
    monkeypatch.setattr(MNIST, "FILES", sums)
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(f"""\
        rounds: 1
        data: {{dataset: {{name: mnist, root: fetched, download: true, mirror: '{url}files/'}}}}
        model: {{name: logreg}}
        clients: {{total: 4}}
        local: {{steps: 1, batch_size: 4}}
        runtime: {{backend: inline}}
    """))
    out = run_loaded(load(p), tracking_uri=mlflow_uri, quiet=True)
    client = MlflowClient(mlflow_uri)
    parent, child = out.parent_run_id, out.runs[0]["run_id"]
    for run in (parent, child):
        client.set_terminated(run, "KILLED")
    shutil.rmtree(tmp_path / "fetched")
    monkeypatch.setattr(MNIST, "FILES", {**sums, NAMES[0]: "0" * 32})
    with pytest.raises(DataError, match=rf"^download: {url}files/{NAMES[0]} has MD5 "):
        resume_run(child, tracking_uri=mlflow_uri, quiet=True)
    runs = client.search_runs([client.get_run(parent).info.experiment_id])
    assert sorted((r.info.run_id, r.info.status) for r in runs) == \
        sorted([(parent, "KILLED"), (child, "KILLED")])


def test_fedray_fetch_downloads_alone_then_finds_the_files_there(tmp_path, capsys, server,
                                                                  monkeypatch):
    """``fedray fetch SCENARIO`` fetches and checks what the scenario needs and nothing else
    (no tracking store, no run); run again, it finds the files there with their checksums."""
    from simulator.data.download import md5

    served, url = server
    formats.write_mnist(served)
    monkeypatch.setattr(MNIST, "FILES", {p.name: md5(p) for p in served.iterdir()})
    monkeypatch.chdir(tmp_path)
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(f"""\
        rounds: 2
        data: {{dataset: {{name: mnist, root: got, download: true, mirror: '{url}files/'}}}}
        model: {{name: logreg}}
        clients: {{total: 4}}
    """))
    capsys.readouterr()
    assert main(["fetch", str(p)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sorted(line.split()[0].rsplit("/", 1)[1] for line in lines) == sorted(NAMES)
    assert all(line.endswith("bytes  fetched") for line in lines)
    assert sorted(f.name for f in (tmp_path / "got").iterdir()) == sorted(NAMES)
    assert main(["fetch", str(p)]) == 0
    again = capsys.readouterr().out.splitlines()
    assert len(again) == 4 and all(line.endswith("already there, checksum verified")
                                   for line in again)
    assert not (tmp_path / "mlflow.db").exists()
    p.write_text(p.read_text().replace("name: mnist, root: got, download: true, "
                                       f"mirror: '{url}files/'", "name: digits"))
    assert main(["fetch", str(p)]) == 0
    assert "nothing to fetch" in capsys.readouterr().out
