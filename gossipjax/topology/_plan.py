"""The sparse form of a mixing matrix: self weights plus partial-permutation rounds.

Every topology is stored in this form and every family builds it directly, in
O(n * degree) memory and time; the dense n x n matrix is only ever a view.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import scipy.sparse as sp

# Past this many nodes a dense n x n float64 matrix (512 MiB at 8,192) is refused: it is a
# view for analysis and tests, and the sparse form holds the same numbers in O(n * degree).
MAX_DENSE_NODES = 8192


def check_dense_size(n: int, what: str, count: int = 1) -> None:
  """Refuses ``count`` dense n x n matrices past ``MAX_DENSE_NODES ** 2`` entries in all."""
  if count * n * n > MAX_DENSE_NODES**2:
    raise ValueError(
        f"{what}: {'a dense' if count == 1 else f'{count} dense'} {n} x {n} "
        f"{'matrix' if count == 1 else 'matrices'} would take {count * n * n * 8 / 2**30:.1f} GiB; "
        f"dense mixing matrices are built only up to n = {MAX_DENSE_NODES} nodes. Use the sparse form: "
        "topology.sparse(step) (a scipy.sparse CSR matrix) or topology.plans() (self weights and exchange rounds)"
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
class MixingPlan:
  """``W = diag(self_weight) + sum_c P_c diag(rounds[c].weight)`` for one step."""

  self_weight: np.ndarray
  rounds: tuple[Round, ...]

  @property
  def num_nodes(self) -> int:
    return self.self_weight.shape[0]

  def edges(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The off-diagonal entries as ``(receiver, sender, weight)`` arrays, round by round."""
    dst = [np.flatnonzero(r.weight) for r in self.rounds]
    return (np.concatenate(dst or [np.zeros(0, np.int64)]),
            np.concatenate([r.src[d] for r, d in zip(self.rounds, dst)] or [np.zeros(0, np.int64)]),
            np.concatenate([r.weight[d] for r, d in zip(self.rounds, dst)] or [np.zeros(0)]))

  def row_sums(self) -> np.ndarray:
    out = self.self_weight.astype(np.float64)
    for r in self.rounds:
      out = out + r.weight
    return out

  def column_sums(self) -> np.ndarray:
    out = self.self_weight.astype(np.float64)
    for r in self.rounds:
      out = out + np.bincount(r.src, weights=r.weight, minlength=self.num_nodes)
    return out

  def sparse(self) -> sp.csr_array:
    """The n x n matrix this plan applies, as a ``scipy.sparse`` CSR array."""
    n = self.num_nodes
    dst, src, w = self.edges()
    keep = np.flatnonzero(self.self_weight)
    return sp.csr_array((np.concatenate([self.self_weight[keep], w]),
                         (np.concatenate([keep, dst]), np.concatenate([keep, src]))), shape=(n, n))

  def dense(self) -> np.ndarray:
    """The n x n matrix this plan applies (for tests and analysis; small n only)."""
    n = self.num_nodes
    check_dense_size(n, "MixingPlan.dense")
    w = np.diag(self.self_weight).astype(np.float64)
    for r in self.rounds:
      w[np.arange(n), r.src] += r.weight
    return w


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
    n = m.shape[0]
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
  """The plan of ``W^T``: every edge reversed (the push form of a pull graph)."""
  dst, src, w = plan.edges()
  return plan_from_edges(plan.num_nodes, src, dst, w, plan.self_weight)
