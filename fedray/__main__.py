"""``python -m fedray``: the ``fedray`` command."""

import sys

from fedray.cli import main

sys.exit(main())
