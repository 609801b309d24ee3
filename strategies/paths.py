"""The one guard every path a scenario names goes through (a scenario key holding a file or
a folder: ``speeds.trace``, a data set's ``root``, a topology's edge list, ...).

:func:`guard` stats the path (following symbolic links, never opening it) and refuses, in
one line that says what the key expects, a path that is missing, a symbolic-link loop, of
the wrong kind (a folder where a file is expected, or the reverse), not a regular file (a
FIFO, a character or block device such as ``/dev/zero``, a socket) or larger than the key's
cap. :func:`open_file` and :func:`read_bytes` open a file only after that check, with
``O_NONBLOCK`` (a FIFO swapped in after the check cannot block the open) and check the
opened descriptor again (``fstat``), so what is read is the regular file that was checked;
:func:`read_bytes` never reads more than the cap.

This module sits below every package (plugins read their own files through it); its
errors are :class:`PathRefused` (a ValueError) without the key, which the caller prefixes.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO, Literal

PathKind = Literal["file", "folder", "either"]
PATH_KINDS: tuple[PathKind, ...] = ("file", "folder", "either")


class PathRefused(ValueError):
    """A path that is not what its key expects: one line, the path and what was expected."""


def _expected(kind: PathKind, max_bytes: int | None) -> str:
    what = {"file": "a regular file", "folder": "a folder",
            "either": "a regular file or a folder"}[kind]
    return what + (f" (files of at most {_size(max_bytes)})" if max_bytes is not None else "")


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n:,} bytes"


def describe_mode(mode: int) -> str:
    """What a ``st_mode`` says the path is (``a FIFO (named pipe)``, ``a folder``, ...)."""
    for test, what in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "a special file"


def _refused(path: Path, is_what: str, kind: PathKind, max_bytes: int | None) -> PathRefused:
    return PathRefused(f"{path} is {is_what}; expected {_expected(kind, max_bytes)}")


_NOUN = {"file": "file", "folder": "folder", "either": "file or folder"}


def _os_error(path: Path, e: OSError, kind: PathKind, max_bytes: int | None) -> PathRefused:
    noun = _NOUN[kind]
    if e.errno == errno.ELOOP:
        return _refused(path, "a symbolic link loop (too many levels of links)", kind,
                        max_bytes)
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        return PathRefused(f"no such {noun}: {path}; expected {_expected(kind, max_bytes)}")
    return PathRefused(f"{path} cannot be read ({e.strerror or type(e).__name__}); expected "
                       f"{_expected(kind, max_bytes)}")


def _check_mode(path: Path, st: os.stat_result, kind: PathKind, max_bytes: int | None) -> None:
    is_file, is_dir = stat.S_ISREG(st.st_mode), stat.S_ISDIR(st.st_mode)
    ok = {"file": is_file, "folder": is_dir, "either": is_file or is_dir}[kind]
    if not ok:
        raise _refused(path, describe_mode(st.st_mode), kind, max_bytes)
    if is_file and max_bytes is not None and st.st_size > max_bytes:
        raise PathRefused(f"{path} holds {st.st_size:,} bytes, more than the "
                          f"{_size(max_bytes)} this key reads")


def guard(path: str | os.PathLike[str], kind: PathKind = "file",
          max_bytes: int | None = None, missing_ok: bool = False) -> Path:
    """``path`` when it is what a key of ``kind`` expects (a regular file of at most
    ``max_bytes``, a folder, or either), found without opening it; PathRefused otherwise.
    ``missing_ok``: a path the plugin creates (a download's root) may be missing, if the
    nearest existing folder above it is a folder."""
    if kind not in PATH_KINDS:
        raise ValueError(f"kind must be one of {PATH_KINDS}, got {kind!r}")
    if not str(path).strip():  # Path("") would be the working folder
        raise PathRefused(f"an empty path; expected {_expected(kind, max_bytes)}")
    p = Path(path)
    if "\0" in str(p):
        raise PathRefused(f"{p!r} is not a path (it holds a NUL byte)")
    try:
        st = os.stat(p)
    except OSError as e:
        if missing_ok and e.errno == errno.ENOENT:
            _existing_parent(p, kind)
            return p
        raise _os_error(p, e, kind, max_bytes) from None
    _check_mode(p, st, kind, max_bytes)
    return p


def _existing_parent(path: Path, kind: PathKind) -> None:
    """The nearest existing folder above a missing ``path`` must be a folder (it will be
    created there); PathRefused naming the path otherwise."""
    for parent in Path(os.path.abspath(path)).parents:
        try:
            st = os.stat(parent)
        except OSError as e:
            if e.errno == errno.ENOENT:
                continue
            raise _os_error(path, e, kind, None) from None
        if not stat.S_ISDIR(st.st_mode):
            raise PathRefused(f"no such {_NOUN[kind]}: {path}, and {parent} is "
                              f"{describe_mode(st.st_mode)}, where it would be created")
        return


def open_file(path: str | os.PathLike[str], max_bytes: int | None = None) -> BinaryIO:
    """``path`` opened for reading in binary, once :func:`guard` has found a regular file;
    the open itself never blocks (``O_NONBLOCK``) and the opened file is checked again."""
    p = guard(path, "file", max_bytes)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise _os_error(p, e, "file", max_bytes) from None
    try:
        _check_mode(p, os.fstat(fd), "file", max_bytes)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_bytes(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them (a file that
    grew past it since the check is refused, not read on)."""
    with open_file(path, max_bytes) as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as e:
            raise _os_error(Path(path), e, "file", max_bytes) from None
    if len(data) > max_bytes:
        raise PathRefused(f"{path} holds more than the {_size(max_bytes)} this key reads")
    return data
