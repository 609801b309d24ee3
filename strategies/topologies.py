"""Communication graphs and mixing matrices for decentralized SGD.

A topology is a small class whose constructor arguments are its scenario keys
(``topology: {name: torus, rows: 4, mixing: metropolis}``). ``mixing_matrix(n, seed, step)``
gives the ``(n, n)`` float64 gossip matrix W of step ``step`` (time-varying graphs change
with it); ``check(n)`` states the constraints on the number of peers with a message naming
the parameter. Random families come from networkx (Erdős–Rényi resampled until connected,
random regular, Watts–Strogatz small world), seeded.

Mixing rules on an undirected graph (self-loops ignored):

* ``metropolis`` (Metropolis–Hastings): W_ij = 1 / (1 + max(deg_i, deg_j)) on edges,
  W_ii = 1 - sum of the row;
* ``uniform`` (max-degree): W_ij = 1 / (1 + max_k deg_k) on edges, W_ii = 1 - sum of the row;
* ``given`` (edge-list files only): the weights in the file, W_ii = 1 - sum of the row.

``validate_mixing`` checks symmetry, double stochasticity and connectivity, and
``spectral_gap`` is 1 - |lambda_2|, the rate at which gossip reaches consensus.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import networkx as nx
import numpy as np
from annotated_types import Ge, Gt, Le

from strategies.paths import PathRefused, read_bytes
from strategies.protocols import Topology, Traits

Mixing = Literal["metropolis", "uniform"]


# ---------------------------------------------------------------------------- mixing maths


def mixing_from_graph(g: nx.Graph, rule: str = "metropolis") -> np.ndarray:
    """The gossip matrix of an undirected graph on nodes 0..n-1 under ``rule``."""
    n = g.number_of_nodes()
    w = np.zeros((n, n))
    edges = np.array([(i, j) for i, j in g.edges() if i != j], dtype=np.int64).reshape(-1, 2)
    deg = np.zeros(n, dtype=np.int64)
    np.add.at(deg, edges.ravel(), 1)
    if rule == "metropolis":
        vals = 1.0 / (1.0 + np.maximum(deg[edges[:, 0]], deg[edges[:, 1]]))
    elif rule == "uniform":
        vals = np.full(len(edges), 1.0 / (1.0 + deg.max(initial=0)))
    elif rule == "given":
        vals = np.array([g.edges[i, j].get("weight", 0.0) for i, j in edges], dtype=np.float64)
    else:
        raise ValueError(f"mixing: must be one of 'metropolis', 'uniform' or 'given', got {rule!r}")
    w[edges[:, 0], edges[:, 1]] = vals
    w[edges[:, 1], edges[:, 0]] = vals
    w[np.arange(n), np.arange(n)] = 1.0 - w.sum(axis=1)
    return w


def validate_mixing(w: np.ndarray, tol: float = 1e-9, connected: bool = True) -> None:
    """Raise ValueError (naming ``mixing``) unless W is symmetric, doubly stochastic with
    non-negative entries and (``connected``) its graph is connected."""
    n = w.shape[0]
    if w.shape != (n, n):
        raise ValueError(f"mixing: must be a square matrix, got shape {w.shape}")
    if not np.allclose(w, w.T, atol=tol):
        i, j = np.unravel_index(np.abs(w - w.T).argmax(), w.shape)
        raise ValueError(f"mixing: must be symmetric; W[{i},{j}] = {w[i, j]:g} but W[{j},{i}] = {w[j, i]:g}")
    if (w < -tol).any():
        i, j = np.unravel_index(w.argmin(), w.shape)
        raise ValueError(f"mixing: entries must be >= 0; W[{i},{j}] = {w[i, j]:g} (a row's "
                         "off-diagonal weights sum to more than 1)")
    rows = w.sum(axis=1)
    if not np.allclose(rows, 1.0, atol=1e-6):
        i = int(np.abs(rows - 1).argmax())
        raise ValueError(f"mixing: rows must sum to 1 (doubly stochastic); row {i} sums to {rows[i]:g}")
    if connected and n > 1:
        g = nx.from_numpy_array((np.abs(w) > tol).astype(int) - np.eye(n, dtype=int))
        if not nx.is_connected(g):
            parts = nx.number_connected_components(g)
            raise ValueError(f"mixing: the graph must be connected; it has {parts} components")


def spectral_gap(w: np.ndarray) -> float:
    """1 - |lambda_2(W)|, the second-largest eigenvalue modulus of symmetric W."""
    if w.shape[0] == 1:
        return 1.0
    ev = np.sort(np.abs(np.linalg.eigvalsh((w + w.T) / 2)))[::-1]
    return float(1.0 - ev[1])


def _connected_sample(make, seed: int, what: str, tries: int = 1000) -> nx.Graph:
    rng = np.random.default_rng(seed)
    for _ in range(tries):
        g = make(int(rng.integers(2**31)))
        if nx.is_connected(g):
            return g
    raise ValueError(f"{what}: no connected graph in {tries} draws; raise the density")


# ---------------------------------------------------------------------------- topologies


class _Static(Topology):
    """A fixed graph; subclasses build it in ``graph(n, seed)``."""

    def __init__(self, mixing: Mixing = "metropolis") -> None:
        self.mixing = mixing

    def graph(self, n: int, seed: int) -> nx.Graph:
        raise NotImplementedError

    def check(self, n: int) -> None:
        return None

    def mixing_matrix(self, n: int, seed: int, step: int = 0) -> np.ndarray:
        g = self.graph(n, seed)
        g.add_nodes_from(range(n))
        return mixing_from_graph(g, self.mixing)


class Complete(_Static):
    """Every peer talks to every other: W = 11^T / n (both rules); spectral gap 1."""

    def graph(self, n: int, seed: int) -> nx.Graph:
        return nx.complete_graph(n)


class Ring(_Static):
    """The cycle C_n; with uniform weights 1/3, spectral gap 1 - (1 + 2 cos(2 pi / n)) / 3."""

    def check(self, n: int) -> None:
        if n < 3:
            raise ValueError(f"a ring needs >= 3 peers, got {n}")

    def graph(self, n: int, seed: int) -> nx.Graph:
        return nx.cycle_graph(n)


class Torus(_Static):
    """The 2-D torus C_rows x C_cols (product of two rings, wrap-around edges included),
    n = rows * cols; each of rows, cols >= 3 so that every peer has 4 distinct neighbours."""

    def __init__(self, rows: Annotated[int, Ge(3)] = 4, mixing: Mixing = "metropolis") -> None:
        super().__init__(mixing)
        self.rows = rows

    def check(self, n: int) -> None:
        if n % self.rows or n // self.rows < 3:
            raise ValueError(f"rows: a torus of n = {n} peers needs rows dividing n with "
                             f"n / rows >= 3, got rows = {self.rows}")

    def graph(self, n: int, seed: int) -> nx.Graph:
        cols = n // self.rows
        g = nx.cartesian_product(nx.cycle_graph(self.rows), nx.cycle_graph(cols))
        return nx.convert_node_labels_to_integers(g, ordering="sorted")


class Star(_Static):
    """One hub (peer 0) linked to every other peer."""

    def graph(self, n: int, seed: int) -> nx.Graph:
        return nx.star_graph(n - 1)


class Hypercube(_Static):
    """The log2(n)-dimensional hypercube (n a power of 2); with uniform weights
    1/(1 + log2 n), spectral gap 2 / (1 + log2 n)."""

    def check(self, n: int) -> None:
        if n < 2 or n & (n - 1):
            raise ValueError(f"a hypercube needs a power of 2 peers, got {n}")

    def graph(self, n: int, seed: int) -> nx.Graph:
        g = nx.hypercube_graph(int(math.log2(n)))
        return nx.convert_node_labels_to_integers(g, ordering="sorted")


class Exponential(_Static):
    """Static exponential graph: peer i links to i +/- 2^k mod n for 2^k < n (as an
    undirected graph; Ying et al., NeurIPS 2021)."""

    def graph(self, n: int, seed: int) -> nx.Graph:
        g = nx.empty_graph(n)
        k = 1
        while k < n:
            g.add_edges_from((i, (i + k) % n) for i in range(n))
            k *= 2
        g.remove_edges_from(nx.selfloop_edges(g))
        return g


class OnePeerExponential(Topology):
    """One-peer exponential graph (Ying et al., NeurIPS 2021), time-varying, n = 2^tau: at
    step k, W_ii = 1/2 and W_{i, (i + 2^(k mod tau)) mod n} = 1/2. Each W is doubly stochastic
    but not symmetric (a peer sends to one and hears from another); tau consecutive steps
    average exactly. The mixing rule does not apply."""

    traits = Traits(time_varying=True)

    def check(self, n: int) -> None:
        if n < 2 or n & (n - 1):
            raise ValueError(f"one-peer exponential needs a power of 2 peers, got {n}")

    def mixing_matrix(self, n: int, seed: int, step: int = 0) -> np.ndarray:
        tau = int(math.log2(n))
        w = np.eye(n) / 2
        hop = 2 ** (step % tau)
        w[np.arange(n), (np.arange(n) + hop) % n] += 0.5
        return w


class ErdosRenyi(_Static):
    """G(n, p), resampled (seeded) until connected."""

    def __init__(self, p: Annotated[float, Gt(0), Le(1)] = 0.3, mixing: Mixing = "metropolis") -> None:
        super().__init__(mixing)
        self.p = p

    def graph(self, n: int, seed: int) -> nx.Graph:
        return _connected_sample(lambda s: nx.erdos_renyi_graph(n, self.p, seed=s), seed, "p")


class RandomRegular(_Static):
    """A uniformly random d-regular graph (networkx), resampled until connected."""

    def __init__(self, degree: Annotated[int, Ge(1)] = 3, mixing: Mixing = "metropolis") -> None:
        super().__init__(mixing)
        self.degree = degree

    def check(self, n: int) -> None:
        if self.degree >= n or (n * self.degree) % 2:
            raise ValueError(f"degree: a {self.degree}-regular graph on n = {n} peers needs "
                             f"degree < n and n * degree even")

    def graph(self, n: int, seed: int) -> nx.Graph:
        return _connected_sample(lambda s: nx.random_regular_graph(self.degree, n, seed=s),
                                 seed, "degree")


class SmallWorld(_Static):
    """Watts–Strogatz small world: a ring lattice with ``k`` nearest neighbours, each edge
    rewired with probability ``p`` (networkx's connected variant)."""

    def __init__(self, k: Annotated[int, Ge(2)] = 4, p: Annotated[float, Ge(0), Le(1)] = 0.1,
                 mixing: Mixing = "metropolis") -> None:
        super().__init__(mixing)
        self.k, self.p = k, p

    def check(self, n: int) -> None:
        if self.k >= n:
            raise ValueError(f"k: must be < n = {n}, got {self.k}")

    def graph(self, n: int, seed: int) -> nx.Graph:
        return nx.connected_watts_strogatz_graph(n, self.k, self.p, tries=1000, seed=seed)


class EdgeList(_Static):
    """A user's graph: a text file with one edge ``i j`` (or ``i j weight``) per line, peers
    numbered 0..n-1, ``#`` comments. ``mixing: given`` takes the weights from the file."""

    traits = Traits(path_params=("path",))

    def __init__(self, path: str, mixing: Literal["metropolis", "uniform", "given"] = "metropolis") -> None:
        self.path = path
        self.mixing = mixing  # type: ignore[assignment]  # "given": only an edge list has weights

    MAX_BYTES = 64 << 20  # an edge list of a few million edges

    def _edges(self) -> list[tuple[int, int, float]]:
        """The file's edges. Only a regular file of at most MAX_BYTES is read, and errors
        name the line, never echo its content (the path may point at any file)."""
        try:
            lines = read_bytes(self.path, self.MAX_BYTES).decode().splitlines()
        except PathRefused as e:
            raise ValueError(f"path: {e}") from None
        except UnicodeDecodeError:
            raise ValueError(f"path: {self.path} is not a text file") from None
        out = []
        for no, line in enumerate(lines, 1):
            parts = line.split("#", 1)[0].split()
            if not parts:
                continue
            if len(parts) not in (2, 3):
                raise ValueError(f"path: {self.path}:{no}: expected 'i j' or 'i j weight', got "
                                 f"{len(parts)} fields")
            try:
                i, j = int(parts[0]), int(parts[1])
                wgt = float(parts[2]) if len(parts) == 3 else 1.0
            except ValueError:
                raise ValueError(f"path: {self.path}:{no}: expected integers i j and a number "
                                 "weight") from None
            if not math.isfinite(wgt):
                raise ValueError(f"path: {self.path}:{no}: the weight must be finite")
            out.append((i, j, wgt))
        return out

    def check(self, n: int) -> None:
        edges = self._edges()
        bad = [(i, j) for i, j, _ in edges if not (0 <= i < n and 0 <= j < n)]
        if bad:
            raise ValueError(f"path: edge {bad[0]} names a peer outside 0..{n - 1}")
        validate_mixing(self.mixing_matrix(n, 0))

    def graph(self, n: int, seed: int) -> nx.Graph:
        g = nx.empty_graph(n)
        for i, j, wgt in self._edges():
            if i != j:
                g.add_edge(i, j, weight=wgt)
        return g


def topology_summary(topology: Topology, n: int, seed: int) -> dict[str, float]:
    """Spectral gap (of W, or for a time-varying graph of the product of one period of W's)
    and mean degree, for the run's params."""
    if topology.traits.time_varying:
        tau = max(1, int(math.log2(n)))
        prod = np.eye(n)
        for k in range(tau):
            prod = topology.mixing_matrix(n, seed, k) @ prod
        ev = np.sort(np.abs(np.linalg.eigvals(prod)))[::-1]
        gap = float(1.0 - ev[1]) if n > 1 else 1.0
        w = topology.mixing_matrix(n, seed, 0)
    else:
        w = topology.mixing_matrix(n, seed)
        gap = spectral_gap(w)
    degree = float(((np.abs(w) > 0).sum() - n) / n)
    return {"spectral_gap": gap, "mean_degree": degree}


__all__ = [
    "Complete",
    "EdgeList",
    "ErdosRenyi",
    "Exponential",
    "Hypercube",
    "OnePeerExponential",
    "RandomRegular",
    "Ring",
    "SmallWorld",
    "Star",
    "Torus",
    "mixing_from_graph",
    "spectral_gap",
    "topology_summary",
    "validate_mixing",
]
