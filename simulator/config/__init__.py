"""Scenario files: the schema, validation with located errors, sweeps, loading.

Validation runs in three passes, each collecting every error it finds:

1. structure (``schema``): pydantic models with ``extra="forbid"`` (unknown keys get a
   suggestion);
2. plugins (``validate``): each ``{name: ..., key: value}`` block is looked up in the
   registry and its keys validated against a model derived from the plugin's constructor;
3. cross-field rules (``checks``): sampled <= total, Byzantine < total, every plugin's
   ``check(n)`` for what it will be given, the data and the model, ...

Every error is one line, ``file:line: dotted.path: message`` (``errors``); ``sweep`` expands
a grid x seeds into run points and ``load`` reads a file with its ``--set`` overrides.
"""

from simulator.config.errors import Problem, ScenarioError
from simulator.config.load import LoadedScenario, json_schema, load, parse_override, read_yaml
from simulator.config.schema import (
    DSGD,
    BHat,
    Clients,
    Data,
    Evaluation,
    Local,
    RunPoint,
    Runtime,
    Scenario,
    ServerSettings,
    Stragglers,
)
from simulator.config.sweep import expand, set_path
from simulator.config.validate import validate_point

__all__ = [
    "DSGD", "BHat", "Clients", "Data", "Evaluation", "LoadedScenario", "Local", "Problem",
    "RunPoint", "Runtime", "Scenario", "ScenarioError", "ServerSettings", "Stragglers", "expand",
    "json_schema", "load", "parse_override", "read_yaml", "set_path", "validate_point",
]
