"""The warm pool's process (``fedray up`` starts it as ``python -m fedray.pool FOLDER``): it
imports torch, MLflow, pyarrow, pydantic and fedray once, then runs the tracked commands that
clients hand it (``fedray.pool_client``), one at a time, in its own main thread:
``fedray.cli.main(argv)`` on the client's stdin, stdout and stderr (dup2'ed onto fds 0, 1,
2), in its working directory, environment, umask and ``sys.argv``, with the signals it
forwards delivered as the command expects them (SIGINT: KeyboardInterrupt in the main thread;
SIGTERM: the process's SIGTERM, which ``trap_sigterm`` turns into ``Terminated``). After each
command everything is as it was before it: those, the signal handlers, the ``fedray``
logger, torch's global settings and random state.

A command the pool cannot run as a new process would is declined before anything ran, and the
client runs it itself: a client whose interpreter or fedray code is not the pool's, whose
start-time environment (threads, kernels, the pinned environment of ``deterministic: strict``:
``pool_client.START_PREFIXES``) differs from the pool's own, fedray's code changed since
the pool started, or a strict run (it needs a process started pinned: ``fedray.cli`` restarts
the client's own command). A second client while a command runs is told the pool is busy.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import pkgutil
import queue
import random
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from fedray import pool_client as wire

PACKAGES = ("strategies", "simulator", "dashboards", "fedray")
#: Imported by the pool before it answers (each module of fedray's packages is imported too).
HEAVY = ("torch", "numpy", "pyarrow", "pyarrow.parquet", "pydantic", "pandas", "yaml", "mlflow",
         "mlflow.tracking", "mlflow.entities", "mlflow.store.tracking.sqlalchemy_store",
         "sqlalchemy", "alembic", "tqdm")
SKIP = ("fedray.pool", "fedray.__main__", "fedray.testing")


#: Caches of pure functions of fedray's code and the files it ships, kept between commands.
KEPT = frozenset({"simulator.config.paths._schema_path_keys", "simulator.registry._number_field",
                  "simulator.registry._params_model", "simulator.config.checks._forward_once",
                  "simulator.data.datasets._digits_table"})


def _installed() -> dict[str, float]:
    """The modification time of each folder of ``sys.path`` (installing or removing a
    package changes its folder's)."""
    out: dict[str, float] = {}
    for folder in sys.path:
        with contextlib.suppress(OSError):
            out[folder] = os.stat(folder or ".").st_mtime
    return out


class HandBack(BaseException):
    """The command cannot run in this process (a ``deterministic: strict`` run): the client
    runs it. Raised before the command printed or ran anything."""


_LOG: list[io.TextIOBase] = []  # the log file, whatever fds 1 and 2 are during a command


def say(text: str) -> None:
    """A line of the pool's log (the log file it started with on stderr)."""
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} [{os.getpid()}] {text}",
          file=_LOG[0] if _LOG else sys.stderr, flush=True)


def warm_imports() -> dict[str, float]:
    """Import what commands need; the modification time of each of fedray's source files
    loaded (a change makes the pool decline commands: its code would be stale)."""
    for name in HEAVY:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - an optional package: the command imports it
            say(f"not imported: {name} ({e})")
    for package in PACKAGES:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            if info.name in SKIP or info.name.startswith(SKIP):
                continue
            try:
                importlib.import_module(info.name)
            except Exception as e:  # noqa: BLE001 - e.g. an optional extra not installed
                say(f"not imported: {info.name} ({type(e).__name__}: {e})")
    return sources()


def sources() -> dict[str, float]:
    out: dict[str, float] = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and name.split(".")[0] in PACKAGES:
            with contextlib.suppress(OSError):
                out[path] = os.stat(path).st_mtime
    return out


@dataclass
class Request:
    conn: socket.socket
    message: dict[str, Any]
    fds: list[int]


