"""Collectives over the named node axis, implemented by the stacked kernels.

Inside `gj.nodes` a transform sees one node; its all-reduce mean (and its gossip round, see
`gossipjax.mixing._node_mixer`) are collectives over the axis ``"nodes"``. Each is a ``jax.custom_batching.custom_vmap`` whose
batching rule receives the node-stacked values and calls the backend's stacked mixer or mean
(the circulant rolls, sparse plans, step tables, buckets and compact wire stay the
implementation), so the named form costs what the stacked call costs. The same functions
called on stacked trees, outside any mapping, call the stacked kernels directly.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from gossipjax._axis import Mapping, mapped, mapping


def _stacked(x: Any, batched: bool, size: int) -> Any:
  return x if batched else jnp.broadcast_to(x, (size,) + jnp.shape(x))


def _shared(x: Any, batched: bool) -> Any:
  """A value every node holds alike (a step count), from its stacked or shared form.

  A stacked count differs between nodes only where a node held its state back (a per-node
  ``optax.apply_if_finite`` around the method); the round then follows the nodes furthest on.
  """
  return jnp.max(x, axis=0) if batched else x


def _witness() -> jax.Array:
  # Varies over the node axis, so a collective's batching rule runs at the mapping's level
  # even when every other argument is the same on every node.
  current = mapping()
  assert current is not None
  return current.index


def check_same_backend(current: Mapping, backend: Any, name: str) -> None:
  """Refuses a transform built for one backend inside a mapping on another, and any collective in `gj.per_node`."""
  if current.axis.local:
    raise ValueError(f"{name} communicates with the other nodes, but runs inside {current.where}, which maps a "
                     "local transform node by node; map a transform that gossips with gj.chain or gj.nodes")
  if backend is current.backend or backend == current.backend:
    return
  raise ValueError(f"{name} was built for backend {backend!r} but runs inside {current.where} on "
                   f"{current.backend!r}: build every transform of one optimizer with the same backend "
                   "(e.g. inside one `with gj.backend.use(b):` block)")


def _collective(backend: Any, stacked_fn: Callable[[Any], Any], tree: Any, name: str,
                per_node: bool = True, one_node: Callable[[Any], Any] = lambda tree: tree) -> Any:
  """``stacked_fn`` of the node-stacked ``tree``: called directly on stacked trees, inside a mapping a collective.

  Inside a mapping, a ``custom_vmap`` whose batching rule stacks the nodes' values and calls
  ``stacked_fn`` on them; its result is per node (``per_node``) or one value every node holds
  (not batched). ``one_node`` gives the shapes of one node's result, for tracing.
  """
  current = mapping()
  if current is None:
    return stacked_fn(tree)
  check_same_backend(current, backend, name)

  @custom_vmap
  def collective(tree, witness):
    del witness
    return one_node(tree)

  @collective.def_vmap
  def rule(axis_size, in_batched, tree, witness):
    del witness
    tree = jax.tree.map(lambda x, b: _stacked(x, b, axis_size), tree, in_batched[0])
    with mapped(None):
      out = stacked_fn(tree)
    return out, jax.tree.map(lambda _: per_node, out)

  return collective(tree, _witness())


def _method(backend: Any, method: str, name: str, what: str) -> Callable[[Any], Any]:
  fn = getattr(backend, method, None)
  if fn is None:
    raise ValueError(f"{name}: backend {backend!r} has no {method} ({what}), which the mean of compressed messages "
                     "needs")
  return fn


def gathered_nodes(backend: Any, local: int, name: str) -> int:
  """How many nodes an all-gather over ``backend`` returns from blocks of ``local`` nodes."""
  return int(_method(backend, "gathered_nodes", name, "the size of a gather")(local))


def node_average(backend: Any, tree: Any, name: str) -> Any:
  """Every node gets the mean over all nodes: ``backend.mean`` on stacked trees, a collective inside a mapping."""
  return _collective(backend, backend.mean, tree, name)


def node_gather(backend: Any, tree: Any, name: str) -> Any:
  """Every node's values on every node: leaves ``(n, ...)`` over all n nodes, the same everywhere (not per node).

  ``backend.gather`` on stacked trees, a collective inside a mapping (whose result is not
  batched: every node holds the same gathered tree).
  """
  gather = _method(backend, "gather", name, "an all-gather of every node's values")
  current = mapping()
  total = gathered_nodes(backend, current.num_nodes, name) if current else 0
  return _collective(backend, gather, tree, name, per_node=False,
                     one_node=lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (total,) + jnp.shape(x)), tree))


def node_all_to_all(backend: Any, tree: Any, name: str) -> Any:
  """Each node's n pieces (leaves ``(n, ...)`` per node) go one to each node: piece ``[s]`` of the result is what node s sent.

  ``backend.all_to_all`` on stacked trees (leaves ``(b, n, ...)``), a collective inside a mapping.
  """
  return _collective(backend, _method(backend, "all_to_all", name, "an exchange of a piece with every node"), tree,
                     name)


def node_fractions(backend: Any, flags: Any, name: str, dtype: Any = jnp.float32) -> jax.Array:
  """For per-node flags, the fraction of all nodes where each holds: one shared value per flag.

  ``flags`` is a sequence of bool per-node values (``(n,)`` on stacked trees, a scalar for
  one node inside a mapping); the result, of shape ``(len(flags),)`` and dtype ``dtype``, is
  the same on every node and is not batched inside a mapping, so a ``lax.cond`` on it stays
  a branch.
  """
  values = jnp.stack([jnp.asarray(f).astype(dtype) for f in flags], axis=-1)
  # Every node's row is the mean (a max over them, not [0]: the rows may be sharded).
  return _collective(backend, lambda v: jnp.max(backend.mean(v), axis=0), values, name, per_node=False)


def node_index(first_node: jax.Array | int, num_nodes: int) -> jax.Array:
  """The global index of each node: ``first_node + arange(n)`` stacked, this node's inside a mapping."""
  if mapping() is None:
    return first_node + jnp.arange(num_nodes)
  return first_node + _witness()


def node_shape(tree: Any) -> tuple[int, ...]:
  """The shape of a per-node scalar in the state: ``(n,)`` on stacked trees, ``()`` for one node."""
  if mapping() is not None:
    return ()
  leaves = jax.tree.leaves(tree)
  return tuple(jnp.shape(leaves[0])[:1]) if leaves else ()
