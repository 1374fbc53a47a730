"""The simulators' views of a topology's sparse plans: column sums and peer lists.

Built from the exchange table (`gossipjax.backend._table.plan_table`, the one the mixing
kernel reads) in O(period * n * degree), never from an n x n matrix.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse as sp

from gossipjax.backend._table import PlanTable, plan_table

__all__ = ("PlanTable", "column_sums", "peer_lists", "plan_table")


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
