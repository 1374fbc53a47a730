"""A transform written over the stacked node axis, adapted to run for one node inside `gj.nodes`.

A method whose own code reads the node axis cannot run on one node's values; inside a
mapping its ``init`` and ``update`` become collectives over the node axis that the mapping
binds (a private axis object, not a string name), whose batching rule hands the
node-stacked arguments to the transform itself (`stacked_transform`). `on_nodes` maps a
per-node function the other way: over the backend's nodes on stacked trees.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from gossipjax._axis import mapped, mapping
from gossipjax.mixing._collectives import _stacked, node_collective


def on_nodes(fn: Callable[..., Any], backend: Any) -> Callable[..., Any]:
  """``fn`` for each node: ``backend.map(fn)`` on stacked trees, ``fn`` itself for one node."""
  return fn if mapping() is not None else backend.map(fn)


def _arrays(tree: Any) -> Any:
  return jax.tree.map(jnp.asarray, tree)


def stacked_transform(tx: Any, name: str) -> Any:
  """A transform written over the stacked node axis that also runs for one node inside `gj.nodes`.

  A method whose own code reads the node axis (indexes nodes, takes a per-node mask as an
  extra argument) cannot run on one node's values. Inside a mapping, its ``init`` and
  ``update`` become collectives: a ``custom_vmap`` whose batching rule hands the node-stacked
  arguments to ``tx`` itself. State leaves with a leading node axis are per node; the others
  (a step count) are shared, as on stacked trees. ``tx`` may not close over per-node values
  (a hyperparameter injected per node): its hyperparameters are the same on every node.

  Args:
    tx: an optax transform over node-stacked trees.
    name: its public name, for errors.

  Returns:
    An optax transform that is ``tx`` on stacked trees and its collective form for one node.
  """
  import optax  # noqa: PLC0415 - optax is only needed here

  tx = optax.with_extra_args_support(tx)

  def out_flags(tree: Any, size: int) -> Any:
    return jax.tree.map(lambda x: bool(jnp.ndim(x)) and jnp.shape(x)[0] == size, tree)

  def init_fn(params):
    if mapping() is None:
      return tx.init(params)

    size = mapping().num_nodes  # type: ignore[union-attr]  # inside a mapping, checked above

    def one_node(params):
      # Shapes only (the rule below runs under the mapping): the stacked state's, less the
      # node axis of its per-node leaves.
      stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((size,) + jnp.shape(x), x.dtype), params)
      with mapped(None):
        shapes = jax.eval_shape(tx.init, stacked)
      one = lambda x, per_node: jnp.zeros(x.shape[1:] if per_node else x.shape, x.dtype)
      return jax.tree.map(one, shapes, out_flags(shapes, size))

    def rule(num_nodes, in_batched, params):
      state = _arrays(tx.init(jax.tree.map(lambda x, b: _stacked(x, b, num_nodes), params, in_batched)))
      return state, out_flags(state, num_nodes)

    return node_collective(one_node, rule, params)

  def update_fn(updates, state, params=None, **extra_args):
    if mapping() is None:
      return tx.update(updates, state, params, **extra_args)
    extra_args = _arrays(extra_args)

    def rule(num_nodes, in_batched, args):
      updates, state, params, extra = args
      b_u, b_s, b_p, _ = in_batched
      updates = jax.tree.map(lambda x, b: _stacked(x, b, num_nodes), updates, b_u)
      if params is not None:
        params = jax.tree.map(lambda x, b: _stacked(x, b, num_nodes), params, b_p)
      new, new_state = tx.update(updates, state, params, **extra)
      return (new, new_state), (jax.tree.map(lambda _: True, new), b_s)

    # Shapes only: an optax update keeps the shapes of both.
    return node_collective(lambda args: (args[0], args[1]), rule, (updates, state, params, extra_args))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
