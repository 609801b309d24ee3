"""The warm pool's client side (``fedray.launch`` asks it first): hand a tracked command
(run, sweep, resume, tune) to the warm pool that ``fedray up`` started (``fedray.pool``);
and ``fedray up``, ``fedray down``.

Only the standard library is imported here: the check costs a few milliseconds, and a
command the pool does not take (no pool, a busy one, one that declines it, ``FEDRAY_POOL=0``)
goes on in this process exactly as without a pool. The pool runs the command in its own
process on this process's stdin, stdout and stderr (passed over the socket, SCM_RIGHTS), in
this process's working directory and environment; Ctrl-C and SIGTERM received here are
forwarded to it; its exit status is this process's.

The wire: each message a 4-byte big-endian length and a JSON object; the request carries this
process's fds 0, 1, 2 beside its first bytes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import signal
import socket
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TRACKED = ("run", "sweep", "resume", "tune")
SOCKET = "pool.sock"
PID = "pool.pid"
LOCK = "pool.lock"
LOG = "pool.log"
#: Environment variables read once, when a process starts or imports its libraries (threads,
#: kernels, the pinned environment of ``runtime.deterministic: strict``, Python's own, Ray's):
#: the pool takes a command only where the client's equal the pool's own at its start.
START_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOTO", "ATEN_", "ONEDNN_",
                  "DNNL_", "NPY_", "TORCH_", "PYTORCH_", "CUDA_", "CUBLAS_", "LD_", "RAY_")


def folder() -> Path:
    """The pool's folder: ``$XDG_RUNTIME_DIR/fedray``, else ``$XDG_CACHE_HOME/fedray``, else
    ``~/.cache/fedray`` (one per user)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "fedray"
    cache = os.environ.get("XDG_CACHE_HOME")
    return (Path(cache) if cache else Path.home() / ".cache") / "fedray"


def start_environment(environ: dict[str, str]) -> dict[str, str]:
    """The variables of ``environ`` that a process reads at its start (``START_PREFIXES``)."""
    return {k: v for k, v in environ.items() if k.startswith(START_PREFIXES)}


def identity() -> dict[str, str]:
    """What makes a pool's process this one's: the interpreter and fedray's own code."""
    return {"executable": os.path.realpath(sys.executable),
            "package": os.path.realpath(os.path.dirname(__file__))}


def debug(text: str) -> None:
    print(f"fedray: {text}", file=sys.stderr, flush=True)


# -- the wire ----------------------------------------------------------------------------------

def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    frame = struct.pack(">I", len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [frame], fds)
        frame = frame[sent:]
    if frame:
        sock.sendall(frame)


def _exactly(sock: socket.socket, n: int, first: bytes = b"") -> bytes | None:
    data = first
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def receive(sock: socket.socket) -> dict[str, Any] | None:
    """The next message; None once the other side closed the connection."""
    head = _exactly(sock, 4)
    if head is None:
        return None
    body = _exactly(sock, struct.unpack(">I", head)[0])
    return None if body is None else json.loads(body)


def receive_with_fds(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and the fds that came with its first bytes."""
    first, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
    if not first:
        return None, fds
    head = _exactly(sock, 4, first[:4])
    if head is None:
        return None, fds
    size = struct.unpack(">I", head)[0]
    body = _exactly(sock, size, first[4:])
    return (None if body is None else json.loads(body)), fds


# -- a pool's liveness -------------------------------------------------------------------------

@contextlib.contextmanager
def lock_if_free(where: Path) -> Iterator[bool]:
    """Whether no pool process holds ``where``'s lock (a pool holds it from its start to its
    end, so a socket or pid file without it is stale); held by the caller inside the block."""
    try:
        fd = os.open(where / LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            yield False
            return
        yield True
    finally:
        os.close(fd)


def clean_stale(where: Path) -> bool:
    """Remove the socket and pid file a pool that no longer runs left (killed -9); whether
    they were stale (a pool that runs, or is starting, keeps its own)."""
    with lock_if_free(where) as free:
        if free:
            for name in (SOCKET, PID):
                with contextlib.suppress(FileNotFoundError):
                    (where / name).unlink()
        return free


def read_pid(where: Path) -> int | None:
    try:
        return int((where / PID).read_text().strip())
    except (OSError, ValueError):
        return None


def connect(where: Path, timeout: float | None = None) -> socket.socket | None:
    """A connection to the pool in ``where``; None where none answers (a stale socket of a
    pool that no longer runs is removed)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(where / SOCKET))
    except OSError as e:
        sock.close()
        if e.errno == errno.ECONNREFUSED:
            clean_stale(where)
        return None
    return sock


