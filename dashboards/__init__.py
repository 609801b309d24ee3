"""Turning MLflow runs into pictures (see issue 7)."""
