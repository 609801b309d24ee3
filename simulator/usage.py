"""What a command line gets wrong, said in one line: the argument parser of every ``fedray``
command (and its subcommands) reports an error in one line with a pointer to ``--help``,
exit 2, instead of argparse's usage block. The credentials a wrong argument may carry are
redacted like every other message (``simulator.errors.redact``)."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from simulator.errors import printable, redact

EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line: ``PROG: error: MESSAGE; see PROG
    --help``. Its subparsers are of the same class (argparse makes them with the parent's)."""

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split())  # argparse's messages may wrap
        sys.stderr.write(printable(redact(f"{self.prog}: error: {text}; see `{self.prog} "
                                          "--help`")) + "\n")
        sys.exit(EXIT_USAGE)