class Pool:
    """The serving loop: a listener thread takes connections, the main thread runs commands."""

    def __init__(self, where: Path, listener: socket.socket, mtimes: dict[str, float],
                 started: dict[str, str]) -> None:
        self.where = where
        self.listener = listener
        self.mtimes = mtimes
        self.identity = wire.identity()
        self.start_env = wire.start_environment(started)  # as this process started
        # what the imports set for themselves (Ray's defaults...), as in a new process
        self.imported_env = {k: v for k, v in os.environ.items() if k not in started}
        self.lock = threading.Lock()
        self.running: Request | None = None
        self.busy = False
        self.stopping: list[socket.socket] = []  # the `fedray down` connections waiting
        self.todo: queue.Queue[Request | None] = queue.Queue()
        self.main_thread = threading.main_thread()
        self.environ = dict(os.environ)
        self.handlers: dict[int, Any] = {
            s: signal.getsignal(s) for s in signal.valid_signals()
            if s not in (signal.SIGKILL, signal.SIGSTOP)}
        import torch

        self.torch_rng = torch.get_rng_state()
        self.torch_settings = self._torch_settings()
        self.installed = _installed()

    # -- the listener thread --------------------------------------------------------------

    def listen(self) -> None:
        """Each connection on a thread of its own (a client slow to send holds no other)."""
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed: the pool ends
            threading.Thread(target=self._take_safely, args=(conn,), daemon=True,
                             name="fedray-pool-connection").start()

    def _take_safely(self, conn: socket.socket) -> None:
        try:
            self._take(conn)
        except Exception as e:  # noqa: BLE001 - one client's fault never ends the pool
            say(f"a connection failed: {type(e).__name__}: {e}")
            conn.close()

    def _take(self, conn: socket.socket) -> None:
        if hasattr(socket, "SO_PEERCRED"):  # Linux; elsewhere the folder's 0700 alone
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                    struct.calcsize("3i"))
            if struct.unpack("3i", creds)[1] != os.getuid():  # (pid, uid, gid)
                conn.close()
                return
        conn.settimeout(30)
        message, fds = wire.receive_with_fds(conn)
        if message is None:
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        op = message.get("op")
        if op != "run":
            for fd in fds:
                os.close(fd)
        if op == "ping":
            wire.send(conn, {"op": "pong", "pid": os.getpid(), "busy": self._busy_text()})
            conn.close()
        elif op == "down":
            self._down(conn, bool(message.get("force")))
        elif op == "run":
            self._run_request(Request(conn, message, fds))
        else:
            conn.close()

    def _busy_text(self) -> str | None:
        with self.lock:
            req = self.running
        return None if req is None else " ".join(["fedray", *req.message["argv"]])

    def _down(self, conn: socket.socket, force: bool) -> None:
        with self.lock:
            busy = self.running
            self.stopping.append(conn)
        wire.send(conn, {"op": "stopping", "pid": os.getpid(), "busy": self._busy_text()})
        if busy is not None and force:
            self.deliver(busy, signal.SIGTERM)
        self.todo.put(None)  # the main thread ends after the command it runs, if any

    def _run_request(self, req: Request) -> None:
        why = self._decline_reason(req.message, req.fds)
        with self.lock:
            if why is None and (self.busy or self.stopping):
                why = "busy: it runs another command" if self.busy else "busy: it is stopping"
            if why is None:
                self.busy = True
        if why is not None:
            for fd in req.fds:
                os.close(fd)
            wire.send(req.conn, {"op": "busy" if why.startswith("busy") else "decline",
                                 "why": why})
            req.conn.close()
            return
        req.conn.settimeout(None)
        wire.send(req.conn, {"op": "accepted", "pid": os.getpid()})
        self.todo.put(req)

    def _decline_reason(self, message: dict[str, Any], fds: list[int]) -> str | None:
        if len(fds) != 3:
            return "it needs the client's stdin, stdout and stderr"
        argv = message.get("argv") or []
        if argv[:1] not in ([c] for c in wire.TRACKED):
            return f"it runs only {', '.join(wire.TRACKED)}"
        if any(a == "--address" or a.startswith("--address=") for a in argv):
            return "it keeps a local Ray instance; a command with --address runs in its client"
        for key, mine in self.identity.items():
            if message.get(key) != mine:
                return f"its {key} is {mine}, the client's {message.get(key)}"
        theirs = wire.start_environment(message.get("environ") or {})
        if theirs != self.start_env:
            names = sorted(k for k in theirs.keys() | self.start_env.keys()
                           if theirs.get(k) != self.start_env.get(k))
            return (f"the environment differs from the pool's start in {', '.join(names)}, "
                    "read when a process starts (fedray down, then fedray up with it)")
        for path, mtime in self.mtimes.items():
            try:
                changed = os.stat(path).st_mtime != mtime
            except OSError:
                changed = True
            if changed:
                return f"fedray's code changed since it started ({path}; fedray down, fedray up)"
        return None

    def watch(self, req: Request) -> None:
        """The client's connection while its command runs: the signals it forwards; its end
        (the client killed) interrupts the command as SIGTERM would."""
        while True:
            try:
                message = wire.receive(req.conn)
            except (OSError, ValueError):
                message = None
            if message is None:
                self.deliver(req, signal.SIGTERM, "the client went away")
                return
            if message.get("op") == "signal" and message.get("signum") in (
                    signal.SIGINT, signal.SIGTERM):
                self.deliver(req, int(message["signum"]))

    def deliver(self, req: Request, signum: int, why: str = "") -> None:
        """``signum`` to the command ``req`` while it runs (never to the pool between)."""
        with self.lock:
            if self.running is not req:
                return
            if why:
                say(f"{why}: {signal.Signals(signum).name} to its command")
            if signum == signal.SIGINT:
                assert self.main_thread.ident is not None
                signal.pthread_kill(self.main_thread.ident, signal.SIGINT)
            else:
                os.kill(os.getpid(), signum)

    # -- the main thread ------------------------------------------------------------------

    def serve(self) -> None:
        while True:
            req = self._next()
            if req is None:
                return
            try:
                self.run(req)
            finally:
                with self.lock:
                    self.busy = False

    def _next(self) -> Request | None:
        """The next command; None once a `fedray down` asked the pool to stop."""
        while True:
            with self.lock:
                if self.stopping:
                    return None
            try:
                req = self.todo.get(timeout=1)
            except queue.Empty:
                continue
            if req is not None:
                with self.lock:
                    stop = bool(self.stopping)
                if stop:  # accepted just before: the client runs it itself
                    with contextlib.suppress(OSError):
                        wire.send(req.conn, {"op": "decline", "why": "the pool is stopping"})
                    self._close(req)
                    continue
                return req

    def run(self, req: Request) -> None:
        m = req.message
        t0 = time.perf_counter()
        say(f"command: fedray {' '.join(m['argv'])}  (cwd {m['cwd']})")
        outcome: dict[str, Any]
        try:
            with self.context(req):
                outcome = self._main(req)
        except Exception as e:  # noqa: BLE001 - the pool's own fault: the client is told
            say(f"the pool failed around the command: {e}\n{traceback.format_exc()}")
            outcome = {"op": "exit", "code": 1}
        say(f"done: {outcome}  ({time.perf_counter() - t0:.2f} s)")
        with contextlib.suppress(OSError):
            wire.send(req.conn, outcome)
        self._close(req)

    def _close(self, req: Request) -> None:
        with contextlib.suppress(OSError):
            req.conn.shutdown(socket.SHUT_RDWR)
        req.conn.close()

    def _main(self, req: Request) -> dict[str, Any]:
        from fedray.cli import main

        def hand_back() -> None:
            raise HandBack

        code: int | None = None
        watcher = threading.Thread(target=self.watch, args=(req,), daemon=True,
                                   name="fedray-pool-client")
        try:
            with self.lock:
                self.running = req
            watcher.start()
            code = main(list(req.message["argv"]), restart=hand_back)
        except HandBack:
            return {"op": "decline", "why": "runtime.deterministic: strict needs a process "
                    "started pinned"}
        except SystemExit as e:  # argparse's usage errors and --help
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
        except KeyboardInterrupt as e:  # before _command caught it, or after it returned
            if code is None:
                code = 128 + (getattr(e, "signum", None) or signal.SIGINT)
        except BaseException:  # noqa: BLE001 - a bug in the command: as Python prints it
            if code is None:
                traceback.print_exc()
                code = 1
        finally:
            with self.lock:
                self.running = None
            self._quiet()
        return {"op": "exit", "code": code}

    def _quiet(self) -> None:
        """No signal reaches the pool once its command returned: SIGINT and SIGTERM ignored
        until the next command (a signal delivered just as it ended is absorbed here)."""
        for _ in range(100):
            try:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                return
            except BaseException:  # noqa: BLE001,S112 - a late signal's exception: absorbed
                continue

    @contextlib.contextmanager
    def context(self, req: Request) -> Iterator[None]:
        """The command's process state for the block, and the pool's back after it."""
        fedray_logger = logging.getLogger("fedray")
        saved = {"fds": [os.dup(fd) for fd in (0, 1, 2)], "argv": sys.argv,
                 "path0": sys.path[0] if sys.path else None,
                 "warnings": list(warnings.filters),
                 "orig_argv": sys.orig_argv, "threads": set(threading.enumerate()),
                 "log": (list(fedray_logger.handlers), fedray_logger.level,
                         fedray_logger.propagate),
                 "umask": os.umask(int(req.message["umask"]))}
        try:
            self._enter(req)
            yield
        finally:
            self._leave(saved)

    def _enter(self, req: Request) -> None:
        """The client's fds 0, 1, 2, environment, working directory, ``sys.argv``; a new
        process's random generators and SIGINT, SIGTERM handlers."""
        import numpy as np
        import torch

        m = req.message
        sys.stdout.flush()
        sys.stderr.flush()
        for i, fd in enumerate(req.fds):
            os.dup2(fd, i)
            os.close(fd)
        req.fds.clear()
        _stdout().reconfigure(line_buffering=os.isatty(1))  # as a new process's
        os.environ.clear()
        os.environ.update({**self.imported_env, **m["environ"]})
        os.chdir(m["cwd"])
        sys.argv = list(m["sys_argv"])
        sys.orig_argv = list(m["orig_argv"])
        if m.get("path0") is not None and sys.path:
            sys.path[0] = m["path0"]  # the script's folder or the working directory
        torch.set_rng_state(self.torch_rng)  # a new process's generators
        random.seed()
        np.random.seed()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _terminated)

    def _leave(self, saved: dict[str, Any]) -> None:
        """The threads the command started joined (as the interpreter's exit joins them),
        what it wrote flushed, then the pool's own state back."""
        for t in set(threading.enumerate()) - saved["threads"]:
            if not t.daemon and t.is_alive():
                t.join(timeout=60)
                if t.is_alive():
                    say(f"a thread of the command still runs: {t.name}")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a client gone: its pipe is closed
                stream.flush()
        for i, fd in enumerate(saved["fds"]):
            os.dup2(fd, i)
            os.close(fd)
        _stdout().reconfigure(line_buffering=False)
        os.umask(saved["umask"])
        os.chdir("/")
        os.environ.clear()
        os.environ.update(self.environ)
        sys.argv, sys.orig_argv = saved["argv"], saved["orig_argv"]
        if saved["path0"] is not None:
            sys.path[0] = saved["path0"]
        # the filters back, and every "once" and "default" warning shown again, as in a new
        # process (resetwarnings invalidates the modules' registries of warnings shown)
        warnings.resetwarnings()
        cast(list, warnings.filters)[:] = saved["warnings"]
        fedray_logger = logging.getLogger("fedray")
        for handler in list(fedray_logger.handlers):
            if handler not in saved["log"][0]:
                fedray_logger.removeHandler(handler)
        fedray_logger.setLevel(saved["log"][1])
        fedray_logger.propagate = saved["log"][2]
        self._restore_torch(self.torch_settings)
        self.forget()
        for signum, handler in self.handlers.items():
            with contextlib.suppress(OSError, ValueError, TypeError):
                signal.signal(signum, handler)

    def forget(self) -> None:
        """What fedray's modules remember within a process (functools caches: data sets'
        sizes, the data loaded, ...): forgotten after each command, so the next one starts
        from what a new process knows (a data file changed), but for the caches of pure
        functions of fedray's code (``KEPT``, a renamed one is merely forgotten) and the
        installed plugins, forgotten where an installation changed a folder of ``sys.path``."""
        from simulator import registry
        from simulator.sim.engine import forget_data

        forget_data()
        for name, module in list(sys.modules.items()):
            if name.split(".")[0] not in PACKAGES or name == "simulator.registry":
                continue
            for key, value in list(vars(module).items()):
                if getattr(value, "__module__", None) == name and hasattr(value, "cache_clear") \
                        and f"{name}.{key}" not in KEPT:
                    value.cache_clear()
        installed = _installed()
        if installed != self.installed:
            registry.refresh()
            self.installed = installed

    def _torch_settings(self) -> dict[str, Any]:
        import torch

        return {"threads": torch.get_num_threads(),
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
                "cudnn": (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic),
                "mkldnn": torch.backends.mkldnn.enabled,
                "dtype": torch.get_default_dtype()}

    def _restore_torch(self, s: dict[str, Any]) -> None:
        import torch

        torch.set_num_threads(s["threads"])
        # only where a command changed it: the call imports torch._inductor and _dynamo (1-2 s)
        if (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled()) != (
                s["deterministic"], s["warn_only"]):
            torch.use_deterministic_algorithms(s["deterministic"], warn_only=s["warn_only"])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = s["cudnn"]
        torch.backends.mkldnn.set_flags(s["mkldnn"])
        torch.set_default_dtype(s["dtype"])

    def stop(self) -> None:
        """Close the socket, remove it and the pid file, and tell the waiting `fedray down`s
        (their connections close as this process ends)."""
        with contextlib.suppress(OSError):
            self.listener.close()
        for name in (wire.SOCKET, wire.PID):
            with contextlib.suppress(FileNotFoundError):
                (self.where / name).unlink()
        say("stopped")


