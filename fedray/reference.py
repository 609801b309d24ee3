"""The generated pages of the documentation site (``make docs``): the scenario file's every
key from the schema (``simulator.config.schema``: type, bounds, default, and each block's
docstring), and every registered plugin of every kind from the registry (what ``fedray list
-v`` prints, from the same source: ``registry.describe``), each with its class's API page
drawn by mkdocstrings from its docstrings. Nothing here is written by hand twice.

    python -m fedray.reference docs/reference
"""

from __future__ import annotations

import inspect
import re
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from simulator import registry
from simulator.config.schema import Scenario

INTRO = {
    "scenario": "Every key of a scenario file, generated from the schema "
                "(`simulator/config/schema.py`): its type with its bounds, and its default "
                "(required where none). A plugin block (`{name: ..., key: value}`) takes the "
                "keys of its plugin: see the plugin pages.",
}


def _models(tp: Any) -> Iterator[type[BaseModel]]:
    """The pydantic models a field's annotation holds (``Audit | None``, ``list[...]``)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        yield tp
        return
    for arg in typing.get_args(tp):
        yield from _models(arg)


def _type(field: Any) -> str:
    """A field's type as a person reads it, bounds included (``int > 0 <= 100000``)."""
    tp = field.annotation
    if field.metadata:
        tp = typing.Annotated[(tp, *field.metadata)]
    text = registry.type_text(tp)
    return text.replace("dict[str, Any]", "plugin block").replace("|", "\\|")


def _default(field: Any) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "its keys' defaults"
    return f"`{value!r}`".replace("|", "\\|")


def _doc(model: type[BaseModel]) -> str:
    """A block's docstring as Markdown (``x`` literals are Markdown's code spans)."""
    own = model.__dict__.get("__doc__")  # not an inherited one (pydantic's BaseModel's)
    return inspect.cleandoc(own) if own else ""


def _anchor(path: str) -> str:
    return "key-" + path.replace(".", "-").replace("_", "-")


def scenario_page() -> str:
    """The scenario reference: the top-level keys, then each block's keys, in the order the
    schema declares them."""
    out = ["# Scenario file reference", "", INTRO["scenario"], ""]
    seen: set[type[BaseModel]] = set()
    queue: list[tuple[str, type[BaseModel]]] = [("", Scenario)]
    while queue:
        path, model = queue.pop(0)
        if model in seen:
            continue
        seen.add(model)
        title = f"`{path}` {{#{_anchor(path)}}}" if path else "Top level"
        out += [f"## {title}", "", _doc(model), "",
                "| key | type | default |", "|---|---|---|"]
        for name, field in model.model_fields.items():
            key = f"{path}.{name}" if path else name
            blocks = [m for m in _models(field.annotation) if m not in seen]
            where = f" ([keys](#{_anchor(key)}))" if blocks else ""
            out.append(f"| `{key}` | {_type(field)}{where} | {_default(field)} |")
            queue += [(key, m) for m in blocks]
        out.append("")
    return "\n".join(out)


def plugin_page(kind: str) -> str:
    """One kind's page: its contract, then each registered plugin: its class's docstring
    (what it computes, its paper, its departures; drawn by mkdocstrings) and its keys with
    their types and defaults (``registry.describe``, as ``fedray list -v`` prints them)."""
    base = registry.contract(kind)
    out = [f"# {kind}", "",
           (f"Scenario blocks of this kind name one of these plugins. The contract every "
           f"plugin of the kind keeps: `{base.__module__}.{base.__qualname__}` "
           f"([API](../../api/protocols.md)). A plugin of your own registers as an entry point "
           f"in the group `fedray.{kind}` or, from a script, with `fedray.register("
           f"\"{kind}\", NAME)`."), ""]
    for name in registry.available(kind):
        cls = registry.get(kind, name)
        facts = registry.describe(kind, name)
        out += [f"## `{name}`", "", f"::: {cls.__module__}.{cls.__qualname__}",
                "    options:", "      show_root_heading: false", "      heading_level: 3",
                "      show_bases: false", ""]
        if facts["keys"]:
            out += ["| key | type | default |", "|---|---|---|"]
            for key, (tp, default) in facts["keys"].items():
                shown = "required" if default is ... else f"`{default!r}`"
                out.append(f"| `{key}` | {tp.replace('|', chr(92) + '|')} | "
                           f"{shown.replace('|', chr(92) + '|')} |")
            out.append("")
    return "\n".join(out)


def write(folder: Path) -> list[Path]:
    """Every generated page under ``folder`` (``scenario.md``, ``plugins/<kind>.md``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "plugins").mkdir(exist_ok=True)
    pages = {folder / "scenario.md": scenario_page()}
    for kind in registry.KINDS:
        pages[folder / "plugins" / f"{kind}.md"] = plugin_page(kind)
    for path, text in pages.items():
        path.write_text(text + "\n")
    return list(pages)


ROLE = re.compile(r":(?:func|class|meth|attr|data|mod|exc|obj):(<code>)")


def on_page_content(html: str, **_: Any) -> str:
    """An MkDocs hook (mkdocs.yml ``hooks``): the Sphinx roles of the docstrings
    (``:class:`Results```) drawn as the code they name, without the role."""
    return ROLE.sub(r"\1", html)


if __name__ == "__main__":
    written = write(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/reference"))
    print(f"{len(written)} pages written")
