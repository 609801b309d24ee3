"""``python -m fedray``: the ``fedray`` command."""

from fedray.cli import entry

entry()
