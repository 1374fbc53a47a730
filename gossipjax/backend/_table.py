"""Mixing from a table: one period of exchange rounds stacked into arrays, applied by gathers.

The form that code indexing W by a traced step, or editing its weights edge by edge, reads:
the simulate backend's long periods (one compiled program for every step) and the fault
simulator (weights of down nodes and lost messages dropped). Both mix through `mix_from_table`,
which follows the library's two leaf rules: 16-bit floats are summed in float32 and rounded
once (`accumulation_dtype`), and a leaf that is not a float (a step counter, an RNG key) is
left as it is. Built from ``topology.plans()`` in O(period * n * degree), never from an n x n
matrix.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gossipjax.backend._precision import accumulation_dtype
from gossipjax.topology import MAX_DENSE_NODES, as_topology


class PlanTable(NamedTuple):
  """The plans of one period stacked into arrays (NumPy, to be closed over by jitted code).

  ``W(k) = diag(self_weight[k]) + sum_r P_{k,r} diag(weight[k, r])``: receiver i gets
  ``weight[k, r, i] * x[src[k, r, i]]`` in round r of step k. Steps with fewer rounds than
  the longest are padded with rounds of weight 0 from the node itself.

  Attributes:
    self_weight: float64 (period, n).
    src: int32 (period, rounds, n).
    weight: float64 (period, rounds, n).
  """

  self_weight: np.ndarray
  src: np.ndarray
  weight: np.ndarray


def plan_table(topology: Any) -> PlanTable:
  """Stacks the plans of one period; rank-one terms (a star's hub, ``complete``) become exchange rounds.

  A table lists W edge by edge, so a hub's rank-one term is listed as its edges: fine for a
  star or a complete graph up to ``MAX_DENSE_NODES`` nodes, refused past it.

  Args:
    topology: a ``gj.topology`` topology, a dense matrix or a networkx graph.

  Returns:
    The `PlanTable` of its period.

  Raises:
    ValueError: naming the topology, when its rank-one terms stand for too many edges.

  Example:
    >>> import gossipjax as gj
    >>> table = plan_table(gj.topology.ring(4))
    >>> table.src.shape, table.self_weight[0].round(4).tolist()  # period 1, two rounds (left and right)
    ((1, 2, 4), [0.3333, 0.3333, 0.3333, 0.3333])
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


def mix_from_table(self_weight: jax.Array, src: jax.Array, weight: jax.Array, x: jax.Array) -> jax.Array:
  """``W x`` for one leaf, W given by one step of a `PlanTable` (rows receive, node axis first).

  ``out[i] = self_weight[i] x[i] + sum_r weight[r, i] x[src[r, i]]``, one gather per round,
  O(rounds * n * d). The weights may be traced (a step's row picked by a traced index, or
  weights edited per step, as the fault simulator drops lost messages).

  Args:
    self_weight: float (n,).
    src: int (rounds, n), the sender of each receiver in each round.
    weight: float (rounds, n).
    x: one leaf, with the node axis first.

  Returns:
    ``W x`` in ``x``'s dtype: 16-bit floats are summed in float32 (weights too) and rounded
    once; a leaf that is not a float is returned unchanged (it is not a quantity to mix).

  Example:
    >>> import jax.numpy as jnp
    >>> table = plan_table(jnp.full((3, 3), 1 / 3))
    >>> mix_from_table(table.self_weight[0], table.src[0], table.weight[0], jnp.array([0.0, 3.0, 6.0])).tolist()
    [3.0, 3.0, 3.0]
  """
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    return x
  shape = (-1,) + (1,) * (x.ndim - 1)
  leaf_dtype, x = x.dtype, x.astype(accumulation_dtype(x.dtype))
  column = lambda w: jnp.asarray(w).astype(x.dtype).reshape(shape)
  out = column(self_weight) * x
  for r in range(src.shape[0]):
    out = out + column(weight[r]) * jnp.take(x, jnp.asarray(src[r]), axis=0)
  return out if x.dtype == leaf_dtype else out.astype(leaf_dtype)
