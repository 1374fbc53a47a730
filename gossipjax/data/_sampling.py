"""Per-node minibatches drawn inside ``jit``: a padded index table and a PRNG key per step."""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np


class NodeData(NamedTuple):
  """A data set split over nodes, ready for jitted sampling.

  Built by `node_data`; `sample_batches` draws from it inside ``jit``.

  Attributes:
    inputs: the whole data set's inputs (N, ...), shared: nodes index into it.
    targets: the whole data set's targets (N, ...), shared likewise.
    index: int32 (n, max_len); row i lists node i's samples, padded by repeating them.
    sizes: int32 (n,), how many samples each node really has.
  """

  inputs: jax.Array
  targets: jax.Array
  index: jax.Array
  sizes: jax.Array

  @property
  def num_nodes(self) -> int:
    """The number of nodes n (rows of ``index``)."""
    return self.index.shape[0]


def node_data(inputs: Any, targets: Any, parts: Sequence[np.ndarray]) -> NodeData:
  """Packs a partition (a list of index arrays, one per node) into a `NodeData`.

  Args:
    inputs: the whole data set's inputs, (N, ...).
    targets: the whole data set's targets, (N, ...).
    parts: one index array per node, such as the ``partition_*`` functions return.

  Returns:
    A `NodeData` whose ``index`` rows are the parts padded (by repeating each part) to the
    longest one's length.

  Raises:
    ValueError: a part is empty, an index is not an integer or lies outside ``[0, N)``, or
      ``inputs`` and ``targets`` have different numbers of samples.

  Example:
    >>> import numpy as np, gossipjax as gj
    >>> data = gj.data.node_data(np.arange(5.0), np.arange(5), [np.array([0, 1, 2]), np.array([3, 4])])
    >>> data.index.tolist(), data.sizes.tolist(), data.num_nodes
    ([[0, 1, 2], [3, 4, 3]], [3, 2], 2)
  """
  num_samples = np.shape(inputs)[0] if np.ndim(inputs) else None
  if num_samples is None or np.ndim(targets) == 0 or np.shape(targets)[0] != num_samples:
    raise ValueError(f"gj.data.node_data: inputs and targets need the same leading sample axis, got shapes "
                     f"{np.shape(inputs)} and {np.shape(targets)}")
  sizes = np.array([len(p) for p in parts])
  if (sizes == 0).any():
    raise ValueError(f"gj.data.node_data: node(s) {np.flatnonzero(sizes == 0)[:10].tolist()} have no data")
  for node, p in enumerate(parts):
    p = np.asarray(p)
    if p.ndim != 1 or p.dtype.kind not in "iu":
      raise ValueError(f"gj.data.node_data: node {node}'s indices must be a 1-D integer array, got {p.dtype} of "
                       f"shape {p.shape}")
    outside = p[(p < 0) | (p >= num_samples)]
    if outside.size:
      raise ValueError(f"gj.data.node_data: node {node} has indices outside [0, {num_samples}): "
                       f"{outside[:5].tolist()}")
  width = int(sizes.max())
  index = np.stack([np.resize(np.asarray(p), width) for p in parts])
  return NodeData(jnp.asarray(inputs), jnp.asarray(targets), jnp.asarray(index, jnp.int32), jnp.asarray(sizes, jnp.int32))


def sample_batches(data: NodeData, key: jax.Array, batch_size: int) -> tuple[jax.Array, jax.Array]:
  """``batch_size`` samples per node, drawn with replacement from that node's own data.

  Deterministic in ``key``; fold the step into it (``jax.random.fold_in(key, step)``).

  Args:
    data: the data set over nodes (`node_data`).
    key: a PRNG key.
    batch_size: samples per node.

  Returns:
    ``(inputs, targets)`` of shapes (n, batch_size, ...): row i holds node i's batch.

  Example:
    Node 0 owns the samples 0 to 2, node 1 the samples 3 and 4:

    >>> import jax, numpy as np, gossipjax as gj
    >>> data = gj.data.node_data(np.arange(5.0), np.arange(5), [np.array([0, 1, 2]), np.array([3, 4])])
    >>> x, y = jax.jit(gj.data.sample_batches, static_argnums=2)(data, jax.random.key(0), 4)
    >>> x.shape
    (2, 4)
    >>> bool((y[0] <= 2).all()), bool((y[1] >= 3).all())
    (True, True)
  """
  u = jax.random.uniform(key, (data.num_nodes, batch_size))
  pos = jnp.minimum((u * data.sizes[:, None]).astype(jnp.int32), data.sizes[:, None] - 1)
  rows = jnp.take_along_axis(data.index, pos, axis=1)
  return data.inputs[rows], data.targets[rows]
