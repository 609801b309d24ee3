"""The documentation site (#48; `make docs`): the generated reference pages and MkDocs in
strict mode, built offline into a temporary folder as `make docs` builds it (a warning, a
broken link, an unknown page fails), and every public name the API pages draw has a
docstring (mkdocstrings leaves out a name without one, silently)."""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from simulator import registry

ROOT = Path(__file__).resolve().parents[1]


def test_the_site_builds_in_strict_mode_with_every_generated_page(tmp_path):
    from fedray.reference import write

    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs, ignore=shutil.ignore_patterns("reference"))
    pages = write(docs / "reference")
    assert len(pages) == 1 + len(registry.KINDS)
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config.update(docs_dir=str(docs), site_dir=str(tmp_path / "site"),
                  hooks=[str(ROOT / h) for h in config["hooks"]])
    (strings,) = [p["mkdocstrings"] for p in config["plugins"]
                  if isinstance(p, dict) and "mkdocstrings" in p]
    strings["handlers"]["python"]["paths"] = [str(ROOT)]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    done = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict",
                           "-f", str(tmp_path / "mkdocs.yml")], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    site = tmp_path / "site"
    scenario = (site / "reference" / "scenario" / "index.html").read_text()
    for key in ("privacy_attacks", "runtime.checkpoint_every", "audit.canaries",
                "clients.b_hat.rule"):
        assert f"<code>{key}</code>" in scenario, key
    lira = (site / "reference" / "plugins" / "privacy_attacks" / "index.html").read_text()
    assert "likelihood-ratio attack" in lira and "<code>runs</code>" in lira
    api = (site / "api" / "fedray" / "index.html").read_text()
    assert "fedray.api.run" in api and "fedray.api.Results" in api
    assert ":class:" not in api and ":func:" not in api  # the hook drew the roles as code
    tutorial = (site / "tutorials" / "1_robust_aggregation" / "index.html").read_text()
    assert "MedianNormClip" in tutorial  # the notebooks are pages


def _public(obj: object) -> list[tuple[str, object]]:
    return [(n, m) for n, m in vars(obj).items()
            if not n.startswith("_") and (inspect.isfunction(m) or isinstance(m, property))]


def test_every_name_the_api_pages_draw_has_a_docstring():
    import fedray.api
    from strategies.protocols import CONTRACTS

    missing = []
    for name in fedray.api.__all__:
        obj = getattr(fedray.api, name)
        if not inspect.getdoc(obj):
            missing.append(f"fedray.{name}")
        if inspect.isclass(obj) and obj.__module__ == "fedray.api":
            missing += [f"fedray.{name}.{n}" for n, m in _public(obj) if not inspect.getdoc(m)]
    for kind, base in CONTRACTS.items():
        if not inspect.getdoc(base):
            missing.append(f"the contract of {kind}")
        missing += [f"{base.__qualname__}.{n}" for n, m in _public(base)
                    if getattr(m, "__isabstractmethod__", False) and not m.__doc__]
        for name in registry.available(kind):
            if not (registry.get(kind, name).__doc__ or "").strip():
                missing.append(f"{kind} {name}")
    assert not missing, missing


def test_every_block_of_the_schema_says_what_it_is():
    """The scenario reference prints each block's own docstring above its keys."""
    from fedray.reference import _models
    from simulator.config.schema import Scenario

    seen, queue, bare = set(), [Scenario], []
    while queue:
        model = queue.pop()
        if model in seen:
            continue
        seen.add(model)
        if not (model.__dict__.get("__doc__") or "").strip():
            bare.append(model.__name__)
        for field in model.model_fields.values():
            queue += list(_models(field.annotation))
    assert len(seen) > 15 and not bare, bare
