"""The `Topology` type: mixing matrices W(k), their sparse plan, validation and spectral facts.

Convention: rows receive. ``x_new[i] = sum_j W[i, j] x[j]``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

import numpy as np

Stochasticity = Literal["row", "column", "doubly", "none"]

_TOL = 1e-9


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
    return tuple((int(self.src[i]), i) for i in np.flatnonzero(self.weight))


@dataclasses.dataclass(frozen=True, eq=False)
class MixingPlan:
  """``W = diag(self_weight) + sum_c P_c diag(rounds[c].weight)`` for one step."""

  self_weight: np.ndarray
  rounds: tuple[Round, ...]

  @property
  def num_nodes(self) -> int:
    return self.self_weight.shape[0]

  def dense(self) -> np.ndarray:
    """The n x n matrix this plan applies (for tests and analysis)."""
    n = self.num_nodes
    w = np.diag(self.self_weight).astype(np.float64)
    for r in self.rounds:
      w[np.arange(n), r.src] += r.weight
    return w


def plan_from_matrix(w: np.ndarray) -> MixingPlan:
  """Edge-colours the off-diagonal support of ``w`` into partial permutations.

  Edges are coloured greedily in order of their cyclic offset ``(j - i) mod n``, so a
  circulant graph (ring, exponential, torus rows) gets one full shift per offset and any
  graph gets at most ``2 * max_degree - 1`` rounds.
  """
  n = w.shape[0]
  dst, src = np.nonzero(w * (1 - np.eye(n)))
  order = np.lexsort((dst, (src - dst) % n))
  received: list[set[int]] = [set() for _ in range(n)]  # colours used by each receiver
  sent: list[set[int]] = [set() for _ in range(n)]  # colours used by each sender
  colours: list[list[tuple[int, int]]] = []
  for e in order:
    i, j = int(dst[e]), int(src[e])
    c = 0
    while c in received[i] or c in sent[j]:
      c += 1
    if c == len(colours):
      colours.append([])
    colours[c].append((j, i))
    received[i].add(c)
    sent[j].add(c)
  rounds = []
  for edges in colours:
    src_arr = np.arange(n)
    weight = np.zeros(n)
    for j, i in edges:
      src_arr[i] = j
      weight[i] = w[i, j]
    shift = None
    if len(edges) == n:
      offsets = (src_arr - np.arange(n)) % n
      if np.all(offsets == offsets[0]):
        shift = int(offsets[0])
    rounds.append(Round(src=src_arr, weight=weight, shift=shift))
  return MixingPlan(self_weight=np.diag(w).copy(), rounds=tuple(rounds))


class Topology:
  """A communication graph with its mixing weights, possibly time-varying.

  A topology is data: n, the period and one n x n matrix per step of the period.
  Algorithms read the sparse plans; analysis reads the dense matrices.

  Attributes:
    name: a short description, e.g. ``"ring(8)"``.
    num_nodes: n.
    period: number of distinct steps before W(k) repeats (1 when static).
  """

  def __init__(self, matrices: np.ndarray | Sequence[np.ndarray], name: str = "custom"):
    mats = np.asarray(matrices, dtype=np.float64)
    if mats.ndim == 2:
      mats = mats[None]
    if mats.ndim != 3 or mats.shape[1] != mats.shape[2]:
      raise ValueError(f"{name}: a mixing matrix must be square n x n, got shape {mats.shape[1:]}")
    if mats.shape[1] == 0:
      raise ValueError(f"{name}: a topology needs at least one node")
    _check_entries(mats, name)
    mats.setflags(write=False)
    self._matrices = mats
    self.name = name
    self._plans: tuple[MixingPlan, ...] | None = None

  @property
  def num_nodes(self) -> int:
    return self._matrices.shape[1]

  @property
  def period(self) -> int:
    return self._matrices.shape[0]

  @property
  def is_time_varying(self) -> bool:
    return self.period > 1

  def matrix(self, step: int = 0) -> np.ndarray:
    """The dense mixing matrix used at ``step`` (rows receive)."""
    return self._matrices[int(step) % self.period]

  @property
  def matrices(self) -> np.ndarray:
    """All matrices of one period, shape (period, n, n)."""
    return self._matrices

  def plans(self) -> tuple[MixingPlan, ...]:
    """One sparse plan per step of the period (built once, then cached)."""
    if self._plans is None:
      self._plans = tuple(plan_from_matrix(m) for m in self._matrices)
    return self._plans

  def max_degree(self) -> int:
    """Largest number of messages any node receives in one step."""
    off = self._matrices * (1 - np.eye(self.num_nodes))
    return int((off > 0).sum(axis=2).max())

  def check(self, stochastic: Stochasticity = "doubly", connected: bool = True) -> "Topology":
    """Raises ``ValueError`` unless W is stochastic as required (and connected).

    Args:
      stochastic: ``"row"`` (rows sum to 1: averaging), ``"column"`` (columns sum
        to 1: push-sum), ``"doubly"`` (both: the average is preserved) or ``"none"``.
      connected: require the union graph over one period to be strongly connected.

    Returns:
      ``self``, so a check can be chained.
    """
    for k, m in enumerate(self._matrices):
      where = f"{self.name}" + (f" at step {k}" if self.is_time_varying else "")
      if stochastic in ("row", "doubly"):
        _check_sums(m.sum(axis=1), "row", where, stochastic)
      if stochastic in ("column", "doubly"):
        _check_sums(m.sum(axis=0), "column", where, stochastic)
    if connected and not is_strongly_connected(self._matrices.sum(axis=0) > 0):
      raise ValueError(
          f"{self.name}: the graph is not connected (over one period of {self.period} step(s)), "
          "so the nodes can never reach consensus"
      )
    return self

  def is_symmetric(self) -> bool:
    """True when every W(k) equals its transpose (an undirected graph with symmetric weights)."""
    return bool(np.allclose(self._matrices, self._matrices.transpose(0, 2, 1), atol=1e-12))

  def __repr__(self) -> str:
    kind = f"time-varying, period {self.period}" if self.is_time_varying else "static"
    return f"Topology({self.name}, n={self.num_nodes}, {kind})"


def _check_entries(mats: np.ndarray, name: str) -> None:
  bad = ~np.isfinite(mats)
  if bad.any():
    k, i, j = np.argwhere(bad)[0]
    raise ValueError(f"{name}: W has a non-finite entry W[{i}, {j}] = {mats[k, i, j]}" + (
        f" at step {k}" if mats.shape[0] > 1 else ""))
  neg = mats < -_TOL
  if neg.any():
    k, i, j = np.argwhere(neg)[0]
    raise ValueError(f"{name}: W has a negative weight W[{i}, {j}] = {mats[k, i, j]:.6g}"
                     + (f" at step {k}" if mats.shape[0] > 1 else "")
                     + "; mixing weights must be non-negative")


def _check_sums(sums: np.ndarray, kind: str, where: str, required: str) -> None:
  off = np.abs(sums - 1.0) > 1e-6
  if off.any():
    i = int(np.argmax(np.abs(sums - 1.0)))
    need = {"doubly": "doubly stochastic", "row": "row stochastic", "column": "column stochastic"}[required]
    hint = ""
    if required == "doubly" and kind == "column":
      hint = (" (uniform 1/(degree+1) weights are only doubly stochastic on regular graphs: "
              "build the topology with weights='metropolis')")
    raise ValueError(f"{where}: W must be {need} but {kind} {i} sums to {sums[i]:.6g}{hint}")


def is_strongly_connected(adj: np.ndarray) -> bool:
  """True when every node reaches every other along edges ``adj[i, j]`` (j -> i)."""
  n = adj.shape[0]
  adj = adj | np.eye(n, dtype=bool)
  for a in (adj, adj.T):
    seen = np.zeros(n, bool)
    seen[0] = True
    frontier = seen.copy()
    while frontier.any():
      new = a[:, frontier].any(axis=1) & ~seen
      seen |= new
      frontier = new
    if not seen.all():
      return False
  return True


def rho(topology: "Topology | np.ndarray", step: int = 0) -> float:
  """``||W - 11^T/n||_2``, the rate at which one gossip step contracts disagreement.

  For a time-varying topology this is the value at ``step``; use
  ``rho(product_over_period)`` for the per-period rate.
  """
  w = topology.matrix(step) if isinstance(topology, Topology) else np.asarray(topology, np.float64)
  n = w.shape[0]
  return float(np.linalg.norm(w - np.full((n, n), 1.0 / n), ord=2))


def spectral_gap(topology: "Topology | np.ndarray", step: int = 0) -> float:
  """``1 - rho(W)``."""
  return 1.0 - rho(topology, step)
