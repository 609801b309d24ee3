"""Small torch models addressed by name; input shape and class count come from the dataset.

A model plugin's constructor takes ``input_shape`` and ``num_classes`` (listed in ``traits.context``,
supplied by the engine) and then its own scenario keys.
"""

from __future__ import annotations

import math
from typing import Annotated

import torch
from annotated_types import Ge, Len
from torch import nn

from strategies.protocols import Model, Traits


class LogisticRegression(Model):
    """Multinomial logistic regression: one linear layer on the flattened input."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class MLP(Model):
    """Fully connected network with ReLU hidden layers of the given widths."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        hidden: Annotated[list[Annotated[int, Ge(1)]], Len(1, 8)] = [64],  # noqa: B006
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(Model):
    """Two 3x3 convolution blocks (ReLU, 2x2 max-pool when the map is large enough), then a
    hidden fully connected layer. Needs image input ``(C, H, W)``."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        channels: Annotated[list[Annotated[int, Ge(1)]], Len(1, 4)] = [16, 32],  # noqa: B006
        hidden: Annotated[int, Ge(1)] = 64,
    ) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(
                f"model: cnn needs image input (C, H, W); the dataset gives shape {tuple(input_shape)}"
            )
        c, h, w = input_shape
        layers: list[nn.Module] = []
        for out in channels:
            layers += [nn.Conv2d(c, out, 3, padding=1), nn.ReLU()]
            if min(h, w) >= 4:
                layers.append(nn.MaxPool2d(2))
                h, w = h // 2, w // 2
            c = out
        layers += [nn.Flatten(), nn.Linear(c * h * w, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build_model(spec: dict, input_shape: tuple[int, ...], num_classes: int, seed: int,
                vocabulary: int | None = None) -> nn.Module:
    """Instantiate the model plugin ``spec = {"name": ..., **params}`` with weights drawn from
    ``seed`` (the process's global torch RNG is left as it was)."""
    from simulator import registry

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: nn.Module = registry.instantiate("models", spec, input_shape=tuple(input_shape),
                                                num_classes=num_classes, vocabulary=vocabulary)
        return model


class CharLSTM(Model):
    """LEAF's Shakespeare model (Caldas et al. 2018): an embedding of ``embedding``
    dimensions per token id (the data's ``vocabulary``), a ``layers``-layer LSTM of
    ``hidden`` units, and a linear head on the last position: the next character, or the
    class of a text. Takes token ids ``(b, sequence)``."""

    TOKENS = True
    traits = Traits(context=("input_shape", "num_classes", "vocabulary"))

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, vocabulary: int | None,
                 embedding: Annotated[int, Ge(1)] = 8, hidden: Annotated[int, Ge(1)] = 256,
                 layers: Annotated[int, Ge(1)] = 2) -> None:
        super().__init__()
        if len(input_shape) != 1:
            raise ValueError(f"model: char_lstm needs token sequences (length,); the dataset "
                             f"gives shape {tuple(input_shape)}")
        if vocabulary is None:
            raise ValueError("model: char_lstm needs token data (a vocabulary of token ids)")
        self.embed = nn.Embedding(vocabulary, embedding)
        self.lstm = nn.LSTM(embedding, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(x))
        return self.head(out[:, -1])
