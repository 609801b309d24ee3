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

This package hands on only the scenario's types (``schema``) and its errors (``errors``),
which import nothing else of the package: ``simulator.config.plan`` and the clock import the schema,
and the checks import them, so handing on ``load`` or ``validate`` here would close a cycle.
Import those from their modules (``from simulator.config.load import load``).
"""

from simulator.config.errors import Problem, ScenarioError
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

__all__ = [
    "DSGD", "BHat", "Clients", "Data", "Evaluation", "Local", "Problem", "RunPoint", "Runtime",
    "Scenario", "ScenarioError", "ServerSettings", "Stragglers",
]
