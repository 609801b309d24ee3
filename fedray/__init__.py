"""fedray: a federated-learning simulator on Ray with MLflow tracking.

From Python (``fedray.api``, docs/python.md)::

    import fedray
    res = fedray.run("scenarios/quickstart.yaml")
    res.final()            # each run's final metrics, a DataFrame
    res.metrics()          # every round's, in long form
    res.model()            # the final model, a torch.nn.Module

The application layer: ``fedray.api`` (this package's names), ``fedray.cli`` (the ``fedray``
command) and ``fedray.testing`` (the conformance checks shipped to plugin authors). The
engine is ``simulator``, the plugins and their contracts ``strategies``, the pictures
``dashboards``.
"""

from fedray.api import (
    Results,
    RunRecord,
    ScenarioError,
    Search,
    load,
    register,
    results,
    resume,
    run,
    sweep,
    tune,
)
from simulator import __version__

__all__ = ["Results", "RunRecord", "ScenarioError", "Search", "__version__", "load", "register",
           "results", "resume", "run", "sweep", "tune"]
