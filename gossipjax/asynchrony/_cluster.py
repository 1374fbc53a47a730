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

  Example:
    >>> import gossipjax as gj
    >>> c = gj.asynchrony.cluster(3, base_time=2.0, slowdown=[1.0, 1.0, 4.0], latency=0.01)
    >>> c.mean_time.tolist(), c.num_nodes
    ([2.0, 2.0, 8.0], 3)
  """

  mean_time: jax.Array
  jitter: jax.Array
  latency: jax.Array
  bandwidth: jax.Array

  @property
  def num_nodes(self) -> int:
    """The number of nodes n."""
    return self.mean_time.shape[0]


def cluster(
    num_nodes: int,
    base_time: float = 1.0,
    slowdown: float | Sequence[float] | np.ndarray = 1.0,
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

  Returns:
    A `Cluster` in the default float dtype (float64 under ``jax_enable_x64``).

  Raises:
    ValueError: ``num_nodes`` is not a positive integer, a time or slowdown is not
      positive and finite, ``jitter`` or ``latency`` is negative or not finite, ``bandwidth``
      is not positive (``inf`` is allowed), or ``slowdown`` has another length than n.

  Example:
    >>> import gossipjax as gj
    >>> c = gj.asynchrony.cluster(4, slowdown=[1.0, 1.0, 2.0, 2.0], latency=0.001, bandwidth=1e9)
    >>> c.mean_time.tolist()
    [1.0, 1.0, 2.0, 2.0]
  """
  if isinstance(num_nodes, bool) or not isinstance(num_nodes, (int, np.integer)) or num_nodes < 1:
    raise ValueError(f"cluster: num_nodes must be a positive integer, got {num_nodes!r}")
  factors = np.asarray(slowdown, np.float64)
  if factors.ndim > 1 or (factors.ndim == 1 and factors.shape[0] != num_nodes):
    raise ValueError(f"cluster: slowdown must be one number or {num_nodes} (one per node), got shape {factors.shape}")
  factors = np.broadcast_to(factors, (num_nodes,))
  if not (np.isfinite(base_time) and base_time > 0) or not (np.isfinite(factors) & (factors > 0)).all():
    raise ValueError(f"cluster: base_time and every slowdown must be finite and positive, got base_time={base_time} "
                     f"and slowdowns {factors[~(np.isfinite(factors) & (factors > 0))][:5].tolist() or 'fine'}")
  for name, value in (("jitter", jitter), ("latency", latency)):
    if not (np.isfinite(value) and value >= 0):
      raise ValueError(f"cluster: {name} must be finite and >= 0, got {value}")
  if not bandwidth > 0:
    raise ValueError(f"cluster: bandwidth must be > 0 bytes per second (inf: free transfers), got {bandwidth}")
  dtype = jnp.zeros([]).dtype  # float64 under jax_enable_x64, else float32
  return Cluster(
      mean_time=jnp.asarray(base_time * factors, dtype),
      jitter=jnp.asarray(jitter, dtype),
      latency=jnp.asarray(latency, dtype),
      bandwidth=jnp.asarray(bandwidth, dtype),
  )


def straggler_cluster(num_nodes: int, slowdown: float, node: int = 0, **kwargs) -> Cluster:
  """``cluster`` with one node ``slowdown`` times slower than the others (Zhang et al., Table 2).

  Args:
    num_nodes: n.
    slowdown: how many times slower the straggler computes a gradient.
    node: which node is the straggler.
    **kwargs: the other arguments of `cluster` (``base_time``, ``jitter``, ``latency``,
      ``bandwidth``).

  Returns:
    A `Cluster` whose node ``node`` takes ``slowdown * base_time`` per gradient.

  Example:
    >>> import gossipjax as gj
    >>> gj.asynchrony.straggler_cluster(4, slowdown=10.0).mean_time.tolist()
    [10.0, 1.0, 1.0, 1.0]
    >>> gj.asynchrony.straggler_cluster(3, slowdown=5.0, node=2, base_time=0.5).mean_time.tolist()
    [0.5, 0.5, 2.5]

  References:
    Zhang, Lian, Zhang, Liu, Decentralized Distributed Deep Learning (IBM T.J. Watson
    Research Center, University of Rochester, ETH Zurich): one slow learner among 16,
    Table 2.
  """
  factors = np.ones(num_nodes)
  factors[node] = slowdown
  return cluster(num_nodes, slowdown=factors, **kwargs)


