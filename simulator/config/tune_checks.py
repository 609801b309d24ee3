"""The ``tune`` block of a scenario (``fedray tune``): checked before anything runs, like
every other key. The block's own fields by the schema (``Tune``); then what only the whole
scenario can say: the metric is one a round logs and its ``HOW`` one a trial can score, the
searched paths exist and are not also swept, ``worst_over`` and ``per`` name sweep keys, and
every searched value the space can give is valid in the scenario: each end of a range and
each choice is validated with the other keys at their first end, at every sweep point (a
problem there is reported at ``tune.space.KEY``, naming the value)."""

from __future__ import annotations

import copy
import math
from typing import Any

from pydantic import ValidationError

from simulator.config.dotted import PathError, path_problem, set_path, sweep_paths
from simulator.config.errors import Problem, ScenarioError, pydantic_problems
from simulator.config.schema import Tune
from simulator.config.validate import validate_point
from simulator.errors import brief
from simulator.metric_names import MLFLOW
from simulator.run.reductions import TimeTo, lower_is_better, parse_how, parse_metrics

# paths a search cannot set: the scenario's identity and its blocks of points
UNSEARCHABLE = ("name", "description", "seeds", "sweep", "tune")
HOWS = "final, lastK (K >= 1), mean or time_toX (X a number)"


def evaluations(rounds: int, every: int) -> int:
    """How many evaluation rounds a run has: every ``every`` rounds, and the last."""
    return rounds // every + (1 if rounds % every else 0)


def _metric_problems(text: str, base: Any) -> list[Problem]:
    """The metric: a name a round logs, a HOW a trial can score (``time_toX`` needs the
    simulated clock)."""
    loc = ("tune", "metric")
    try:
        ((metric, how),) = parse_metrics([text])
    except ValueError:
        return [Problem(loc, f"must be METRIC:HOW with HOW one of {HOWS}, got {brief(text)}")]
    if metric not in MLFLOW:
        names = ", ".join(sorted(MLFLOW))
        return [Problem(loc, f"{brief(metric)} is not a metric a round logs; one of {names}")]
    k = parse_how(how)
    if k in ("sum", "param"):
        return [Problem(loc, f"HOW must be one of {HOWS}, got {how!r}")]
    clock = base.speeds is not None or base.server.resolved_mode.clock
    if isinstance(k, TimeTo) and not clock:
        return [Problem(loc, f"{how} needs the simulated clock (sim_time): a speeds: block or "
                        "an asynchronous server.mode")]
    return []


def _key_problems(tune: Tune, sweep: dict[str, list[Any]], base: Any) -> list[Problem]:
    """The searched paths, ``worst_over`` and ``per`` against the sweep."""
    problems: list[Problem] = []
    swept = set(sweep_paths({"sweep": sweep}))
    for key in tune.space:
        bad = path_problem(key)
        if bad is None and key.split(".")[0] in UNSEARCHABLE:
            bad = f"cannot be searched (the search does not set {', '.join(UNSEARCHABLE)})"
        inside = next((p for p in swept if key == p or key.startswith(p + ".")
                       or p.startswith(key + ".")), None)
        if bad is None and inside is not None:
            bad = f"overlaps the sweep key {inside}: a value is either swept or searched"
        if bad:
            problems.append(Problem(("tune", "space", key), bad))
    for field in ("worst_over", "per"):
        for i, key in enumerate(getattr(tune, field)):
            if key not in sweep:
                keys = ", ".join(sweep) or "none: the scenario has no sweep"
                problems.append(Problem(("tune", field, i), f"must be a sweep key ({keys}), "
                                        f"got {brief(key)}"))
    both = set(tune.worst_over) & set(tune.per)
    if both:
        problems.append(Problem(("tune", "per"), f"{', '.join(sorted(both))} is in both "
                                "worst_over and per"))
    return problems


def _budget_problems(tune: Tune, base: Any) -> list[Problem]:
    """Trials against the settings a space of choices holds, ASHA's grace against the
    evaluation rounds."""
    problems: list[Problem] = []
    settings = math.prod(len(d.choice or []) for d in tune.space.values())
    if all(d.choice is not None for d in tune.space.values()) and tune.trials > settings:
        problems.append(Problem(("tune", "trials"), f"must be <= the {settings} settings the "
                                f"space holds (choices only: more trials would repeat "
                                f"settings), got {tune.trials}"))
    n_eval = evaluations(base.rounds, base.evaluation.every)
    if tune.scheduler == "asha" and tune.grace >= n_eval:
        problems.append(Problem(("tune", "grace"), f"must be < the {n_eval} evaluation "
                                "round(s) of a run for ASHA to stop anything; set "
                                "scheduler: none, or more rounds"))
    return problems


def _corner_problems(tune: Tune, base_raw: dict, grid: list[dict[str, Any]]) -> list[Problem]:
    """Every end of a range and every choice, the other keys at their first end, validated
    at every sweep point; a problem found is reported once, at the searched key."""
    first = {k: d.extremes[0] for k, d in tune.space.items()}
    seen: set[tuple[str, str]] = set()
    problems: list[Problem] = []
    for key, dist in tune.space.items():
        for value in dist.extremes:
            for values in grid:
                raw = copy.deepcopy(base_raw)
                try:
                    for k, v in {**values, **first, key: value}.items():
                        try:
                            set_path(raw, k, v)
                        except PathError as e:
                            raise ScenarioError([Problem(tuple(k.split(".")), str(e))]
                                                ) from None
                    validate_point(raw)
                except ScenarioError as e:
                    p = e.problems[0]
                    where = ".".join(map(str, p.loc)) or "scenario"
                    if (key, where) not in seen:
                        seen.add((key, where))
                        problems.append(Problem(("tune", "space", key),
                                                f"the value {brief(value)} gives {where}: "
                                                f"{p.message}"))
                    break
    return problems


def check_tune(raw: Any, base_raw: dict, base: Any, sweep: dict[str, list[Any]],
               grid: list[dict[str, Any]]) -> Tune:
    """The validated ``tune`` block of a scenario whose base (``base``, a Scenario of the
    first sweep point) and sweep are valid; ScenarioError with every problem otherwise."""
    try:
        tune = Tune.model_validate(raw)
    except ValidationError as e:
        problems = pydantic_problems(e, Tune, ("tune",))
        metric = raw.get("metric") if isinstance(raw, dict) else None
        if isinstance(metric, str) and not any(p.loc[:2] == ("tune", "metric")
                                               for p in problems):
            problems += _metric_problems(metric, base)
        raise ScenarioError(problems) from None
    problems = (_metric_problems(tune.metric, base) + _key_problems(tune, sweep, base)
                + _budget_problems(tune, base))
    if not problems:
        problems = _corner_problems(tune, base_raw, grid)
    if problems:
        raise ScenarioError(problems)
    if tune.mode is None:
        ((metric, _),) = parse_metrics([tune.metric])
        tune = tune.model_copy(update={"mode": "min" if lower_is_better(metric) else "max"})
    return tune
