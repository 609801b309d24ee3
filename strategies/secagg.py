"""Secure aggregation over groups, simulated faithfully (``codecs: [{name: secagg, ...}]``).

The protocol of Bonawitz, Ivanov, Kreuter, Marcedone, McMahan, Patel, Ramage, Segal, Seth,
"Practical secure aggregation for privacy-preserving machine learning" (CCS 2017), with the
groups of SecAgg+ (Bell, Bonawitz, Gascón, Lepoint, Raykova, CCS 2020) and the robust
aggregation over group sums of So, Güler, Avestimehr ("Byzantine-resilient secure federated
learning", JSAC 2021; the bucketing of Karimireddy, He, Jaggi, ICLR 2022 has the same shape):

1. each round the step's rows (honest and Byzantine clients alike) are split into random
   groups of ``group_size`` (seeded by the round);
2. each client clips its row to ``[-range, range]`` and quantises it to fixed point modulo
   ``2^bits`` (:func:`to_fixed`: ``scale = floor((2^(bits-1) - 1) / g) / range``, so a group's
   sum cannot wrap);
3. it holds a key pair (:func:`public_key`: Diffie-Hellman in the multiplicative group
   modulo the Mersenne prime ``2^61 - 1``: a stand-in for X25519 with the same algebra, not
   its security), agrees a key with each group mate (:func:`agreed_key`), and adds the
   pairwise masks ``+PRG(k_ij)`` (``i < j``) and ``-PRG(k_ij)`` (``i > j``) and a self mask
   ``PRG(b_i)`` (:func:`masked`); it Shamir-shares its secret key and ``b_i`` among its
   mates, threshold ``t`` (:func:`share`);
4. the server sums the masked words of the group's survivors modulo ``2^bits``; it removes
   the survivors' self masks from ``t`` shares of each ``b_i`` and, for a client that dropped
   after masking, its pairwise masks with the survivors from ``t`` shares of its secret key
   (:func:`reconstruct`) — the recovery of SecAgg; fewer than ``t`` survivors lose the group
   (:func:`group_sum`);
5. the robust pipeline aggregates the group means: the only rows its server sees.

The masks cancel exactly, so a group's sum equals the plaintext fixed-point sum bit for bit
(a test checks it with 0, 1 and ``g - 1`` dropouts). Departure from a deployment: the
client half (quantise and mask) runs in the server actor on each row as it arrives, since a
client's masks need its group, drawn when the step's rows (honest and Byzantine) are known;
the numbers are those of clients masking their own rows. The masked words travel as 4-byte
words (``bits`` <= 32), the size of the float32 rows that cross the object store; the key
advertisements and the encrypted shares are charged to the simulated clock beside them
(:meth:`SecureAggregation.extra_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated

import numpy as np
import torch
from annotated_types import Ge, Gt, Le

from strategies.protocols import Codec, MessageShape

__all__ = ["PRIME", "GroupSum", "Keys", "SecureAggregation", "agreed_key", "from_fixed",
           "group_sum", "groups_of", "keys_of", "masked_group", "public_key", "reconstruct",
           "share", "to_fixed"]

PRIME = 2**61 - 1  # the field of the toy Diffie-Hellman and of Shamir's shares
GENERATOR = 3  # the base of the toy Diffie-Hellman (its algebra, not its security)
KEY_BYTES = 32  # an X25519 public key, as a deployment sends it
SHARE_BYTES = 60  # an encrypted share pair (two 16-byte shares, AES-GCM's nonce and tag)


def _seed(*parts: int) -> int:
    """A 63-bit seed from integers (SeedSequence, as every fedray draw)."""
    ss = np.random.SeedSequence([p & 0xFFFFFFFFFFFFFFFF for p in parts])
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def public_key(secret: int) -> int:
    """``GENERATOR^secret mod PRIME``."""
    return pow(GENERATOR, secret, PRIME)


def agreed_key(secret: int, other_public: int) -> int:
    """The key two clients agree: ``other_public^secret mod PRIME`` (the same from both
    sides: ``g^(a b)``)."""
    return pow(other_public, secret, PRIME)


def share(secret: int, xs: list[int], threshold: int, seed: int) -> list[int]:
    """Shamir's shares of ``secret`` at the points ``xs`` (non-zero, distinct), any
    ``threshold`` of which give it back (:func:`reconstruct`); the polynomial's other
    coefficients drawn from ``seed``."""
    coefficients = [secret % PRIME] + [_seed(seed, k) % PRIME for k in range(1, threshold)]
    out = []
    for x in xs:
        y = 0
        for c in reversed(coefficients):
            y = (y * x + c) % PRIME
        out.append(y)
    return out


def reconstruct(points: list[tuple[int, int]]) -> int:
    """The secret from shares ``(x, y)`` (Lagrange interpolation at 0 modulo PRIME).

    >>> reconstruct(list(zip([1, 2, 3], share(42, [1, 2, 3], 2, seed=7)))[1:])
    42
    """
    total = 0
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                num = num * (-xj) % PRIME
                den = den * (xi - xj) % PRIME
        total = (total + yi * num * pow(den, PRIME - 2, PRIME)) % PRIME
    return total


def _prg(key: int, width: int) -> torch.Tensor:
    """``width`` 32-bit words expanded from ``key``, as int32 (arithmetic on them wraps
    modulo 2^32, which ``2^bits`` divides): the halves of SFC64's raw output (a fast PRG
    standing in for SecAgg's AES-CTR; two words a draw)."""
    raw = np.random.SFC64(key & 0x7FFFFFFFFFFFFFFF).random_raw((width + 1) // 2)
    return torch.from_numpy(raw.view(np.int32)[:width].copy())


def _wrap(words: torch.Tensor) -> torch.Tensor:
    """Non-negative int64 words below 2^32 as the int32 of the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _unwrap(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words modulo 2^32 as non-negative int64 words modulo ``2^bits``."""
    return words.to(torch.int64) & (2**bits - 1)


def scale_of(bits: int, group: int, bound: float) -> float:
    """Fixed-point steps per unit: a group of ``group`` clipped rows sums within
    ``+-(2^(bits-1) - 1)``."""
    return math.floor((2 ** (bits - 1) - 1) / group) / bound


def to_fixed(rows: torch.Tensor, scale: float, bound: float, bits: int,
             clipped: torch.Tensor | None = None) -> torch.Tensor:
    """``rows`` clipped to ``[-bound, bound]`` (only the rows ``clipped`` marks, when given:
    a crafted payload's words need not come from a clipped row), times ``scale``, rounded
    to the nearest integer (ties to even), modulo ``2^bits`` (int64). A non-finite entry
    is no fixed-point number: NaN becomes 0, an infinity the largest value it may take."""
    x = torch.nan_to_num(rows.to(torch.float64), nan=0.0)
    bounded = x.clamp(-bound, bound)
    if clipped is not None:
        bounded = torch.where(clipped.unsqueeze(1), bounded, x)
    q = torch.round((bounded * scale).clamp(-(2.0**62), 2.0**62)).to(torch.int64)
    return q & (2**bits - 1)


def from_fixed(words: torch.Tensor, scale: float, bits: int) -> torch.Tensor:
    """Words modulo ``2^bits`` read as signed integers, over ``scale`` (float64)."""
    signed = torch.where(words >= 2 ** (bits - 1), words - 2**bits, words)
    return signed.to(torch.float64) / scale


def groups_of(n: int, size: int, seed: int) -> list[list[int]]:
    """A seeded random split of rows ``0..n-1`` into groups of ``size`` (the last ones
    smaller by one when ``size`` does not divide ``n``: ``ceil(n / size)`` groups as even
    as can be)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=g).tolist()
    count = max(1, math.ceil(n / size))
    sizes = [n // count + (1 if k < n % count else 0) for k in range(count)]
    out, at = [], 0
    for s in sizes:
        out.append(sorted(order[at:at + s]))
        at += s
    return out


@dataclass(frozen=True)
class Keys:
    """A group's key material: each member's secret key, public key and self-mask seed."""

    secret: list[int]
    public: list[int]
    self_seed: list[int]


def keys_of(members: list[int], seed: int) -> Keys:
    """The key material of a group's ``members`` (client ids), drawn from ``seed``."""
    secret = [_seed(seed, 1, m) % (PRIME - 1) + 1 for m in members]
    return Keys(secret, [public_key(s) for s in secret],
                [_seed(seed, 2, m) % PRIME for m in members])  # an element of the field


def masked_group(words: torch.Tensor, keys: Keys, bits: int) -> torch.Tensor:
    """Each group member's masked words (rows of ``words``, the members in order): its
    words plus its self mask, plus ``PRG(k_ij)`` for each later mate ``j``, minus it for
    each earlier one, modulo ``2^bits``. Each pair's mask is expanded once and given to both
    (the numbers each client computes alone)."""
    g, width = words.shape
    out = _wrap(words)
    for i in range(g):
        out[i].add_(_prg(keys.self_seed[i], width))
        for j in range(i + 1, g):
            m = _prg(agreed_key(keys.secret[i], keys.public[j]), width)
            out[i].add_(m)
            out[j].sub_(m)
    return _unwrap(out, bits)


@dataclass(frozen=True)
class GroupSum:
    """A group's unmasked sum (int64 words modulo ``2^bits``; None when too few survived
    to recover it) and its survivors (positions in the group)."""

    words: torch.Tensor | None
    survivors: list[int]


def group_sum(masked_rows: torch.Tensor, survivors: list[int], keys: Keys, threshold: int,
              bits: int, seed: int) -> GroupSum:
    """The server's half for one group: the survivors' masked words summed modulo
    ``2^bits``; each survivor's self mask removed with its seed rebuilt from ``threshold``
    survivors' shares; each dropped member's pairwise masks with the survivors removed with
    its secret key rebuilt likewise. ``masked_rows``: the survivors' rows, in ``survivors``
    order."""
    g = len(keys.secret)
    if len(survivors) < threshold:
        return GroupSum(None, survivors)
    xs = list(range(1, g + 1))
    holders = survivors[:threshold]
    width = masked_rows.shape[1]
    total = _wrap(masked_rows).sum(dim=0, dtype=torch.int32)  # wraps modulo 2^32
    for i in survivors:
        shares = share(keys.self_seed[i], xs, threshold, _seed(seed, 3, i))
        b = reconstruct([(xs[h], shares[h]) for h in holders])
        total.sub_(_prg(b, width))
    for j in (p for p in range(g) if p not in survivors):
        shares = share(keys.secret[j], xs, threshold, _seed(seed, 4, j))
        sk = reconstruct([(xs[h], shares[h]) for h in holders])
        for i in survivors:
            m = _prg(agreed_key(sk, keys.public[i]), width)
            # survivor i added +m for a later mate j, -m for an earlier one: take it away
            if i < j:
                total.sub_(m)
            else:
                total.add_(m)
    return GroupSum(_unwrap(total, bits), survivors)


class SecureAggregation(Codec):
    """Secure aggregation over random groups (see the module docstring): the robust
    pipeline aggregates each group's mean, never a client's row. ``group_size``: clients a
    group (null: one group of the whole step, plain SecAgg, where only an averaging rule is
    allowed); ``bits``: the modulus ``2^bits`` of the masked words (8 to 32); ``range``:
    each entry is clipped to ``[-range, range]`` before quantisation; ``threshold``: the
    fraction of a group whose shares recover a key (SecAgg+: a majority); ``dropout``: the
    chance a client drops after masking (seeded by round and row), recovered from the
    survivors' shares or, below the threshold, losing its group for the round.

    >>> c = SecureAggregation(group_size=2, bits=16, range=1.0)
    >>> rows = torch.tensor([[0.5, -0.25], [0.25, 0.25], [1.0, 0.0], [-1.0, 0.5]])
    >>> means, info = c.combine(rows, round_=0, seed=0)
    >>> means.shape, info["secagg_groups"]
    (torch.Size([2, 2]), 2.0)
    """

    def __init__(self, group_size: Annotated[int, Ge(1)] | None = None,
                 bits: Annotated[int, Ge(8), Le(32)] = 32,
                 range: Annotated[float, Gt(0)] = 1.0,
                 threshold: Annotated[float, Gt(0), Le(1)] = 0.5,
                 dropout: Annotated[float, Ge(0), Le(1)] = 0.0) -> None:
        self.group_size = group_size
        self.bits = bits
        self.bound = range
        self.threshold = threshold
        self.dropout = dropout

    def size(self, n: int) -> int:
        """Clients a group for a step of ``n`` rows."""
        return n if self.group_size is None else min(self.group_size, n)

    def output_rows(self, n: int) -> int:
        """Groups of a step of ``n`` rows: the rows the pipeline aggregates."""
        return max(1, math.ceil(n / self.size(n))) if n else 0

    def check(self, n: int) -> None:
        if self.group_size is not None and n and self.group_size > n:
            raise ValueError(f"group_size: must be <= the {n} rows of a step, got "
                             f"{self.group_size} (leave it out for one group of all)")
        g = self.size(n)
        steps = (2 ** (self.bits - 1) - 1) // g
        if steps < 2**7:
            raise ValueError(f"bits: 2^{self.bits} leaves a group of {g} only {steps} "
                             "fixed-point steps an entry (at least 128): raise bits or "
                             "lower group_size")

    def needs_rows(self) -> bool:
        return True

    def hides_rows(self) -> bool:
        return True

    def reach(self, rows: torch.Tensor, shape: MessageShape) -> torch.Tensor:
        """The rows as they are: the clip a crafted payload skips is in :meth:`combine`."""
        return rows

    def extra_bytes(self, shape: MessageShape, n: int) -> int:
        """Each client's protocol bytes beside its masked words: two public keys, then an
        encrypted share pair for each group mate (SecAgg's AdvertiseKeys and ShareKeys),
        and in the unmasking round a share for each mate."""
        mates = max(0, self.size(n) - 1)
        return 2 * KEY_BYTES + mates * SHARE_BYTES + mates * SHARE_BYTES // 2

    def threshold_of(self, g: int) -> int:
        return max(1, min(g, math.floor(self.threshold * g) + 1))

    def combine(self, rows: torch.Tensor, round_: int, seed: int, crafted: int = 0
                ) -> tuple[torch.Tensor, dict[str, float]]:
        """The group means ``(G', w)`` float32 of the step's dense ``rows`` (G' the groups
        recovered) and the round's protocol metrics. The last ``crafted`` rows are Byzantine
        payloads built by their clients: their words skip the clip, so a large row wraps
        modulo ``2^bits`` (the modulus, not the clip, bounds what one client adds)."""
        n, width = rows.shape
        g = self.size(n)
        scale = scale_of(self.bits, g, self.bound)
        groups = groups_of(n, g, _seed(seed, 5, round_))
        gen = torch.Generator().manual_seed(_seed(seed, 6, round_))
        gone = (torch.rand(n, generator=gen, dtype=torch.float64) < self.dropout).tolist()
        clipped = torch.arange(n) < n - crafted if crafted else None
        words = to_fixed(rows, scale, self.bound, self.bits, clipped)
        means, lost, dropped = [], 0, 0
        for k, members in enumerate(groups):
            keys = keys_of(members, _seed(seed, 7, round_, k))
            survivors = [p for p, m in enumerate(members) if not gone[m]]
            dropped += len(members) - len(survivors)
            masked_rows = masked_group(words[members], keys, self.bits)[survivors]
            out = group_sum(masked_rows, survivors, keys, self.threshold_of(len(members)),
                            self.bits, _seed(seed, 8, round_, k))
            if out.words is None:
                lost += 1
                continue
            means.append(from_fixed(out.words, scale, self.bits) / len(survivors))
        stacked = torch.stack(means).to(torch.float32) if means else \
            torch.empty((0, width), dtype=torch.float32)
        return stacked, {"secagg_groups": float(len(groups)), "secagg_dropped": float(dropped),
                         "secagg_groups_lost": float(lost)}
