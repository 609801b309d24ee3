"""Tasks: what the model learns, its loss and the metrics that fit it.

* ``classification`` / :func:`cross_entropy`: one class per sample; accuracy and mean
  cross-entropy (what every image benchmark of the field reports).
* ``next_token`` / :func:`next_token_losses`: language modelling on integer sequences (LEAF's
  Shakespeare, Caldas et al. 2018). With a model that scores every position
  (``char_lstm`` with ``positions: all``) the target of a sequence ``x`` with next token
  ``y`` is ``x[1:] + [y]``: every position predicts the token after it, and the metrics are
  per-token accuracy, per-token cross-entropy and its exponential, the perplexity. With a
  model that scores the last position only, the target is ``y`` (LEAF's own setting, where
  the per-token and per-sequence numbers coincide).
* ``regression`` / :func:`squared_errors`: real-valued targets, mean squared error over the
  outputs (``test_loss`` is the MSE); no accuracy.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

from strategies.protocols import Task, Traits

__all__ = ["Classification", "NextToken", "Regression", "cross_entropy", "next_token_losses",
           "squared_errors"]


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample cross-entropy of class scores ``(b, C)`` against class ids ``(b,)``."""
    return nn.functional.cross_entropy(output, target, reduction="none")


def next_token_losses(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean cross-entropy of scores ``(b, L, V)`` against ids ``(b, L)`` (or of
    ``(b, V)`` against ``(b,)``: one position)."""
    if output.dim() == 2:
        return cross_entropy(output, target)
    per = nn.functional.cross_entropy(output.transpose(1, 2), target, reduction="none")
    return per.mean(dim=1)


def squared_errors(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample mean squared error of outputs ``(b, k)`` against targets ``(b,)`` or
    ``(b, k)``."""
    return (output - target.reshape(output.shape)).pow(2).reshape(len(output), -1).mean(dim=1)


class Classification(Task):
    """One class per sample: cross-entropy; accuracy."""

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(output, target)

    def hits(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output.argmax(dim=1) == target).to(torch.float32)


class NextToken(Task):
    """Next-token prediction on integer sequences: per-token cross-entropy, accuracy and
    perplexity (module docstring). ``positions``: ``all`` needs scores for every position,
    ``last`` for the last one only (the next token after the sequence)."""

    def __init__(self, positions: Literal["all", "last"] = "all") -> None:
        self.positions = positions

    def target(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.positions == "last":
            return y
        return torch.cat([x[:, 1:], y.reshape(-1, 1)], dim=1)

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return next_token_losses(output, target)

    def hits(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        right = (output.argmax(dim=-1) == target).to(torch.float32)
        return right if right.dim() == 1 else right.mean(dim=1)

    def output_shape(self, batch: int, input_shape: tuple[int, ...], num_classes: int
                     ) -> tuple[int, ...]:
        if self.positions == "last":
            return (batch, num_classes)
        return (batch, *input_shape, num_classes)

    def metrics(self, loss: float, accuracy: float | None) -> dict[str, float]:
        return {**super().metrics(loss, accuracy),
                "perplexity": math.exp(loss) if loss < 700 else float("inf")}


class Regression(Task):
    """Real-valued targets: mean squared error (the ``loss`` metric); no accuracy. The model's
    ``num_classes`` is the number of outputs (1 for a scalar target)."""

    traits = Traits(targets="values")

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return squared_errors(output, target)
