"""``python -m fedray``: the ``fedray`` command (on the warm pool where one takes it)."""

from fedray.launch import entry

entry()
