"""fedray's own exception types: what the CLI reports in one line, without a traceback.

Only these (and the scenario's ``ScenarioError``, the data's ``DataError``) are caught by the
commands; any other exception is a bug and keeps its traceback (the run is still marked
FAILED and named first).
"""

from __future__ import annotations

import re
import reprlib
from typing import Any


class FedrayError(Exception):
    """A failure fedray explains in one line."""


class UsageError(FedrayError):
    """A command line that asks for something impossible (exit 2, like an invalid scenario)."""


class PluginError(FedrayError):
    """A plugin raised while the run used it: the run fails, naming the plugin. ``error`` is
    the plugin's exception (or its one-line text); only text travels, so the error pickles
    across Ray whatever the plugin raised."""

    def __init__(self, where: str, name: str, error: BaseException | str) -> None:
        if isinstance(error, BaseException):
            first = (str(error).strip().splitlines() or [""])[0]
            error = f"{type(error).__name__}: {brief_text(first)}"
        self.where, self.name, self.text = where, name, error
        super().__init__(f"{where} {name!r} raised {error}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (PluginError, (self.where, self.name, self.text))


def guarded(where: str, name: str, fn: Any) -> Any:
    """``fn`` with any exception it raises turned into a PluginError naming the plugin: a bug
    in a plugin fails the run in one line, and is never mistaken for a condition of the run."""
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise PluginError(where, name, e) from e
    return call


class DataError(ValueError):
    """A dataset or partition that cannot be built from the scenario as written (a user's
    mistake: exit 2, like an invalid scenario)."""


class TooFewRows(FedrayError):
    """A round left fewer rows than a rule of the aggregation pipeline accepts (dropouts,
    stragglers): the round is skipped, not the run."""


class WorkerLost(FedrayError):
    """A ClientWorker died (its node went away, or it was killed)."""


class ClientStateLost(FedrayError):
    """Per-client state (worker momentum, mu2-SGD) died with its worker: the run cannot go on
    with the same numbers; ``fedray resume`` continues it from its last checkpoint."""


class ClockStalled(FedrayError):
    """The simulated clock of an asynchronous run cannot go on: no client will ever be
    active again (an availability trace) before the server's buffer fills."""


class DeviceUnavailable(FedrayError):
    """The scenario asks for a device this process does not have."""


class TrackingUnavailable(UsageError):
    """The tracking store cannot be reached or opened before the run starts (its first
    answer, awaited before round 0): a URI or a store to fix, exit 2 like any user error. An
    outage later in a run is no error: what cannot be sent is journaled."""


class Removed(FedrayError):
    """A file or folder the run still needs was removed while it went on (its working
    directory, a data file, the tracking store): ``what`` says which (``working directory``,
    ``tracking store`` or the scenario key), ``path`` where it was. Reported as that, not as
    whatever its absence broke (``simulator.run.removed``)."""

    WORKING_DIRECTORY = "working directory"
    TRACKING_STORE = "tracking store"

    def __init__(self, message: str, what: str, path: str | None = None) -> None:
        super().__init__(message)
        self.what, self.path = what, path

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.what, self.path))


class CheckpointUnreadable(FedrayError):
    """A checkpoint file that does not load (truncated, or not one of fedray's)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"signal {signum}")


_REPR = reprlib.Repr()
_REPR.maxstring = 60
_REPR.maxother = 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6
_REPR.maxlevel = 3


def brief(value: Any) -> str:
    """A bounded repr for messages: a huge (or alias-expanded) value never becomes a huge line."""
    return _REPR.repr(value)


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on or hide (ESC, BEL, NUL, newlines,
    direction overrides such as U+202E, zero-width characters) written as its escape
    (``\\x1b``, ``\\u202e``): user text in a message can never drive the terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def brief_text(text: str, limit: int = 300) -> str:
    """User text for a one-line message: control characters escaped, at most ``limit``
    characters."""
    text = printable(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# scheme://userinfo@ (userinfo up to the last @ of the token: a password may hold / ? # @)
_URI = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<rest>[^\s'\"<>]*)")
_KEY_VALUE = re.compile(r"(?i)\b(?P<key>password|passwd|pwd|token|secret)(?P<sep>\s*=\s*)"
                        r"(?P<value>[^\s&;,'\")]+)")
_SECRETS: set[str] = set()  # passwords seen in URIs this process was given (see redact)


def _mask_userinfo(m: re.Match[str]) -> str:
    rest = m["rest"]
    at = rest.rfind("@")
    if at < 0:
        return m[0]
    user, colon, secret = rest[:at].partition(":")
    if colon and "/" not in user:
        _remember(secret)
        return f"{m['scheme']}{user}:***{rest[at:]}"
    if "/" not in user and not m["scheme"].lower().startswith("http"):
        return m[0]  # a database's user without a password (it authenticates otherwise)
    return f"{m['scheme']}***{rest[at:]}"  # a web URI's bare user is a token


def _remember(secret: str) -> None:
    from urllib.parse import unquote

    for s in (secret, unquote(secret)):
        if len(s) >= 8:  # shorter ones (a word) are masked where they sit in a URI only
            _SECRETS.add(s)


def redact(text: str) -> str:
    """``text`` with every credential it carries replaced by ``***``: the password (or the
    bare token) of each URI's user info (``postgresql://u:***@host/db``), ``password=...``
    and ``token=...`` pairs, and any password already seen in a URI anywhere else in the text
    (a library that echoes it decoded). Every message, log line, tag and param that may carry
    a tracking URI goes through it."""
    text = _URI.sub(_mask_userinfo, text)
    text = _KEY_VALUE.sub(lambda m: f"{m['key']}{m['sep']}***", text)
    for secret in sorted(_SECRETS, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text
