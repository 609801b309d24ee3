"""The names fedray's per-round metrics have in MLflow: grouped by a prefix, so MLflow's
chart view folds them into sections (``eval``, ``robust``, ``round``, ``dsgd``, ``time``,
``privacy``, ``comm``)
instead of listing seventeen names alphabetically with the constant counters first.

Inside fedray (the engine's rows, ``metrics.parquet``, the CLI's lines) a metric keeps its
plain name (``test_accuracy``); ``mlflow_name`` gives the logged one (``eval/test_accuracy``).
Every reader of MLflow (the report, ``fedray table``, ``fedray resume``) goes through this
table; a metric it does not know (a third-party plugin's) is logged under its plain name.
"""

from __future__ import annotations

SECTIONS: dict[str, tuple[str, ...]] = {
    # the model's quality on held-out data
    "eval": ("test_accuracy", "test_loss", "test_perplexity", "train_loss",
             "client_test_accuracy_mean", "client_test_accuracy_p10", "min_peer_accuracy",
             "personal_test_accuracy_mean", "personal_test_accuracy_p10", "personal_clients",
             "averaged_test_accuracy", "averaged_test_loss", "generalization_gap"),
    # what the Byzantine clients did to the aggregate
    "robust": ("aggregation_error", "relative_aggregation_error", "honest_update_norm",
               "aggregate_norm", "nonfinite_aggregate", "aggregation_skipped",
               "byzantine_sampled", "byzantine_exceeded", "b_hat", "buffer_aggregation_error",
               "attack_success_rate"),
    # who took part in the round and how local training went
    "round": ("sampled", "participants", "dropped", "stragglers", "partial_work", "client_loss",
              "late", "carried"),
    "dsgd": ("consensus_distance", "byzantine_peers"),
    # the simulated clock (speeds; the asynchronous modes)
    "time": ("sim_time", "staleness_mean", "staleness_max", "dropped_stale", "started",
             "clients_applied"),
    # the accountant's epsilon; an audit's estimate and lower bound, and its canaries'
    # cosines with the model's change (inserted, and never inserted)
    "privacy": ("epsilon", "audit_epsilon", "audit_epsilon_lower", "audit_canaries_inserted",
                "audit_cosine_in_mean", "audit_cosine_in_std", "audit_cosine_out_mean",
                "audit_cosine_out_std"),
    # the message path: bytes each round (or step) sent up and down, and their totals
    "comm": ("bytes_up", "bytes_down", "bytes_up_total", "bytes_down_total",
             # secure aggregation: the step's groups, the clients that dropped after masking,
             # the groups too few survivors could unmask
             "secagg_groups", "secagg_dropped", "secagg_groups_lost",
             # downlink compression: how far the clients' replica is from the model
             "replica_distance"),
}
MLFLOW = {name: f"{section}/{name}" for section, names in SECTIONS.items() for name in names}
PLAIN = {v: k for k, v in MLFLOW.items()}
SIM_TIME = "sim_time"  # simulated seconds since the start, each step (a run with speeds:)


def mlflow_name(name: str) -> str:
    """``test_accuracy`` -> ``eval/test_accuracy``; an unknown or already prefixed name as is."""
    return MLFLOW.get(name, name)


def plain_name(name: str) -> str:
    """``eval/test_accuracy`` -> ``test_accuracy`` (the inverse of :func:`mlflow_name`)."""
    return PLAIN.get(name, name)
