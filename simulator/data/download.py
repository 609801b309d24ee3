"""``download: true``: a data set's published files fetched into ``root`` once, each checked
against its published MD5 before it is used (a wrong or truncated file is deleted and named),
never fetched again while a file with the right checksum is there. Archives are unpacked
with tarfile's ``data`` filter (no absolute paths, no links out of ``root``).

Every transfer is bounded: ``http``/``https`` mirrors only (redirects too), at most a data
set's ``deadline`` key (seconds, default ``DEADLINE``) for all its files, from the first
byte asked to the last one received (a server that drips a byte now and then is cut off;
``TIMEOUT`` bounds each read besides), and at most each file's
published size plus ``SIZE_MARGIN`` bytes
(an endless body never fills the disk). ``simulator.data.prepare.fetch`` does all of it for a
scenario before any MLflow run exists.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import socket
import tarfile
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from simulator.errors import DataError, brief

TIMEOUT = 60.0  # seconds without a byte from the server
DEADLINE = 600.0  # seconds for all the files of a data set, by default (its ``deadline`` key)
MAX_DEADLINE = 86_400.0  # the largest ``deadline`` key: a day
SIZE_MARGIN = 1 << 20  # bytes allowed beyond a file's published size
UNKNOWN_SIZE = 1 << 30  # the cap of a file whose size is not published
REDIRECTS = 5
SCHEMES = ("http", "https")


def check_mirror(mirror: str, key: str = "mirror") -> str:
    """``mirror`` when it is an ``http://`` or ``https://`` URL with a host; DataError naming
    ``key`` otherwise (a ``file://`` mirror, a path, a URL with a bad port)."""
    text = brief(mirror)
    if any(ord(c) < 33 or ord(c) == 127 for c in mirror):
        raise DataError(f"{key}: must be an http:// or https:// URL without spaces or control "
                        f"characters, got {text}")
    parts = urllib.parse.urlsplit(mirror)
    if parts.scheme.lower() not in SCHEMES:
        raise DataError(f"{key}: must be an http:// or https:// URL, got {text}"
                        + (f" (a {parts.scheme}:// mirror is not fetched)" if parts.scheme
                           else ""))
    try:
        port = parts.port
    except ValueError:
        port = -1
    if not parts.hostname or port == -1 or port == 0:
        raise DataError(f"{key}: must be an http:// or https:// URL with a host (and a port "
                        f"1-65535, if any), got {text}")
    return mirror


def md5(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class _Refused(Exception):
    """A transfer this module stops (over its size, past its deadline, a bad redirect):
    raised and caught here only, with the one-line reason."""


@dataclass(frozen=True)
class Deadline:
    """When the downloads of a data set must be over (``at``, ``time.monotonic()``), and
    the ``seconds`` they were given (for the message)."""

    at: float
    seconds: float


def deadline(seconds: float | None = None) -> Deadline:
    """The deadline of the downloads starting now: one for all the files of a data set,
    ``seconds`` from now (default ``DEADLINE``)."""
    seconds = DEADLINE if seconds is None else seconds
    return Deadline(time.monotonic() + seconds, seconds)


def fetch(url: str, dest: Path, checksum: str, size: int | None = None,
          until: Deadline | None = None) -> Path:
    """``dest``, fetched from ``url`` unless a file with ``checksum`` (MD5) is there; at most
    ``size`` (the published size) plus ``SIZE_MARGIN`` bytes, over by ``until`` (a
    ``deadline()``; by default ``DEADLINE`` seconds from now)."""
    if dest.is_file() and md5(dest) == checksum:
        return dest
    check_mirror(url, "mirror")
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    cap = (size if size is not None else UNKNOWN_SIZE) + SIZE_MARGIN
    try:
        _transfer(url, part, cap, deadline() if until is None else until)
    except (_Refused, OSError, http.client.HTTPException) as e:
        part.unlink(missing_ok=True)
        if isinstance(e, _Refused):
            raise DataError(f"download: {url}: {e}; nothing was kept") from None
        reason = getattr(e, "reason", None) or e.__class__.__name__ + (f": {e}" if str(e) else "")
        raise DataError(f"download: could not fetch {url} ({reason}); fetch it by hand into "
                        f"{dest.parent} (docs/datasets.md) or set mirror") from None
    got = md5(part)
    if got != checksum:
        part.unlink()
        raise DataError(f"download: {url} has MD5 {got}, the published file {checksum}; "
                        "nothing was kept (a wrong mirror, or a truncated transfer)")
    os.replace(part, dest)
    return dest


def _transfer(url: str, part: Path, cap: int, until: Deadline) -> None:
    """The body of ``url`` (redirects followed, http(s) only) into ``part``: at most ``cap``
    bytes, ended at ``deadline`` (monotonic) by a watchdog that shuts the socket, whatever the server
    sends or withholds (headers dripped a byte at a time included)."""
    deadline, late = until.at, f"not complete after {until.seconds:g} s (the download deadline)"
    for _ in range(REDIRECTS + 1):
        parts = urllib.parse.urlsplit(url)
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        # a stalled server past TIMEOUT is a failed fetch; the deadline is the watchdog's (the
        # socket's own timeout a second after it, so the two never race)
        conn = cls(parts.hostname or "", parts.port,
                   timeout=min(TIMEOUT, max(0.0, deadline - time.monotonic()) + 1.0))
        expired = threading.Event()
        watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), _cut, (conn, expired))
        watchdog.daemon = True
        watchdog.start()
        try:
            target = _get(conn, parts, part, cap, until, expired)
        except (OSError, http.client.HTTPException):
            if expired.is_set() or time.monotonic() >= deadline:
                raise _Refused(late) from None
            raise
        finally:
            watchdog.cancel()
            conn.close()
        if target is None:
            return
        url = urllib.parse.urljoin(url, target)
        try:
            check_mirror(url, "redirect")
        except DataError as e:
            raise _Refused(f"redirected to a URL that is not fetched ({e})") from None
    raise _Refused(f"more than {REDIRECTS} redirects")


