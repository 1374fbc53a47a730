"""A heterogeneous cluster in simulated time: per-node compute-time models and a link model.

A node's gradient takes ``mean_time[i] * jitter`` simulated seconds, where ``jitter`` is
log-normal with unit mean (``sigma = 0`` gives fixed speeds). A message of ``b`` bytes over
a link takes ``latency + b / bandwidth``. A ring all-reduce of ``b`` bytes over ``n`` nodes
takes ``2 (n - 1) (latency + b / (n * bandwidth))`` (Patarasuk and Yuan 2009; the
``2N/B + O(n)`` of Zhang, Lian, Zhang and Liu, "Decentralized Distributed Deep Learning").
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np


class Cluster(NamedTuple):
  """Timing model of ``n`` nodes and the links between them (a pytree of arrays).

  Attributes:
    mean_time: float (n,), mean simulated seconds per gradient of each node
      (``base_time * slowdown``).
    jitter: sigma of the unit-mean log-normal factor on every compute time (0: fixed).
    latency: seconds per message on a link.
    bandwidth: bytes per second of a link.
  """

  mean_time: jax.Array
  jitter: jax.Array
  latency: jax.Array
  bandwidth: jax.Array

  @property
  def num_nodes(self) -> int:
    return self.mean_time.shape[0]


def cluster(
    num_nodes: int,
    base_time: float = 1.0,
    slowdown: float | Sequence[float] = 1.0,
    jitter: float = 0.0,
    latency: float = 0.0,
    bandwidth: float = float("inf"),
) -> Cluster:
  """A cluster whose node i computes a gradient in ``base_time * slowdown[i]`` on average.

  Args:
    num_nodes: n.
    base_time: simulated seconds per gradient of a normal node.
    slowdown: one factor for every node, or a sequence of n factors.
    jitter: sigma of the log-normal noise on each compute time (random speeds).
    latency: seconds per message.
    bandwidth: bytes per second (``inf``: transfers cost only latency).

  Example:
    >>> import gossipjax as gj
    >>> c = gj.asynchrony.straggler_cluster(4, slowdown=10.0)
    >>> c.mean_time.tolist()
    [10.0, 1.0, 1.0, 1.0]
  """
  if isinstance(num_nodes, bool) or not isinstance(num_nodes, (int, np.integer)) or num_nodes < 1:
    raise ValueError(f"cluster: num_nodes must be a positive integer, got {num_nodes!r}")
  factors = np.broadcast_to(np.asarray(slowdown, np.float64), (num_nodes,))
  if not base_time > 0 or (factors <= 0).any():
    raise ValueError("cluster: base_time and slowdowns must be positive")
  if jitter < 0 or latency < 0 or not bandwidth > 0:
    raise ValueError("cluster: jitter and latency must be >= 0 and bandwidth > 0")
  dtype = jnp.zeros([]).dtype  # float64 under jax_enable_x64, else float32
  return Cluster(
      mean_time=jnp.asarray(base_time * factors, dtype),
      jitter=jnp.asarray(jitter, dtype),
      latency=jnp.asarray(latency, dtype),
      bandwidth=jnp.asarray(bandwidth, dtype),
  )


def straggler_cluster(num_nodes: int, slowdown: float, node: int = 0, **kwargs) -> Cluster:
  """``cluster`` with one node ``slowdown`` times slower than the others (Zhang et al., Table 2)."""
  factors = np.ones(num_nodes)
  factors[node] = slowdown
  return cluster(num_nodes, slowdown=factors, **kwargs)


def random_speed_cluster(num_nodes: int, spread: float, seed: int = 0, **kwargs) -> Cluster:
  """``cluster`` whose nodes have fixed speeds drawn log-uniformly in ``[1, spread]`` times slower."""
  rng = np.random.default_rng(seed)
  return cluster(num_nodes, slowdown=np.exp(rng.uniform(0.0, np.log(spread), num_nodes)), **kwargs)


def compute_time(c: Cluster, key: jax.Array, node: jax.Array | None = None) -> jax.Array:
  """Simulated seconds of one gradient: of ``node`` (a scalar) or of every node (shape (n,))."""
  mean = c.mean_time if node is None else c.mean_time[node]
  z = jax.random.normal(key, jnp.shape(mean), mean.dtype)
  return mean * jnp.exp(c.jitter * z - 0.5 * c.jitter**2)


def transfer_time(c: Cluster, num_bytes: float) -> jax.Array:
  """Seconds to send one message of ``num_bytes`` over one link."""
  return c.latency + num_bytes / c.bandwidth


def allreduce_time(c: Cluster, num_bytes: float) -> jax.Array:
  """Seconds of a ring all-reduce of ``num_bytes`` over all n nodes."""
  n = c.num_nodes
  if n == 1:
    return jnp.zeros_like(c.latency)
  return 2 * (n - 1) * (c.latency + num_bytes / (n * c.bandwidth))
