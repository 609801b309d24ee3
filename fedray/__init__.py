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

The API's names are read from ``fedray.api`` when first used (PEP 562): importing the
package stays as cheap as it was, since every ``fedray`` command imports it, the warm
pool's client first (``fedray.launch``, which otherwise imports only the standard library).
"""

from typing import TYPE_CHECKING, Any

from simulator import __version__

if TYPE_CHECKING:
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

__all__ = ["Results", "RunRecord", "ScenarioError", "Search", "__version__", "load", "register",
           "results", "resume", "run", "sweep", "tune"]
API = frozenset(__all__) - {"__version__"}  # the names fedray.api gives


def __getattr__(name: str) -> Any:
    if name in API:
        from fedray import api

        return getattr(api, name)
    raise AttributeError(f"module 'fedray' has no attribute {name!r}")