def random_speed_cluster(num_nodes: int, spread: float, seed: int = 0, **kwargs) -> Cluster:
  """``cluster`` whose nodes have fixed speeds drawn log-uniformly in ``[1, spread]`` times slower.

  Args:
    num_nodes: n.
    spread: the largest slowdown (>= 1).
    seed: seed of the draws.
    **kwargs: the other arguments of `cluster` (``base_time``, ``jitter``, ``latency``,
      ``bandwidth``).

  Returns:
    A `Cluster` whose ``mean_time`` lies in ``[base_time, spread * base_time]``.

  Example:
    >>> import gossipjax as gj
    >>> c = gj.asynchrony.random_speed_cluster(8, spread=10.0)
    >>> bool(((c.mean_time >= 1.0) & (c.mean_time <= 10.0)).all())
    True
  """
  rng = np.random.default_rng(seed)
  return cluster(num_nodes, slowdown=np.exp(rng.uniform(0.0, np.log(spread), num_nodes)), **kwargs)


def compute_time(c: Cluster, key: jax.Array, node: jax.Array | None = None) -> jax.Array:
  """Simulated seconds of one gradient: of ``node`` (a scalar) or of every node (shape (n,)).

  The time is ``mean_time * exp(jitter * z - jitter**2 / 2)`` with ``z`` standard normal:
  log-normal with mean ``mean_time``.

  Args:
    c: the cluster.
    key: a PRNG key.
    node: one node's index (traced or not); ``None``: every node.

  Returns:
    A float scalar, or a float (n,) array when ``node`` is ``None``.

  Example:
    >>> import jax, gossipjax as gj
    >>> c = gj.asynchrony.straggler_cluster(3, slowdown=4.0)
    >>> gj.asynchrony.compute_time(c, jax.random.key(0)).tolist()  # jitter 0: the means
    [4.0, 1.0, 1.0]
    >>> noisy = gj.asynchrony.cluster(3, jitter=0.5)
    >>> gj.asynchrony.compute_time(noisy, jax.random.key(0), node=1).shape
    ()
  """
  mean = c.mean_time if node is None else c.mean_time[node]
  z = jax.random.normal(key, jnp.shape(mean), mean.dtype)
  return mean * jnp.exp(c.jitter * z - 0.5 * c.jitter**2)


def transfer_time(c: Cluster, num_bytes: float) -> jax.Array:
  """Seconds to send one message of ``num_bytes`` over one link: ``latency + num_bytes / bandwidth``.

  Args:
    c: the cluster.
    num_bytes: the message size in bytes.

  Returns:
    The time as a float scalar array.

  Example:
    >>> import gossipjax as gj
    >>> c = gj.asynchrony.cluster(4, latency=0.001, bandwidth=1e9)
    >>> round(float(gj.asynchrony.transfer_time(c, 1e6)), 6)  # 1 ms latency + 1 MB at 1 GB/s
    0.002
  """
  return c.latency + num_bytes / c.bandwidth


def allreduce_time(c: Cluster, num_bytes: float) -> jax.Array:
  r"""Seconds of a ring all-reduce of ``num_bytes`` over all n nodes.

  A reduce-scatter and an all-gather, each of n - 1 steps that send a chunk of
  ``num_bytes / n``:

  .. math:: T = 2 (n - 1) \left(\mathrm{latency} + \frac{b}{n\, \mathrm{bandwidth}}\right).

  Args:
    c: the cluster (n from ``c.num_nodes``).
    num_bytes: the size b of the reduced vector in bytes.

  Returns:
    The time as a float scalar array (0 for a single node).

  Example:
    >>> import gossipjax as gj
    >>> c = gj.asynchrony.cluster(4, bandwidth=1e9)
    >>> float(gj.asynchrony.allreduce_time(c, 1e9))  # 2 * 3 chunks of 0.25 GB
    1.5

  References:
    Patarasuk, Yuan (2009), Bandwidth Optimal All-reduce Algorithms for Clusters of
    Workstations, Journal of Parallel and Distributed Computing.
  """
  n = c.num_nodes
  if n == 1:
    return jnp.zeros_like(c.latency)
  return 2 * (n - 1) * (c.latency + num_bytes / (n * c.bandwidth))
