"""``download: true``: a data set's published files fetched into ``root`` once, each checked
against its published MD5 before it is used (a wrong or truncated file is deleted and named),
never fetched again while a file with the right checksum is there. Archives are unpacked
with tarfile's ``data`` filter (no absolute paths, no links out of ``root``)."""

from __future__ import annotations

import hashlib
import os
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

from simulator.errors import DataError

TIMEOUT = 60.0  # seconds without a byte from the server


def md5(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(url: str, dest: Path, checksum: str) -> Path:
    """``dest``, fetched from ``url`` unless a file with ``checksum`` (MD5) is there."""
    if dest.is_file() and md5(dest) == checksum:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT) as response, part.open("wb") as out:
            for block in iter(lambda: response.read(1 << 20), b""):
                out.write(block)
    except (urllib.error.URLError, OSError) as e:
        part.unlink(missing_ok=True)
        reason = getattr(e, "reason", None) or e
        raise DataError(f"download: could not fetch {url} ({reason}); fetch it by hand into "
                        f"{dest.parent} (docs/datasets.md) or set mirror") from None
    got = md5(part)
    if got != checksum:
        part.unlink()
        raise DataError(f"download: {url} has MD5 {got}, the published file {checksum}; "
                        "nothing was kept (a wrong mirror, or a truncated transfer)")
    os.replace(part, dest)
    return dest


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
