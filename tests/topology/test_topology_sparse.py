"""Topologies are built, checked and planned in their sparse form: equal to the dense definitions, and cheap at scale."""

import math
import time
import tracemalloc

import networkx as nx
import numpy as np
import pytest
import scipy.sparse as sp

from gossipjax import topology as T
from gossipjax.topology import _families, _spectral

# --- The dense definitions, written out as n x n arrays: the sparse builds must equal them bit for bit.


def _weights(adj, rule="uniform"):
  adj = adj & ~np.eye(len(adj), dtype=bool)
  deg = adj.sum(axis=1)
  w = adj / (deg[:, None] + 1.0) if rule == "uniform" else adj / (1.0 + np.maximum(deg[:, None], deg[None, :]))
  row_sum = np.zeros(len(adj))
  for j in range(len(adj)):  # left to right, as the library sums a row (pairwise sums may differ by an ulp)
    row_sum += w[:, j]
  w[np.arange(len(adj)), np.arange(len(adj))] = 1.0 - row_sum
  return w


def _adj(n, edges):
  a = np.zeros((n, n), bool)
  for i, j in edges:
    a[i, j] = True
  return a


def _grid(rows, cols, wrap):
  edges = []
  for r in range(rows):
    for c in range(cols):
      for dr, dc in ((0, 1), (0, -1), (1, 0), (-1, 0)):
        rr, cc = r + dr, c + dc
        if wrap:
          rr, cc = rr % rows, cc % cols
        if 0 <= rr < rows and 0 <= cc < cols:
          edges.append((r * cols + c, rr * cols + cc))
  return _adj(rows * cols, edges)


def _exponential(n, symmetric=False):
  peers = sorted({(2**k) % n for k in range(max(1, math.ceil(math.log2(n))) if n > 1 else 0)} - {0})
  if symmetric:
    peers = sorted(set(peers) | {(-h) % n for h in peers})
  w = np.eye(n)
  for i in range(n):
    for h in peers:
      w[i, (i + h) % n] += 1.0
  return w / w.sum(axis=1, keepdims=True)


def _one_peer(n):
  mats = np.zeros((max(1, math.ceil(math.log2(n))), n, n))
  for k in range(len(mats)):
    for i in range(n):
      mats[k, i, i] += 0.5
      mats[k, i, (i + 2**k) % n] += 0.5
  return mats


def _random_pairs(n, seed, period):
  rng = np.random.default_rng(seed)
  mats = np.zeros((period, n, n))
  for k in range(period):
    perm = rng.permutation(n)
    mats[k, np.arange(n), np.arange(n)] = 1.0
    for a, b in zip(perm[0:n - 1:2], perm[1::2]):
      mats[k, [a, b, a, b], [a, b, b, a]] = 0.5
  return mats


def _erdos_renyi(n, p, seed):
  upper = np.triu(np.random.default_rng(seed).random((n, n)) < p, k=1)
  return _weights(upper | upper.T, "metropolis")


def _cases(n):
  yield "ring", T.ring(n), _weights(_adj(n, [(i, (i + s) % n) for i in range(n) for s in (-1, 1)]))
  yield "exponential", T.exponential(n), _exponential(n)
  yield "symmetric_exponential", T.exponential(n, symmetric=True), _exponential(n, True)
  yield "directed_exponential", T.directed_exponential(n), _exponential(n).T
  yield "complete", T.complete(n), np.full((n, n), 1.0 / n)
  yield "star", T.star(n), _weights(_adj(n, [e for i in range(1, n) for e in ((0, i), (i, 0))]))
  yield "star-metropolis", T.star(n, "metropolis"), _weights(
      _adj(n, [e for i in range(1, n) for e in ((0, i), (i, 0))]), "metropolis")
  for rows in {1, 2, 3, int(math.isqrt(n))} & {r for r in range(1, n + 1) if n % r == 0}:
    yield f"torus{rows}", T.torus(rows, n // rows), _weights(_grid(rows, n // rows, True))
    yield f"grid{rows}", T.grid(rows, n // rows, "metropolis"), _weights(_grid(rows, n // rows, False), "metropolis")
  if n & (n - 1) == 0:
    d = n.bit_length() - 1
    yield "hypercube", T.hypercube(n), _weights(_adj(n, [(i, i ^ (1 << k)) for i in range(n) for k in range(d)]))
  if n >= 2:
    yield "one_peer_exponential", T.one_peer_exponential(n), _one_peer(n)
    yield "one_peer_directed_exponential", T.one_peer_directed_exponential(n), _one_peer(n).transpose(0, 2, 1)
    yield "random_pairs", T.random_pairs(n, seed=n, period=max(16, n)), _random_pairs(n, n, max(16, n))
  if n >= 8:
    p = min(1.0, 3 * math.log(n) / n)
    yield "erdos_renyi", T.erdos_renyi(n, p, seed=n), _erdos_renyi(n, p, n)
    g = nx.gnp_random_graph(n, 0.3, seed=2, directed=True)
    yield "networkx-directed", T.from_networkx(g), _weights(nx.to_numpy_array(g, nodelist=range(n)).T != 0)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 12, 64, 100, 512])
