"""A tracking URI checked by its class before anything runs, without opening the store and
without importing MLflow: every command that takes ``--tracking-uri`` calls
``check_store_uri`` first (the CLI before Ray starts; ``simulator.run.tracking`` again before it
opens a store).

The class is the URI's scheme, looked up in ``SCHEMES`` (the schemes MLflow's tracking-store
registry knows; a test compares the two). Each class has one check:

* a server (``http``, ``https``): a host and port that parse;
* a database (``postgresql``, ``mysql``, ``mssql``, with or without ``+driver``): SQLAlchemy
  parses it and its driver imports (SQLAlchemy's own dialect lookup, as MLflow's store does);
* SQLite: a file (not in memory: its runs would vanish with the command, and a journal kept
  for them could never be sent), a regular file or none yet, in an existing, writable folder;
* a file store (a path or ``file:``): MLflow 3 refuses it unless MLFLOW_ALLOW_FILE_STORE is
  set; with it, a folder or none yet in an existing folder;
* Databricks: a workspace, whose host and credentials must be configured.

Every message is one line that names where the URI came from (``source``) with its
credentials redacted (``simulator.errors.redact``).
"""

from __future__ import annotations

import ipaddress
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from urllib.parse import SplitResult, urlsplit

from simulator.errors import UsageError, redact

FILE_STORE_HINT = ("use sqlite:///PATH/mlflow.db (`mlflow migrate-filestore` moves its runs "
                   "there), or set MLFLOW_ALLOW_FILE_STORE=true")
IN_MEMORY = ("an in-memory database, whose runs vanish when the command ends (and a journal "
             "kept for them could never be sent); give a file: sqlite:////ABSOLUTE/PATH/mlflow.db")
_HOST = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})"
                   r"(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?$")


class Refused(Exception):
    """What is wrong with a URI of a known class (the message's tail)."""


def _split(uri: str) -> SplitResult:
    try:
        return urlsplit(uri)
    except ValueError:  # urlsplit's one error: an IPv6 host without its closing bracket
        raise Refused("not a URI that parses (an IPv6 host is written [ADDRESS], with both "
                      "brackets)") from None


def _host_port(parts: SplitResult, need_host: bool = True) -> None:
    """A host that is an IP address or a DNS name (none: a database's local socket, where
    ``need_host`` is False), and a port in 1-65535 when given."""
    try:
        port = parts.port
    except ValueError:
        raise Refused("its port is not a number from 1 to 65535") from None
    host = parts.hostname
    if not host:
        if need_host:
            raise Refused("it names no host (scheme://HOST:PORT)")
        return
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not _HOST.match(host):
            raise Refused(f"its host {host!r} is neither an IP address nor a host name") from None
    if port == 0:
        raise Refused("its port is not a number from 1 to 65535")


def _server(uri: str) -> None:
    _host_port(_split(uri))


def _database(uri: str) -> None:
    """SQLAlchemy's URL and dialect (its driver imported), as the store would load them."""
    from sqlalchemy.engine.url import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(uri)
    except (ArgumentError, ValueError):
        raise Refused("SQLAlchemy cannot parse it (DIALECT[+DRIVER]://USER:PASSWORD@HOST:PORT/"
                      "DATABASE)") from None
    _host_port(_split(uri), need_host=False)
    try:  # NoSuchModuleError is an ArgumentError: a driver SQLAlchemy does not know
        dialect = url.get_dialect()
    except ArgumentError:
        raise Refused(f"SQLAlchemy has no driver {url.drivername!r}") from None
    try:
        dialect.import_dbapi()
    except ImportError as e:
        raise Refused(f"its database driver {e.name or dialect.driver!r} (SQLAlchemy's "
                      f"{dialect.name}+{dialect.driver}) is not installed; install it, or name "
                      f"an installed driver ({dialect.name}+DRIVER://...)") from None


