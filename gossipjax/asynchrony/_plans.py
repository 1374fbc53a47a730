"""The simulators' views of a topology's sparse plans: exchange tables and peer lists.

Both are built from ``topology.plans()`` in O(period * n * degree), never from an n x n matrix.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import scipy.sparse as sp

from gossipjax.topology import MAX_DENSE_NODES, as_topology


class PlanTable(NamedTuple):
  """The plans of one period stacked into arrays (NumPy, to be closed over by jitted code).

  ``W(k) = diag(self_weight[k]) + sum_r P_{k,r} diag(weight[k, r])``: receiver i gets
  ``weight[k, r, i] * x[src[k, r, i]]`` in round r of step k. Steps with fewer rounds than
  the longest are padded with rounds of weight 0 from the node itself.

  Attributes:
    self_weight: float (period, n).
    src: int32 (period, rounds, n).
    weight: float (period, rounds, n).
  """

  self_weight: np.ndarray
  src: np.ndarray
  weight: np.ndarray


def plan_table(topology: Any) -> PlanTable:
  """Stacks the plans of one period; rank-one terms (a star's hub, ``complete``) become exchange rounds.

  The simulators read W edge by edge (a message per edge, a loss per link), so a hub's
  rank-one term is listed as its edges: fine for a star or a complete graph up to
  ``MAX_DENSE_NODES`` nodes, refused past it with a ``ValueError`` that names the topology.
  """
  topo = as_topology(topology)
  try:
    plans = [p.expanded(topo.name) for p in topo.plans()]
  except ValueError as e:
    raise ValueError(
        f"{topo.name}: the asynchronous and fault simulators send one message per edge, and this topology's "
        f"rank-one terms (a hub talking to every node, or exact averaging) stand for too many edges at "
        f"n = {topo.num_nodes}. Use a sparse graph at this size (ring, torus, exponential, one_peer_exponential), "
        f"or build the star / complete graph with at most {MAX_DENSE_NODES} nodes ({e})") from e
  n, rounds = plans[0].num_nodes, max(len(p.rounds) for p in plans)
  src = np.tile(np.arange(n, dtype=np.int32), (len(plans), rounds, 1))
  weight = np.zeros((len(plans), rounds, n))
  for k, p in enumerate(plans):
    for r, rnd in enumerate(p.rounds):
      src[k, r], weight[k, r] = rnd.src, rnd.weight
  return PlanTable(np.stack([np.asarray(p.self_weight, np.float64) for p in plans]), src, weight)


def column_sums(table: PlanTable) -> np.ndarray:
  """float (period, n): the column sums of every W(k) (what a sender gives away in all)."""
  period, _, n = table.src.shape
  sums = table.self_weight.copy()
  for k in range(period):
    sums[k] += np.bincount(table.src[k].ravel(), table.weight[k].ravel(), minlength=n)
  return sums


def peer_lists(topology: Any) -> tuple[np.ndarray, np.ndarray]:
  """The neighbours of every node in the undirected union graph over one period, as CSR.

  Returns:
    ``(indptr, indices)``: node i's peers are ``indices[indptr[i]:indptr[i + 1]]``, sorted,
    without i itself.
  """
  table = plan_table(topology)
  n = table.src.shape[-1]
  on = table.weight != 0
  dst = np.broadcast_to(np.arange(n), table.src.shape)[on]
  src = table.src[on]
  rows, cols = np.concatenate([dst, src]), np.concatenate([src, dst])
  off = rows != cols
  adj = sp.csr_array((np.ones(int(off.sum()), bool), (rows[off], cols[off])), shape=(n, n))
  adj.sum_duplicates()
  adj.sort_indices()
  return adj.indptr.astype(np.int32), adj.indices.astype(np.int32)
