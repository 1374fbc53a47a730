"""Collectives over the node axis that `gj.nodes` binds, implemented by the stacked kernels.

Inside `gj.nodes` a transform sees one node; its all-reduce mean (and its gossip round, see
`gossipjax.mixing._node_mixer`) are collectives over the node axis that the mapping binds: a
private axis object of gossipjax's (`gossipjax._axis.NodeAxis`), not a string, so no axis of
the user's, ``"nodes"`` included, is ever taken for it. Each is a
``jax.custom_batching.custom_vmap`` (`node_collective`) whose batching rule receives the
node-stacked values and calls the backend's stacked mixer or mean (the circulant rolls, sparse
plans, step tables, buckets and compact wire stay the implementation), so the mapped form
costs what the stacked call costs. The same functions
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


# A collective's batching rule at the node axis: (number of nodes, which leaves of the args are
# stacked over them, the args) -> (the result, which of its leaves are per node).
NodeRule = Callable[[int, Any, Any], tuple[Any, Any]]

# Each jax.vmap inside a node around a collective, outermost first: (its size, which leaves it batches).
_Inner = tuple[tuple[int, Any], ...]


def node_collective(one_node: Callable[[Any], Any], node_rule: NodeRule, args: Any) -> Any:
  """A collective over the node axis: ``node_rule`` on the node-stacked ``args``, from one node's code.

  A ``custom_vmap`` whose batching rule runs at the mapping's level: there ``args`` arrive
  stacked over the nodes and ``node_rule(num_nodes, in_batched, args)`` returns the
  stacked result and, for each leaf, whether it is per node. ``one_node(args)`` gives one
  node's result shapes, for tracing.

  Only the node axis is communicated over. A ``jax.vmap`` inside a node (a scanned model's
  layer axis) is told apart by the node witness, which varies over the node axis alone: under
  it the collective maps over that axis as any JAX function would (each layer's mean over the
  nodes), by running ``node_rule`` under the same ``jax.vmap`` at the mapping's level.
  """
  return _bind(one_node, node_rule, args, _witness(), ())


def _bind(one_node: Callable[[Any], Any], node_rule: NodeRule, args: Any, witness: jax.Array, inner: _Inner) -> Any:
  @custom_vmap
  def collective(args, witness):
    del witness
    return _over_inner(one_node, inner)(args)

  @collective.def_vmap
  def rule(axis_size, in_batched, args, witness):
    b_args, b_witness = in_batched
    if not b_witness:  # a vmap inside a node, not the node axis: bind again under it
      out = _bind(one_node, node_rule, args, witness, ((axis_size, b_args),) + inner)
      return out, jax.tree.map(lambda _: True, out)
    with mapped(None):
      return _at_nodes(node_rule, inner, axis_size, b_args, args)

  return collective(args, witness)


def _over_inner(fn: Callable[[Any], Any], inner: _Inner) -> Callable[[Any], Any]:
  """``fn`` of one node's values under the vmaps ``inner`` (each inner axis leading, outermost first)."""
  for size, batched in reversed(inner):
    fn = jax.vmap(fn, in_axes=(jax.tree.map(lambda b: 0 if b else None, batched),), axis_size=size)
  return fn


def _at_nodes(node_rule: NodeRule, inner: _Inner, num_nodes: int, b_nodes: Any, args: Any) -> tuple[Any, Any]:
  """``node_rule`` on the node-stacked ``args``, mapped over each inner vmap's axis (after the node axis)."""
  if not inner:
    return node_rule(num_nodes, b_nodes, args)
  found: list[Any] = []

  def stacked(args):
    out, per_node = node_rule(num_nodes, b_nodes, args)
    found.append(per_node)
    return out

  fn = stacked
  for size, batched in reversed(inner):
    axes = jax.tree.map(lambda node, b: (1 if node else 0) if b else None, b_nodes, batched)
    fn = jax.vmap(fn, in_axes=(axes,), axis_size=size)
  out = fn(args)
  per_node = found[0]
  # Each inner axis is leading (outermost first), as for one node; the node axis goes in front.
  out = jax.tree.map(lambda x, node: jnp.moveaxis(x, len(inner), 0) if node else x, out, per_node)
  return out, per_node


def _collective(backend: Any, stacked_fn: Callable[[Any], Any], tree: Any, name: str,
                per_node: bool = True, one_node: Callable[[Any], Any] = lambda tree: tree) -> Any:
  """``stacked_fn`` of the node-stacked ``tree``: called directly on stacked trees, inside a mapping a collective.

  Inside a mapping, a `node_collective` that stacks the nodes' values and calls ``stacked_fn``
  on them; its result is per node (``per_node``) or one value every node holds (not batched).
  ``one_node`` gives the shapes of one node's result, for tracing.
  """
  current = mapping()
  if current is None:
    return stacked_fn(tree)
  check_same_backend(current, backend, name)

  def rule(num_nodes, in_batched, tree):
    out = stacked_fn(jax.tree.map(lambda x, b: _stacked(x, b, num_nodes), tree, in_batched))
    return out, jax.tree.map(lambda _: per_node, out)

  return node_collective(one_node, rule, tree)


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
