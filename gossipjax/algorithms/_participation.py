"""Partial participation in an outer step: which nodes take part, and how a node that missed one rejoins.

A node that is down (``up=False``), or that skips a step under ``gj.guard_finite``, neither
computes nor changes. At an outer step (DiLoCo's round, a Streaming DiLoCo fragment's sync,
NoLoCo's exchange) the nodes that take part are combined, and the others keep what they
hold. Where the step ends in one shared result (an all-reduce: DiLoCo and Streaming
DiLoCo), a live node that missed an outer step rejoins from the participants' outer params
and outer state (`participants`): the one rejoin rule of the outer methods.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gossipjax._axis import mapping
from gossipjax._guard import SkipNodes
from gossipjax._validation import check_node_mask
from gossipjax.mixing import Backend
from gossipjax.mixing._collectives import node_average, node_fractions, node_shape


def node_mask(up: Any, params: Any, name: str) -> jax.Array:
  """``up`` as a bool per node, checked against the node axis of ``params``."""
  mask = jnp.asarray(up)
  check_node_mask(mask, node_shape(params), name)
  return mask


def live_nodes(up: jax.Array | None, skip_nodes: SkipNodes | None, params: Any) -> jax.Array:
  """The nodes that step: up (all without ``up``) and not skipping under ``gj.guard_finite``."""
  ok = jnp.ones(node_shape(params), bool) if up is None else up
  return ok if skip_nodes is None else ok & ~skip_nodes.mask


def _per_node_leaf(x: Any, n: int) -> bool:
  return (isinstance(x, jax.Array) and x.ndim >= 1 and x.shape[0] == n
          and not jnp.issubdtype(x.dtype, jax.dtypes.prng_key))


def select_nodes(mask: jax.Array, new: Any, old: Any, own: list[bool] | None = None) -> Any:
  """Per node, ``new`` where ``mask`` holds and ``old`` elsewhere.

  On stacked trees the leaves without the node axis (what every node shares) are taken from
  ``new``. For one node (inside ``gj.nodes``) ``own`` says which leaves differ per node (the
  others are taken from ``new``); ``None`` selects every leaf.
  """
  leaves, treedef = jax.tree.flatten(new)
  olds = treedef.flatten_up_to(old)
  if mapping() is not None:
    own = [True] * len(leaves) if own is None else own
    return jax.tree.unflatten(treedef, [jnp.where(mask, a, b) if f else a for a, b, f in zip(leaves, olds, own)])
  n = mask.shape[0]
  pick = lambda a, b: jnp.where(mask.reshape((n,) + (1,) * (a.ndim - 1)), a, b) if _per_node_leaf(a, n) else a
  return jax.tree.unflatten(treedef, [pick(a, b) for a, b in zip(leaves, olds)])


class Participation:
  """The nodes that take part in an outer step, and the means and mixes over them.

  ``mask`` is a bool per node and ``frac`` the fraction of all nodes it holds for (shared).
  """

  def __init__(self, mask: jax.Array, frac: jax.Array, backend: Backend, name: str):
    self.mask, self.frac, self.backend, self.name = mask, frac, backend, name

  def zero_others(self, tree: Any) -> Any:
    return select_nodes(self.mask, tree, jax.tree.map(jnp.zeros_like, tree))

  def divide(self, total: Any) -> Any:
    """A mean over all nodes of values zero outside the participants, as their mean (zero if there are none)."""
    frac = jnp.where(self.frac > 0, self.frac, 1)
    return jax.tree.map(lambda t: (t.astype(frac.dtype) / frac).astype(t.dtype), total)

  def mean(self, tree: Any, own: list[bool] | None = None) -> Any:
    """The participants' mean of each leaf that differs per node (``own`` for one node; ``None``: all)."""
    leaves, treedef = jax.tree.flatten(tree)
    if mapping() is not None:
      own = [True] * len(leaves) if own is None else own
    else:
      own = [_per_node_leaf(x, self.mask.shape[0]) for x in leaves]
    picked = [x for x, f in zip(leaves, own) if f]
    as_float = [x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(self.frac.dtype) for x in picked]
    means = self.divide(node_average(self.backend, self.zero_others(as_float), self.name))
    means = iter([m if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.round(m).astype(x.dtype)
                  for m, x in zip(means, picked)])
    return jax.tree.unflatten(treedef, [next(means) if f else x for x, f in zip(leaves, own)])

  def fill_self(self, mixed: Any, own: Any, mixer: Any, step: Any) -> Any:
    """A gossip round among the participants: ``mixed`` (of the zeroed others) plus the weight they left to ``own``."""
    weight = mixer.mix(self.mask.astype(self.frac.dtype), step)
    kept = 1 - weight
    if mapping() is None:
      per_node = lambda x: kept.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype)
    else:
      per_node = lambda x: kept.astype(x.dtype)
    return jax.tree.map(lambda m, x: m + per_node(x) * x, mixed, own)


def participants(ok: jax.Array, synced: jax.Array, outer_steps: jax.Array, anchor: Any, outer_state: Any,
                 own_outer: list[bool] | None, backend: Backend, name: str, dtype: Any, *,
                 shared_result: bool = True) -> tuple[Participation, Any, Any]:
  """Who takes part in an outer step among the live nodes ``ok``; the outer params and state after rejoins.

  With a shared result (an all-reduce: DiLoCo, a Streaming DiLoCo fragment) the nodes that
  hold the last outer result (``synced == outer_steps``) take part, and a live node that
  missed an outer step rejoins: it takes the participants' mean of ``anchor`` and
  ``outer_state`` (equal over them), then steps with them, so every live node leaves the step
  with one model. Where no live node holds the last result (all were held back alike),
  every live node takes part. The rejoin is one more all-reduce of the outer params and
  state, in the steps that have a node to rejoin. Over a gossip topology (NoLoCo) there is
  no shared result: every live node takes part, and one that missed a step takes part
  again from what it holds.

  Args:
    ok: the live nodes, a bool per node.
    synced: per node, the outer steps whose result its ``anchor`` holds.
    outer_steps: the outer steps taken so far (shared).
    anchor: the outer params, each node's.
    outer_state: the outer optimizer's state, each node's.
    own_outer: inside ``gj.nodes``, which leaves of ``outer_state`` are per node (read
      before any ``lax.cond``); ``None`` on stacked trees.
    backend: where the nodes live, for the all-reduces.
    name: the public method, for errors.
    dtype: the dtype of the fractions of nodes.
    shared_result: whether the outer step ends in one result for all (an all-reduce).

  Returns:
    The `Participation`, and ``anchor`` and ``outer_state`` with the rejoining nodes'
    replaced.
  """
  if not shared_result:
    (frac,) = node_fractions(backend, (ok,), name, dtype)
    return Participation(ok, frac, backend, name), anchor, outer_state
  current = synced == outer_steps
  frac_current, frac_ok, frac_stale = node_fractions(backend, (ok & current, ok, ok & ~current), name, dtype)
  anyone_current = frac_current > 0
  mask = ok & (current | ~anyone_current)  # nobody current (all held back alike): every live node
  takes_part = Participation(mask, jnp.where(anyone_current, frac_current, frac_ok), backend, name)
  own = None if own_outer is None else [True] * len(jax.tree.leaves(anchor)) + own_outer

  def rejoin(phi_and_state):
    return select_nodes(ok & ~mask, takes_part.mean(phi_and_state, own), phi_and_state, own)

  anchor, outer_state = lax.cond(anyone_current & (frac_stale > 0), rejoin, lambda x: x, (anchor, outer_state))
  return takes_part, anchor, outer_state
