"""fedray's messages go through ``logging`` (the ``fedray`` logger and its children); what
reaches the terminal is the command line's choice (``to_stderr``). Without it, Python's own
rules apply: warnings and errors reach stderr, information does not."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from simulator.errors import redact

logger = logging.getLogger("fedray")


class StderrHandler(logging.Handler):
    """Each message as it was written, one line per message, on whatever ``sys.stderr`` is
    when it is emitted (a test's capture, a redirected stream); credentials redacted."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(redact(self.format(record)) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging's own contract: never raise from emit
            self.handleError(record)


@contextmanager
def to_stderr(level: int = logging.INFO) -> Iterator[logging.Handler]:
    """While it is open, fedray's messages of ``level`` and above are printed on stderr as
    they were written (no prefix is added) and go nowhere else."""
    handler = StderrHandler(level)
    handler.setFormatter(logging.Formatter("%(message)s"))
    saved = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # printed once, whatever handlers the root logger has
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