def test_every_family_equals_its_dense_definition_exactly(n):
  for name, topo, dense in _cases(n):
    dense = dense if dense.ndim == 3 else dense[None]
    assert topo.period == len(dense), name
    for k, w in enumerate(dense):
      np.testing.assert_array_equal(topo.matrix(k), w, err_msg=name)
      np.testing.assert_array_equal(topo.sparse(k).toarray(), w, err_msg=name)


@pytest.mark.parametrize("make", [T.ring, T.exponential, T.one_peer_exponential, T.random_pairs],
                         ids=lambda f: f.__name__)
def test_large_topologies_build_check_and_plan_in_linear_memory(make):
  n = 65_536
  tracemalloc.start()
  start = time.perf_counter()
  topo = make(n).check("doubly")
  plans = topo.plans()
  rho = T.rho(topo) if topo.period == 1 else None
  seconds = time.perf_counter() - start
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  assert plans[0].num_nodes == n and seconds < 20  # about 0.1 s on 2 cores; a dense W took minutes
  assert peak < 400 * 2**20  # bytes: the plans are O(n log n); one dense W would be 32 GiB
  if make is T.exponential:
    assert rho == pytest.approx(1 - 2 / (1 + math.log2(n)), abs=1e-12)
    assert all(r.shift is not None for r in plans[0].rounds)  # circulant: one shift per peer


def test_a_million_node_ring_is_a_pair_of_shifts():
  topo = T.ring(2**20).check("doubly")
  assert [r.shift for r in topo.plans()[0].rounds] == [1, 2**20 - 1]
  assert topo.is_symmetric() and topo.max_degree() == 2


def test_dense_views_are_refused_past_the_cap_with_a_pointer_to_the_sparse_form():
  big = T.ring(T.MAX_DENSE_NODES + 1)
  with pytest.raises(ValueError, match=r"only up to n = 8192 nodes.*topology.sparse\(step\).*topology.plans\(\)"):
    big.matrix()
  with pytest.raises(ValueError, match="dense"):
    _ = big.matrices
  assert big.sparse().nnz == 3 * big.num_nodes
  # A hub given as an edge list is coloured into rounds and still needs n - 1 of them.
  leaves = np.arange(1, 65_536)
  adj = sp.csr_array((np.ones(2 * len(leaves), bool), (np.r_[leaves, 0 * leaves], np.r_[0 * leaves, leaves])),
                     shape=(65_536, 65_536))
  with pytest.raises(ValueError, match="degree 65535 needs at least 65535 exchange rounds"):
    T.from_adjacency(adj)
  with pytest.raises(ValueError, match=r"rank-one terms.*entry lists are built only up to 8192\*\*2"):
    T.complete(65_536).sparse()


