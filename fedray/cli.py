"""``fedray``: run | sweep | resume | sync | report | privacy compare | validate | list | ui |
up | down.

The command line only: argument parsing, the commands' printed output and exit codes. The
work is in ``simulator`` (the runner, resume, the config), the pictures in ``dashboards``.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import simulator
from simulator import registry
from simulator.config import ScenarioError
from simulator.config.load import LoadedScenario, load
from simulator.errors import (
    ClientStateLost,
    DataError,
    FedrayError,
    Removed,
    Terminated,
    UsageError,
    WorkerLost,
    printable,
    redact,
)
from simulator.log import to_stderr
from simulator.pinning import (
    PINNED_TEXT,
    NeedsPinnedProcess,
    environment_pinned,
    pinned_environment,
)
from simulator.run.interrupts import SIGNALS, Unfinished, trap_sigterm, unfinished_of
from simulator.usage import OneLineParser

EXIT_INVALID = 2


def _figures() -> list:
    """The callbacks the commands add to the runner's: each run's curves as a figure."""
    from dashboards.figures import RunFigure

    return [RunFigure()]


def _load(args: argparse.Namespace) -> LoadedScenario | None:
    """``args.scenario`` with its ``--set`` overrides; None after printing its errors."""
    try:
        return load(args.scenario, args.set)
    except ScenarioError as e:
        print("\n".join(e.lines), file=sys.stderr)
        return None


def _before_anything(loaded: LoadedScenario | None, args: argparse.Namespace) -> None:
    """What a run command can refuse before Ray starts and before MLflow is opened (its
    tracking URI's class was checked already, ``_check_tracking_uri``): a tracking store in
    Ray's temporary files, an ``--address`` where nothing answers, and more ClientWorkers than
    a local Ray instance (whose CPUs are this machine's) could ever place, or than
    runtime.workers allows anywhere."""
    from simulator.config.checks import check_local_workers
    from simulator.config.schema import MAX_WORKERS
    from simulator.run.store_uri import default_uri
    from simulator.runtime.backend import check_address, refuse_local_instance_in_job

    _lasting_store(args.tracking_uri or default_uri())
    workers = getattr(args, "workers", None)
    backend = getattr(args, "backend", None) or (loaded.scenario.runtime.backend if loaded
                                                  else None)
    if args.address is None and (backend in ("ray", "auto") or args.command in ("sweep", "tune")):
        refuse_local_instance_in_job()  # a sweep's points are Ray tasks, a search's trials
    if loaded is not None and backend in ("ray", "auto") and args.address is None:
        for point in loaded.points:  # a local instance (auto: Ray for more than one worker)
            rt = point.scenario.runtime
            check_local_workers(workers or rt.workers, rt.num_cpus,
                                "--workers" if workers else "runtime.workers")
    elif workers is not None and workers > MAX_WORKERS:  # runtime.workers' bound
        raise UsageError(f"--workers: must be <= {MAX_WORKERS} (as runtime.workers), got "
                         f"{workers}")
    if args.address is not None:  # the network last, before any store or run exists
        if backend == "inline":
            raise UsageError("--address: only with --backend ray or auto")
        check_address(args.address)


def _lasting_store(uri: str) -> None:
    """Refuse an embedded SQLite store in Ray's temporary files: a `ray job submit
    --working-dir` job runs in a folder that Ray removes (the runs would vanish with it, and
    `fedray report` could not find them). Refused rather than moved elsewhere: no folder of
    the node that runs the driver is sure to last or to be found again (docs/cluster.md)."""
    from simulator.run.store_uri import sqlite_path
    from simulator.runtime.backend import ray_temporary_folder

    path = sqlite_path(uri)
    if path is None:
        return
    db = path.absolute()
    folder = ray_temporary_folder(db)
    if folder is not None:
        raise UsageError(
            f"--tracking-uri: the MLflow store {db} would be in Ray's temporary folder "
            f"{folder} (a `ray job submit --working-dir` job runs there), removed with the job; "
            "pass --tracking-uri http://HOST:5000 (a shared MLflow server, docs/cluster.md) "
            "or --tracking-uri sqlite:////ABSOLUTE/PATH/mlflow.db in a folder that lasts")


def cmd_run(args: argparse.Namespace) -> int:
    loaded = _load(args)
    if loaded is None:
        return EXIT_INVALID
    _before_anything(loaded, args)
    from simulator.run.runner import final_text, run_loaded

    out = run_loaded(loaded, args.backend, args.address, args.tracking_uri, args.quiet, args.workers,
                     callbacks=_figures())
    for r in out.runs:
        print(f"{r['label']}: {final_text(r)}  (run {r['run_id']})")
    print(f"MLflow parent run: {out.parent_run_id}  experiment: {loaded.scenario.name}")
    print(f"tracking URI: {redact(out.tracking_uri)}")
    _closing(args, loaded.scenario.name, out.tracking_uri, out.experiment_id)
    return 0


def _closing(args: argparse.Namespace, experiment: str, uri: str,
             experiment_id: str | None = None) -> None:
    """What to do next: the report of the runs, and the MLflow UI: ``fedray ui`` over a
    store, or, for a tracking server (http, https), the server's own UI at its address
    (``fedray ui`` would start a second UI, on the port such a server often holds)."""
    given = args.tracking_uri is not None or "MLFLOW_TRACKING_URI" in os.environ
    where = f" --tracking-uri {redact(uri)}" if given else ""
    name = experiment if experiment.replace("-", "").replace("_", "").isalnum() else \
        repr(experiment)
    print(f"figures and tables: fedray report {name}{where}")
    if uri.lower().startswith(("http://", "https://")):
        page = f"/#/experiments/{experiment_id}{ML_VIEW}" if experiment_id else ""
        print(f"open the MLflow UI of the tracking server: {redact(uri.rstrip('/'))}{page}")
        return
    print(f"open the MLflow UI with: fedray ui{where}   (then http://127.0.0.1:5000)")


def cmd_sweep(args: argparse.Namespace) -> int:
    loaded = _load(args)
    if loaded is None:
        return EXIT_INVALID
    _before_anything(None, args)
    _tasks_fit_here(loaded, args, "a sweep point's Ray task")
    from simulator.run.runner import run_sweep

    out = run_sweep(loaded, args.address, args.tracking_uri, args.parallel, args.fresh,
                    callbacks=_figures())
    # each point's result was printed as it finished
    print(f"MLflow parent run: {out.parent_run_id}  experiment: {loaded.scenario.name}  "
          f"({len(out.runs)} run, {len(out.skipped)} already finished, "
          f"{len(out.failed)} failed)")
    if out.failed:
        print(f"failed: {', '.join(out.failed)}; run the same command again to retry them",
              file=sys.stderr)
        return 1
    _closing(args, loaded.scenario.name, out.tracking_uri, out.experiment_id)
    return 0


def _tasks_fit_here(loaded: LoadedScenario, args: argparse.Namespace, what: str) -> None:
    """A point's ``runtime.num_cpus`` that no node of a local Ray instance could give (a
    sweep point's task, a search's trial would wait for ever): refused."""
    have = os.cpu_count() or 1
    for point in loaded.points if args.address is None else []:
        if point.scenario.runtime.num_cpus > have:
            raise UsageError(f"runtime.num_cpus: {what} needs "
                             f"{point.scenario.runtime.num_cpus:g} CPUs, and this machine has "
                             f"{have}; use {have} or fewer, or --address a cluster")


def cmd_tune(args: argparse.Namespace) -> int:
    loaded = _load(args)
    if loaded is None:
        return EXIT_INVALID
    if loaded.scenario.tune is None:
        raise UsageError(f"{args.scenario}: tune: this scenario has no tune block (the keys "
                         "to search and how to score a trial; docs/tuning.md)")
    _before_anything(None, args)
    _tasks_fit_here(loaded, args, "a search's trial")
    from simulator.run.tuning import run_tune

    out = run_tune(loaded, args.address, args.tracking_uri, args.fresh)
    for best in out.best:  # each search's best trial among those that ran every round
        values = " ".join(f"{k}={v}" for k, v in best["values"].items())
        print(f"{best['search']}: best score {best['score']:.4f} ({loaded.scenario.tune.metric}) "
              f"with {values}  (run {best['run_id']}; {best['trials']} "
              f"{'trial' if best['trials'] == 1 else 'trials'} ran every round)")
    print(f"MLflow parent run: {out.parent_run_id}  experiment: {loaded.scenario.name}")
    _closing(args, loaded.scenario.name, out.tracking_uri, out.experiment_id)
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    _before_anything(None, args)
    from simulator.run.resume import resume_run
    from simulator.run.runner import final_text

    out = resume_run(args.run_id, args.tracking_uri, args.backend, args.address, args.quiet,
                     args.workers, callbacks=_figures())
    for r in out.runs:
        print(f"{r['label']}: {final_text(r)}  (run {r['run_id']})")
    return 0


def cmd_sync(args: argparse.Namespace) -> int:
    from simulator.run.tracking import sync

    out = sync(uri=args.tracking_uri)
    print(f"synced {out['runs']} run(s): {out['metrics']} metric values, {out['artifacts']} "
          f"artifact(s), {out['statuses']} final status(es)"
          + (f"; {out['failed_runs']} run(s) still unreachable" if out["failed_runs"] else ""))
    return 1 if out["failed_runs"] else 0


def _out_folder(text: str) -> Path:
    """``--out``: a folder, or a path whose nearest existing part is a folder (the report
    creates the rest)."""
    out = Path(text)
    for part in (out, *out.parents):
        if part.exists() or part.is_symlink():
            if not part.is_dir():
                what = "is" if part == out else f"is under {printable(str(part))}, which is"
                raise UsageError(f"--out {printable(text)}: {what} not a folder; give a "
                                 "folder (the report writes report.html, figures/ and tables/ "
                                 "into it)")
            break
    return out


def cmd_report(args: argparse.Namespace) -> int:
    from simulator.run.tracking import default_uri, require_store

    out = _out_folder(args.out) if args.out else None
    require_store(args.tracking_uri or default_uri(),
                  f"no experiment or run {', '.join(map(repr, args.target))}")
    from dashboards.report import build_report

    try:
        path = build_report(args.target, out, args.tracking_uri)
    except ValueError as e:
        print(printable(redact(f"fedray report: {e}")), file=sys.stderr)
        return EXIT_INVALID
    print(f"report: {path.resolve()}")
    return 0


def cmd_privacy(args: argparse.Namespace) -> int:
    if not args.scenarios and not args.runs:
        args.usage_error("give scenario files, or finished runs with --runs")
    if not args.scenarios and (args.delta is not None or args.set):
        args.usage_error(f"{'--delta' if args.delta is not None else '--set'} applies to "
                         "scenario files; a run's epsilons are those it logged, at its deltas")
    if args.delta is not None and not 0 < args.delta < 1:
        print(f"--delta: must be in (0, 1), got {args.delta:g}", file=sys.stderr)
        return EXIT_INVALID
    if args.scenarios:
        code = _privacy_scenarios(args)
        if code:
            return code
    if args.runs:
        from simulator.run.privacy_compare import audit_line, audited_runs
        from simulator.run.tracking import default_uri, require_store

        require_store(args.tracking_uri or default_uri(),
                      f"--runs: no run {', '.join(map(repr, args.runs))}")
        for name, run_id, facts in audited_runs(args.runs, args.tracking_uri):
            print(printable(audit_line(name, run_id, facts)))
    return 0


def cmd_privacy_shadows(args: argparse.Namespace) -> int:
    """``fedray privacy shadows RUN ...``: each shadow-run attack's runs combined, its
    measures printed and logged on each run."""
    from simulator.run.privacy_shadows import group_lines, shadow_groups
    from simulator.run.tracking import default_uri, require_store

    require_store(args.tracking_uri or default_uri(),
                  f"no run {', '.join(map(repr, args.runs))}")
    for group in shadow_groups(args.runs, args.tracking_uri):
        print("\n".join(printable(line) for line in group_lines(group)))
    return 0


def _privacy_scenarios(args: argparse.Namespace) -> int:
    """``fedray privacy compare SCENARIO ...``: each mechanism's epsilon and advantage, and
    the Delta-divergence between every ordered pair."""
    from simulator.run.privacy_compare import privacy_compare

    try:
        rows = privacy_compare(args.scenarios, args.set, args.delta)
    except (ScenarioError, ValueError) as e:
        print("\n".join(e.lines) if isinstance(e, ScenarioError) else printable(str(e)),
              file=sys.stderr)
        return EXIT_INVALID
    for r in rows:
        m = r["mechanism"]
        print(f"{r['path']}: epsilon {r['epsilon']:.4g} at delta {r['delta']:g}, attacker "
              f"advantage {r['advantage']:.4f}  (subsampled Gaussian: q = {m.q:.4g}, noise "
              f"multiplier {m.sigma:g}, {m.steps} compositions)")
    for a in rows:
        for b in rows:
            if a is not b:
                kappa = a["divergence"][b["path"]]
                print(f"Delta({a['path']} || {b['path']}) = {kappa:.4f}"
                      + (f"  (choosing {b['path']}: the best attacker's error falls by up to "
                         f"{kappa:.4f}, at prior {a['binding_prior'][b['path']]:.2f})"
                         if kappa > 0 else ""))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    bad = 0
    for f in args.scenarios:
        try:
            loaded = load(f, args.set)
        except ScenarioError as e:
            print("\n".join(e.lines), file=sys.stderr)
            bad += 1
            continue
        print(f"{printable(f)}: ok ({len(loaded.points)} run{'s' if len(loaded.points) != 1 else ''})")
    return EXIT_INVALID if bad else 0


LIST_KINDS = registry.KINDS


def cmd_list(args: argparse.Namespace) -> int:
    """Registered plugins; of one kind, each with the scenario keys it takes (``-v``: what
    it does, the paper it follows, each key's type and default)."""
    if not args.kind:
        if args.verbose:
            print("fedray list -v: name a kind, e.g. fedray list -v aggregators", file=sys.stderr)
            return EXIT_INVALID
        for kind in LIST_KINDS:
            print(f"{kind}: {', '.join(registry.available(kind)) or '(none installed)'}")
        return 0
    for name in registry.available(args.kind):
        if args.verbose:
            _describe_plugin(args.kind, name)
            continue
        keys = registry.keys(args.kind, name)
        shown = ", ".join(k if v is ... else f"{k}={v!r}" for k, v in keys.items())
        print(f"{name}" + (f"  ({shown})" if shown else ""))
    return 0


def _describe_plugin(kind: str, name: str) -> None:
    import textwrap

    info = registry.describe(kind, name)
    print(name)
    for line in textwrap.wrap(info["doc"], 88, initial_indent="    ",
                              subsequent_indent="    "):
        print(line)
    for key, (tp, default) in info["keys"].items():
        print(f"    {key}: {tp}" + ("  (required)" if default is ... else f" = {default!r}"))
    print()


def _flow(value: object) -> str:
    """A value as it is written in a scenario file: ``{name: gaussian, sigma: 10.0}``."""
    import yaml

    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip() \
        .removesuffix("...").strip()


def _table(argv: list[str]) -> int:
    from dashboards.tables import main as table_main

    return table_main(argv)


def cmd_fetch(args: argparse.Namespace) -> int:
    """Fetch and check the published files a scenario needs (``download: true``), and say
    which were fetched now and which were there already; nothing else runs."""
    from simulator.data.prepare import fetch

    loaded = _load(args)
    if loaded is None:
        return EXIT_INVALID
    files = fetch(loaded)
    for f in files:
        print(f"{printable(str(f.path))}  {f.size:,} bytes  "
              f"{'fetched' if f.downloaded else 'already there, checksum verified'}")
    if not files:
        print(f"{printable(args.scenario)}: nothing to fetch (no data set with download: true)")
    return 0


def cmd_data_convert(args: argparse.Namespace) -> int:
    """Write a scenario's data set, its own clients (``clients.total``, the ``natural``
    partitioner), once as Parquet sorted by client into ``OUT``, and print the ``data:``
    block that reads it back a cohort at a time (``data.load: cohort``)."""
    from simulator.data.convert import convert

    loaded = _load(args)
    if loaded is None:
        return EXIT_INVALID
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"OUT {printable(args.out)}: "
                         f"{'is not a folder' if not out.is_dir() else 'is not empty'}; "
                         "give a new or empty folder")
    sc = loaded.points[0].scenario
    done = convert(sc.data.dataset, sc.data.partitioner, sc.clients.total, sc.seeds[0],
                   sc.data.test_fraction, out)
    print(f"{done.clients:,} clients, {done.train_samples:,} training and "
          f"{done.test_samples:,} test samples: {printable(str(done.train))}, "
          f"{printable(str(done.test))}")
    for line in done.block().splitlines():  # each line escaped alone
        print(printable(line))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """The scenario as it will run (defaults filled in, plugins resolved) and its points."""
    import yaml

    loaded = _load(args)
    if loaded is None:
        return EXIT_INVALID
    sc = loaded.scenario
    print(f"# {printable(args.scenario)}, resolved: every default filled in")
    print(yaml.safe_dump(sc.model_dump(mode="json"), sort_keys=False).rstrip())
    points = loaded.points
    chosen = {(p.scenario.data.load, p.scenario.data.load_reason) for p in points}
    for how, reason in sorted((c for c in chosen if c[1]), key=str):
        print(printable(f"# data.load: {how}, chosen by {reason}"))
    from simulator.sim.work import backend_for

    backend = backend_for([p.scenario for p in points], sc.runtime.backend, fetched=False)
    print(printable(f"# backend: {backend.name} ({backend.reason}; `fedray run` without "
                    "--backend, --address or --workers)"))
    grid = len({tuple(sorted((k, repr(v)) for k, v in p.values.items())) for p in points})
    print(f"# {len(points)} run{'s' if len(points) != 1 else ''}: {grid} point"
          f"{'s' if grid != 1 else ''} x {len(sc.seeds)} seed{'s' if len(sc.seeds) != 1 else ''}")
    for p in points:
        values = ", ".join(f"{k}={_flow(v)}" for k, v in p.values.items())
        print(f"{p.label}" + (f"    {values}" if values else ""))
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    """Start the warm pool (``fedray.pool``), or say that one is up."""
    from fedray.pool_client import up

    return up()


def cmd_down(args: argparse.Namespace) -> int:
    """Stop the warm pool, or say that none is up."""
    from fedray.pool_client import down

    return down(args.force)


def ui_command(tracking_uri: str, host: str, port: int) -> list[str]:
    """The ``mlflow ui`` command line ``fedray ui`` runs. A store URI that carries
    credentials is not on it (a command line is visible to every user of the machine): it
    goes in the environment, MLFLOW_BACKEND_STORE_URI (``cmd_ui`` sets it)."""
    from simulator.run.tracking import artifact_root

    mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
    store = [] if redact(tracking_uri) != tracking_uri else ["--backend-store-uri", tracking_uri]
    cmd = [mlflow, "ui", *store, "--host", host, "--port", str(port), "--workers", "1"]
    root = artifact_root(tracking_uri)
    if root:
        cmd += ["--default-artifact-root", root]
    return cmd


ML_VIEW = "?workflowType=machine_learning"  # MLflow 3 opens on its GenAI view without it


def ui_links(tracking_uri: str, base: str, limit: int = 10) -> list[tuple[str, str]]:
    """(experiment, link to its runs in MLflow's ML view) for the store's newest experiments
    that hold fedray runs."""
    from mlflow.tracking import MlflowClient

    from simulator.run.tracking import ensure_store

    ensure_store(tracking_uri)
    client = MlflowClient(tracking_uri)
    out: list[tuple[str, str]] = []
    for exp in client.search_experiments(order_by=["last_update_time DESC"],
                                         max_results=100):
        if exp.name != "Default" and len(out) < limit:
            out.append((exp.name, f"{base}/#/experiments/{exp.experiment_id}{ML_VIEW}"))
    return out


def _open_when_up(base: str, link: str) -> None:
    """A detached helper that opens ``link`` in the desktop's browser once the UI answers
    (where there is a desktop: nothing on a headless machine)."""
    if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")
            or sys.platform in ("darwin", "win32")):
        return
    import subprocess

    code = ("import time, urllib.request, webbrowser\n"
            "for _ in range(120):\n"
            "    try:\n"
            f"        urllib.request.urlopen({base + '/health'!r}, timeout=1); break\n"
            "    except OSError: time.sleep(0.5)\n"
            f"webbrowser.open({link!r})\n")
    subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _bindable(host: str, port: int) -> None:
    """``fedray ui --host HOST --port PORT``: a socket is bound there first, so that a host
    this machine cannot listen on, or a port in use, is one line before MLflow starts (MLflow
    printed about 15 lines and kept running)."""
    import errno
    import socket

    try:
        family, kind, proto, _, where = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except OSError as e:  # socket.gaierror: a host name that does not resolve
        raise UsageError(f"--host {host}: not an address of this machine ({e.strerror}); give "
                         "one it can listen on (default 127.0.0.1, this machine only)") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(where)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UsageError(f"--port {port}: in use on {host} (another MLflow UI?); give "
                                 "a free port") from None
            raise UsageError(f"--host {host}: this machine cannot listen there "
                             f"({e.strerror}); give one of its addresses (default 127.0.0.1, "
                             "this machine only)") from None


def cmd_ui(args: argparse.Namespace) -> int:
    from simulator.run.tracking import default_uri

    _bindable(args.host, args.port)
    uri = args.tracking_uri or default_uri()
    cmd = ui_command(uri, args.host, args.port)
    if "--backend-store-uri" not in cmd:
        os.environ["MLFLOW_BACKEND_STORE_URI"] = uri  # not on the command line (ui_command)
    base = f"http://{args.host}:{args.port}"
    shown = " ".join(cmd) + ("" if "--backend-store-uri" in cmd else
                             f"  with MLFLOW_BACKEND_STORE_URI={redact(uri)}")
    links = ui_links(uri, base)  # a store that does not answer: one line, before the rest
    print(f"MLflow UI on {base}  ({shown})", file=sys.stderr)
    for name, link in links:
        print(f"  {name}: {link}", file=sys.stderr)
    print(f"(the runs view; its {ML_VIEW[1:]} switches MLflow 3 from its GenAI view, "
          "and the browser remembers it)", file=sys.stderr)
    _open_when_up(base, links[0][1] if links else f"{base}/{ML_VIEW}")
    os.execv(cmd[0], cmd) if os.path.isabs(cmd[0]) else os.execvp(cmd[0], cmd)
    return 0


def _bounded_int(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` (to ``high``), else argparse's one-line
    usage error naming the option (``--workers -1`` failed with an IndexError traceback,
    ``--workers 0`` silently meant the default, ``ui --port 99999`` an OverflowError)."""
    allowed = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value}")
        return value

    return parse


def _verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also the debug messages (runs opened and ended, tasks, checkpoints)")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="fedray", description=__doc__)
    p.add_argument("--version", action="version", version=f"fedray {simulator.__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a scenario file (every sweep point x seed)")
    r.add_argument("scenario")
    r.add_argument("--backend", choices=["auto", "ray", "inline"], default=None,
                   help="default: the scenario's runtime.backend (auto: inline where the "
                   "run's estimated work ends before Ray would have started, else ray)")
    r.add_argument("--address", default=None, help="an existing Ray cluster: auto or HOST:PORT")
    r.add_argument("--tracking-uri", default=None,
                   help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///./mlflow.db)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field by dotted path, e.g. --set rounds=50 (repeatable)")
    r.add_argument("--workers", type=_bounded_int(1), default=None,
                   help="number of ClientWorker actors")
    r.add_argument("--quiet", action="store_true", help="plain progress lines, no bar")
    _verbose(r)
    r.set_defaults(func=cmd_run)

    w = sub.add_parser("sweep", help="run a scenario's sweep points in parallel on Ray; "
                       "resumes a partly finished sweep of the same scenario")
    w.add_argument("scenario")
    w.add_argument("--parallel", type=_bounded_int(1), default=None,
                   help="simulations at once (default: the Ray cluster's CPUs)")
    w.add_argument("--fresh", action="store_true",
                   help="start a new parent run instead of resuming the last sweep")
    w.add_argument("--address", default=None, help="an existing Ray cluster: auto or HOST:PORT")
    w.add_argument("--tracking-uri", default=None)
    w.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    _verbose(w)
    w.set_defaults(func=cmd_sweep)

    tu = sub.add_parser("tune", help="search the scenario's tune: space on Ray Tune (ASHA, "
                        "random or Optuna); resumes an interrupted search of the same scenario")
    tu.add_argument("scenario")
    tu.add_argument("--fresh", action="store_true",
                    help="start a new search instead of resuming the last one")
    tu.add_argument("--address", default=None, help="an existing Ray cluster: auto or HOST:PORT")
    tu.add_argument("--tracking-uri", default=None)
    tu.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    _verbose(tu)
    tu.set_defaults(func=cmd_tune)

    rs = sub.add_parser("resume", help="continue a run from its last checkpoint, in the same "
                        "MLflow run")
    rs.add_argument("run_id", help="the MLflow run id of a point (a child run)")
    rs.add_argument("--backend", choices=["auto", "ray", "inline"], default=None)
    rs.add_argument("--address", default=None)
    rs.add_argument("--tracking-uri", default=None)
    rs.add_argument("--workers", type=_bounded_int(1), default=None)
    rs.add_argument("--quiet", action="store_true")
    _verbose(rs)
    rs.set_defaults(func=cmd_resume)

    sy = sub.add_parser("sync", help="send what runs could not log during a tracking outage "
                        "(.fedray/pending/)")
    sy.add_argument("--tracking-uri", default=None,
                    help="send there instead of where each run was logging")
    sy.set_defaults(func=cmd_sync)

    rp = sub.add_parser("report", help="a self-contained HTML report of experiments or runs, "
                        "with every figure as PDF/SVG and every table as Markdown/LaTeX")
    rp.add_argument("target", nargs="+", help="experiment names (each its latest scenario run) "
                    "or run ids; several make one report across them")
    rp.add_argument("--out", default=None, help="directory (default: ./fedray-report/TARGET)")
    rp.add_argument("--tracking-uri", default=None)
    rp.set_defaults(func=cmd_report)

    pv = sub.add_parser("privacy", help="compare the DP mechanisms of scenario files, and "
                        "finished runs' accountant epsilon with their audit's")
    pv_sub = pv.add_subparsers(dest="privacy_command", required=True)
    pc = pv_sub.add_parser("compare", help="epsilon at each delta and the Delta-divergence "
                           "between the trade-off curves, both ways; with --runs, each run's "
                           "accountant epsilon beside its audit's estimate and lower bound")
    pc.add_argument("scenarios", nargs="*")
    pc.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    pc.add_argument("--delta", type=float, default=None,
                    help="report every epsilon at this delta (default: each scenario's own)")
    pc.add_argument("--runs", nargs="+", default=[], metavar="RUN",
                    help="finished runs: run ids, scenario run ids (their point runs) or "
                    "experiment names (their latest scenario run's); the final values each "
                    "logged")
    pc.add_argument("--tracking-uri", default=None,
                    help="where the --runs are (default: $MLFLOW_TRACKING_URI or "
                    "sqlite:///./mlflow.db)")
    pc.set_defaults(func=cmd_privacy, usage_error=pc.error)
    ps = pv_sub.add_parser("shadows", help="a membership attack with shadow runs (LiRA) "
                           "combined over its finished runs: each run the target of the "
                           "others; its AUC, advantage and TPR at low FPR logged on it")
    ps.add_argument("runs", nargs="+", metavar="RUN",
                    help="experiment names (their latest scenario run's runs), scenario run "
                    "ids or run ids")
    ps.add_argument("--tracking-uri", default=None,
                    help="where the runs are (default: $MLFLOW_TRACKING_URI or "
                    "sqlite:///./mlflow.db)")
    ps.set_defaults(func=cmd_privacy_shadows)

    tb = sub.add_parser("table", help="a sweep's table from MLflow: metrics over seeds (final, "
                        "mean of the last K evaluations, simulated time to a threshold, ...), "
                        "differences paired by seed; Markdown, LaTeX or CSV", add_help=False)
    tb.add_argument("args", nargs=argparse.REMAINDER)
    tb.set_defaults(func=lambda a: _table(a.args))

    fe = sub.add_parser("fetch", help="download and check the published files a scenario "
                        "needs (download: true), before any run")
    fe.add_argument("scenario")
    fe.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    fe.set_defaults(func=cmd_fetch)

    da = sub.add_parser("data", help="data sets: convert a scenario's clients to Parquet")
    da_sub = da.add_subparsers(dest="data_command", required=True)
    dc = da_sub.add_parser("convert", help="write a scenario's data set, its own clients, "
                           "once as Parquet sorted by client (read a cohort at a time with "
                           "data.load: cohort); prints the data: block to use")
    dc.add_argument("scenario")
    dc.add_argument("out", help="a new or empty folder: train.parquet and test.parquet")
    dc.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    dc.set_defaults(func=cmd_data_convert)

    sh = sub.add_parser("show", help="print a scenario as it will run (defaults filled in) "
                        "and its points")
    sh.add_argument("scenario")
    sh.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sh.set_defaults(func=cmd_show)

    v = sub.add_parser("validate", help="validate scenario files; exit 2 if any is invalid")
    v.add_argument("scenarios", nargs="+")
    v.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    v.set_defaults(func=cmd_validate)

    ls = sub.add_parser("list", help="list registered plugins")
    ls.add_argument("kind", nargs="?", choices=LIST_KINDS)
    ls.add_argument("-v", "--verbose", action="store_true",
                    help="each plugin's description, paper, keys with types and defaults")
    ls.set_defaults(func=cmd_list)

    up = sub.add_parser("up", help="start a warm pool: a process with torch, MLflow and "
                        "fedray imported that runs fedray run, sweep, resume and tune for this "
                        "user's commands (FEDRAY_POOL=0 runs a command without it)")
    up.set_defaults(func=cmd_up)
    dn = sub.add_parser("down", help="stop the warm pool (after the command it runs)")
    dn.add_argument("--force", action="store_true",
                    help="interrupt the command it runs (as SIGTERM would) instead of waiting")
    dn.set_defaults(func=cmd_down)

    u = sub.add_parser("ui", help="the MLflow UI over the tracking store")
    u.add_argument("--tracking-uri", default=None)
    u.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (this machine only)")
    u.add_argument("--port", type=_bounded_int(1, 65535), default=5000)
    u.set_defaults(func=cmd_ui)
    return p


def _unfinished(command: str, resumable: bool, unfinished: list[Unfinished]) -> str:
    """``; label (run id) marked KILLED, ...`` and, when going on makes sense (an interrupt,
    a lost worker), the command that continues them."""
    if not unfinished:
        return ""
    text = "; " + ", ".join(f"{label} ({run_id}) marked {status}"
                            for run_id, label, status in unfinished)
    if resumable and command in ("sweep", "tune"):
        text += f"; run the same `fedray {command}` command again to continue"
    elif resumable:
        text += f"; continue with `fedray resume {unfinished[0].run_id}`"
    return text


def _pending_note(command: str, start: Path) -> None:
    """What a tracking outage left in the journal under ``start`` (the working directory the
    command started in), and the command that sends it; or, where that directory was removed
    while the command ran, that its journal and checkpoints went with it."""
    from simulator.run.tracking import pending, removed_store

    if not start.is_dir():
        print(printable(f"fedray {command}: the working directory {start} was removed while "
                        "it ran; what it held (.fedray/pending/, .fedray/checkpoints/) went "
                        "with it"), file=sys.stderr)
        return
    for run_id, what in pending(start).items():
        store = removed_store(run_id, start)
        then = ("`fedray sync` sends it" if store is None else
                f"its tracking store {store} was removed while it ran: put it back, then "
                "`fedray sync`")
        print(printable(f"fedray: run {run_id}: {what} not yet in MLflow (kept in "
                        f".fedray/pending/); {then}"), file=sys.stderr)


def main(argv: list[str] | None = None,
         restart: Callable[[], None] | None = None) -> int:
    """The ``fedray`` command. fedray's messages (``logging``) are printed on stderr as they
    are written: information and above, the debug messages too with ``-v``. A
    ``deterministic: strict`` run in a process not started pinned calls ``restart`` before
    anything ran (it must not return): this process's own command line (``argv`` None)
    restarts pinned (``_restart_pinned``); the warm pool hands the command back to its
    client (``fedray.pool``); without one the command ends in its one line."""
    if argv is None:  # this process's own command line: it may restart itself
        restart = _restart_pinned
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["table"]:  # its own parser (python -m dashboards.tables is the same)
        with to_stderr():
            return _table(argv[1:])
    args = build_parser().parse_args(argv)
    tracked = args.command in ("run", "sweep", "resume", "tune")
    level = logging.DEBUG if tracked and args.verbose else logging.INFO
    try:
        start = Path.cwd()  # once: the folder may be removed under a running command
    except FileNotFoundError:
        print(f"fedray {args.command}: the working directory no longer exists; cd to an "
              "existing folder and run it again", file=sys.stderr)
        return EXIT_INVALID
    with to_stderr(level):
        return _command(args, tracked, start, restart)


def _restart_pinned() -> None:
    """This command again, in a process started with the pinned kernels' environment
    (``runtime.deterministic: strict``, ``simulator.pinning``): nothing has run yet."""
    logging.getLogger("fedray").debug("deterministic: strict: restarting with %s", PINNED_TEXT)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], pinned_environment())


def entry() -> None:
    """The ``fedray`` process (its console script and ``python -m fedray``): ``main``, then
    the exit without the interpreter's teardown. Everything a command writes is written by
    the time ``main`` returns (runs, statuses, artifacts, the journal; Ray shut down); the
    exit then does what the interpreter's own would, the threads it joins (non-daemon
    threads, thread pools) and the ``atexit`` handlers (logging's flush, finalizers), and
    ends the process (``os._exit``) instead of freeing every object torch, MLflow and Ray
    made: that teardown took 0.16 s of a one-round run on an idle machine here, 0.4-0.8 s
    under load. A command that raises ends as Python ends it (its traceback, status 1)."""
    code = main()
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own first step
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _check_tracking_uri(args: argparse.Namespace) -> None:
    """The tracking URI of every command that takes --tracking-uri (run, sweep, tune, resume,
    sync, report, ui, privacy compare --runs; ``fedray table`` calls the same check), or the
    default one, checked by class before anything else (``simulator.run.store_uri``); ``fedray
    sync`` checks only the one it is given, ``fedray privacy compare`` only with --runs."""
    if "tracking_uri" in vars(args):
        from simulator.run.store_uri import check_command_uri

        if args.command == "sync" and args.tracking_uri is None:
            return  # each journal names its own store; nothing else is opened
        if args.command == "privacy" and args.privacy_command == "compare" and not args.runs:
            return  # scenario files only: no store is opened
        check_command_uri(args.tracking_uri)


def _command(args: argparse.Namespace, tracked: bool, start: Path,
             restart: Callable[[], None] | None = None) -> int:
    """``args.func``, its failures reported in one line with the runs they left unfinished:
    exit 2 for a user's mistake (UsageError, DataError: a scenario, an argument, a file, a
    URI, an address), 1 for a fault during a run, 128 + the signal for an interrupt. A
    ``deterministic: strict`` run found before anything ran calls ``restart`` (``main``): the
    command again in a process started with the pinned kernels, nothing printed here."""
    if tracked:
        trap_sigterm()
    note = tracked  # the journal's note at the end
    try:
        _check_tracking_uri(args)
        return int(args.func(args) or 0)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM through trap_sigterm
        signum = e.signum if isinstance(e, Terminated) else \
            (SIGNALS[-1] if SIGNALS else int(signal.SIGINT))
        print(f"fedray {args.command}: interrupted by {signal.Signals(signum).name}"
              f"{_unfinished(args.command, True, unfinished_of(e))}", file=sys.stderr)
        return 128 + signum
    except (FedrayError, DataError) as e:
        if isinstance(e, NeedsPinnedProcess) and restart is not None \
                and not environment_pinned():
            note = False  # the restarted command says it
            restart()  # does not return: it execs, or raises
        # a run that lost a worker, or a file put back, goes on; a removed store held the runs
        resumable = isinstance(e, (WorkerLost, ClientStateLost)) or (
            isinstance(e, Removed) and e.what != Removed.TRACKING_STORE)
        # the line says what the journal's note would: where it was is gone
        note = note and not (isinstance(e, Removed)
                             and e.what in (Removed.WORKING_DIRECTORY, Removed.TRACKING_STORE))
        # user text in the message (a run id, a path) never reaches the terminal raw
        print(printable(redact(f"fedray {args.command}: {e}"
                               f"{_unfinished(args.command, resumable, unfinished_of(e))}")),
              file=sys.stderr)
        return EXIT_INVALID if isinstance(e, (DataError, UsageError)) else 1
    except Exception as e:
        if unfinished_of(e):  # a bug: its traceback follows, after the runs it ended
            print(f"fedray {args.command}: failed"
                  f"{_unfinished(args.command, False, unfinished_of(e))}", file=sys.stderr)
        raise
    finally:
        if note:
            _pending_note(args.command, start)


if __name__ == "__main__":
    sys.exit(main())
