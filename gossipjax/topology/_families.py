"""Static graph families and the weight rules that turn a graph into W.

Every family builds the sparse form directly: an edge list (or, for circulant graphs, one
shift per offset) in O(n * degree), never an n x n array.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Literal, cast

import numpy as np
import scipy.sparse as sp

from gossipjax.topology._plan import (
    MAX_DENSE_NODES,
    MixingPlan,
    check_degree,
    circulant_plan,
    make_rank_one,
    plan_from_edges,
    sparse_shape,
)
from gossipjax.topology._topology import Topology, is_strongly_connected

Weights = Literal["uniform", "metropolis", "push"]


def _check_n(n: Any, name: str, minimum: int = 1, what: str = "the number of nodes") -> int:
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < minimum:
    raise ValueError(f"gj.topology.{name}: {what} must be an integer >= {minimum}, got {n!r}")
  return int(n)


def _check_weights(weights: Any) -> None:
  if weights not in ("uniform", "metropolis", "push"):
    raise ValueError(f"weights must be 'uniform', 'metropolis' or 'push', got {weights!r}")


_METROPOLIS_DIRECTED = ("metropolis weights need an undirected graph (a symmetric adjacency); on a directed graph "
                        "use weights='uniform' (row stochastic) or weights='push' (column stochastic, for gj.sgp)")


def weights_from_adjacency(adj: Any, weights: Weights = "uniform") -> np.ndarray | sp.csr_array:
  """Turns a 0/1 adjacency (``adj[i, j]``: i receives from j) into a mixing matrix.

  Args:
    adj: boolean n x n, dense or ``scipy.sparse`` (then so is the result); the diagonal
      is ignored (every node keeps a self weight).
    weights: ``"uniform"``: 1/(in-degree + 1) over the closed in-neighbourhood, as BlueFog
      does (row stochastic; doubly stochastic on regular graphs); ``"metropolis"``:
      Metropolis-Hastings ``w_ij = 1 / (1 + max(d_i, d_j))``, doubly stochastic on any
      undirected graph; ``"push"``: each sender splits its value equally over itself and
      the nodes it sends to, ``w_ij = 1/(out-degree_j + 1)`` (column stochastic on any
      graph, directed ones included: what push-sum, `gj.sgp`, needs).

  Returns:
    W, n x n: a NumPy array for a dense ``adj``, a ``scipy.sparse`` CSR array for a sparse
    one. Each row sums to one (the self weight takes the rest), or with ``"push"`` each
    column (the self weight is the sender's own share).

  Raises:
    ValueError: ``weights`` is none of the rules, or ``"metropolis"`` on a directed graph.

  Example:
    A path of three nodes, where the end nodes have one neighbour and the middle two:

    >>> import numpy as np
    >>> from gossipjax import topology as T
    >>> adj = np.array([[0, 1, 0], [1, 0, 1], [0, 1, 0]])
    >>> print(T.weights_from_adjacency(adj).round(3))
    [[0.5   0.5   0.   ]
     [0.333 0.333 0.333]
     [0.    0.5   0.5  ]]
    >>> print(T.weights_from_adjacency(adj, "metropolis").round(3))
    [[0.667 0.333 0.   ]
     [0.333 0.333 0.333]
     [0.    0.333 0.667]]

    A directed cycle with a chord, 0 -> 1 -> 2 -> 0 and 0 -> 2: node 0 sends to two nodes,
    so its column splits three ways:

    >>> directed = np.array([[0, 0, 1], [1, 0, 0], [1, 1, 0]])  # [i, j]: i receives from j
    >>> print(T.weights_from_adjacency(directed, "push").round(3))
    [[0.333 0.    0.5  ]
     [0.333 0.5   0.   ]
     [0.333 0.5   0.5  ]]

  References:
    Xiao, Boyd, Lall (2005), A Scheme for Robust Distributed Sensor Fusion Based on
    Average Consensus, IPSN (the Metropolis-Hastings weights).
  """
  if sp.issparse(adj):
    a = sp.coo_array(adj)
    n = sparse_shape(a)[0]
    dst, src, w, self_w = _edge_weights(n, a.row[a.data != 0], a.col[a.data != 0], weights)
    nodes = np.arange(n)
    return sp.csr_array((np.concatenate([self_w, w]), (np.concatenate([nodes, dst]), np.concatenate([nodes, src]))),
                        shape=(n, n))
  adj = np.asarray(adj).astype(bool)
  n = adj.shape[0]
  adj = adj & ~np.eye(n, dtype=bool)
  deg = adj.sum(axis=1)
  if weights == "uniform":
    w = adj / (deg[:, None] + 1.0)
  elif weights == "metropolis":
    if not np.array_equal(adj, adj.T):
      raise ValueError(_METROPOLIS_DIRECTED)
    w = adj / (1.0 + np.maximum(deg[:, None], deg[None, :]))
  elif weights == "push":
    out_deg = adj.sum(axis=0)
    w = adj / (out_deg[None, :] + 1.0)
    w[np.arange(n), np.arange(n)] = 1.0 - w.sum(axis=0)
    return w
  else:
    _check_weights(weights)
    raise AssertionError(f"unreachable: {weights!r} passed _check_weights")
  w[np.arange(n), np.arange(n)] = 1.0 - w.sum(axis=1)
  return w


def _edge_weights(n: int, dst: np.ndarray, src: np.ndarray, weights: Weights):
  """The rule of ``weights_from_adjacency`` on an edge list: ``(dst, src, weight, self_weight)``.

  Duplicate edges and self loops are dropped; edges come back sorted by (receiver, sender).
  """
  _check_weights(weights)
  dst, src = np.asarray(dst, np.int64), np.asarray(src, np.int64)
  key = np.sort(dst[dst != src] * n + src[dst != src])
  key = key[np.concatenate([[True], key[1:] != key[:-1]])] if len(key) else key
  dst, src = key // n, key % n
  deg = np.bincount(dst, minlength=n)
  if weights == "push":
    w = 1.0 / (np.bincount(src, minlength=n)[src] + 1.0)
    return dst, src, w, 1.0 - np.bincount(src, weights=w, minlength=n)
  if weights == "uniform":
    w = 1.0 / (deg[dst] + 1.0)
  else:
    if not np.array_equal(np.sort(src * n + dst), key):
      raise ValueError(_METROPOLIS_DIRECTED)
    w = 1.0 / (1.0 + np.maximum(deg[dst], deg[src]))
  return dst, src, w, 1.0 - np.bincount(dst, weights=w, minlength=n)


def _from_edges(n: int, dst: np.ndarray, src: np.ndarray, name: str, weights: Weights) -> Topology:
  dst, src, w, self_w = _edge_weights(n, dst, src, weights)
  return _with_rule(Topology.from_plans(plan_from_edges(n, dst, src, w, self_w, name), name=name), weights)


def _with_rule(topology: Topology, weights: Weights) -> Topology:
  topology._rule = weights  # what a failed check suggests instead
  return topology


def _regular_circulant(n: int, offsets: list[int], name: str, weights: Weights) -> Topology:
  """A circulant graph whose edges go both ways, so uniform and Metropolis weights agree."""
  _check_weights(weights)
  offsets = sorted({h % n for h in offsets} - {0})
  w = 1.0 / (len(offsets) + 1.0)
  row_sum = 0.0
  for _ in offsets:  # the self weight is 1 minus the row, summed as the dense rule sums it
    row_sum += w
  return _with_rule(Topology.from_plans(circulant_plan(n, offsets, w, 1.0 - row_sum, name), name=name), weights)


def ring(n: int, weights: Weights = "uniform") -> Topology:
  """Undirected ring: node i talks to i - 1 and i + 1 (weights 1/3 each, self 1/3).

  Args:
    n: the number of nodes.
    weights: ``"uniform"`` or ``"metropolis"`` (the same on a ring: every node has two
      neighbours).

  Returns:
    A static, symmetric, doubly stochastic `Topology` named ``ring(n)``, stored as two
    cyclic shifts.

  Example:
    >>> from gossipjax import topology as T
    >>> print(T.ring(5).matrix()[0].round(3))
    [0.333 0.333 0.    0.    0.333]
    >>> round(T.rho(T.ring(8)), 4)
    0.8047
  """
  n = _check_n(n, "ring")
  return _regular_circulant(n, [1, -1], f"ring({n})", weights)


def _grid_edges(rows: int, cols: int, wrap: bool) -> tuple[np.ndarray, np.ndarray]:
  node = np.arange(rows * cols)
  r, c = np.divmod(node, cols)
  dst, src = [], []
  for dr, dc in ((0, 1), (0, -1), (1, 0), (-1, 0)):
    rr, cc = r + dr, c + dc
    if wrap:
      rr, cc = rr % rows, cc % cols
    inside = (rr >= 0) & (rr < rows) & (cc >= 0) & (cc < cols)
    dst.append(node[inside])
    src.append((rr * cols + cc)[inside])
  return np.concatenate(dst), np.concatenate(src)


def grid(rows: int, cols: int, weights: Weights = "uniform") -> Topology:
  """2D grid without wrap-around; irregular, so pass ``weights="metropolis"`` for a doubly stochastic W.

  Node ``r * cols + c`` talks to its 2 to 4 neighbours up, down, left and right.

  Args:
    rows: rows of the grid.
    cols: columns of the grid.
    weights: ``"uniform"`` (1 / (degree + 1), row stochastic only) or ``"metropolis"``
      (doubly stochastic).

  Returns:
    A static `Topology` named ``grid(rowsxcols)``.

  Example:
    The corner of a 2 x 3 grid, with Metropolis weights:

    >>> from gossipjax import topology as T
    >>> print(T.grid(2, 3, weights="metropolis").matrix()[0].round(3))
    [0.417 0.25  0.    0.333 0.    0.   ]
  """
  rows, cols = _check_n(rows, "grid", what="rows"), _check_n(cols, "grid", what="cols")
  return _from_edges(rows * cols, *_grid_edges(rows, cols, False), f"grid({rows}x{cols})", weights)


def torus(rows: int, cols: int, weights: Weights = "uniform") -> Topology:
  """2D torus (grid with wrap-around): 4 neighbours, weight 1/5 each when rows, cols >= 3.

  Args:
    rows: rows of the torus.
    cols: columns of the torus.
    weights: ``"uniform"`` or ``"metropolis"`` (the same when every node has 4 neighbours).

  Returns:
    A static, symmetric `Topology` named ``torus(rowsxcols)``.

  Example:
    >>> from gossipjax import topology as T
    >>> print(T.torus(3, 3).matrix()[0].round(3))
    [0.2 0.2 0.2 0.2 0.  0.  0.2 0.  0. ]
    >>> round(T.rho(T.torus(4, 4)), 4)
    0.6
  """
  rows, cols = _check_n(rows, "torus", what="rows"), _check_n(cols, "torus", what="cols")
  return _from_edges(rows * cols, *_grid_edges(rows, cols, True), f"torus({rows}x{cols})", weights)


def star(n: int, weights: Weights = "uniform") -> Topology:
  """Node 0 is the hub; irregular, so pass ``weights="metropolis"`` for a doubly stochastic W.

  The plan is ``W = diag(s) + e_0 a^T + b e_0^T``: self weights and two rank-one terms, the
  hub's row ``a`` (a weighted reduction into the hub) and its column ``b`` (a broadcast from
  it, scaled per leaf). Exchange rounds would need n - 1 of them, one per leaf; the rank-one
  form is O(n) and every backend applies it with one reduction, so a star of a million
  nodes builds and mixes.

  Args:
    n: the number of nodes (node 0 is the hub).
    weights: ``"uniform"`` (1 / (degree + 1): the hub keeps 1/n, a leaf 1/2; row
      stochastic only) or ``"metropolis"`` (doubly stochastic: each leaf gives the hub 1/n).

  Returns:
    A static `Topology` named ``star(n)``.

  Example:
    >>> from gossipjax import topology as T
    >>> len(T.star(2**16).plans()[0].rank_one), T.star(5).matrix()[0].round(2).tolist()
    (2, [0.2, 0.2, 0.2, 0.2, 0.2])
  """
  n = _check_n(n, "star")
  leaves = np.arange(1, n)
  hub = np.zeros(n - 1, np.int64)
  dst, src, w, self_w = _edge_weights(n, np.concatenate([hub, leaves]), np.concatenate([leaves, hub]), weights)
  into_hub = dst == 0
  row, column = np.zeros(n), np.zeros(n)
  row[src[into_hub]] = w[into_hub]
  column[dst[~into_hub]] = w[~into_hub]
  hub_vector = np.zeros(n)
  hub_vector[0] = 1.0
  terms = (make_rank_one(hub_vector, row), make_rank_one(column, hub_vector)) if n > 1 else ()
  self_w.setflags(write=False)
  return _with_rule(Topology.from_plans(MixingPlan(self_weight=self_w, rounds=(), rank_one=terms), name=f"star({n})"),
                    weights)


def complete(n: int) -> Topology:
  """Every node averages with every node: W = 11^T / n (exact averaging in one step).

  The plan is one rank-one term (``u = 1``, ``v = 1/n``): an all-reduce mean on every
  backend, O(n * d) however large n is, where exchange rounds would need n - 1 shifts.

  Args:
    n: the number of nodes.

  Returns:
    A static, symmetric, doubly stochastic `Topology` named ``complete(n)``, with ``rho = 0``.

  Example:
    >>> from gossipjax import topology as T
    >>> T.rho(T.complete(2**16)), T.complete(2**16).check("doubly").max_degree()
    (0.0, 65535)
  """
  n = _check_n(n, "complete")
  if n == 1:
    return Topology.from_plans(MixingPlan(self_weight=np.ones(1), rounds=()), name="complete(1)")
  term = make_rank_one(np.ones(n), np.full(n, 1.0 / n))
  self_w = np.zeros(n)
  self_w.setflags(write=False)
  return Topology.from_plans(MixingPlan(self_weight=self_w, rounds=(), rank_one=(term,)), name=f"complete({n})")


def _exponential_peers(n: int) -> list[int]:
  return sorted({(2**k) % n for k in range(max(1, math.ceil(math.log2(n))) if n > 1 else 0)} - {0})


def exponential(n: int, symmetric: bool = False) -> Topology:
  """Static exponential graph (Ying et al. 2021).

  Directed (default): node i receives from ``(i + 2^k) mod n`` for every ``2^k < n``, each
  of these ``ceil(log2 n)`` peers and the node itself weighted ``1 / (1 + number of peers)``.
  It is circulant, hence doubly stochastic; for n a power of 2, ``rho = 1 - 2 / (1 + log2 n)``.

  The edges run the other way from BlueFog's ``ExponentialTwoGraph``, where node i receives
  from ``(i - 2^k) mod n``: node 0 of 8 receives from {1, 2, 4} here and from {4, 6, 7} in
  BlueFog. The two graphs are transposes, with the same spectrum and ``rho``; BlueFog's
  orientation is `directed_exponential` (the same W, every edge reversed).

  ``symmetric=True`` gives the undirected variant (i talks to ``i +- 2^k``), for methods
  that need a symmetric W such as DecentLaM and exact diffusion.

  Args:
    n: the number of nodes.
    symmetric: the undirected variant.

  Returns:
    A static, doubly stochastic `Topology` named ``exponential(n)`` (or
    ``symmetric_exponential(n)``), stored as one cyclic shift per peer.

  Example:
    >>> import numpy as np
    >>> from gossipjax import topology as T
    >>> np.flatnonzero(T.exponential(8).matrix()[0]).tolist()  # node 0 receives from 1, 2, 4
    [0, 1, 2, 4]
    >>> np.flatnonzero(T.exponential(8, symmetric=True).matrix()[0]).tolist()
    [0, 1, 2, 4, 6, 7]
    >>> T.rho(T.exponential(8))  # 1 - 2 / (1 + log2 8)
    0.5

  References:
    Ying, Yuan, Chen, Hu, Pan, Yin (2021), Exponential Graph is Provably Efficient for
    Decentralized Deep Training, NeurIPS.
  """
  n = _check_n(n, "exponential")
  peers = _exponential_peers(n)
  if symmetric:
    peers = sorted(set(peers) | {(-h) % n for h in peers})
  w = 1.0 / (1.0 + len(peers))
  name = f"{'symmetric_' if symmetric else ''}exponential({n})"
  return Topology.from_plans(circulant_plan(n, peers, w, w, name), name=name)


def hypercube(n: int) -> Topology:
  """Hypercube on n = 2^d nodes: i talks to ``i XOR 2^k``, weights 1/(d + 1).

  Args:
    n: the number of nodes, a power of 2.

  Returns:
    A static, symmetric, doubly stochastic `Topology` named ``hypercube(n)``.

  Raises:
    ValueError: ``n`` is not a power of 2.

  Example:
    >>> import numpy as np
    >>> from gossipjax import topology as T
    >>> np.flatnonzero(T.hypercube(8).matrix()[3]).tolist()  # 3 XOR 1, 3 XOR 2, 3 and 3 XOR 4
    [1, 2, 3, 7]
  """
  n = _check_n(n, "hypercube")
  if n & (n - 1):
    raise ValueError(f"hypercube: n must be a power of 2, got {n}")
  d = n.bit_length() - 1
  node = np.arange(n)
  dst = np.tile(node, d)
  src = np.concatenate([node ^ (1 << k) for k in range(d)] or [np.zeros(0, np.int64)])
  return _from_edges(n, dst, src, f"hypercube({n})", "uniform")


def erdos_renyi(n: int, p: float, seed: int = 0, weights: Weights = "metropolis") -> Topology:
  """Undirected Erdos-Renyi graph G(n, p), Metropolis-Hastings weights by default.

  Up to ``MAX_DENSE_NODES`` nodes the sample for a seed is the one drawn pair by pair from
  ``numpy.random.default_rng(seed)`` (rows of draws at a time, never n x n at once); past
  that, the number of edges is drawn from its binomial law and the edges uniformly among
  the pairs, O(n + edges) (the same law, G(n, p), another sample).

  Args:
    n: the number of nodes.
    p: the probability of each edge, in [0, 1].
    seed: seed of the sample.
    weights: ``"metropolis"`` (doubly stochastic) or ``"uniform"`` (row stochastic only).

  Returns:
    A static, symmetric `Topology` named ``erdos_renyi(n, p=p, seed=seed)``.

  Raises:
    ValueError: the sampled graph is disconnected (raise ``p`` or change ``seed``), or
      ``p`` is outside [0, 1].

  Example:
    >>> from gossipjax import topology as T
    >>> g = T.erdos_renyi(8, p=0.5, seed=0)
    >>> g.check("doubly").max_degree()
    4

  References:
    Erdős, Rényi (1959), On Random Graphs I, Publicationes Mathematicae Debrecen.
  """
  n = _check_n(n, "erdos_renyi")
  if not 0.0 <= p <= 1.0:
    raise ValueError(f"erdos_renyi: p must be in [0, 1], got {p}")
  name = f"erdos_renyi({n}, p={p}, seed={seed})"
  check_degree(n, int(p * (n - 1)), name)
  rng = np.random.default_rng(seed)
  if n <= MAX_DENSE_NODES:
    rows = max(1, 2**22 // n)  # about 32 MiB of draws at a time
    dst, src = [], []
    for start in range(0, n, rows):
      block = rng.random((min(rows, n - start), n)) < p
      i, j = np.nonzero(block)
      i += start
      upper = j > i
      dst.append(i[upper])
      src.append(j[upper])
    dst, src = np.concatenate(dst), np.concatenate(src)
  else:
    pairs = n * (n - 1) // 2
    index = np.sort(rng.choice(pairs, size=rng.binomial(pairs, p), replace=False))
    first = np.arange(n, dtype=np.int64)
    first = first * n - first * (first + 1) // 2  # index of pair (i, i + 1) in row-major upper-triangle order
    dst = np.searchsorted(first, index, side="right") - 1
    src = index - first[dst] + dst + 1
  adj = sp.csr_array((np.ones(2 * len(dst), bool), (np.concatenate([dst, src]), np.concatenate([src, dst]))),
                     shape=(n, n))
  if not is_strongly_connected(adj):
    raise ValueError(f"erdos_renyi({n}, p={p}, seed={seed}) sampled a disconnected graph; "
                     "raise p (about log(n)/n is the threshold) or try another seed")
  return _from_edges(n, np.concatenate([dst, src]), np.concatenate([src, dst]), name, weights)


def from_adjacency(adj: Any, weights: Weights = "uniform", name: str | None = None) -> Topology:
  """Topology from a 0/1 adjacency (``adj[i, j]``: i receives from j), dense or ``scipy.sparse``, or a networkx graph.

  Args:
    adj: the n x n adjacency (non-zero entries are edges; the diagonal is ignored), or a
      networkx graph (see `from_networkx`).
    weights: ``"uniform"``, ``"metropolis"`` or ``"push"``, as in `weights_from_adjacency`.
    name: the topology's name (default ``graph(n)``).

  Returns:
    A static `Topology` with the weights of `weights_from_adjacency`.

  Raises:
    ValueError: the adjacency is not square.

  Example:
    >>> import numpy as np
    >>> from gossipjax import topology as T
    >>> path = T.from_adjacency(np.array([[0, 1, 0], [1, 0, 1], [0, 1, 0]]), name="path(3)")
    >>> print(path.matrix().round(3))
    [[0.5   0.5   0.   ]
     [0.333 0.333 0.333]
     [0.    0.5   0.5  ]]
  """
  if _is_networkx(adj):
    return from_networkx(adj, weights=weights)
  if sp.issparse(adj):
    a = sp.coo_array(adj)
    shape = sparse_shape(a)
  else:
    a = np.asarray(adj)
    shape = a.shape
  if len(shape) != 2 or shape[0] != shape[1]:
    raise ValueError(f"from_adjacency: adjacency must be square n x n, got shape {shape}")
  if isinstance(a, np.ndarray):
    dst, src = np.nonzero(a != 0)
  else:
    dst, src = a.row[a.data != 0], a.col[a.data != 0]
  return _from_edges(shape[0], dst, src, name or f"graph({shape[0]})", weights)


def from_matrix(w: Any, name: str = "custom") -> Topology:
  """Topology from a mixing matrix, or a sequence of them (time-varying, cycled).

  Each W may be dense or ``scipy.sparse``. Entries are checked (finite, non-negative);
  stochasticity is checked by each algorithm for what it needs (``Topology.check``).

  Args:
    w: an n x n matrix (rows receive), a (period, n, n) stack or a sequence of matrices.
    name: the topology's name.

  Returns:
    A `Topology`, time-varying when ``w`` holds several matrices.

  Raises:
    ValueError: a matrix is not square, the sizes differ, or an entry is non-finite or
      negative.

  Example:
    >>> import numpy as np
    >>> from gossipjax import topology as T
    >>> T.from_matrix(np.full((3, 3), 1 / 3), name="average(3)")
    Topology(average(3), n=3, static)
    >>> T.from_matrix([np.eye(2), np.full((2, 2), 0.5)]).period
    2
  """
  if isinstance(w, (list, tuple)) and w and not isinstance(w[0], (int, float, np.number)):
    shapes = [tuple(np.shape(m)) for m in w]
    other = next((k for k, shape in enumerate(shapes) if shape != shapes[0]), None)
    if other is not None and max(map(len, shapes)) >= 2:
      raise ValueError(f"gj.topology.from_matrix: every step's W must be of the same n x n, got {shapes[0]} at step 0 "
                       f"and {shapes[other]} at step {other}")
    if other is not None:
      raise ValueError(f"gj.topology.from_matrix: the rows of W must be of one length, got {len(w[0])} in row 0 and "
                       f"{len(w[other])} in row {other}")
  return Topology(w, name=name)


def from_networkx(graph: Any, weights: Weights = "uniform") -> Topology:
  """Topology from a ``networkx`` Graph (undirected) or DiGraph (edge u -> v: v receives from u).

  Nodes are numbered in ``sorted(graph.nodes)`` order.

  Args:
    graph: a ``networkx.Graph`` or ``networkx.DiGraph`` (edge weights are ignored).
    weights: ``"uniform"``, ``"metropolis"`` or ``"push"``, as in `weights_from_adjacency`.

  Returns:
    A static `Topology` named ``networkx(n)``.

  Raises:
    ValueError: the graph has no node.
    TypeError: the node names cannot be sorted (e.g. strings and integers).

  Example:
    >>> import networkx as nx
    >>> from gossipjax import topology as T
    >>> print(T.from_networkx(nx.path_graph(3), weights="metropolis").matrix().round(3))
    [[0.667 0.333 0.   ]
     [0.333 0.333 0.333]
     [0.    0.333 0.667]]
  """
  import networkx as nx

  try:
    nodes = sorted(graph.nodes)
  except TypeError:
    kinds = sorted({type(v).__name__ for v in graph.nodes})
    raise TypeError(f"gj.topology.from_networkx: the graph's node names cannot be sorted (they mix {', '.join(kinds)}), "
                    "and nodes are numbered in sorted order; relabel them first, e.g. "
                    "nx.convert_node_labels_to_integers(graph)") from None
  if not nodes:
    raise ValueError("gj.topology.from_networkx: the graph has no node; a topology needs at least one")
  # typeshed's networkx stub types weight as str; None (every edge weighs 1) is networkx's documented use.
  to_scipy_sparse_array = cast(Callable[..., Any], nx.to_scipy_sparse_array)
  a = sp.coo_array(to_scipy_sparse_array(graph, nodelist=nodes, weight=None))
  dst, src = (a.col, a.row) if graph.is_directed() else (a.row, a.col)
  return _from_edges(len(nodes), dst, src, f"networkx({len(nodes)})", weights)


def _is_networkx(x: Any) -> bool:
  return type(x).__module__.startswith("networkx")


def as_topology(x: Any) -> Topology:
  """Accepts a Topology, a mixing matrix (dense or ``scipy.sparse``, or a stack of them), or a networkx graph.

  What every algorithm calls on its ``topology`` argument.

  Args:
    x: a `Topology` (returned as is), a matrix or stack of matrices (`from_matrix`) or a
      networkx graph (`from_networkx`, uniform weights).

  Returns:
    The `Topology`.

  Raises:
    TypeError: ``x`` is none of these.

  Example:
    >>> import numpy as np, networkx as nx
    >>> from gossipjax import topology as T
    >>> T.as_topology(np.full((2, 2), 0.5))
    Topology(custom, n=2, static)
    >>> T.as_topology(nx.cycle_graph(4))
    Topology(networkx(4), n=4, static)
    >>> ring = T.ring(4)
    >>> T.as_topology(ring) is ring
    True
  """
  if isinstance(x, Topology):
    return x
  if _is_networkx(x):
    return from_networkx(x)
  if sp.issparse(x) or isinstance(x, (np.ndarray, list, tuple)) or hasattr(x, "__array__"):
    return from_matrix(x)
  raise TypeError(f"expected a gossipjax Topology, a mixing matrix or a networkx graph, got {type(x).__name__}")