def sqlite_path(uri: str) -> Path | None:
    """The database file of an ``sqlite:///PATH`` URI (PATH relative to the working
    directory, or absolute with a fourth slash); None for any other URI."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].partition("?")[0]
    return Path(path) if path else None


def _sqlite(uri: str) -> None:
    rest = uri[len("sqlite:"):]
    query = rest.partition("?")[2]
    if not rest.startswith("///") and rest not in ("//", "") and not rest.startswith("//?"):
        raise Refused("an SQLite URI is sqlite:///PATH (three slashes, then the path)")
    db = sqlite_path(uri)
    if db is None or str(db) == ":memory:" or str(db).startswith("file::memory:") or \
            "mode=memory" in query:
        raise Refused(IN_MEMORY)
    _regular_file_in_folder(db, "the database")


def _regular_file_in_folder(db: Path, what: str) -> None:
    """``db`` is a regular file (after its links), or nothing yet in an existing, writable
    folder (fedray creates the file and a lock file beside it, not folders)."""
    try:
        mode = db.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:  # a loop of links, a name too long, no permission
        raise Refused(f"{what} {db} cannot be read ({e.strerror})") from None
    if mode is not None and not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a device, pipe or socket"
        raise Refused(f"{what} {db} is {kind}, not a regular file; give a file path")
    folder = db.absolute().parent
    if not folder.is_dir():
        raise Refused(f"the folder {folder} does not exist; create it, or give a path in an "
                      f"existing folder (fedray creates {what} file, not its folder)")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise Refused(f"the folder {folder} is not writable; give a path in a folder you can "
                      "write")


def _file_store(uri: str) -> None:
    if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() not in ("true", "1"):
        raise Refused(f"a file store (a path or file:), which MLflow 3 no longer opens; "
                      f"{FILE_STORE_HINT}")
    parts = _split(uri)
    root = Path(parts.path if parts.scheme == "file" else uri)
    if root.exists() and not root.is_dir():
        raise Refused(f"the file store {root} is not a folder")
    if not root.absolute().parent.is_dir():
        raise Refused(f"the folder {root.absolute().parent} does not exist; create it")


def _databricks(uri: str) -> None:
    """A Databricks workspace: its host and credentials from the environment
    (DATABRICKS_HOST) or a profile of ~/.databrickscfg (``databricks://PROFILE``)."""
    profile = _split(uri).netloc.partition(":")[0] or "DEFAULT"
    config = Path(os.environ.get("DATABRICKS_CONFIG_FILE", "~/.databrickscfg")).expanduser()
    has_profile = config.is_file() and f"[{profile}]" in config.read_text(errors="replace")
    if not (os.environ.get("DATABRICKS_HOST") or has_profile):
        raise Refused(f"a Databricks workspace, and none is configured here (no DATABRICKS_HOST "
                      f"and DATABRICKS_TOKEN, no profile [{profile}] in {config}); configure "
                      "one, or use a local store: sqlite:////ABSOLUTE/PATH/mlflow.db")


# the schemes MLflow's tracking-store registry knows (tests/simulator/test_trust.py compares)
SCHEMES: dict[str, Callable[[str], None]] = {
    "http": _server, "https": _server,
    "postgresql": _database, "mysql": _database, "mssql": _database,
    "sqlite": _sqlite,
    "file": _file_store, "": _file_store,
    "databricks": _databricks, "databricks-uc": _databricks, "uc": _databricks,
}
KNOWN = "http, https, sqlite, postgresql, mysql, mssql, databricks, file"


def scheme_of(uri: str) -> str:
    """The class of a tracking URI: its scheme without ``+driver`` (``databricks`` alone is
    Databricks' profile, as MLflow reads it)."""
    if uri in ("databricks", "databricks-uc", "uc"):
        return uri
    head, sep, _ = uri.partition(":")
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.\-]*", head) or len(head) == 1:
        return ""  # a path (a Windows drive letter too)
    return head.lower().partition("+")[0]


def check_store_uri(uri: str, source: str = "tracking store") -> None:
    """Refuse (UsageError, one line) a tracking URI whose class MLflow cannot open, or that its
    class's check finds wrong; ``source`` names where it came from (``--tracking-uri``,
    ``MLFLOW_TRACKING_URI``)."""
    shown = redact(uri)  # first: it also remembers the password, for any later message
    if not uri.strip() or not uri.isprintable():  # a path may hold spaces, not control chars
        raise UsageError(f"{source} {shown!r}: empty or holding control characters; give a "
                         f"URI of one of {KNOWN}")
    scheme = scheme_of(uri)
    check = SCHEMES.get(scheme)
    if check is None:
        raise UsageError(f"{source} {shown}: unknown scheme {scheme!r}; MLflow opens {KNOWN} "
                         "(e.g. sqlite:////ABSOLUTE/PATH/mlflow.db or http://HOST:5000)")
    try:
        check(uri)
    except Refused as e:
        raise UsageError(redact(f"{source} {shown}: {e}")) from None


def default_uri(cwd: Path | None = None) -> str:
    """``MLFLOW_TRACKING_URI`` if set, else the embedded store ``sqlite:///<cwd>/mlflow.db``."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{(cwd or Path.cwd()).resolve() / 'mlflow.db'}"


def check_command_uri(given: str | None) -> str:
    """A command's tracking URI (``given`` by --tracking-uri, else the default), checked by
    class; the same check for every command that takes --tracking-uri. Returns it."""
    uri = given if given is not None else default_uri()
    check_store_uri(uri, uri_source(given))
    return uri


def uri_source(given: str | None) -> str:
    """Where a command's tracking URI came from, as its messages name it."""
    if given is not None:
        return "--tracking-uri"
    return "MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "tracking store"
