"""fedray: a federated-learning simulator on Ray with MLflow tracking."""

__version__ = "0.1.0"
