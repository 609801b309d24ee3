"""The report's figures and tables as files to paste into a paper or a slide: every chart
and heat map as PDF and SVG (the very figures the HTML report inlines: ``dashboards.draw``
draws each once), every table as Markdown and LaTeX (booktabs). ``fedray report`` writes them
beside ``report.html``, in ``figures/`` and ``tables/``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from dashboards.draw import SVG_RC, Drawing
from dashboards.formats import latex, markdown


@dataclass
class Exports:
    """What a report shows, collected while it is rendered."""

    figures: list[Drawing] = field(default_factory=list)
    tables: list[tuple[str, list[str], list[list[str]]]] = field(default_factory=list)


def slug(text: str, n: int = 60) -> str:
    """A file name from a title: ``test-accuracy``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:n] or "figure"


def write_figures(exports: Exports, folder: Path) -> list[Path]:
    """Each figure as ``NN-title.pdf`` and ``.svg`` in ``folder`` (the SVG's text as text,
    as on the page); the paths written."""
    import matplotlib

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i, drawing in enumerate(exports.figures):
        for ext in ("pdf", "svg"):
            path = folder / f"{i + 1:02d}-{slug(drawing.title)}.{ext}"
            with matplotlib.rc_context(SVG_RC):
                drawing.figure.savefig(path, metadata={"Date": None} if ext == "svg" else
                                      {"CreationDate": None})
            out.append(path)
    return out


def write_tables(exports: Exports, folder: Path) -> list[Path]:
    """Each table as ``NAME.md`` and ``NAME.tex`` (booktabs) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    seen: dict[str, int] = {}
    for name, head, rows in exports.tables:
        seen[name] = seen.get(name, 0) + 1
        stem = name if seen[name] == 1 else f"{name}-{seen[name]}"
        for ext, text in (("md", markdown(head, rows, 1)), ("tex", latex(head, rows, 1))):
            path = folder / f"{stem}.{ext}"
            path.write_text(text + "\n", encoding="utf-8")
            out.append(path)
    return out
