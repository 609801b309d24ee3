"""Dotted paths into a scenario's mapping (``local.lr``, ``aggregator.params.f``): the keys
of ``--set``, of a sweep and of a search's space; shared by loading (``load``), sweeps
(``sweep``) and the ``tune`` block's checks (``search``)."""

from __future__ import annotations

from typing import Any


class PathError(ValueError):
    """A dotted path that steps into a list at a part that is not one of its indices."""


def set_path(d: dict, dotted: str, value: Any) -> None:
    """Set ``d[a][b][c] = value`` for ``dotted = "a.b.c"``, creating mappings as needed. A
    part that meets a list is an index into it (``privacy_attacks.0.iterations``: the first
    attack's key); :class:`PathError` when it is not one (naming the path and the indices)."""
    parts = dotted.split(".")
    cur: Any = d
    for depth, p in enumerate(parts):
        last = depth == len(parts) - 1
        if isinstance(cur, list):
            if not (p.isdigit() and int(p) < len(cur)):
                where = ".".join(parts[:depth])
                raise PathError(f"{where} is a list of {len(cur)}: {p!r} is not one of its "
                                f"indices 0..{len(cur) - 1}" if cur else
                                f"{where} is an empty list: nothing at {p!r}")
            if last:
                cur[int(p)] = value
            elif not isinstance(cur[int(p)], (dict, list)):
                cur[int(p)] = {}
            cur = cur[int(p)]
        elif last:
            cur[p] = value
        else:
            if not isinstance(cur.get(p), (dict, list)):
                cur[p] = {}
            cur = cur[p]


# levels of nesting of a scenario (a plugin block's list of lists is 4 or 5 deep), and parts
# of a dotted path; PyYAML's composer and every walk after it recurse once per level
MAX_DEPTH = 32


def path_problem(dotted: str) -> str | None:
    """What is wrong with a dotted path (``--set`` or a sweep key), or None."""
    parts = dotted.split(".")
    if len(parts) > MAX_DEPTH:
        return f"a path of {len(parts)} parts; a scenario is at most {MAX_DEPTH} levels deep"
    if not all(parts):
        return "an empty part in a dotted path"
    return None


def sweep_parts(key: str) -> list[str]:
    """The dotted paths of a sweep key: ``"local.steps, local.lr"`` zips two paths (each value
    of that key is a list with one value per path); a plain key is one path."""
    return [part.strip() for part in key.split(",")]


def sweep_paths(raw: Any) -> list[str]:
    """The dotted paths a mapping's ``sweep`` sets (zipped keys split into their paths)."""
    sweep = raw.get("sweep") if isinstance(raw, dict) else None
    return [part for k in sweep for part in sweep_parts(str(k))] \
        if isinstance(sweep, dict) else []
