"""The `Topology` type: the sparse plans of W(k), their validation and views.

Convention: rows receive. ``x_new[i] = sum_j W[i, j] x[j]``.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal, Sequence, cast

import numpy as np
import scipy.sparse as sp
from scipy.sparse import csgraph

from gossipjax.topology._plan import MAX_LISTED_ENTRIES, MixingPlan, check_dense_size, plan_from_matrix, sparse_shape

Stochasticity = Literal["row", "column", "doubly", "none"]
STOCHASTICITIES = ("row", "column", "doubly", "none")

_TOL = 1e-9
# How far a row or column sum may be from 1.
_SUM_TOL = 1e-6


class Topology:
  """A communication graph with its mixing weights, possibly time-varying.

  A topology is data: n, the period and, per step of the period, a sparse plan (self
  weights plus partial-permutation exchange rounds) of W(k). Algorithms and backends
  read ``plans()``; analysis reads ``sparse(step)`` or, for small n, ``matrix(step)``.
  Nothing here builds an n x n matrix unless asked for one.

  Args:
    matrices: W for a static topology or one per step of the period: dense arrays
      (n x n, a (period, n, n) stack or a sequence), ``scipy.sparse`` matrices, or
      ``MixingPlan`` objects.
    name: a short description, e.g. ``"ring(8)"``.

  Attributes:
    name: a short description, e.g. ``"ring(8)"``.
    num_nodes: n.
    period: number of distinct steps before W(k) repeats (1 when static).

  Example:
    >>> import numpy as np
    >>> from gossipjax import topology as T
    >>> g = T.Topology(np.array([[0.5, 0.5, 0.0], [0.5, 0.0, 0.5], [0.0, 0.5, 0.5]]), name="path(3)")
    >>> g, g.num_nodes, g.period
    (Topology(path(3), n=3, static), 3, 1)
    >>> g.check("doubly").sparse().nnz, len(g.plans()[0].rounds)
    (6, 2)
  """

  def __init__(self, matrices: Any, name: str = "custom"):
    self.name = name
    self._plans = _to_plans(matrices, name)
    self._sparse: dict[int, sp.csr_array] = {}
    # The weight rule a family built W with ("uniform", "metropolis", "push"), or None for a
    # user's own matrix: what a failed check suggests depends on it.
    self._rule: str | None = None

  @classmethod
  def from_plans(cls, plans: MixingPlan | Sequence[MixingPlan], name: str = "custom") -> "Topology":
    """A topology from its sparse plans, one per step (entries are checked as for matrices)."""
    return cls([plans] if isinstance(plans, MixingPlan) else list(plans), name=name)

  @property
  def num_nodes(self) -> int:
    """n, the number of nodes."""
    return self._plans[0].num_nodes

  @property
  def period(self) -> int:
    """The number of distinct steps before W(k) repeats (1 when static)."""
    return len(self._plans)

  @property
  def is_time_varying(self) -> bool:
    """True when W(k) changes from step to step (a period above 1)."""
    return self.period > 1

  def plans(self) -> tuple[MixingPlan, ...]:
    """One sparse plan per step of the period: what the backends execute."""
    return self._plans

  def sparse(self, step: int = 0) -> sp.csr_array:
    """W at ``step`` as a ``scipy.sparse`` CSR array (rows receive).

    Raises:
      ValueError: when W is dense, as ``complete(n)`` past ``MAX_DENSE_NODES`` nodes (its
        plan holds it as one rank-one term, ``11^T / n``).
    """
    k = int(step) % self.period
    if k not in self._sparse:
      self._sparse[k] = self._plans[k].sparse()
    return self._sparse[k]

  def matrix(self, step: int = 0) -> np.ndarray:
    """The dense mixing matrix used at ``step`` (rows receive).

    Raises:
      ValueError: past ``MAX_DENSE_NODES`` (8,192) nodes, where the dense matrix would take
        more than 512 MiB; use ``sparse(step)`` or ``plans()`` there.
    """
    check_dense_size(self.num_nodes, f"{self.name}.matrix")
    w = self._plans[int(step) % self.period].dense()
    w.setflags(write=False)
    return w

  @property
  def matrices(self) -> np.ndarray:
    """All matrices of one period, dense, shape (period, n, n) (small n only, as ``matrix``)."""
    check_dense_size(self.num_nodes, f"{self.name}.matrices", count=self.period)
    out = np.stack([p.dense() for p in self._plans])
    out.setflags(write=False)
    return out

  def max_degree(self) -> int:
    """Largest number of messages any node receives in one step (a rank-one term counts its senders)."""
    most = 0
    for plan in self._plans:
      received = np.zeros(self.num_nodes, np.int64)
      for r in plan.rounds:
        received += r.weight > 0
      for t in plan.rank_one:
        senders = np.count_nonzero(t.v)
        received += (t.u != 0) * (senders - (t.v != 0))
      most = max(most, int(received.max()))
    return most

  def check(self, stochastic: Stochasticity = "doubly", connected: bool = True) -> "Topology":
    """Raises ``ValueError`` unless W is stochastic as required (and connected).

    Runs on the sparse plans: O(n * degree) per step of the period.

    Args:
      stochastic: ``"row"`` (rows sum to 1: averaging), ``"column"`` (columns sum
        to 1: push-sum), ``"doubly"`` (both: the average is preserved) or ``"none"``.
      connected: require the union graph over one period to be strongly connected.

    Returns:
      ``self``, so a check can be chained.

    Raises:
      ValueError: W is not as required, or not connected; or ``stochastic`` is none of the
        four values (a misspelled value would otherwise check nothing). The message of a
        failed sum says what works instead: Metropolis weights on an undirected graph built
        by a family, `gj.sgp` with ``weights="push"`` or row / column mixing on a directed
        one, and what to change in a matrix of your own.
    """
    check_stochasticity(stochastic, f"{self.name}.check")
    for k, plan in enumerate(self._plans):
      where = f"{self.name}" + (f" at step {k}" if self.is_time_varying else "")
      for kind in ("row", "column"):
        if stochastic in (kind, "doubly"):
          sums = plan.row_sums() if kind == "row" else plan.column_sums()
          if np.abs(sums - 1.0).max() > _SUM_TOL:
            raise ValueError(_sum_message(sums, kind, where, stochastic, self._rule, _pattern_symmetric(plan)))
    if connected and not is_strongly_connected(self._reach_graph()):
      raise ValueError(
          f"{self.name}: the graph is not connected (over one period of {self.period} step(s)), "
          "so the nodes can never reach consensus"
      )
    return self

  def union_graph(self) -> sp.csr_array:
    """Boolean adjacency (``[i, j]``: i receives from j at some step of the period), sparse.

    Raises:
      ValueError: when the rank-one terms stand for more than ``MAX_DENSE_NODES ** 2``
        edges (``complete(n)`` past 8,192 nodes); ``check(connected=True)`` still works there.
    """
    n = self.num_nodes
    edges = [p.edges() for p in self._plans]
    dst = np.concatenate([d[w > 0] for d, _, w in edges])
    src = np.concatenate([s[w > 0] for _, s, w in edges])
    return sp.csr_array((np.ones(len(dst), bool), (dst, src)), shape=(n, n))

  def _reach_graph(self) -> sp.csr_array:
    """The union graph with one extra vertex per rank-one term, O(n) per term instead of O(n^2).

    Term ``u v^T`` joins every j with ``v_j > 0`` to every i with ``u_i > 0``; routing those
    edges through a vertex of its own (j -> t -> i) keeps who reaches whom among the nodes,
    so the graph is strongly connected exactly when the union graph is.
    """
    n = self.num_nodes
    dst, src, extra = [], [], n
    for p in self._plans:
      d, s_, w = p.round_edges()
      dst.append(d[w > 0])
      src.append(s_[w > 0])
      for t in p.rank_one:
        receivers, senders = np.flatnonzero(t.u > 0), np.flatnonzero(t.v > 0)
        if len(receivers) and len(senders):
          dst += [np.full(len(senders), extra), receivers]
          src += [senders, np.full(len(receivers), extra)]
          extra += 1
    dst, src = np.concatenate(dst), np.concatenate(src)
    return sp.csr_array((np.ones(len(dst), bool), (dst, src)), shape=(extra, extra))

  def is_symmetric(self) -> bool:
    """True when every W(k) equals its transpose (an undirected graph with symmetric weights).

    Where the rank-one terms are too many entries to list (``complete(n)`` past 8,192 nodes),
    the sparse part and the sum of the rank-one terms are tested apart (W is symmetric
    when both are): ``sum_k u_k v_k^T`` is symmetric when ``||U V^T - V U^T||_F = 0``,
    computed from the 2k x 2k Gram matrix of ``[U V]`` in O(n k^2).
    """
    for plan in self._plans:
      if plan.rank_one_entry_count() <= MAX_LISTED_ENTRIES:
        if not _sparse_symmetric(plan.sparse()):
          return False
      elif not (_sparse_symmetric(plan.sparse_part()) and _rank_one_symmetric(plan)):
        return False
    return True

  def fingerprint(self) -> str:
    """SHA-256 of n, the period and every plan's self weights, rounds and rank-one terms.

    Weights are rounded to 12 decimals, so round-off does not count; two topologies with
    the same fingerprint exchange the same messages with the same weights.
    """
    h = hashlib.sha256(np.asarray([self.num_nodes, self.period], np.int64).tobytes())

    def add(weights: np.ndarray) -> None:
      h.update((np.round(np.asarray(weights, np.float64), 12) + 0.0).tobytes())  # + 0.0: -0.0 hashes as 0.0

    for plan in self._plans:
      add(plan.self_weight)
      h.update(np.asarray([len(plan.rounds), len(plan.rank_one)], np.int64).tobytes())
      for r in plan.rounds:
        h.update(np.asarray(r.src, np.int64).tobytes())
        add(r.weight)
      for t in plan.rank_one:
        add(t.u)
        add(t.v)
    return h.hexdigest()

  def __repr__(self) -> str:
    kind = f"time-varying, period {self.period}" if self.is_time_varying else "static"
    return f"Topology({self.name}, n={self.num_nodes}, {kind})"


def _sparse_symmetric(w: sp.csr_array) -> bool:
  wt = w.T.tocsr()
  excess = abs(w - wt) - 1e-5 * abs(wt)  # np.allclose(w, w.T, atol=1e-12), entry by entry
  return not (excess.nnz and excess.max() > 1e-12)


def _rank_one_symmetric(plan: MixingPlan) -> bool:
  k = len(plan.rank_one)
  m = np.stack([t.u for t in plan.rank_one] + [t.v for t in plan.rank_one], axis=1)  # [U V], (n, 2k)
  gram = m.T @ m
  j = np.block([[np.zeros((k, k)), np.eye(k)], [-np.eye(k), np.zeros((k, k))]])  # U V^T - V U^T = M J M^T
  skew = float(np.trace(j @ gram @ j.T @ gram))  # ||M J M^T||_F^2
  scale = float(np.trace(gram)) ** 2
  return skew <= 1e-20 * max(scale, 1.0)


def _to_plans(matrices: Any, name: str) -> tuple[MixingPlan, ...]:
  """Validates the entries of W (every form) and returns its plans, one per step."""
  if isinstance(matrices, MixingPlan) or sp.issparse(matrices):
    matrices = [matrices]
  if isinstance(matrices, (list, tuple)) and any(isinstance(m, MixingPlan) or sp.issparse(m) for m in matrices):
    steps = list(matrices)
  else:
    mats = np.asarray(matrices, dtype=np.float64)
    if mats.ndim == 2:
      mats = mats[None]
    if mats.ndim != 3 or mats.shape[1] != mats.shape[2]:
      raise ValueError(f"{name}: a mixing matrix must be square n x n, got shape {mats.shape[1:]}")
    steps = list(mats)
  if not steps:
    raise ValueError(f"{name}: a topology needs at least one mixing matrix")
  entries = []
  for m in steps:
    if isinstance(m, MixingPlan):
      n = m.num_nodes
      dst, src, w = m.round_edges()
      nodes = np.arange(n)
      entries.append((np.concatenate([nodes, dst]), np.concatenate([nodes, src]), np.concatenate([m.self_weight, w])))
      _check_rank_one(m, name)
    elif sp.issparse(m):
      if len(m.shape) != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"{name}: a mixing matrix must be square n x n, got shape {m.shape}")
      coo = sp.coo_array(m, dtype=np.float64)
      n = sparse_shape(coo)[0]
      entries.append((coo.row, coo.col, coo.data))
    else:
      m = np.asarray(m, np.float64)
      if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"{name}: a mixing matrix must be square n x n, got shape {m.shape}")
      n = m.shape[0]
      i, j = np.nonzero(~np.isfinite(m) | (m < -_TOL))  # only the bad entries: the rest need no index
      entries.append((i, j, m[i, j]))
    if n == 0:
      raise ValueError(f"{name}: a topology needs at least one node")
    if n != _num_nodes(steps[0]):
      raise ValueError(f"{name}: every step's W must have the same n, got {_num_nodes(steps[0])} and {n}")
  _check_entries(entries, name)
  return tuple(m if isinstance(m, MixingPlan) else plan_from_matrix(m, name) for m in steps)


def _check_rank_one(plan: MixingPlan, name: str) -> None:
  """Rank-one terms need finite, non-negative ``u`` and ``v`` of length n (so every entry of u v^T is >= 0)."""
  for k, t in enumerate(plan.rank_one):
    for part in ("u", "v"):
      vec = np.asarray(getattr(t, part))
      if vec.shape != (plan.num_nodes,):
        raise ValueError(f"{name}: rank-one term {k} has {part} of shape {vec.shape}, expected ({plan.num_nodes},)")
      bad = np.flatnonzero(~np.isfinite(vec) | (vec < -_TOL))
      if len(bad):
        raise ValueError(f"{name}: rank-one term {k} has {part}[{bad[0]}] = {vec[bad[0]]:.6g}; "
                         "u and v must be finite and non-negative")


def _num_nodes(m: Any) -> int:
  return m.num_nodes if isinstance(m, MixingPlan) else m.shape[0]


def _check_entries(entries: list[tuple[np.ndarray, np.ndarray, np.ndarray]], name: str) -> None:
  """Refuses a non-finite entry anywhere, then a negative one, naming the first of each (step, row, column)."""
  at = lambda k: f" at step {k}" if len(entries) > 1 else ""
  for k, (i, j, v) in enumerate(entries):
    bad = np.flatnonzero(~np.isfinite(v))
    if len(bad):
      e = bad[np.lexsort((j[bad], i[bad]))[0]]
      raise ValueError(f"{name}: W has a non-finite entry W[{i[e]}, {j[e]}] = {v[e]}" + at(k))
  for k, (i, j, v) in enumerate(entries):
    bad = np.flatnonzero(v < -_TOL)
    if len(bad):
      e = bad[np.lexsort((j[bad], i[bad]))[0]]
      raise ValueError(f"{name}: W has a negative weight W[{i[e]}, {j[e]}] = {v[e]:.6g}" + at(k)
                       + "; mixing weights must be non-negative")


def check_stochasticity(stochastic: Any, what: str) -> None:
  """Refuses a ``stochastic=`` value other than the four, which would otherwise check nothing."""
  if not isinstance(stochastic, str) or stochastic not in STOCHASTICITIES:
    raise ValueError(f"{what}: stochastic must be one of 'row', 'column', 'doubly' or 'none', got {stochastic!r}")


def _sum_message(sums: np.ndarray, kind: str, where: str, required: str, rule: str | None, undirected: bool) -> str:
  """What is wrong with the sums of W, and what to use instead."""
  i = int(np.argmax(np.abs(sums - 1.0)))
  need = {"doubly": "doubly stochastic", "row": "row stochastic", "column": "column stochastic"}[required]
  message = f"{where}: W must be {need} but {kind} {i} sums to {sums[i]:.6g}"
  if rule is None:
    hint = f"the weights are your own: make every {kind} sum to 1"
    if required == "doubly" and undirected:
      hint += (", or take gj.topology.from_adjacency(W != 0, weights='metropolis'), doubly stochastic weights "
               "on the same edges")
  elif required == "doubly" and undirected:
    hint = (f"{rule} weights are only doubly stochastic on regular graphs: build the topology with "
            "weights='metropolis'")
  elif required == "doubly":
    hint = "a directed graph has no doubly stochastic weight rule here"
  else:
    hint = f"build the topology with weights='{'uniform' if kind == 'row' else 'push'}'"
  if required == "doubly" and not undirected:
    hint += ("; on a directed graph use gj.sgp (push-sum, column stochastic: weights='push'), or mix with "
             "gj.mixing.make_mixer(W, stochastic='row' | 'column') in a method of your own "
             "(the algorithms guide, 'Row and column mixing')")
  return f"{message} ({hint})"


def _pattern_symmetric(plan: MixingPlan) -> bool:
  """True when every edge of the plan goes both ways (an undirected graph, whatever its weights)."""
  try:
    pattern = cast(sp.csr_array, plan.sparse() != 0).astype(np.int8)  # scipy's != reads as object.__ne__
  except ValueError:  # rank-one terms too large to list: only exact averaging is that dense
    return True
  return (pattern - pattern.T).count_nonzero() == 0


def is_strongly_connected(adj: Any) -> bool:
  """True when every node reaches every other along edges ``adj[i, j]`` (j -> i).

  ``adj`` is a dense or ``scipy.sparse`` adjacency; the test is one strongly-connected-
  components pass (``scipy.sparse.csgraph``), O(n + edges).

  Args:
    adj: the n x n adjacency (non-zero entries are edges), dense or ``scipy.sparse``.

  Returns:
    Whether the directed graph is strongly connected (always True for one node).

  Example:
    >>> import numpy as np
    >>> from gossipjax import topology as T
    >>> T.is_strongly_connected(np.array([[0, 1], [0, 0]]))  # 1 -> 0 only
    False
    >>> T.is_strongly_connected(np.array([[0, 1], [1, 0]]))
    True
  """
  a = sp.csr_array(adj if sp.issparse(adj) else np.asarray(adj) != 0)
  if sparse_shape(a)[0] <= 1:
    return True
  a.eliminate_zeros()
  count, _ = csgraph.connected_components(a, directed=True, connection="strong")
  return count == 1