# -- the client --------------------------------------------------------------------------------

def _verbose(argv: list[str]) -> bool:
    return "-v" in argv or "--verbose" in argv


def on_pool(argv: list[str]) -> int | None:
    """``argv`` run on the pool: its exit status; None where the pool did not take it (this
    process then runs it), saying why with ``-v``."""
    if not argv or argv[0] not in TRACKED or os.environ.get("FEDRAY_POOL", "1") == "0":
        return None
    where = folder()
    if not (where / SOCKET).exists():
        return None  # no pool: the usual case, said by nothing
    try:
        cwd = os.getcwd()
    except FileNotFoundError:
        return None  # the command says it in its own line
    verbose = _verbose(argv)
    sock = connect(where, timeout=30)
    if sock is None:
        if verbose:
            debug("no warm pool answers (fedray up starts one); running here")
        return None
    call = _Call(sock, verbose)
    with call.forwarding():
        return call.run(argv, cwd, where)


class _Call:
    """One command handed to the pool, with the signals this process receives meanwhile."""

    def __init__(self, sock: socket.socket, verbose: bool) -> None:
        self.sock = sock
        self.verbose = verbose
        self.accepted = False
        self.early: list[int] = []  # signals received before the pool took the command

    def forward(self, signum: int, frame: Any) -> None:
        if not self.accepted:
            self.early.append(signum)
            return
        with contextlib.suppress(OSError):
            send(self.sock, {"op": "signal", "signum": signum})

    @contextlib.contextmanager
    def forwarding(self) -> Iterator[None]:
        saved = {s: signal.signal(s, self.forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in saved.items():
                signal.signal(s, handler)
            self.sock.close()
            if not self.accepted and self.early:  # as if the pool had never been asked
                signal.raise_signal(self.early[0])

    def run(self, argv: list[str], cwd: str, where: Path) -> int | None:
        try:
            umask = os.umask(0o022)
            os.umask(umask)
            send(self.sock, {"op": "run", "argv": argv, "sys_argv": sys.argv,
                             "orig_argv": list(sys.orig_argv), "cwd": cwd,
                             "environ": dict(os.environ), "umask": umask,
                             "path0": sys.path[0] if sys.path else None, **identity()},
                 [0, 1, 2])
            reply = receive(self.sock)
        except (OSError, ValueError) as e:  # a closed fd 0, 1 or 2, a pool that went away
            reply = {"op": "failed", "why": str(e)}
        if reply is None or reply.get("op") != "accepted":
            if self.verbose:
                why = "it went away" if reply is None else reply.get("why", reply.get("op"))
                debug(f"the warm pool did not take the command ({why}); running here")
            return None
        if self.verbose:
            debug(f"running on the warm pool (pid {reply['pid']}, {where / SOCKET})")
        self.accepted = True
        for signum in self.early:  # forwarded now that a command runs there to receive them
            with contextlib.suppress(OSError):
                send(self.sock, {"op": "signal", "signum": signum})
        self.sock.settimeout(None)
        try:
            final = receive(self.sock)
        except (OSError, ValueError):
            final = None
        return _outcome(final, self.verbose)


def _outcome(reply: dict[str, Any] | None, verbose: bool) -> int | None:
    """The command's exit status from the pool's last message; None where it handed the
    command back (before anything ran)."""
    if reply is not None and reply.get("op") == "exit":
        return int(reply["code"])
    if reply is not None and reply.get("op") == "decline":
        if verbose:
            debug(f"the warm pool handed the command back ({reply['why']}); running here")
        return None
    # the pool died under the command: what it wrote is on the terminal already
    print("fedray: the warm pool ended while it ran the command (its log: "
          f"{folder() / LOG}); run it again", file=sys.stderr, flush=True)
    return 1


# -- fedray up, fedray down ----------------------------------------------------------------------

def _ping(where: Path, timeout: float = 10) -> dict[str, Any] | None:
    sock = connect(where, timeout)
    if sock is None:
        return None
    try:
        send(sock, {"op": "ping"})
        return receive(sock)
    except (OSError, ValueError):
        return None
    finally:
        sock.close()


def _log_tail(where: Path, lines: int = 5) -> str:
    try:
        text = (where / LOG).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:])


