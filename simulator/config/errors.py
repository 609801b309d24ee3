"""Scenario problems: one located line each (``file:line: dotted.path: message``), and the
translation of pydantic's errors and plugins' ``check`` messages into them."""

from __future__ import annotations

import difflib
import inspect
import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from simulator.errors import brief, printable

Loc = tuple[Any, ...]

@dataclass
class Problem:
    loc: Loc
    message: str
    line: int | None = None
    sweep_key: str | None = None  # the sweep entry that produced this problem, if any

    def format(self, source: str | None) -> str:
        path = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in self.loc)
        path = path.replace(".[", "[") or "scenario"
        where = f"{source}:{self.line}: " if source and self.line else (f"{source}: " if source else "")
        return f"{where}{path}: {self.message}"


class ScenarioError(ValueError):
    """Every problem found in a scenario, one formatted line each."""

    def __init__(self, problems: list[Problem], source: str | None = None) -> None:
        self.problems = problems
        self.source = source
        # user text (keys, values, the file's name) never reaches a terminal raw
        self.lines = list(dict.fromkeys(printable(p.format(source)) for p in problems))
        super().__init__("\n".join(self.lines))


def suggest(word: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _unwrap_model(tp: Any) -> type[BaseModel] | None:
    """The pydantic model class inside ``tp`` (through Optional/Annotated/list), if any."""
    origin = typing.get_origin(tp)
    if inspect.isclass(tp) and issubclass(tp, BaseModel):
        return tp
    for arg in typing.get_args(tp) if origin is not None else ():
        m = _unwrap_model(arg)
        if m is not None:
            return m
    return None


def _fields_at(model: type[BaseModel], loc: Loc) -> list[str]:
    cur: type[BaseModel] | None = model
    for part in loc:
        if cur is None:
            return []
        if isinstance(part, int):
            continue
        f = cur.model_fields.get(part)
        cur = _unwrap_model(f.annotation) if f is not None else None
    return list(cur.model_fields) if cur is not None else []


_OPS = {
    "greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<=",
}

# what a value of a pydantic error type must be
_MUST_BE = {
    **dict.fromkeys(("int_type", "int_parsing", "int_from_float"), "an integer"),
    **dict.fromkeys(("float_type", "float_parsing"), "a number"),
    "finite_number": "a finite number",
    "string_type": "a string",
    **dict.fromkeys(("bool_type", "bool_parsing"), "true or false"),
    **dict.fromkeys(("dict_type", "model_type", "model_attributes_type"), "a mapping"),
    "list_type": "a list",
}


def message(err: Any, root: type[BaseModel], loc: Loc) -> str:
    """One pydantic error as the scenario's one-line message (``must be ..., got ...``)."""
    kind = err["type"]
    ctx = err.get("ctx") or {}
    got = brief(err.get("input"))
    if kind == "extra_forbidden":
        return "unknown key" + (suggest(str(loc[-1]), _fields_at(root, loc[:-1])) or
                                f"; allowed: {', '.join(_fields_at(root, loc[:-1]))}")
    if kind == "missing":
        return "required"
    if kind in _OPS:
        bound = next(iter(ctx.values())) if ctx else "?"
        return f"must be {_OPS[kind]} {bound}, got {got}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}, got {got}"
    if kind in _MUST_BE:
        return f"must be {_MUST_BE[kind]}, got {got}"
    if kind in ("too_short", "too_long"):
        return str(err["msg"]).replace("List", "list") + f", got {got}"
    return str(err["msg"])


def _is_union(tp: Any) -> bool:
    """Whether ``tp`` (through Annotated) is a union of more than a type and None."""
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return False
    return len([a for a in typing.get_args(tp) if a is not type(None)]) > 1


def _field_loc(root: type[BaseModel], loc: Loc) -> Loc:
    """``loc`` without the union members' tags pydantic puts in it (a field typed ``bool |
    Literal['strict']`` reports ``...deterministic.bool`` and ``...deterministic.literal[
    'strict']``): the name that follows a union-typed field."""
    out: list[Any] = []
    cur: type[BaseModel] | None = root
    union = False
    for part in loc:
        if union and isinstance(part, str):
            union = False
            continue  # a union member's tag
        out.append(part)
        f = cur.model_fields.get(part) if cur is not None and isinstance(part, str) else None
        union = f is not None and _is_union(f.annotation)
        if not isinstance(part, int):
            cur = _unwrap_model(f.annotation) if f is not None else None
    return tuple(out)


def pydantic_problems(e: ValidationError, root: type[BaseModel], prefix: Loc = ()) -> list[Problem]:
    """One problem per key: the errors of a union's members at one key become one line
    (``must be true or false, or one of 'strict', got 'nope'``)."""
    by_loc: dict[Loc, list[str]] = {}
    for err in e.errors(include_url=False):
        loc = tuple(err["loc"])
        by_loc.setdefault(_field_loc(root, loc), []).append(message(err, root, loc))
    out = []
    for loc, texts in by_loc.items():
        musts = [t.removeprefix("must be ").rpartition(", got ") for t in texts]
        if len(texts) > 1 and all(t.startswith("must be ") for t in texts) and \
                len({got for _, _, got in musts}) == 1:
            text = f"must be {', or '.join(m for m, _, _ in musts)}, got {musts[0][2]}"
        else:
            text = "; ".join(dict.fromkeys(texts))
        out.append(Problem(prefix + loc, text))
    return out


def problem(loc: Loc, e: Exception, note: str = "") -> Problem:
    """A plugin's ``ValueError`` as a problem at ``loc``: a message that starts with its
    parameter name ('f: must be ...') is placed at that key of ``loc``, one that starts with
    a scenario key in full ('clients.total: must equal ...') at that key; any other at
    ``loc`` itself."""
    head, sep, rest = str(e).partition(": ")
    keys = tuple(head.split("."))
    if sep and all(k.isidentifier() for k in keys):
        return Problem(loc + keys if len(keys) == 1 else keys, rest + note)
    return Problem(loc, str(e) + note)
