"""The model plugins addressed by name; input shape and class count come from the dataset.

A model plugin's constructor takes ``input_shape`` and ``num_classes`` (listed in ``traits.context``,
supplied by the engine) and then its own scenario keys. docs/models.md lists each model's
parameters, FLOPs per sample and time per local epoch.

Normalisation layers (``norm``): ``batch`` has running statistics, buffers that travel with
the parameters under ``server.buffers`` (docs/models.md); ``group`` (GroupNorm, Wu and He,
ECCV 2018) has none, which is why robust-FL papers prefer it (Hsieh et al., ICML 2020).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import torch
from annotated_types import Ge, Len
from torch import nn

from strategies.protocols import Model, Traits


class _Sequential(Model):
    """A model that is its Sequential ``net``: ``forward`` applies it, and ``chain()`` says
    so (the vectorised trainer's batched kernels)."""

    net: nn.Sequential

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def chain(self) -> nn.Sequential:
        return self.net


class LogisticRegression(_Sequential):
    """Multinomial logistic regression: one linear layer on the flattened input."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


class MLP(_Sequential):
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


def norm_layer(norm: str, channels: int, groups: int) -> list[nn.Module]:
    """The normalisation after a convolution: none, BatchNorm2d, or GroupNorm of ``groups``
    groups (``groups`` must divide ``channels``)."""
    if norm == "batch":
        return [nn.BatchNorm2d(channels)]
    if norm == "group":
        if channels % groups:
            raise ValueError(f"groups: must divide every layer's channels; {groups} does not "
                             f"divide {channels}")
        return [nn.GroupNorm(groups, channels)]
    return []


def _image(name: str, input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ValueError(f"model: {name} needs image input (C, H, W); the dataset gives shape "
                         f"{tuple(input_shape)}")
    c, h, w = input_shape
    return c, h, w


class CNN(_Sequential):
    """Convolution blocks (3x3, ``norm``, ReLU, 2x2 max-pool when the map is large enough),
    then a hidden fully connected layer. Needs image input ``(C, H, W)``."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        channels: Annotated[list[Annotated[int, Ge(1)]], Len(1, 4)] = [16, 32],  # noqa: B006
        hidden: Annotated[int, Ge(1)] = 64,
        norm: Literal["none", "batch", "group"] = "none",
        groups: Annotated[int, Ge(1)] = 2,
    ) -> None:
        super().__init__()
        c, h, w = _image("cnn", input_shape)
        layers: list[nn.Module] = []
        for out in channels:
            layers += [nn.Conv2d(c, out, 3, padding=1, bias=norm == "none"),
                       *norm_layer(norm, out, groups), nn.ReLU()]
            if min(h, w) >= 4:
                layers.append(nn.MaxPool2d(2))
                h, w = h // 2, w // 2
            c = out
        layers += [nn.Flatten(), nn.Linear(c * h * w, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)]
        self.net = nn.Sequential(*layers)


