"""docs/python.md's quickstart block, run as a user would from the repository's folder: it
prints the quickstart's final test accuracy (0.9554, the number README and the page give)
from the result object, and the final model's class and size."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_pages_quickstart_block_prints_what_its_comments_say(tmp_path):
    page = (ROOT / "docs" / "python.md").read_text()
    code = re.search(r"<!-- python quickstart -->\n```python\n(.*?)```", page, re.DOTALL).group(1)
    assert len(code.strip().splitlines()) <= 12  # "ten lines", give or take the comments
    (tmp_path / "scenarios").symlink_to(ROOT / "scenarios")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MLFLOW_TRACKING_URI", None)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.strip().splitlines()
    assert out[0] == "0.9554" and out[-1] == "MLP 4810"
    assert out[1].split() == ["round", "value"] and out[-2].split()[0] == "29"
    assert (tmp_path / "mlflow.db").is_file()
