"""The sparse form of a mixing matrix: self weights, partial-permutation rounds and rank-one terms.

Every topology is stored in this form and every family builds it directly, in
O(n * degree) memory and time; the dense n x n matrix is only ever a view. A node of
degree close to n (the hub of a star, every node of the complete graph) would need about
n rounds of n entries; such rows and columns are held as rank-one terms ``u v^T`` instead,
which every backend applies as one reduction over the node axis (``sum``, ``psum``, an MPI
all-reduce) and a per-node scale: O(n) memory and O(n * d) work per term.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, cast

import numpy as np
import scipy.sparse as sp

# Past this many nodes a dense n x n float64 matrix (512 MiB at 8,192) is refused: it is a
# view for analysis and tests, and the sparse form holds the same numbers in O(n * degree).
MAX_DENSE_NODES = 8192
# Past this many entries the rank-one terms of a plan are not listed (as many as the largest dense W holds).
MAX_LISTED_ENTRIES = MAX_DENSE_NODES**2


def sparse_shape(a: sp.coo_array | sp.csr_array) -> tuple[int, ...]:
  """``a.shape``: scipy leaves it unannotated, and a type checker reads it as Optional (``None`` before ``__init__``)."""
  return cast("tuple[int, ...]", a.shape)


def check_dense_size(n: int, what: str, count: int = 1) -> None:
  """Refuses ``count`` dense n x n matrices past ``MAX_DENSE_NODES ** 2`` entries in all."""
  if count * n * n > MAX_DENSE_NODES**2:
    raise ValueError(
        f"{what}: {'a dense' if count == 1 else f'{count} dense'} {n} x {n} "
        f"{'matrix' if count == 1 else 'matrices'} would take {count * n * n * 8 / 2**30:.1f} GiB; "
        f"dense mixing matrices are built only up to n = {MAX_DENSE_NODES} nodes. Use the sparse form: "
        "topology.sparse(step) (a scipy.sparse CSR matrix) or topology.plans() (self weights and exchange rounds)"
    )


def check_entry_count(count: int, what: str) -> None:
  """Refuses to list more than ``MAX_DENSE_NODES ** 2`` matrix entries (as many as the largest dense W holds)."""
  if count > MAX_LISTED_ENTRIES:
    raise ValueError(
        f"{what}: the rank-one terms of this plan stand for {count:,} matrix entries "
        f"({count * 24 / 2**30:.1f} GiB as a sparse matrix); entry lists are built only up to "
        f"{MAX_DENSE_NODES}**2 entries, like dense matrices. The plan itself (topology.plans(): self weights, "
        "exchange rounds and rank-one terms u v^T) holds W in O(n), and check(), rho() and every backend use it"
    )


def check_degree(n: int, degree: int, what: str) -> None:
  """Refuses a plan whose rounds (at least one array of n per unit of degree) outgrow the dense cap."""
  if degree * n > MAX_DENSE_NODES**2:
    raise ValueError(
        f"{what}: a node of degree {degree} needs at least {degree} exchange rounds of {n} entries each "
        f"({degree * n * 16 / 2**30:.1f} GiB); plans are built up to {MAX_DENSE_NODES}**2 round entries. "
        "Use a sparser graph (ring, torus, exponential, one_peer_exponential) at this size"
    )


@dataclasses.dataclass(frozen=True, eq=False)
class Round:
  """One exchange round of a sparse plan: a partial permutation with per-receiver weights.

  Receiver ``i`` adds ``weight[i] * x[src[i]]``. Where ``weight[i] == 0`` node ``i``
  receives nothing in this round (``src[i] == i`` then, by convention). Among receivers
  with a non-zero weight, ``src`` is injective, so the round is one ``ppermute`` /
  one ``sendrecv`` per node.

  Attributes:
    src: int array (n,), the node each receiver reads from.
    weight: float array (n,), the weight of that message at the receiver.
    shift: ``h`` when the round is the full cyclic shift ``src[i] = (i + h) % n``
      for every node, else ``None`` (the simulator then uses ``roll`` instead of a gather).

  Example:
    The rounds of a ring of 4 are the shifts by 1 and by -1:

    >>> from gossipjax import topology as T
    >>> first = T.ring(4).plans()[0].rounds[0]
    >>> first.src.tolist(), first.shift, first.pairs
    ([1, 2, 3, 0], 1, ((1, 0), (2, 1), (3, 2), (0, 3)))
  """

  src: np.ndarray
  weight: np.ndarray
  shift: int | None

  @property
  def pairs(self) -> tuple[tuple[int, int], ...]:
    """``(source, destination)`` pairs, the form ``lax.ppermute`` takes."""
    dst = np.flatnonzero(self.weight)
    return tuple(zip(self.src[dst].tolist(), dst.tolist()))


@dataclasses.dataclass(frozen=True, eq=False)
class RankOne:
  """A rank-one term ``u v^T`` of a plan: node i receives ``u[i] * sum_j v[j] x[j]``.

  Applying it is one weighted reduction over the node axis and a per-node scale, so a
  hub's row (``u = e_hub``), a hub's column (``v = e_hub``) or exact averaging
  (``u = 1``, ``v = 1/n``) costs O(n * d), not one exchange round per neighbour.

  Attributes:
    u: float array (n,), the receivers' scales (non-negative).
    v: float array (n,), the senders' weights (non-negative).

  Example:
    ``complete(4)`` is one term, exact averaging:

    >>> from gossipjax import topology as T
    >>> term = T.complete(4).plans()[0].rank_one[0]
    >>> term.u.tolist(), term.v.tolist(), term.is_constant
    ([1.0, 1.0, 1.0, 1.0], [0.25, 0.25, 0.25, 0.25], True)
  """

  u: np.ndarray
  v: np.ndarray

  @property
  def is_constant(self) -> bool:
    """True when ``u v^T`` has the same value everywhere (a multiple of 11^T, as in exact averaging)."""
    return bool(np.all(self.u == self.u[0]) and np.all(self.v == self.v[0]) and self.u[0] * self.v[0] != 0)

  def entry_count(self) -> int:
    """How many non-zero entries ``u v^T`` has."""
    return int(np.count_nonzero(self.u)) * int(np.count_nonzero(self.v))

  def entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The non-zero entries of ``u v^T`` as ``(receiver, sender, weight)`` (diagonal included)."""
    rows, cols = np.flatnonzero(self.u), np.flatnonzero(self.v)
    dst, src = np.repeat(rows, len(cols)), np.tile(cols, len(rows))
    return dst, src, self.u[dst] * self.v[src]


