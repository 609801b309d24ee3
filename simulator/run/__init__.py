"""The run's lifecycle on the driver: `fedray run`, `sweep`, `resume` and `tune` as one
Experiment with its executors and callbacks, the MLflow layout and tracking (with the journal
behind it), checkpoints, signals, progress, and the reductions of a run's metrics."""
