from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from simulator import registry
from simulator.registry import instantiate
from strategies.attacks import Dissensus
from strategies.gossip import (
    adaptive_tau,
    clipped_gossip,
    consensus_distance,
    plain_gossip,
    robust_gossip,
    sparse_rows,
)
from strategies.topologies import (
    EdgeList,
    Hypercube,
    OnePeerExponential,
    Ring,
    Torus,
    mixing_from_graph,
    spectral_gap,
    topology_summary,
    validate_mixing,
)

SIZES = {"torus": 16, "hypercube": 16, "one_peer_exponential": 16}


@pytest.mark.parametrize("name", [n for n in registry.available("topologies") if n != "edge_list"])
def test_every_topology_gives_a_valid_mixing_matrix(name):
    topo = instantiate("topologies", {"name": name})
    n = SIZES.get(name, 12)
    topo.check(n)
    for step in range(3):
        w = topo.mixing_matrix(n, seed=0, step=step)
        assert w.shape == (n, n)
        np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12)  # doubly stochastic
        np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)
        assert (w >= 0).all()
        if not topo.traits.time_varying:
            validate_mixing(w)
            np.testing.assert_array_equal(w, topo.mixing_matrix(n, seed=0))  # seeded
    assert 0 < topology_summary(topo, n, 0)["spectral_gap"] <= 1 + 1e-12


@pytest.mark.parametrize("n", [5, 8, 16, 33])
def test_ring_spectral_gap_closed_form(n):
    # every degree is 2, so Metropolis and uniform both put 1/3 on each edge and the self-loop
    expect = 1 - (1 + 2 * math.cos(2 * math.pi / n)) / 3
    for rule in ("metropolis", "uniform"):
        assert spectral_gap(Ring(rule).mixing_matrix(n, 0)) == pytest.approx(expect, abs=1e-12)


@pytest.mark.parametrize("n", [2, 7, 20])
def test_complete_graph_averages_in_one_step(n):
    w = instantiate("topologies", {"name": "complete"}).mixing_matrix(n, 0)
    np.testing.assert_allclose(w, np.full((n, n), 1 / n), atol=1e-15)
    assert spectral_gap(w) == pytest.approx(1.0)


@pytest.mark.parametrize("dim", [1, 2, 3, 4, 5])
def test_hypercube_spectral_gap_closed_form(dim):
    n = 2**dim
    w = Hypercube("uniform").mixing_matrix(n, 0)
    assert spectral_gap(w) == pytest.approx(2 / (1 + dim), abs=1e-12)


def test_torus_has_wrap_around_edges():
    w = Torus(rows=3).mixing_matrix(12, 0)  # 3 x 4 torus
    adj = (w > 0) & ~np.eye(12, dtype=bool)
    assert (adj.sum(axis=1) == 4).all()  # every peer has 4 distinct neighbours
    # node (r, c) is r * 4 + c: row wrap (0, 3) and column wrap (0, 8) are edges
    assert adj[0, 3] and adj[0, 8] and adj[0, 1] and adj[0, 4] and not adj[0, 5]
    with pytest.raises(ValueError, match="^rows: a torus of n = 10"):
        Torus(rows=4).check(10)


def test_one_peer_exponential_averages_exactly_over_a_period():
    n, tau = 16, 4
    topo = OnePeerExponential()
    w0 = topo.mixing_matrix(n, 0, 0)
    assert w0[3, 3] == 0.5 and w0[3, 4] == 0.5 and w0[15, 0] == 0.5
    assert topo.mixing_matrix(n, 0, 2)[3, 7] == 0.5  # hop 2^2
    prod = np.eye(n)
    for k in range(tau):
        prod = topo.mixing_matrix(n, 0, k) @ prod
    np.testing.assert_allclose(prod, np.full((n, n), 1 / n), atol=1e-15)


def test_metropolis_weights_follow_the_degrees():
    import networkx as nx

    g = nx.star_graph(3)  # hub 0 with degree 3, leaves of degree 1
    w = mixing_from_graph(g, "metropolis")
    assert w[0, 1] == pytest.approx(1 / 4) and w[1, 1] == pytest.approx(3 / 4)
    assert w[0, 0] == pytest.approx(1 - 3 / 4)
    u = mixing_from_graph(g, "uniform")
    assert u[1, 1] == pytest.approx(3 / 4) and u[0, 0] == pytest.approx(1 / 4)


