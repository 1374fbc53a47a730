"""Per-node minibatches drawn inside ``jit``: a padded index table and a PRNG key per step."""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np


class NodeData(NamedTuple):
  """A data set split over nodes, ready for jitted sampling.

  Attributes:
    inputs, targets: the whole data set (shared; nodes index into it).
    index: int32 (n, max_len); row i lists node i's samples, padded by repeating them.
    sizes: int32 (n,), how many samples each node really has.
  """

  inputs: jax.Array
  targets: jax.Array
  index: jax.Array
  sizes: jax.Array

  @property
  def num_nodes(self) -> int:
    return self.index.shape[0]


def node_data(inputs: Any, targets: Any, parts: Sequence[np.ndarray]) -> NodeData:
  """Packs a partition (a list of index arrays, one per node) into a `NodeData`."""
  sizes = np.array([len(p) for p in parts])
  if (sizes == 0).any():
    raise ValueError(f"node(s) {np.flatnonzero(sizes == 0)[:10].tolist()} have no data")
  width = int(sizes.max())
  index = np.stack([np.resize(np.asarray(p), width) for p in parts])
  return NodeData(jnp.asarray(inputs), jnp.asarray(targets), jnp.asarray(index, jnp.int32), jnp.asarray(sizes, jnp.int32))


def sample_batches(data: NodeData, key: jax.Array, batch_size: int) -> tuple[jax.Array, jax.Array]:
  """``batch_size`` samples per node, drawn with replacement from that node's own data.

  Returns inputs of shape (n, batch_size, ...) and targets of shape (n, batch_size, ...).
  Deterministic in ``key``; fold the step into it (``jax.random.fold_in(key, step)``).
  """
  u = jax.random.uniform(key, (data.num_nodes, batch_size))
  pos = jnp.minimum((u * data.sizes[:, None]).astype(jnp.int32), data.sizes[:, None] - 1)
  rows = jnp.take_along_axis(data.index, pos, axis=1)
  return data.inputs[rows], data.targets[rows]
