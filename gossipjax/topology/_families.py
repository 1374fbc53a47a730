"""Static graph families and the weight rules that turn a graph into W."""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np

from gossipjax.topology._topology import Topology, is_strongly_connected

Weights = Literal["uniform", "metropolis"]


def _check_n(n: Any, name: str, minimum: int = 1) -> int:
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < minimum:
    raise ValueError(f"{name}: the number of nodes must be an integer >= {minimum}, got {n!r}")
  return int(n)


def weights_from_adjacency(adj: np.ndarray, weights: Weights = "uniform") -> np.ndarray:
  """Turns a 0/1 adjacency (``adj[i, j]``: i receives from j) into a mixing matrix.

  Args:
    adj: boolean n x n; the diagonal is ignored (every node keeps a self weight).
    weights: ``"uniform"``: 1/(in-degree + 1) over the closed in-neighbourhood, as BlueFog
      does (doubly stochastic on regular graphs); ``"metropolis"``: Metropolis-Hastings
      ``w_ij = 1 / (1 + max(d_i, d_j))``, doubly stochastic on any undirected graph.
  """
  adj = np.asarray(adj).astype(bool)
  n = adj.shape[0]
  adj = adj & ~np.eye(n, dtype=bool)
  deg = adj.sum(axis=1)
  if weights == "uniform":
    w = adj / (deg[:, None] + 1.0)
  elif weights == "metropolis":
    if not np.array_equal(adj, adj.T):
      raise ValueError("metropolis weights need an undirected graph (a symmetric adjacency)")
    w = adj / (1.0 + np.maximum(deg[:, None], deg[None, :]))
  else:
    raise ValueError(f"weights must be 'uniform' or 'metropolis', got {weights!r}")
  w[np.arange(n), np.arange(n)] = 1.0 - w.sum(axis=1)
  return w


def _from_edges(n: int, edges, name: str, weights: Weights) -> Topology:
  adj = np.zeros((n, n), bool)
  for i, j in edges:
    if i != j:
      adj[i, j] = True
  return Topology(weights_from_adjacency(adj, weights), name=name)


def ring(n: int, weights: Weights = "uniform") -> Topology:
  """Undirected ring: node i talks to i - 1 and i + 1 (weights 1/3 each, self 1/3)."""
  n = _check_n(n, "ring")
  edges = [(i, (i + s) % n) for i in range(n) for s in (-1, 1)]
  return _from_edges(n, edges, f"ring({n})", weights)


def _grid_edges(rows: int, cols: int, wrap: bool):
  for r in range(rows):
    for c in range(cols):
      i = r * cols + c
      for dr, dc in ((0, 1), (0, -1), (1, 0), (-1, 0)):
        rr, cc = r + dr, c + dc
        if wrap:
          rr, cc = rr % rows, cc % cols
        if 0 <= rr < rows and 0 <= cc < cols:
          yield i, rr * cols + cc


def grid(rows: int, cols: int, weights: Weights = "uniform") -> Topology:
  """2D grid without wrap-around; irregular, so pass ``weights="metropolis"`` for a doubly stochastic W."""
  rows, cols = _check_n(rows, "grid rows"), _check_n(cols, "grid cols")
  return _from_edges(rows * cols, _grid_edges(rows, cols, False), f"grid({rows}x{cols})", weights)


def torus(rows: int, cols: int, weights: Weights = "uniform") -> Topology:
  """2D torus (grid with wrap-around): 4 neighbours, weight 1/5 each when rows, cols >= 3."""
  rows, cols = _check_n(rows, "torus rows"), _check_n(cols, "torus cols")
  return _from_edges(rows * cols, _grid_edges(rows, cols, True), f"torus({rows}x{cols})", weights)


def star(n: int, weights: Weights = "uniform") -> Topology:
  """Node 0 is the hub; irregular, so pass ``weights="metropolis"`` for a doubly stochastic W."""
  n = _check_n(n, "star")
  edges = [e for i in range(1, n) for e in ((0, i), (i, 0))]
  return _from_edges(n, edges, f"star({n})", weights)


def complete(n: int) -> Topology:
  """Every node averages with every node: W = 11^T / n (exact averaging in one step)."""
  n = _check_n(n, "complete")
  return Topology(np.full((n, n), 1.0 / n), name=f"complete({n})")


