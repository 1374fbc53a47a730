"""What a backend provides: a mixer per topology, an all-reduce mean, and ``map`` for per-node work."""

from __future__ import annotations

from typing import Any, Callable, Protocol

import jax

from gossipjax.topology import Topology


class Mixer(Protocol):
  """Applies W(step) to pytrees whose leaves carry the (local block of the) node axis.

  What an algorithm gets from `gj.mixing.make_mixer`: every backend builds one per
  topology, and the algorithm only calls ``mix`` (and ``first_node`` for per-node
  randomness), so the same algorithm runs on every backend.

  Attributes:
    topology: the validated topology whose W it applies.
    local_nodes: the size of the leading (node) axis where the transform runs: n in one
      process, the local block under MPI or inside ``shard_map``.

  Example:
    >>> import jax.numpy as jnp, gossipjax as gj
    >>> mixer = gj.mixing.make_mixer(gj.topology.ring(4))
    >>> mixer.topology.name, mixer.local_nodes, int(mixer.first_node())
    ('ring(4)', 4, 0)
    >>> [round(float(v), 4) for v in mixer.mix({"w": jnp.arange(4.0)}, 0)["w"]]
    [1.3333, 1.0, 2.0, 1.6667]
  """

  topology: Topology
  local_nodes: int  # the leading-axis size the transform sees where it runs

  def mix(self, tree: Any, step: jax.Array | int) -> Any:
    """``x_i <- sum_j W(step)[i, j] x_j`` for every node, on every leaf."""
    ...

  def first_node(self) -> jax.Array | int:
    """Global index of the first node on the local leading axis (per-node randomness uses it)."""
    ...


class Backend(Protocol):
  """Where the nodes live. Backends are data (frozen dataclasses), not callables.

  A backend provides what the algorithms need besides the math: a `Mixer` per topology,
  the all-reduce ``mean``, the local block size and ``map`` for per-node work. The
  algorithms take one as their ``backend=`` argument (``gj.backend.simulate()`` when
  omitted).

  Example:
    >>> import jax.numpy as jnp, gossipjax as gj
    >>> backend = gj.backend.simulate()
    >>> backend.mean(jnp.arange(4.0)).tolist()  # every node gets the average
    [1.5, 1.5, 1.5, 1.5]
    >>> backend.map(jnp.sum)(jnp.ones((4, 3))).tolist()  # one sum per node
    [3.0, 3.0, 3.0, 3.0]
  """

  def mixer(self, topology: Topology) -> Mixer:
    """The `Mixer` that applies ``topology``'s W where this backend keeps the nodes."""
    ...

  def mean(self, tree: Any) -> Any:
    """Every node gets the average over all n nodes (the all-reduce)."""
    ...

  def local_nodes(self, num_nodes: int) -> int:
    """How many nodes sit on the leading axis where a transform runs."""
    ...

  def map(self, fn: Callable[..., Any], in_axes: Any = 0, num_nodes: int | None = None) -> Callable[..., Any]:
    """``fn`` on each node's slice, as ``jax.vmap(fn, in_axes)``, run where the nodes live."""
    ...
