"""Sweeps: a scenario's grid (and zipped keys) x seeds expanded into run points, every point
validated; a problem common to every point is reported once."""

from __future__ import annotations

import copy
import itertools
import json
import math
from typing import Any

from simulator import registry
from simulator.config.dotted import PathError, path_problem, set_path, sweep_parts
from simulator.config.errors import Loc, Problem, ScenarioError
from simulator.config.schema import MAX_RUN_NAME, RunPoint, Scenario, check_name, short
from simulator.config.tune_checks import check_tune
from simulator.config.validate import validate_point
from simulator.errors import brief

MAX_POINTS = 10_000  # sweep points of one scenario file


def _check_sweep(raw: dict) -> dict[str, list[Any]]:
    """The ``sweep`` block of a mapping: paths to non-empty lists (a zipped key's values are
    lists of one value per path), at most MAX_POINTS points; ScenarioError otherwise."""
    if not isinstance(raw, dict):
        raise ScenarioError([Problem((), f"must be a mapping of keys, got {type(raw).__name__}")])
    sweep = raw.get("sweep") or {}
    if not isinstance(sweep, dict):
        raise ScenarioError([Problem(("sweep",), f"must map dotted paths to lists, got {brief(sweep)}")])
    problems: list[Problem] = []
    for k, v in sweep.items():
        if not isinstance(v, list) or not v:
            problems.append(Problem(("sweep", k), f"must be a non-empty list of values, got {brief(v)}"))
            continue
        bad_path = next((m for part in sweep_parts(k) if (m := path_problem(part))), None)
        if bad_path:
            problems.append(Problem(("sweep", k), bad_path))
            continue
        width = len(sweep_parts(k))
        bad = [e for e in v if width > 1 and (not isinstance(e, list) or len(e) != width)]
        if bad:
            problems.append(Problem(("sweep", k), f"zips {width} paths: each value must be a "
                                    f"list of {width} values, one per path, got {brief(bad[0])}"))
    if problems:
        raise ScenarioError(problems)
    n_grid = math.prod(len(v) for v in sweep.values())
    if n_grid > MAX_POINTS:
        raise ScenarioError([Problem(("sweep",), f"{n_grid:,} points; at most {MAX_POINTS:,} "
                                     "(split the study into several files)")])
    return sweep