def test_validation_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match=r"^mixing: must be symmetric; W\[0,1\]"):
        validate_mixing(np.array([[0.5, 0.5], [0.2, 0.8]]))
    with pytest.raises(ValueError, match="^mixing: rows must sum to 1"):
        validate_mixing(np.array([[0.5, 0.4], [0.4, 0.5]]))
    with pytest.raises(ValueError, match="^mixing: the graph must be connected; it has 4 components"):
        validate_mixing(np.eye(4))
    edges = tmp_path / "g.txt"
    edges.write_text("# two triangles\n0 1\n1 2\n2 0\n3 4\n4 5\n5 3\n")
    with pytest.raises(ValueError, match="it has 2 components"):
        EdgeList(str(edges)).check(6)
    edges.write_text("0 1 0.5\n1 2 0.25\n")
    w = EdgeList(str(edges), mixing="given").mixing_matrix(3, 0)
    np.testing.assert_allclose(w, [[0.5, 0.5, 0], [0.5, 0.25, 0.25], [0, 0.25, 0.75]])


def test_gossip_without_gradients_reaches_the_average_at_the_spectral_rate():
    n, d, t = 16, 8, 40
    w = Ring().mixing_matrix(n, 0)
    lam = 1 - spectral_gap(w)
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mean0, c0 = x.mean(0), consensus_distance(x)
    w_t = torch.from_numpy(w)
    for _ in range(t):
        x = plain_gossip(x, w_t)
    torch.testing.assert_close(x.mean(0), mean0)  # the average is kept exactly
    ratio = consensus_distance(x) / c0
    # ||X_t - X_bar||^2 <= lambda^(2t) ||X_0 - X_bar||^2, and the slowest mode makes it tight
    assert ratio <= lam ** (2 * t) * (1 + 1e-9)
    assert ratio >= 0.05 * lam ** (2 * t)
    sparse = plain_gossip(torch.ones(n, 3), sparse_rows(w))
    torch.testing.assert_close(sparse, torch.ones(n, 3))


def test_dissensus_freezes_plain_gossip_and_clipped_gossip_limits_it():
    w = Ring().mixing_matrix(8, 0)
    honest = [0, 1, 2, 3, 5, 6, 7]
    byz = [4]
    w_hh = w[np.ix_(honest, honest)]
    w_byz = w[np.ix_(honest, byz)].sum(axis=1)
    x = torch.randn(7, 5, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(0)
    frozen = Dissensus(epsilon=1.0).messages(x, torch.from_numpy(w_hh).float(),
                                             torch.from_numpy(w_byz).float(), g)
    out = plain_gossip(x, torch.from_numpy(w_hh).float(), torch.from_numpy(w_byz).float(), frozen)
    hit = torch.from_numpy(w_byz > 0)  # peers 3 and 5 neighbour the Byzantine peer: they stay put
    torch.testing.assert_close(out[hit], x[hit])
    assert not torch.allclose(out[~hit], x[~hit])
    apart = Dissensus(epsilon=20.0).messages(x, torch.from_numpy(w_hh).float(),
                                             torch.from_numpy(w_byz).float(), g)
    plain = plain_gossip(x, torch.from_numpy(w_hh).float(), torch.from_numpy(w_byz).float(), apart)
    clipped = clipped_gossip(x, w_hh, w_byz, apart, tau=None)
    assert consensus_distance(clipped) < 0.2 * consensus_distance(plain)
    # without Byzantine peers and tau large, ClippedGossip is plain gossip
    x8 = torch.randn(8, 5, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(clipped_gossip(x8, w, np.zeros(8), None, tau=1e9),
                               plain_gossip(x8, torch.from_numpy(w).float()), atol=1e-6, rtol=0)
    torch.testing.assert_close(clipped_gossip(x8, w, np.zeros(8), None, tau=None),
                               plain_gossip(x8, torch.from_numpy(w).float()), atol=1e-6, rtol=0)
    # and with the neighbourhood median, the Byzantine message is one vote of three
    med = robust_gossip(x, w_hh, (w[np.ix_(honest, byz)] > 0).sum(axis=1), apart,
                        lambda r: r.median(dim=0).values)
    assert torch.isfinite(med).all() and consensus_distance(med) < consensus_distance(plain)


def test_adaptive_tau_clips_the_byzantine_share():
    # weights 0.25 each, honest share 0.5: the radius covers the two nearest
    assert adaptive_tau(np.array([3.0, 1.0, 10.0, 2.0]), np.full(4, 0.25), 0.5) == 2.0