def test_from_matrix_accepts_scipy_sparse():
  w = T.torus(3, 4).matrix()
  for form in (sp.csr_array(w), sp.csc_matrix(w), sp.coo_array(w)):
    topo = T.from_matrix(form).check("doubly")
    np.testing.assert_array_equal(topo.matrix(), w)
  stack = T.from_matrix([sp.csr_array(m) for m in T.one_peer_exponential(8).matrices])
  assert stack.period == 3 and stack.is_time_varying
  np.testing.assert_array_equal(stack.matrix(2), T.one_peer_exponential(8).matrix(2))
  assert T.as_topology(sp.csr_array(w)).num_nodes == 12
  bad = sp.lil_array((3, 3))
  bad[0, 0], bad[1, 2] = 1.0, -0.5
  with pytest.raises(ValueError, match=r"negative weight W\[1, 2\] = -0.5"):
    T.from_matrix(bad)
  with pytest.raises(ValueError, match="square"):
    T.from_matrix(sp.csr_array((2, 3)))


def test_checks_run_on_the_sparse_form():
  n = 20_000
  pieces = sp.block_diag([T.ring(n // 2).sparse(), T.ring(n // 2).sparse()], format="csr")
  with pytest.raises(ValueError, match="not connected"):
    T.from_matrix(pieces).check("doubly")
  assert not T.is_strongly_connected(pieces) and T.is_strongly_connected(T.ring(n).sparse())
  assert T.exponential(n, symmetric=True).is_symmetric() and not T.exponential(n).is_symmetric()
  with pytest.raises(ValueError, match="column 0 sums to"):
    T.grid(100, n // 100).check("doubly")  # uniform weights on an irregular graph


@pytest.mark.filterwarnings("ignore:rho. W is not doubly stochastic")  # the norm itself is under test
@pytest.mark.parametrize("topo", [T.ring(64), T.exponential(48), T.one_peer_exponential(16), T.torus(5, 6),
                                  T.random_pairs(12, seed=1, period=4), T.directed_exponential(20),
                                  T.from_adjacency(np.random.default_rng(0).random((30, 30)) < 0.2)],
                         ids=lambda t: t.name)
def test_large_n_rho_paths_agree_with_the_exact_svd(topo, monkeypatch):
  exact = [T.rho(topo, k) for k in range(topo.period)]
  monkeypatch.setattr(_spectral, "EXACT_RHO_NODES", 0)  # FFT for circulant W, Lanczos for the others
  for k in range(topo.period):
    assert T.rho(topo, k) == pytest.approx(exact[k], abs=1e-8)
  assert T.rho(sp.csr_array(topo.sparse())) == pytest.approx(exact[0], abs=1e-8)


def test_erdos_renyi_past_the_dense_cap_samples_pairs_without_an_n_by_n_draw(monkeypatch):
  monkeypatch.setattr(_families, "MAX_DENSE_NODES", 8)
  n, p = 400, 0.05
  topo = T.erdos_renyi(n, p, seed=4).check("doubly")
  adj = topo.union_graph().toarray()
  assert not adj.diagonal().any() and (adj == adj.T).all()
  edges, expected = adj.sum() // 2, p * n * (n - 1) / 2
  assert abs(edges - expected) < 5 * math.sqrt(expected)
  with pytest.raises(ValueError, match="disconnected"):
    T.erdos_renyi(n, 0.001, seed=0)


def test_plans_and_sparse_adjacency_are_accepted_and_checked():
  ring = T.ring(10)
  again = T.Topology.from_plans(ring.plans(), name="again")
  np.testing.assert_array_equal(again.matrix(), ring.matrix())
  adj = sp.csr_array(_grid(3, 4, False))
  np.testing.assert_array_equal(T.weights_from_adjacency(adj, "metropolis").toarray(),
                                T.weights_from_adjacency(adj.toarray(), "metropolis"))
  np.testing.assert_array_equal(T.from_adjacency(adj, "metropolis").matrix(), T.grid(3, 4, "metropolis").matrix())
  plan = ring.plans()[0]
  bad = T.MixingPlan(plan.self_weight, (plan.rounds[0], T.Round(plan.rounds[1].src, -plan.rounds[1].weight, None)))
  with pytest.raises(ValueError, match=r"negative weight W\[0, 9\] = -0.333333"):
    T.Topology.from_plans(bad)
  with pytest.raises(ValueError, match="same n"):
    T.Topology.from_plans([plan, T.ring(11).plans()[0]])
