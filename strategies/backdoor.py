"""Targeted (backdoor) attacks: the Byzantine clients train on poisoned samples so that the
global model keeps its clean accuracy but maps inputs carrying a trigger (or inputs of one
chosen class) to the attacker's ``target`` label.

Four attacks, each a class (an :class:`Attack` whose constructor arguments are its scenario
keys) and the pure functions it calls:

* :class:`PixelBackdoor` / :func:`square_trigger`, :func:`backdoor_poison`: a square pixel
  pattern in the bottom-right corner (Gu et al. 2017, BadNets; Bagdasaryan et al. 2020);
* :class:`DistributedBackdoor` / :func:`dba_parts`: the trigger split into local patterns,
  one per Byzantine client (Xie et al., ICLR 2020, DBA);
* :class:`ModelReplacement` / :func:`boost_and_constrain`: the pixel backdoor with the update
  boosted (and projected onto a norm bound) so it survives averaging (Bagdasaryan et al.,
  AISTATS 2020);
* :class:`EdgeCaseBackdoor` / :func:`relabel_class`: no trigger, one class relabelled
  (Wang et al., NeurIPS 2020, semantic variant).

The contract (:class:`BackdoorAttack`) extends :class:`Attack`: a backdoor changes the
Byzantine clients' samples *and* labels, so it poisons through :meth:`BackdoorAttack.poison`
rather than ``poison_labels``, and it gives the server the test set of its attack success
rate through :meth:`BackdoorAttack.triggered`.

Inputs are what a model takes (``simulator.runtime.common.model_input``): float32, images
``(n, C, H, W)`` with pixels scaled to [0, 1] (uint8 images divided by 255, scikit-learn's
digits by 16), so a trigger pixel's default value 1.0 is the brightest pixel. A trigger is a
boolean mask over the input's pixel grid (:func:`trigger_grid`), the same for every channel.
Nothing here modifies its inputs; randomness comes from the ``generator`` argument only.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import Annotated

import torch
from annotated_types import Ge, Gt, Le, Lt

from strategies.protocols import Attack, DatasetInfo, Traits

__all__ = [
    "BackdoorAttack",
    "DistributedBackdoor",
    "EdgeCaseBackdoor",
    "ModelReplacement",
    "PixelBackdoor",
    "backdoor_poison",
    "boost_and_constrain",
    "class_test_set",
    "dba_part",
    "dba_parts",
    "poison_indices",
    "relabel_class",
    "square_trigger",
    "stamp_trigger",
    "trigger_grid",
    "triggered_set",
]

# a class id or a trigger size (a plugin's integer keys are bounded, as the schema's are)
_Label = Annotated[int, Ge(0), Lt(2**31)]
_Pixels = Annotated[int, Ge(1), Lt(2**31)]


# ---------------------------------------------------------------------------- triggers


def trigger_grid(input_shape: tuple[int, ...]) -> tuple[int, int]:
    """The ``(H, W)`` pixel grid of one sample of shape ``input_shape``: the last two
    dimensions of an image (``(C, H, W)`` or ``(H, W)``); a flat sample ``(d,)`` is a square
    image ``(s, s)`` stored row by row when ``d = s * s`` (a flattened 8x8 digit), otherwise
    one row of ``d`` pixels ``(1, d)``.

    >>> trigger_grid((3, 32, 32)), trigger_grid((64,)), trigger_grid((10,))
    ((32, 32), (8, 8), (1, 10))
    """
    if len(input_shape) >= 2:
        return int(input_shape[-2]), int(input_shape[-1])
    if len(input_shape) != 1:
        raise ValueError(f"input: a sample needs at least one dimension, got {input_shape}")
    d = int(input_shape[0])
    s = math.isqrt(d)
    return (s, s) if s * s == d else (1, d)


def square_trigger(grid: tuple[int, int], size: int) -> torch.Tensor:
    """The ``(H, W)`` boolean mask of a ``size`` x ``size`` square in the bottom-right corner
    of the grid (BadNets' pattern), clipped to the grid (``min(size, H)`` rows, ``min(size,
    W)`` columns: a one-row grid gets the last ``size`` pixels).

    >>> square_trigger((4, 4), 2).int()
    tensor([[0, 0, 0, 0],
            [0, 0, 0, 0],
            [0, 0, 1, 1],
            [0, 0, 1, 1]], dtype=torch.int32)
    """
    h, w = grid
    mask = torch.zeros((h, w), dtype=torch.bool)
    mask[h - min(size, h):, w - min(size, w):] = True
    return mask


def dba_parts(grid: tuple[int, int], size: int, parts: int, gap: int = 0) -> torch.Tensor:
    """DBA's local triggers as a ``(parts, H, W)`` boolean stack (Xie et al., ICLR 2020):
    ``parts`` horizontal bars of ``min(size, W)`` pixels at the right edge, one bar per part,
    ``gap`` empty rows between consecutive bars, the last bar on the bottom row. The parts
    are disjoint and their union (``.any(0)``) is the global trigger.

    >>> dba_parts((4, 4), 2, 2, gap=1).any(0).int()
    tensor([[0, 0, 0, 0],
            [0, 0, 1, 1],
            [0, 0, 0, 0],
            [0, 0, 1, 1]], dtype=torch.int32)
    """
    h, w = grid
    rows = parts + (parts - 1) * gap
    if rows > h:
        raise ValueError(f"parts: {parts} bars with gap {gap} need {rows} rows, the "
                         f"input's pixel grid is {h} x {w}")
    masks = torch.zeros((parts, h, w), dtype=torch.bool)
    bars = torch.arange(parts)
    masks[bars, h - rows + bars * (gap + 1), w - min(size, w):] = True
    return masks


def dba_part(grid: tuple[int, int], size: int, parts: int, part: int, gap: int = 0
             ) -> torch.Tensor:
    """The ``(H, W)`` mask of local trigger ``part`` (0 <= part < parts) of :func:`dba_parts`."""
    if not 0 <= part < parts:
        raise ValueError(f"part: must be in 0..{parts - 1}, got {part}")
    return dba_parts(grid, size, parts, gap)[part]


def stamp_trigger(x: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    """A new tensor: the samples ``x`` ``(n, *input_shape)`` with every pixel of ``mask``
    (``(H, W)`` over :func:`trigger_grid` of the input shape) set to ``value`` in every
    channel, all other entries unchanged."""
    grid = trigger_grid(tuple(x.shape[1:]))
    if tuple(mask.shape) != grid:
        raise ValueError(f"trigger: a {tuple(mask.shape)} mask for inputs of shape "
                         f"{tuple(x.shape[1:])}, whose pixel grid is {grid}")
    where = mask.to(x.device)
    if x.dim() == 2:  # flat samples: the grid stored row by row
        where = where.reshape(-1)
    return torch.where(where, torch.tensor(value, dtype=x.dtype, device=x.device), x)


# ---------------------------------------------------------------------------- poisoning


def poison_indices(n: int, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """The sorted int64 indices of the ``round(fraction * n)`` samples (halves rounded up)
    chosen uniformly without replacement from ``n``, drawn from ``generator`` (one
    ``randperm(n)`` whatever ``fraction`` is, so the stream advances the same way)."""
    count = min(n, math.floor(fraction * n + 0.5))
    order = torch.randperm(n, generator=generator, device=generator.device)
    return torch.sort(order[:count].cpu()).values


def _check_label(key: str, label: int, num_classes: int) -> None:
    if label >= num_classes:
        raise ValueError(f"{key}: must be < num_classes = {num_classes}, got {label}")


def backdoor_poison(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, value: float,
                    target: int, fraction: float, generator: torch.Generator
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """New ``(x, y)``: the samples of :func:`poison_indices` with the trigger ``mask``
    stamped (:func:`stamp_trigger`) and their label set to ``target``; the others copied
    unchanged (BadNets' poisoned training set, Gu et al. 2017)."""
    idx = poison_indices(int(y.shape[0]), fraction, generator).to(x.device)
    x_out, y_out = x.clone(), y.clone()
    x_out[idx] = stamp_trigger(x[idx], mask, value)
    y_out[idx.to(y.device)] = target
    return x_out, y_out


def triggered_set(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, value: float,
                  target: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The attack-success test set: the samples whose label is not ``target``, trigger
    stamped, every label ``target`` (a model's accuracy on it is the attack success rate)."""
    keep = y != target
    return stamp_trigger(x[keep.to(x.device)], mask, value), torch.full_like(y[keep], target)


def relabel_class(x: torch.Tensor, y: torch.Tensor, source: int, target: int, fraction: float,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """New ``(x, y)``: of the samples labelled ``source``, the ``round(fraction * m)``
    (:func:`poison_indices` over those ``m``) relabelled ``target``; ``x`` copied unchanged
    (no trigger)."""
    where = torch.nonzero(y == source).reshape(-1)
    chosen = where[poison_indices(int(where.numel()), fraction, generator).to(where.device)]
    y_out = y.clone()
    y_out[chosen] = target
    return x.clone(), y_out


def class_test_set(x: torch.Tensor, y: torch.Tensor, source: int, target: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The semantic backdoor's test set: the samples labelled ``source`` (a copy), every
    label ``target``."""
    keep = y == source
    return x[keep.to(x.device)], torch.full_like(y[keep], target)


def boost_and_constrain(own: torch.Tensor, boost: float, norm_bound: float | None = None
                        ) -> torch.Tensor:
    """``(f, d)`` rows ``boost * own``, each scaled down to L2 norm ``norm_bound`` when its
    norm is larger (None: no bound). Model replacement's scaling (Bagdasaryan et al.,
    AISTATS 2020, Eq. 3: gamma (X - G) with gamma = n / eta) and its norm-bound evasion
    (the largest gamma with ``||gamma (X - G)|| <= S``; Sun et al. 2019's adaptive attacker).
    A non-finite row stays non-finite (it has no norm to scale to).

    >>> boost_and_constrain(torch.tensor([[3.0, 4.0], [0.3, 0.4]]), 2.0, norm_bound=5.0)
    tensor([[3.0000, 4.0000],
            [0.6000, 0.8000]])
    """
    rows = own * boost
    if norm_bound is None:
        return rows
    norms = torch.linalg.vector_norm(rows, dim=1, keepdim=True)
    over = norms > norm_bound
    scale = norm_bound / torch.where(over, norms, torch.ones((), dtype=norms.dtype))
    return torch.where(over, rows * scale, rows)


# ---------------------------------------------------------------------------- the contract


class BackdoorAttack(Attack):
    """A targeted (backdoor) attack: the Byzantine clients train on poisoned samples and
    labels (``traits.data_poisoning``), and the server measures the attack's success on a
    test set the attack builds.

    The contract, in the order the engine uses it:

    * ``poison(x, y, attacker, round_, num_classes, generator) -> (x, y)``: the training
      data of round ``round_`` of the ``attacker``-th Byzantine client (its index among
      them, by id), called on the worker before training
      in place of ``poison_labels``. ``x`` is float32 ``(n, *input_shape)`` as the model takes
      it (images ``(n, C, H, W)`` in [0, 1]; flat ``(n, d)``: see :func:`trigger_grid`),
      ``y`` the int64 labels ``(n,)``. Returns new tensors (never ``x`` or ``y`` themselves,
      nor views of them: the trainer may write into what it gets), with the same
      shapes and dtypes and labels in ``0..num_classes-1``. Draws only from ``generator``
      (give it a stream of its own, so poisoning does not shift the training stream).
      Raises ``ValueError("target: ...")`` when a class key is not below ``num_classes``.
    * ``__call__(own, f, generator) -> (f, d)``: the rows the Byzantine clients send, from
      ``own``, their updates honestly trained on the poisoned data (rows in client order):
      the updates themselves for plain data poisoning, scaled for model replacement.
    * ``triggered(x_test, y_test) -> (x, y)``: the attack-success test set, built from the
      clean test set (same layout as ``poison``'s inputs): the samples the backdoor should
      move (for a trigger: every sample whose true label is not ``target``), with the full
      trigger stamped, every label ``target``. The attack success rate (ASR) is the global
      model's accuracy on it. Pure and deterministic: the server may build it once.
    * ``poison_labels``: refused (a backdoor rewrites samples, not only labels).

    Keys every backdoor has: ``target``, the label the backdoor maps to, and
    ``poison_fraction``, the fraction of the poisoned samples (of a client's samples, or of
    the samples an attack can poison: see the class).
    """

    traits = Traits(data_poisoning=True, targeted=True)

    def check_data(self, info: DatasetInfo) -> None:
        """``target`` below the data's classes (class labels only: a backdoor maps samples
        to a class)."""
        _check_label("target", self.target, info.num_classes)

    def __init__(self, target: _Label = 0,
                 poison_fraction: Annotated[float, Ge(0), Le(1)] = 0.5) -> None:
        self.target = target
        self.poison_fraction = poison_fraction

    @abstractmethod
    def poison(self, x: torch.Tensor, y: torch.Tensor, attacker: int, round_: int,
               num_classes: int, generator: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``attacker``-th Byzantine client's poisoned training ``(x, y)`` in round
        ``round_``."""

    @abstractmethod
    def triggered(self, x_test: torch.Tensor, y_test: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attack-success test set ``(x, y)`` from the clean test set."""

    def __call__(self, own: torch.Tensor, f: int, generator: torch.Generator) -> torch.Tensor:
        """The updates trained on the poisoned data, unchanged (a copy)."""
        return own.clone()

    def poison_labels(self, y: torch.Tensor, num_classes: int) -> torch.Tensor:
        raise NotImplementedError(
            f"{type(self).__name__} is a backdoor attack: it rewrites samples and labels "
            "together through poison(x, y, attacker, round_, num_classes, generator)")


# ---------------------------------------------------------------------------- plugins


class PixelBackdoor(BackdoorAttack):
    """Pixel-pattern backdoor (Gu, Dolan-Gavitt, Garg, "BadNets", arXiv:1708.06733, 2017;
    the federated setting of Bagdasaryan et al., AISTATS 2020): each Byzantine client stamps
    a ``size`` x ``size`` square of pixels of value ``value`` (every channel) in the
    bottom-right corner of a random ``poison_fraction`` of its samples and labels them
    ``target`` (:func:`backdoor_poison`), then sends its honestly trained updates.

    Departures: BadNets also uses a single-pixel trigger and other patterns; here the square
    (the default 3x3, clipped to small inputs) is the one pattern. ``value`` defaults to 1.0,
    the brightest pixel of fedray's [0, 1] image scaling. The poisoned samples replace clean
    ones (the count is ``poison_fraction`` of the client's samples, redrawn every round).
    """

    def __init__(self, target: _Label = 0,
                 poison_fraction: Annotated[float, Ge(0), Le(1)] = 0.5,
                 size: _Pixels = 3, value: float = 1.0) -> None:
        super().__init__(target, poison_fraction)
        self.size = size
        self.value = value

    def local_trigger(self, input_shape: tuple[int, ...], attacker: int) -> torch.Tensor:
        """The ``(H, W)`` mask the ``attacker``-th Byzantine client stamps when training."""
        return self.global_trigger(input_shape)

    def trigger_extent(self) -> tuple[int, int]:
        """The (rows, columns) of the pixel grid the full trigger covers: what an image
        must hold for it to fit unclipped."""
        return self.size, self.size

    def check_data(self, info: DatasetInfo) -> None:
        """The data must be images (``(C, H, W)`` or ``(H, W)``; a trigger has no meaning
        on features or token ids) whose pixel grid holds the whole trigger (no clipping:
        a 9 x 9 square on 8 x 8 images is not the pattern asked for)."""
        super().check_data(info)
        if not info.images:
            raise ValueError(f"name: a pixel trigger needs images (samples of shape (C, H, W) "
                             f"or (H, W)); the data's samples are {info.kind} (a Parquet "
                             "data set of images says so with its shape key, [1, 28, 28])")
        self.global_trigger(info.input_shape)  # the pattern's own bounds (DBA's parts)
        h, w = trigger_grid(info.input_shape)
        rows, cols = self.trigger_extent()
        if rows > h or cols > w:
            square = (rows, cols) == (self.size, self.size)
            raise ValueError(f"size: a trigger of {rows} x {cols} pixels does not fit the "
                             f"data's {h} x {w} images; size must be at most "
                             f"{min(h, w) if square else w}, got {self.size}")

    def global_trigger(self, input_shape: tuple[int, ...]) -> torch.Tensor:
        """The ``(H, W)`` mask of the full trigger (the one the test set carries)."""
        return square_trigger(trigger_grid(input_shape), self.size)

    def poison(self, x: torch.Tensor, y: torch.Tensor, attacker: int, round_: int,
               num_classes: int, generator: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_label("target", self.target, num_classes)
        mask = self.local_trigger(tuple(x.shape[1:]), attacker)
        return backdoor_poison(x, y, mask, self.value, self.target, self.poison_fraction,
                               generator)

    def triggered(self, x_test: torch.Tensor, y_test: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        return triggered_set(x_test, y_test, self.global_trigger(tuple(x_test.shape[1:])),
                             self.value, self.target)


class DistributedBackdoor(PixelBackdoor):
    """Distributed backdoor attack, DBA (Xie, Huang, Chen, Li, "DBA: Distributed Backdoor
    Attacks against Federated Learning", ICLR 2020): the global trigger is ``parts``
    horizontal bars of ``size`` pixels at the right edge, ``gap`` rows apart
    (:func:`dba_parts`); the ``i``-th Byzantine client (by id, ``attacker`` in
    :meth:`poison`) trains with local trigger ``i mod parts`` only, as the paper assigns
    its parts to its attackers in order, and the attack is tested with the union of the
    parts (the full trigger).

    Departures: the paper places its four local patterns in a 2x2 layout with tunable gaps
    and shifts; here the bars are stacked in one column at the bottom-right corner (``gap``
    is the paper's trigger gap along the rows). With fewer Byzantine clients than ``parts``
    some parts are never trained. The paper's scale factor is :class:`ModelReplacement`'s, not
    applied here (the updates are sent unchanged).
    """

    def __init__(self, target: _Label = 0,
                 poison_fraction: Annotated[float, Ge(0), Le(1)] = 0.5,
                 size: _Pixels = 3, value: float = 1.0, parts: _Pixels = 4,
                 gap: Annotated[int, Ge(0), Lt(2**31)] = 0) -> None:
        super().__init__(target, poison_fraction, size, value)
        self.parts = parts
        self.gap = gap

    def local_trigger(self, input_shape: tuple[int, ...], attacker: int) -> torch.Tensor:
        return dba_part(trigger_grid(input_shape), self.size, self.parts,
                        attacker % self.parts, self.gap)

    def global_trigger(self, input_shape: tuple[int, ...]) -> torch.Tensor:
        return dba_parts(trigger_grid(input_shape), self.size, self.parts, self.gap).any(0)

    def trigger_extent(self) -> tuple[int, int]:
        """``parts`` bars ``gap`` rows apart, each ``size`` pixels long."""
        return self.parts + (self.parts - 1) * self.gap, self.size


class ModelReplacement(PixelBackdoor):
    """Model replacement (Bagdasaryan, Veit, Hua, Estrin, Shmatikov, "How To Backdoor
    Federated Learning", AISTATS 2020): the pixel backdoor's poisoned training
    (:class:`PixelBackdoor`), then each update is boosted by ``boost`` (the paper's
    gamma = n / eta, so the boosted update replaces the global model under plain averaging)
    and, with a ``norm_bound`` S, scaled down to L2 norm S when larger
    (:func:`boost_and_constrain`; the largest boost that passes a norm-bounding defence, the
    adaptive attacker of Sun et al., "Can You Really Backdoor Federated Learning?", 2019).

    Departures: the paper's constrain-and-scale trains with an anomaly-detection term in
    the loss (``alpha L_class + (1 - alpha) L_ano``, a distance to the global model); here
    the constraint is a projection of the boosted update onto the norm ball, after honest
    training on the poisoned data. ``boost`` has the default 10 (n / eta of the paper's
    setting is for the scenario to give). The paper attacks in chosen rounds; here every
    round the Byzantine clients are sampled.
    """

    def __init__(self, target: _Label = 0,
                 poison_fraction: Annotated[float, Ge(0), Le(1)] = 0.5,
                 size: _Pixels = 3, value: float = 1.0,
                 boost: Annotated[float, Gt(0)] = 10.0,
                 norm_bound: Annotated[float, Gt(0)] | None = None) -> None:
        super().__init__(target, poison_fraction, size, value)
        self.boost = boost
        self.norm_bound = norm_bound

    def __call__(self, own: torch.Tensor, f: int, generator: torch.Generator) -> torch.Tensor:
        """``boost * own``, each row projected onto the ``norm_bound`` ball."""
        return boost_and_constrain(own, self.boost, self.norm_bound)


class EdgeCaseBackdoor(BackdoorAttack):
    """Semantic edge-case backdoor (Wang, Sreenivasan, Rajput, Vishwakarma, Agarwal, Sohn,
    Lee, Papailiopoulos, "Attack of the Tails: Yes, You Really Can Backdoor Federated
    Learning", NeurIPS 2020): no trigger; each Byzantine client relabels a random
    ``poison_fraction`` of its samples of class ``source`` as ``target``
    (:func:`relabel_class`), and the attack succeeds when the global model classifies the
    test samples of ``source`` as ``target`` (:func:`class_test_set`). The defaults follow
    the paper's EMNIST task (sevens labelled one).

    Departures: the paper's edge cases come from the tail of the input distribution (ARDIS
    sevens, Southwest airplanes) mixed into the attacker's clean data; here they are the
    ``source`` class of the data set itself, so the backdoor competes with the honest
    clients' samples of that class. ``poison_fraction`` is of the ``source`` samples
    (default 1.0: all). The paper's projected-gradient variant is not implemented (the
    updates are sent unchanged).
    """

    def __init__(self, target: _Label = 1,
                 poison_fraction: Annotated[float, Ge(0), Le(1)] = 1.0,
                 source: _Label = 7) -> None:
        super().__init__(target, poison_fraction)
        self.source = source

    def check(self, n: int) -> None:
        if self.source == self.target:
            raise ValueError(f"source: must differ from target = {self.target}, "
                             f"got {self.source}")

    def check_data(self, info: DatasetInfo) -> None:
        """``target`` and ``source`` below the data's classes."""
        super().check_data(info)
        _check_label("source", self.source, info.num_classes)

    def poison(self, x: torch.Tensor, y: torch.Tensor, attacker: int, round_: int,
               num_classes: int, generator: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_label("target", self.target, num_classes)
        _check_label("source", self.source, num_classes)
        return relabel_class(x, y, self.source, self.target, self.poison_fraction, generator)

    def triggered(self, x_test: torch.Tensor, y_test: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        return class_test_set(x_test, y_test, self.source, self.target)
