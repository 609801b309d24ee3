"""fedray: a federated-learning simulator on Ray with MLflow tracking.

The application layer: ``fedray.cli`` (the ``fedray`` command) and ``fedray.testing`` (the
conformance checks shipped to plugin authors). The engine is ``simulator``, the plugins and
their contracts ``strategies``, the pictures ``dashboards``.
"""

from simulator import __version__

__all__ = ["__version__"]