def _stdout() -> io.TextIOWrapper:
    assert isinstance(sys.stdout, io.TextIOWrapper)
    return sys.stdout


def _terminated(signum: int, frame: Any) -> None:
    """SIGTERM before the command trapped it (``trap_sigterm``), as the command would end."""
    from simulator.errors import Terminated

    raise Terminated(signum)


class _Stop(Exception):
    pass


def _stop_on_signal(signum: int, frame: Any) -> None:
    raise _Stop


def serve(where: Path) -> int:
    """The pool in ``where`` (its lock held for the process's life): imports, the socket, the
    pid file, then commands until `fedray down` (or SIGTERM between commands)."""
    import fcntl

    from simulator.runtime.pool import warm_pool

    # the log for the process's life (fd 2 is the client's during a command)
    _LOG.append(open(os.dup(2), "w", buffering=1, encoding="utf-8",  # noqa: SIM115
                     errors="replace"))
    lock = os.open(where / wire.LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        say("another pool runs in this folder; this one ends")
        return 0
    signal.signal(signal.SIGTERM, _stop_on_signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pool: Pool | None = None
    started = dict(os.environ)
    try:
        t0 = time.perf_counter()
        mtimes = warm_imports()
        os.chdir("/")
        for name in (wire.SOCKET, wire.PID):  # a pool's that was killed
            with contextlib.suppress(FileNotFoundError):
                (where / name).unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            listener.bind(str(where / wire.SOCKET))
        finally:
            os.umask(old)
        os.chmod(where / wire.SOCKET, 0o600)
        listener.listen(16)
        pool = Pool(where, listener, mtimes, started)
        pid_tmp = where / f"{wire.PID}.{os.getpid()}"
        fd = os.open(pid_tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
        pid_tmp.replace(where / wire.PID)
        threading.Thread(target=pool.listen, daemon=True, name="fedray-pool-listener").start()
        say(f"up: {len(mtimes)} modules of fedray imported in {time.perf_counter() - t0:.1f} s; "
            f"socket {where / wire.SOCKET}")
        with warm_pool():  # Ray (once a command starts it) and idle actors, between commands
            pool.serve()
    except _Stop:
        say("SIGTERM: stopping")
    finally:
        if pool is not None:
            pool.stop()
        else:
            with contextlib.suppress(FileNotFoundError):
                (where / wire.PID).unlink()
    return 0


def main() -> None:
    if len(sys.argv) != 2:
        print("usage: python -m fedray.pool FOLDER  (fedray up starts it)", file=sys.stderr)
        sys.exit(2)
    code = serve(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # Ray's and MLflow's threads are not waited for


if __name__ == "__main__":
    main()


__all__ = ["HandBack", "Pool", "serve"]