def make_folder(where: Path) -> None:
    """The pool's folder, this user's only (0700)."""
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    if where.stat().st_uid != os.getuid():
        raise PermissionError(f"{where} belongs to another user")
    os.chmod(where, 0o700)


def up(timeout: float = 300) -> int:
    """``fedray up``: start the pool (detached, its output in the folder's log) and return
    once it answers; a pool already up is said so. The exit status."""
    import subprocess
    import time

    where = folder()
    try:
        make_folder(where)
    except OSError as e:
        print(f"fedray up: cannot use {where} for the pool ({e}); set XDG_RUNTIME_DIR to a "
              "folder of yours", file=sys.stderr)
        return 2
    answer = _ping(where)
    if answer is not None:
        print(f"fedray up: a warm pool is up already (pid {answer['pid']}, socket "
              f"{where / SOCKET}); stop it with: fedray down")
        return 0
    clean_stale(where)
    with open(where / LOG, "ab") as log:
        os.chmod(where / LOG, 0o600)
        proc = subprocess.Popen([sys.executable, "-m", "fedray.pool", str(where)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer = _ping(where) if (where / SOCKET).exists() else None
        if answer is not None:
            print(f"fedray up: a warm pool is up (pid {answer['pid']}, socket "
                  f"{where / SOCKET}, log {where / LOG}); fedray run, sweep, resume and tune "
                  "run on it; stop it with: fedray down")
            return 0
        if proc.poll() is not None:
            with lock_if_free(where) as free:
                pass
            if not free:  # another `fedray up` started one at the same time
                time.sleep(0.1)
                continue
            print(f"fedray up: the pool ended as it started (status {proc.returncode}): "
                  f"{_log_tail(where)}", file=sys.stderr)
            return 1
        time.sleep(0.1)
    print(f"fedray up: the pool did not answer within {timeout:.0f} s (pid {proc.pid}; its "
          f"log: {where / LOG})", file=sys.stderr)
    return 1


def down(force: bool = False, timeout: float = 60) -> int:
    """``fedray down``: stop the pool once its command (if one runs) ended, or interrupt that
    command (``force``: as SIGTERM would); nothing up is said so. The exit status."""
    where = folder()
    if not where.is_dir() or clean_stale(where):
        print("fedray down: no warm pool is up")
        return 0
    pid = read_pid(where)
    sock = connect(where, 10)
    reply: dict[str, Any] | None = None
    if sock is not None:
        try:
            send(sock, {"op": "down", "force": force})
            reply = receive(sock)
        except (OSError, ValueError):
            reply = None
    if reply is not None:
        assert sock is not None
        pid = reply["pid"]
        if reply.get("busy"):
            print(f"fedray down: the pool (pid {pid}) runs `{reply['busy']}`: "
                  + ("interrupting it (SIGTERM)" if force else
                     "waiting for it to end (fedray down --force interrupts it)"),
                  file=sys.stderr, flush=True)
        sock.settimeout(None)
        with contextlib.suppress(OSError, ValueError):
            while receive(sock) is not None:  # closed as the pool's process ends
                pass
    elif not force or pid is None:  # starting, or not answering
        print(f"fedray down: the pool (pid {pid}) does not answer (still starting?); try "
              "again, or fedray down --force ends its process", file=sys.stderr)
        return 1
    else:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    if sock is not None:
        sock.close()
    if not _gone(where, pid, force, timeout):
        print(f"fedray down: the pool (pid {pid}) has not ended; fedray down --force ends it",
              file=sys.stderr)
        return 1
    print(f"fedray down: the warm pool (pid {pid}) stopped")
    return 0


def _gone(where: Path, pid: int | None, force: bool, timeout: float) -> bool:
    """Whether the pool's process ended within ``timeout`` (its lock free; its files then
    removed if it left them); ``force``: SIGKILL after it."""
    import time

    deadline = time.monotonic() + timeout
    while not clean_stale(where):
        if time.monotonic() > deadline:
            if not force or pid is None:
                return False
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            force = False
            deadline = time.monotonic() + 10
        time.sleep(0.05)
    return True