def exponential(n: int, symmetric: bool = False) -> Topology:
  """Static exponential graph (Ying et al. 2021; BlueFog's default).

  Directed (default): node i receives from ``(i + 2^k) mod n`` for every ``2^k < n``, each
  of these ``ceil(log2 n)`` peers and the node itself weighted ``1 / (1 + number of peers)``.
  It is circulant, hence doubly stochastic; for n a power of 2, ``rho = 1 - 2 / (1 + log2 n)``.

  ``symmetric=True`` gives the undirected variant (i talks to ``i +- 2^k``), for methods
  that need a symmetric W such as DecentLaM and exact diffusion.
  """
  n = _check_n(n, "exponential")
  peers = sorted({(2**k) % n for k in range(max(1, math.ceil(math.log2(n))) if n > 1 else 0)} - {0})
  if symmetric:
    peers = sorted(set(peers) | {(-h) % n for h in peers})
  w = np.zeros((n, n))
  for i in range(n):
    w[i, i] = 1.0
    for h in peers:
      w[i, (i + h) % n] += 1.0
  w /= w.sum(axis=1, keepdims=True)
  return Topology(w, name=f"{'symmetric_' if symmetric else ''}exponential({n})")


def hypercube(n: int) -> Topology:
  """Hypercube on n = 2^d nodes: i talks to ``i XOR 2^k``, weights 1/(d + 1)."""
  n = _check_n(n, "hypercube")
  if n & (n - 1):
    raise ValueError(f"hypercube: n must be a power of 2, got {n}")
  d = n.bit_length() - 1
  edges = [(i, i ^ (1 << k)) for i in range(n) for k in range(d)]
  return _from_edges(n, edges, f"hypercube({n})", "uniform")


def erdos_renyi(n: int, p: float, seed: int = 0, weights: Weights = "metropolis") -> Topology:
  """Undirected Erdos-Renyi graph G(n, p), Metropolis-Hastings weights by default.

  Raises ``ValueError`` when the sampled graph is disconnected (raise ``p`` or change ``seed``).
  """
  n = _check_n(n, "erdos_renyi")
  if not 0.0 <= p <= 1.0:
    raise ValueError(f"erdos_renyi: p must be in [0, 1], got {p}")
  rng = np.random.default_rng(seed)
  upper = np.triu(rng.random((n, n)) < p, k=1)
  adj = upper | upper.T
  if not is_strongly_connected(adj):
    raise ValueError(f"erdos_renyi({n}, p={p}, seed={seed}) sampled a disconnected graph; "
                     "raise p (about log(n)/n is the threshold) or try another seed")
  return Topology(weights_from_adjacency(adj, weights), name=f"erdos_renyi({n}, p={p}, seed={seed})")


def from_adjacency(adj: Any, weights: Weights = "uniform", name: str | None = None) -> Topology:
  """Topology from a 0/1 adjacency matrix (``adj[i, j]``: i receives from j) or a networkx graph."""
  if _is_networkx(adj):
    return from_networkx(adj, weights=weights)
  adj = np.asarray(adj)
  if adj.ndim != 2 or adj.shape[0] != adj.shape[1]:
    raise ValueError(f"from_adjacency: adjacency must be square n x n, got shape {adj.shape}")
  return Topology(weights_from_adjacency(adj != 0, weights), name=name or f"graph({adj.shape[0]})")


def from_matrix(w: Any, name: str = "custom") -> Topology:
  """Topology from a dense mixing matrix, or a sequence of them (time-varying, cycled).

  Entries are checked (finite, non-negative); stochasticity is checked by each algorithm
  for what it needs (``Topology.check``).
  """
  return Topology(np.asarray(w, dtype=np.float64), name=name)


def from_networkx(graph: Any, weights: Weights = "uniform") -> Topology:
  """Topology from a ``networkx`` Graph (undirected) or DiGraph (edge u -> v: v receives from u).

  Nodes are numbered in ``sorted(graph.nodes)`` order.
  """
  import networkx as nx

  nodes = sorted(graph.nodes)
  a = nx.to_numpy_array(graph, nodelist=nodes, weight=None) != 0
  adj = a.T if graph.is_directed() else a
  return Topology(weights_from_adjacency(adj, weights), name=f"networkx({len(nodes)})")


def _is_networkx(x: Any) -> bool:
  return type(x).__module__.startswith("networkx")


def as_topology(x: Any) -> Topology:
  """Accepts a Topology, a dense matrix (or stack of them), or a networkx graph."""
  if isinstance(x, Topology):
    return x
  if _is_networkx(x):
    return from_networkx(x)
  if isinstance(x, (np.ndarray, list, tuple)) or hasattr(x, "__array__"):
    return from_matrix(x)
  raise TypeError(f"expected a gossipjax Topology, a mixing matrix or a networkx graph, got {type(x).__name__}")
