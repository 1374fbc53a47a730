"""What a backend provides: a mixer per topology, an all-reduce mean, and ``map`` for per-node work."""

from __future__ import annotations

from typing import Any, Callable, Protocol

import jax

from gossipjax.topology import Topology


class Mixer(Protocol):
  """Applies W(step) to pytrees whose leaves carry the (local block of the) node axis."""

  topology: Topology
  local_nodes: int  # the leading-axis size the transform sees where it runs

  def mix(self, tree: Any, step: jax.Array | int) -> Any:
    """``x_i <- sum_j W(step)[i, j] x_j`` for every node, on every leaf."""
    ...

  def first_node(self) -> jax.Array | int:
    """Global index of the first node on the local leading axis (per-node randomness uses it)."""
    ...


class Backend(Protocol):
  """Where the nodes live. Backends are data (frozen dataclasses), not callables."""

  def mixer(self, topology: Topology) -> Mixer:
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