def _shadow_sweep(raw: dict, sweep: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """The sweep a shadow-run membership attack adds (``privacy_attacks: [{name: lira,
    runs: R}]``): ``privacy_attacks.I.run`` over 0..R-1, one point a run, unless the
    attack gives its ``run`` or the scenario's sweep sets its block (validation then asks
    for ``run`` where it is missing). A block that is not valid adds nothing: validation
    says why."""
    attacks = raw.get("privacy_attacks")
    if not isinstance(attacks, list) or any(p.startswith("privacy_attacks")
                                            for k in sweep for p in sweep_parts(k)):
        return {}
    for i, spec in enumerate(attacks):
        name = spec.get("name") if isinstance(spec, dict) else None
        if not isinstance(name, str) or name not in registry.available("privacy_attacks") \
                or spec.get("run") is not None:
            continue
        runs = spec.get("runs", registry.keys("privacy_attacks", name).get("runs", 1))
        if type(runs) is int and 1 < runs <= MAX_POINTS:
            return {f"privacy_attacks.{i}.run": list(range(runs))}
    return {}


def _with_shadows(raw: dict, sweep: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """The scenario's sweep and the runs of its shadow-run attack (``_shadow_sweep``), at
    most MAX_POINTS points together."""
    out = {**sweep, **_shadow_sweep(raw, sweep)}
    if len(out) > len(sweep) and math.prod(len(v) for v in out.values()) > MAX_POINTS:
        raise ScenarioError([Problem(("privacy_attacks",), f"its runs times the sweep's points "
                                     f"exceed {MAX_POINTS:,} points (split the study)")])
    return out


def _sweep_key_of(problem: Problem, keys: list[str]) -> str | None:
    """The sweep key whose paths reach the problem's location, if any."""
    dotted = ".".join(map(str, problem.loc))
    return next((k for k in keys for part in sweep_parts(k)
                 if dotted == part or dotted.startswith(part + ".")
                 or part.startswith(dotted + ".")), None)


def _grid(sweep: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """The values of every grid point, by dotted path (zipped keys split into their paths)."""
    keys = list(sweep)
    out = []
    for combo in itertools.product(*(sweep[k] for k in keys)) if keys else [()]:
        values: dict[str, Any] = {}
        for k, v in zip(keys, combo):
            parts = sweep_parts(k)
            values.update(zip(parts, v) if len(parts) > 1 else {k: v})
        out.append(values)
    return out


def _run_name_problems(points: list[RunPoint]) -> list[Problem]:
    """The first run name MLflow would refuse (too long) or a terminal would act on (control
    characters), at the sweep key whose value made it."""
    for point in points:
        bad = check_name(point.run_name, "a run's name", MAX_RUN_NAME)
        if bad:
            if len(point.run_name) > MAX_RUN_NAME:
                bad += f" ({brief(point.run_name)})"
            key = next((k for k, v in point.values.items()
                        if not isinstance(v, (int, float)) and check_name(short(v), "", 60)
                        ), None)
            return [Problem(("sweep", key) if key else ("name",),
                            bad + "; a run is named after its sweep values and seed")]
    return []


def _set_swept(point: dict, path: str, value: Any) -> None:
    """``set_path``; a path into a list at no index of it is the sweep key's problem."""
    try:
        set_path(point, path, value)
    except PathError as e:
        raise ScenarioError([Problem(("sweep", path), str(e))]) from None


def _validate_once(point: dict, seen: dict[str, Scenario | ScenarioError]) -> Scenario:
    """``validate_point(point)``, or what it gave for the same point before (a grid whose
    keys give equal points, such as a swept value equal to another's)."""
    try:
        key = json.dumps(point, sort_keys=True, default=repr)
    except (TypeError, ValueError, RecursionError):  # keys of mixed types: not cached
        return validate_point(point)
    if key not in seen:
        try:
            seen[key] = validate_point(point)
        except ScenarioError as e:
            seen[key] = e
    got = seen[key]
    if isinstance(got, ScenarioError):
        raise ScenarioError(copy.deepcopy(got.problems))
    return got


def expand(raw: dict) -> tuple[list[RunPoint], Scenario]:
    """Validate a scenario mapping and expand its sweep grid x seeds into run points.

    Returns the points and the validated base scenario. Raises ScenarioError listing every
    problem of the base and of each sweep point (a problem every point has, once).
    """
    sweep = _with_shadows(raw, _check_sweep(raw))
    base_raw = {k: v for k, v in raw.items() if k not in ("sweep", "tune")}
    keys = list(sweep)
    points: list[RunPoint] = []
    base: Scenario | None = None
    per_point: dict[tuple[Loc, str], list[tuple[Problem, str]]] = {}
    grid = _grid(sweep)
    seen: dict[str, Scenario | ScenarioError] = {}  # each distinct point validated once
    for values in grid:
        point = copy.deepcopy(base_raw)
        try:
            for k, v in values.items():
                _set_swept(point, k, v)
            sc = _validate_once(point, seen)
        except ScenarioError as e:
            where = ", ".join(f"{k}={short(v)}" for k, v in values.items())
            for p in e.problems:
                p.sweep_key = _sweep_key_of(p, keys)
                per_point.setdefault((p.loc, p.message), []).append((p, where))
            continue
        base = base or sc
        points += [RunPoint(values, seed, sc.model_copy(update={"seeds": [seed]}))
                   for seed in sc.seeds]
    problems: list[Problem] = []
    for group in per_point.values():
        if len(group) == len(grid) or not keys:  # the same problem at every point: say it once
            problems.append(group[0][0])
        else:
            for p, where in group:
                p.message += f" (sweep point {where})"
                problems.append(p)
    problems += _run_name_problems(points)
    if problems:
        raise ScenarioError(problems)
    assert base is not None
    tune = None
    if raw.get("tune") is not None:
        tune = check_tune(raw["tune"], base_raw, base, sweep, grid).model_dump(mode="json")
    full = Scenario.model_validate({**base.model_dump(mode="json"), "sweep": sweep,
                                    "tune": tune})
    return points, full