def _cut(conn: http.client.HTTPConnection, expired: threading.Event) -> None:
    """The watchdog: the connection's socket shut, which ends any read waiting on it."""
    expired.set()
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed: the transfer is over


def _get(conn: http.client.HTTPConnection, parts: urllib.parse.SplitResult, part: Path,
         cap: int, until: Deadline, expired: threading.Event) -> str | None:
    """One GET: its body into ``part`` (None), or the redirect's target."""
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    conn.request("GET", path, headers={"User-Agent": "fedray"})
    response = conn.getresponse()
    if response.status in (301, 302, 303, 307, 308):
        return response.getheader("Location") or ""
    if response.status != 200:
        raise _Refused(f"the server answered {response.status} {response.reason}")
    length = response.getheader("Content-Length")
    if length is not None and length.isdigit() and int(length) > cap:
        raise _Refused(f"the server announces {int(length):,} bytes, more than the published "
                       f"size allows ({cap:,} bytes)")
    got = 0
    with part.open("wb") as out:
        while True:
            block = response.read1(1 << 20)
            if expired.is_set() or time.monotonic() > until.at:
                raise _Refused(f"not complete after {until.seconds:g} s (the download "
                               "deadline)")
            if not block:
                return None
            got += len(block)
            if got > cap:
                raise _Refused(f"more than {cap:,} bytes, more than the published size "
                               "allows")
            out.write(block)


def unpack(archive: Path, into: Path) -> None:
    """A .tar.gz archive's members under ``into`` (tarfile's ``data`` filter)."""
    try:
        with tarfile.open(archive, "r:*") as tar:
            tar.extractall(into, filter="data")
    except tarfile.FilterError as e:
        raise DataError(f"download: {archive.name} holds a member that would land outside "
                        f"{into} ({e}); nothing of it is used") from None
    except tarfile.TarError as e:
        raise DataError(f"download: {archive.name} is not a readable archive ({e})") from None
