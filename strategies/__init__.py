"""Plugins of fedray: pure functions and classes over `(n, d)` update matrices.

Nothing here imports Ray, MLflow or the engine.
"""