class FemnistCNN(_Sequential):
    """LEAF's FEMNIST model (Caldas et al., 2018, models/femnist/cnn.py): two 5x5 "same"
    convolutions of 32 and 64 channels, each with ReLU and a 2x2 max-pool, a dense layer of
    2048 units and the class head; 6.6 M parameters on 28 x 28 images with 62 classes."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = _image("femnist_cnn", input_shape)
        if min(h, w) < 4:
            raise ValueError(f"model: femnist_cnn pools twice; images of {h} x {w} are too small")
        self.net = nn.Sequential(
            nn.Conv2d(c, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(64 * (h // 4) * (w // 4), 2048), nn.ReLU(), nn.Linear(2048, num_classes))


class SimpleCNN(_Sequential):
    """pfl-research's CIFAR-10 benchmark CNN (``simple_cnn``, the Keras CIFAR-10 example's):
    two 3x3 valid convolutions of 32 and 64 channels with ReLU, one 2x2 max-pool, a dense
    layer of 128 units and the class head; 1,626,442 parameters on 3 x 32 x 32 images with 10
    classes. Departs from pfl's in leaving out its two dropout layers (0.25, 0.5): fedray's
    clients draw no randomness outside their seeded generators, so a run's numbers do not
    depend on which worker trains a client."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = _image("simple_cnn", input_shape)
        if min(h, w) < 6:
            raise ValueError(f"model: simple_cnn needs images of at least 6 x 6, got {h} x {w}")
        self.net = nn.Sequential(
            nn.Conv2d(c, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * ((h - 4) // 2) * ((w - 4) // 2), 128), nn.ReLU(),
            nn.Linear(128, num_classes))


class _Block(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with ``norm`` and a shortcut, which is
    the identity, a 1x1 convolution (option B) or, for ResNet-20, the subsampled input
    with zero channels added (option A, He et al. 2016, section 4.2)."""

    def __init__(self, c_in: int, c_out: int, stride: int, norm: str, groups: int,
                 shortcut: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=norm == "none")
        self.n1 = nn.Sequential(*norm_layer(norm, c_out, groups))
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=norm == "none")
        self.n2 = nn.Sequential(*norm_layer(norm, c_out, groups))
        self.pad = 0
        self.stride = stride
        self.short: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            if shortcut == "pad":
                self.pad = c_out - c_in
            else:
                self.short = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=norm == "none"),
                                           *norm_layer(norm, c_out, groups))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.n1(self.conv1(x)))
        out = self.n2(self.conv2(out))
        if self.pad:
            s = x[:, :, :: self.stride, :: self.stride]
            short = nn.functional.pad(s, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))
        else:
            short = self.short(x)
        return torch.relu(out + short)


class _ResNet(Model):
    """A CIFAR-form ResNet: a 3x3 stem (no max-pool), stages of basic blocks (the first of
    each later stage halves the map), global average pooling and the class head."""

    WIDTHS: tuple[int, ...] = ()
    BLOCKS: tuple[int, ...] = ()
    SHORTCUT = "conv"
    NAME = ""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int,
                 norm: Literal["batch", "group", "none"] = "batch",
                 groups: Annotated[int, Ge(1)] = 2) -> None:
        super().__init__()
        c, _, _ = _image(self.NAME, input_shape)
        w0 = self.WIDTHS[0]
        self.stem = nn.Sequential(nn.Conv2d(c, w0, 3, 1, 1, bias=norm == "none"),
                                  *norm_layer(norm, w0, groups), nn.ReLU())
        blocks: list[nn.Module] = []
        c_in = w0
        for i, (width, n) in enumerate(zip(self.WIDTHS, self.BLOCKS)):
            for j in range(n):
                blocks.append(_Block(c_in, width, 2 if i > 0 and j == 0 else 1, norm, groups,
                                     self.SHORTCUT))
                c_in = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.blocks(self.stem(x))
        return self.head(out.mean(dim=(2, 3)))


class ResNet18(_ResNet):
    """ResNet-18 in its CIFAR form (He et al., CVPR 2016; the 3x3 stem without max-pool of
    the common CIFAR implementations): stages of 64/128/256/512 channels, two basic blocks
    each, 1x1-convolution shortcuts; 11.2 M parameters. ``norm``: batch (the paper's) or
    group (``groups`` groups)."""

    WIDTHS, BLOCKS, NAME = (64, 128, 256, 512), (2, 2, 2, 2), "resnet18"


class ResNet20(_ResNet):
    """ResNet-20 (He et al., CVPR 2016, section 4.2): three stages of 16/32/64 channels,
    three basic blocks each, zero-padding shortcuts (option A); 0.27 M parameters."""

    WIDTHS, BLOCKS, SHORTCUT, NAME = (16, 32, 64), (3, 3, 3), "pad", "resnet20"


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
    ``hidden`` units, and a linear head: on the last position (``positions: last``; scores
    ``(b, classes)``: the next character, or the class of a text), or on every position
    (``all``; scores ``(b, sequence, classes)`` for the ``next_token`` task). Takes token
    ids ``(b, sequence)``."""

    traits = Traits(context=("input_shape", "num_classes", "vocabulary"), tokens=True)

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, vocabulary: int | None,
                 embedding: Annotated[int, Ge(1)] = 8, hidden: Annotated[int, Ge(1)] = 256,
                 layers: Annotated[int, Ge(1)] = 2,
                 positions: Literal["last", "all"] = "last") -> None:
        super().__init__()
        if len(input_shape) != 1:
            raise ValueError(f"model: char_lstm needs token sequences (length,); the dataset "
                             f"gives shape {tuple(input_shape)}")
        if vocabulary is None:
            raise ValueError("model: char_lstm needs token data (a vocabulary of token ids)")
        self.embed = nn.Embedding(vocabulary, embedding)
        self.lstm = nn.LSTM(embedding, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)
        self.all = positions == "all"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(x))
        return self.head(out if self.all else out[:, -1])
