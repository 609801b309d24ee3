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


def test_the_readmes_first_scenario_validates_and_sweeps_what_it_says():
    from simulator.config.load import load_text

    readme = (ROOT / "README.md").read_text()
    text = re.search(r"## A first scenario file\n\n```yaml\n(.*?)```", readme,
                     re.DOTALL).group(1)
    loaded = load_text(text, ROOT / "my-first.yaml")
    assert len(loaded.points) == 6  # "3 rules x 2 seeds = 6 runs"
    assert len(readme.splitlines()) <= 150  # an entry; the rest is the site's


def test_every_key_the_scenario_tour_shows_is_in_the_generated_reference():
    """docs/scenario-files.md (the README's former field-by-field tour) shows a scenario
    file with every block; each key it shows is in the reference generated from the schema,
    or inside a plugin block (whose keys its plugin's page lists)."""
    import yaml

    from fedray.reference import scenario_page

    page = (ROOT / "docs" / "scenario-files.md").read_text()
    blocks = re.findall(r"```(?:yaml)?\n(.*?)```", page, re.DOTALL)
    tour = next(yaml.safe_load(b) for b in blocks if b.lstrip().startswith("name:"))
    reference = scenario_page()

    def paths(d, prefix=""):
        for k, v in d.items():
            key = f"{prefix}{k}"
            yield key
            free = (f"| `{key}` | {t}" in reference for t in ("plugin block", "dict["))
            if isinstance(v, dict) and not any(free):  # a plugin's keys, a sweep's paths
                yield from paths(v, key + ".")

    missing = [p for p in paths(tour) if f"| `{p}` |" not in reference]
    assert len(list(paths(tour))) > 40 and not missing, missing
