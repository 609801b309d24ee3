"""A table (a header and rows of cells) as text: Markdown, LaTeX (booktabs) or CSV."""

from __future__ import annotations

from collections.abc import Sequence


def markdown(head: Sequence[str], body: Sequence[Sequence[str]], keys: int) -> str:
    lines = ["| " + " | ".join(head) + " |",
             "|" + "---|" * keys + "---:|" * (len(head) - keys)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#",
       "_": r"\_", "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}",
       "^": r"\textasciicircum{}", "±": r"$\pm$", "Δ": r"$\Delta$", "≥": r"$\geq$",
       "≤": r"$\leq$"}


def _tex(text: str) -> str:
    """``text`` with LaTeX's special characters escaped."""
    return "".join(TEX.get(ch, ch) for ch in text)


def latex(head: Sequence[str], body: Sequence[Sequence[str]], keys: int) -> str:
    """A booktabs table (``\\usepackage{booktabs}``)."""
    spec = "l" * keys + "r" * (len(head) - keys)
    lines = [rf"\begin{{tabular}}{{{spec}}}", r"\toprule",
             " & ".join(_tex(h) for h in head) + r" \\", r"\midrule"]
    lines += [" & ".join(_tex(c) for c in cells) + r" \\" for cells in body]
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines)


def csv_text(head: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    import csv
    import io

    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(head)
    writer.writerows(body)
    return buf.getvalue().rstrip("\n")
