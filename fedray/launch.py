"""The ``fedray`` process (its console script and ``python -m fedray``): a tracked command on
the warm pool where one takes it (``fedray.pool_client``, which imports only the standard
library), else the command here, ``fedray.cli.entry``, which imports what it needs."""

from __future__ import annotations

import os
import sys

from fedray.pool_client import on_pool


def entry() -> None:
    code = on_pool(sys.argv[1:])
    if code is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    from fedray.cli import entry as here

    here()