def make_rank_one(u: np.ndarray, v: np.ndarray) -> RankOne:
  """A read-only ``RankOne`` term from two length-n vectors."""
  u, v = np.array(u, np.float64), np.array(v, np.float64)
  u.setflags(write=False)
  v.setflags(write=False)
  return RankOne(u=u, v=v)


@dataclasses.dataclass(frozen=True, eq=False)
class MixingPlan:
  r"""``W = diag(self_weight) + sum_c P_c diag(rounds[c].weight) + sum_k rank_one[k].u rank_one[k].v^T``, one step.

  .. math::
    W = \mathrm{diag}(s) + \sum_c P_c\, \mathrm{diag}(w_c) + \sum_k u_k v_k^\top,

  with :math:`P_c` the partial permutation of round c: receiver i gets
  ``rounds[c].weight[i] * x[rounds[c].src[i]]``. What `Topology.plans` returns, one per
  step of the period, and what every backend executes.

  Attributes:
    self_weight: float array (n,), the diagonal of W: what each node keeps of its own value.
    rounds: the exchange rounds (`Round`), each a partial permutation with per-receiver
      weights.
    rank_one: the rank-one terms (`RankOne`), for hubs and exact averaging.

  Example:
    Half of each node's own value plus half of the average:

    >>> import numpy as np
    >>> from gossipjax import topology as T
    >>> half = T.RankOne(u=np.full(3, 0.5), v=np.full(3, 1 / 3))
    >>> plan = T.MixingPlan(self_weight=np.full(3, 0.5), rounds=(), rank_one=(half,))
    >>> print(T.Topology.from_plans(plan).matrix().round(3))
    [[0.667 0.167 0.167]
     [0.167 0.667 0.167]
     [0.167 0.167 0.667]]
  """

  self_weight: np.ndarray
  rounds: tuple[Round, ...]
  rank_one: tuple[RankOne, ...] = ()

  @property
  def num_nodes(self) -> int:
    return self.self_weight.shape[0]

  def round_edges(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The entries the rounds hold as ``(receiver, sender, weight)`` arrays, round by round."""
    dst = [np.flatnonzero(r.weight) for r in self.rounds]
    return (np.concatenate(dst or [np.zeros(0, np.int64)]),
            np.concatenate([r.src[d] for r, d in zip(self.rounds, dst)] or [np.zeros(0, np.int64)]),
            np.concatenate([r.weight[d] for r, d in zip(self.rounds, dst)] or [np.zeros(0)]))

  def rank_one_entry_count(self) -> int:
    """How many entries the rank-one terms stand for (n^2 for exact averaging)."""
    return sum(t.entry_count() for t in self.rank_one)

  def edges(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The off-diagonal entries as ``(receiver, sender, weight)`` arrays: rounds first, then rank-one terms.

    Entries of different rank-one terms (or of a term and a round) at the same place come
    separately. Raises ``ValueError`` when the rank-one terms stand for more than
    ``MAX_DENSE_NODES ** 2`` entries.
    """
    dst, src, w = self.round_edges()
    if not self.rank_one:
      return dst, src, w
    check_entry_count(self.rank_one_entry_count(), "MixingPlan.edges")
    parts = [t.entries() for t in self.rank_one]
    off = [d != s for d, s, _ in parts]
    return (np.concatenate([dst] + [d[o] for (d, _, _), o in zip(parts, off)]),
            np.concatenate([src] + [s[o] for (_, s, _), o in zip(parts, off)]),
            np.concatenate([w] + [v[o] for (_, _, v), o in zip(parts, off)]))

  def row_sums(self) -> np.ndarray:
    out = self.self_weight.astype(np.float64)
    for r in self.rounds:
      out = out + r.weight
    for t in self.rank_one:
      out = out + t.u * np.sum(t.v)
    return out

  def column_sums(self) -> np.ndarray:
    out = self.self_weight.astype(np.float64)
    for r in self.rounds:
      out = out + np.bincount(r.src, weights=r.weight, minlength=self.num_nodes)
    for t in self.rank_one:
      out = out + t.v * np.sum(t.u)
    return out

  def sparse_part(self) -> sp.csr_array:
    """``diag(self_weight) + sum_c P_c diag(w_c)`` (W without its rank-one terms), as CSR; O(n * degree)."""
    n = self.num_nodes
    dst, src, w = self.round_edges()
    keep = np.flatnonzero(self.self_weight)
    return sp.csr_array((np.concatenate([self.self_weight[keep], w]),
                         (np.concatenate([keep, dst]), np.concatenate([keep, src]))), shape=(n, n))

  def sparse(self) -> sp.csr_array:
    """The n x n matrix this plan applies, as a ``scipy.sparse`` CSR array.

    Raises:
      ValueError: when the rank-one terms stand for more than ``MAX_DENSE_NODES ** 2``
        entries (``complete(n)`` past 8,192 nodes is dense); the plan holds W in O(n).
    """
    if not self.rank_one:
      return self.sparse_part()
    n = self.num_nodes
    check_entry_count(self.rank_one_entry_count(), "MixingPlan.sparse")
    coo, entries = self.sparse_part().tocoo(), [t.entries() for t in self.rank_one]
    rows = np.concatenate([coo.row] + [d for d, _, _ in entries])
    cols = np.concatenate([coo.col] + [s for _, s, _ in entries])
    vals = np.concatenate([coo.data] + [v for _, _, v in entries])
    return sp.csr_array((vals, (rows, cols)), shape=(n, n))

  def dense(self) -> np.ndarray:
    """The n x n matrix this plan applies (for tests and analysis; small n only)."""
    n = self.num_nodes
    check_dense_size(n, "MixingPlan.dense")
    w = np.diag(self.self_weight).astype(np.float64)
    for r in self.rounds:
      w[np.arange(n), r.src] += r.weight
    for t in self.rank_one:
      w += np.outer(t.u, t.v)
    return w

  def matvec(self, x: np.ndarray) -> np.ndarray:
    """``W x`` for a NumPy array with the nodes on axis 0, in O(n * (degree + rank-one terms)) per column."""
    out = self.sparse_part() @ x
    for t in self.rank_one:
      out = out + np.multiply.outer(t.u, np.tensordot(t.v, x, axes=1))
    return out

  def expanded(self, what: str = "topology") -> "MixingPlan":
    """The same W with every rank-one term turned into exchange rounds (for code that only reads rounds).

    A constant term (a multiple of 11^T) becomes one cyclic shift per offset, any other one
    its edges, edge-coloured. Like every plan, the rounds are refused past
    ``MAX_DENSE_NODES ** 2`` entries (a hub of degree d needs d rounds of n).
    """
    if not self.rank_one:
      return self
    n = self.num_nodes
    if all(t.is_constant for t in self.rank_one) and not self.rounds:
      c = sum(float(t.u[0] * t.v[0]) for t in self.rank_one)
      check_degree(n, n - 1, what)
      nodes = np.arange(n)
      shifts = tuple(make_round(n, nodes, (nodes + h) % n, np.full(n, c)) for h in range(1, n))
      self_w = np.array(self.self_weight + c)
      self_w.setflags(write=False)
      return MixingPlan(self_weight=self_w, rounds=shifts)
    check_entry_count(self.rank_one_entry_count(), what)
    return plan_from_matrix(self.sparse(), what)


def make_round(n: int, dst: np.ndarray, src: np.ndarray, weight: np.ndarray) -> Round:
  """A round from its edges (receivers distinct, senders distinct), with its shift when it is one."""
  src_arr = np.arange(n)
  w = np.zeros(n)
  src_arr[dst] = src
  w[dst] = weight
  shift = None
  if len(dst) == n:
    offsets = (src_arr - np.arange(n)) % n
    if np.all(offsets == offsets[0]):
      shift = int(offsets[0])
  src_arr.setflags(write=False)
  w.setflags(write=False)
  return Round(src=src_arr, weight=w, shift=shift)


def circulant_plan(n: int, offsets: Sequence[int], weight: float, self_weight: float,
                   what: str = "topology") -> MixingPlan:
  """Every node receives ``weight`` from ``i + h`` for each offset ``h``: one shift per offset.

  The offsets come out in increasing order, as ``plan_from_edges`` colours them.
  """
  offsets = sorted({int(h) % n for h in offsets} - {0})
  check_degree(n, len(offsets), what)
  self_w = np.full(n, float(self_weight))
  self_w.setflags(write=False)
  nodes = np.arange(n)
  rounds = tuple(make_round(n, nodes, (nodes + h) % n, np.full(n, float(weight))) for h in offsets)
  return MixingPlan(self_weight=self_w, rounds=rounds)


def edge_colours(n: int, dst: np.ndarray, src: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Greedy edge colouring in order of cyclic offset ``(src - dst) mod n``, then receiver.

  Returns ``(order, colour)``: the edges sorted as coloured and the colour of each. Each
  edge takes the smallest colour its receiver has not received on and its sender has not
  sent on. The edges of one offset share no receiver and no sender, so a whole offset is
  coloured at once: O(number of offsets) array operations, O(edges * colours) work.
  """
  if not len(dst):
    return np.zeros(0, np.int64), np.zeros(0, np.int64)
  off = (src - dst) % n
  order = np.lexsort((dst, off))
  dst, src, off = dst[order], src[order], off[order]
  starts = np.concatenate([[0], np.flatnonzero(np.diff(off)) + 1, [len(off)]])
  colour = np.empty(len(dst), np.int64)
  width, used = 4, 0
  received = np.zeros((n, width), bool)
  sent = np.zeros((n, width), bool)
  for a, b in zip(starts[:-1], starts[1:]):
    d, s = dst[a:b], src[a:b]
    busy = received[d] | sent[s]
    c = np.argmin(busy, axis=1)
    full = busy[np.arange(len(c)), c]
    if full.any():  # every colour so far is taken at some edge: open the next one
      c[full] = used
      if used == width:
        width *= 2
        received = np.pad(received, ((0, 0), (0, width - received.shape[1])))
        sent = np.pad(sent, ((0, 0), (0, width - sent.shape[1])))
    used = max(used, int(c.max()) + 1)
    received[d, c] = True
    sent[s, c] = True
    colour[a:b] = c
  return order, colour


def plan_from_edges(n: int, dst: np.ndarray, src: np.ndarray, weight: np.ndarray,
                    self_weight: np.ndarray, what: str = "topology") -> MixingPlan:
  """Edge-colours an off-diagonal edge list (``dst`` receives from ``src``) into rounds.

  A circulant graph (ring, exponential, torus rows) gets one full shift per offset and any
  graph at most ``2 * max_degree - 1`` rounds (each an array of n), so a node of degree d
  costs d arrays of n: graphs with a hub (star, complete) are refused past
  ``MAX_DENSE_NODES ** 2`` round entries, like the dense matrix.
  """
  dst, src = np.asarray(dst, np.int64), np.asarray(src, np.int64)
  weight = np.asarray(weight, np.float64)
  if len(dst):
    check_degree(n, int(max(np.bincount(dst, minlength=n).max(), np.bincount(src, minlength=n).max())), what)
  order, colour = edge_colours(n, dst, src)
  dst, src, weight = dst[order], src[order], weight[order]
  by_colour = np.argsort(colour, kind="stable")
  bounds = np.searchsorted(colour[by_colour], np.arange(int(colour.max(initial=-1)) + 2))
  rounds = tuple(make_round(n, dst[e], src[e], weight[e])
                 for e in (by_colour[a:b] for a, b in zip(bounds[:-1], bounds[1:])))
  self_w = np.array(self_weight, np.float64)
  self_w.setflags(write=False)
  return MixingPlan(self_weight=self_w, rounds=rounds)


def plan_from_matrix(w: np.ndarray | sp.sparray | sp.spmatrix, what: str = "topology") -> MixingPlan:
  """The plan of a dense or ``scipy.sparse`` matrix (its non-zero off-diagonal entries are the edges)."""
  if sp.issparse(w):
    m = sp.coo_array(w, dtype=np.float64)
    m.sum_duplicates()
    n = sparse_shape(m)[0]
    off = m.row != m.col
    self_w = np.zeros(n)
    self_w[m.row[~off]] = m.data[~off]
    keep = off & (m.data != 0)
    return plan_from_edges(n, m.row[keep], m.col[keep], m.data[keep], self_w, what)
  w = np.asarray(w, np.float64)
  n = w.shape[0]
  dst, src = np.nonzero(w)
  off = dst != src
  dst, src = dst[off], src[off]
  return plan_from_edges(n, dst, src, w[dst, src], np.diag(w).copy(), what)


def reversed_plan(plan: MixingPlan) -> MixingPlan:
  """The plan of ``W^T``: every edge reversed (the push form of a pull graph), ``u`` and ``v`` swapped."""
  dst, src, w = plan.round_edges()
  out = plan_from_edges(plan.num_nodes, src, dst, w, plan.self_weight)
  if not plan.rank_one:
    return out
  return dataclasses.replace(out, rank_one=tuple(make_rank_one(t.v, t.u) for t in plan.rank_one))
