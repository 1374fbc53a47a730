"""Stacked-node helpers: build n copies of a model, average them, measure their disagreement."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gossipjax._axis import mapping
from gossipjax.backend._base import auto_where_explicit
from gossipjax.backend._cpu_threads import check_placed_threads
from gossipjax.backend._precision import mean_terms
from gossipjax.mixing._collectives import node_average


def _stack(tree: Any, num_nodes: int) -> Any:
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_nodes,) + jnp.shape(x)), tree)


# One compiled program per tree structure, leaf shapes and n, which later calls reuse (the runs of a job share it);
# broadcasting and copying leaf by leaf, eagerly, compiles two programs per leaf shape and n.
_stack = jax.jit(_stack, static_argnums=1)


def init_nodes(init_fn: Callable[[jax.Array], Any], key: jax.Array, num_nodes: int, same_init: bool = True) -> Any:
  """Params for ``num_nodes`` nodes, every leaf with a leading node axis.

  Args:
    init_fn: ``key -> params`` for one node (e.g. ``lambda k: model.init(k, x)``).
    key: a PRNG key.
    num_nodes: n.
    same_init: every node starts from ``init_fn(key)`` (the usual choice: consensus at
      step 0); ``False`` gives each node its own ``init_fn(fold_in(key, i))``.

  Returns:
    ``init_fn``'s params with a leading axis of size ``num_nodes`` on every leaf.

  Raises:
    ValueError: ``num_nodes`` is not a positive integer.

  Example:
    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> p = gj.init_nodes(lambda k: {"w": jax.random.normal(k, (3,))}, jax.random.key(0), 4)
    >>> p["w"].shape, float(gj.consensus_distance(p))
    ((4, 3), 0.0)
  """
  if isinstance(num_nodes, bool) or not isinstance(num_nodes, (int, np.integer)) or num_nodes < 1:
    raise ValueError(f"gj.init_nodes: num_nodes must be a positive integer, got {num_nodes!r}")
  if same_init:
    return _stack(init_fn(key), int(num_nodes))
  keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(num_nodes))
  return jax.vmap(init_fn)(keys)


def _is_spec(x: Any) -> bool:
  return isinstance(x, P)


def _is_float(x: Any) -> bool:
  return jnp.issubdtype(x.dtype, jnp.inexact)


def _node_leaves(tree: Any, what: str) -> list[tuple[Any, Any]]:
  """``(path, leaf)`` of every leaf, each checked to carry a leading node axis of one size.

  Integer, bool and PRNG-key leaves (step counters, flax RNG streams) are allowed, as `mix`
  allows them; a leaf that is not an array, a scalar without a node axis, or a node axis of
  another size raises, naming the leaf. Leaves placed on several CPU devices need the client's
  threads for a program over them (`check_placed_threads`).
  """
  check_placed_threads(tree, what)
  leaves, first = jax.tree_util.tree_leaves_with_path(tree), None
  for path, x in leaves:
    name = jax.tree_util.keystr(path) or "<root>"
    dtype = getattr(x, "dtype", None)
    if dtype is None or not hasattr(x, "shape"):
      raise TypeError(f"{what}: leaf {name} is a {type(x).__name__}, not an array with a leading node axis")
    numeric = jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)
    if not (numeric or jnp.issubdtype(dtype, jax.dtypes.prng_key)):
      raise TypeError(f"{what}: leaf {name} has dtype {dtype}, which is neither a number nor a PRNG key")
    if not x.shape:
      raise ValueError(f"{what}: leaf {name} is a scalar of dtype {dtype}: every leaf needs a leading node axis")
    if first is None:
      first = (name, x.shape[0])
    elif x.shape[0] != first[1]:
      raise ValueError(f"{what}: leaf {name} has {x.shape[0]} nodes on its leading axis, leaf {first[0]} has "
                       f"{first[1]}")
  return leaves


def node_mean(tree: Any) -> Any:
  """The average model: the mean over the node axis of every floating-point leaf.

  Leaves that are not floating point (PRNG keys and counters of a full ``nnx.state``, an
  integer step) are not averaged: as `mix` leaves them alone, the average model takes node
  0's. A 16-bit leaf is summed in float32 and returned in its own dtype.

  Inside `gj.chain` / `gj.nodes`, where a transform sees one node's values, it is the
  collective form: every node gets the mean over all nodes, on every backend (the devices of
  a sharded or pmapped run and the ranks of an MPI run included). It is the public
  collective over the node axis: that axis has no string name, so a raw
  ``lax.pmean(x, "nodes")`` there is refused.

  Args:
    tree: a pytree whose leaves carry a leading node axis (inside a mapping: one node's
      floating-point values).

  Returns:
    ``tree`` with the node axis averaged out of every float leaf, and node 0's value of every
    other leaf (one model). Inside a mapping: the mean over all nodes, on every node.

  Raises:
    TypeError: a leaf is not an array (a Python number), or neither a number nor a PRNG key;
      inside a mapping, a leaf is not floating point.
    ValueError: a leaf has no node axis, or a node axis of another size; the message names it;
      inside `gj.per_node`, which maps a local transform.

  Example:
    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> tree = {"w": jnp.array([[0.0, 2.0], [2.0, 4.0]]), "count": jnp.array([3, 3]),
    ...         "key": jax.random.split(jax.random.key(0), 2)}
    >>> mean = gj.node_mean(tree)
    >>> mean["w"].tolist(), mean["count"].tolist(), mean["key"].shape
    ([1.0, 3.0], 3, ())
  """
  if mapping() is not None:
    return _mean_over_all_nodes(tree)
  _node_leaves(tree, "gj.node_mean")
  # Measured from node 0 and scaled before the sum: nodes that agree give node 0's value
  # exactly, and nodes near the dtype's largest value keep a finite mean.
  mean = lambda x: (x[0] + jnp.sum(mean_terms(x - x[:1], x.shape[0]), axis=0)).astype(x.dtype)
  # On a mesh, each result keeps its leaf's layout on the other mesh axes.
  return auto_where_explicit(lambda t: jax.tree.map(lambda x: mean(x) if _is_float(x) else x[0], t), tree,
                             lambda specs: jax.tree.map(lambda s: P(*s[1:]), specs, is_leaf=_is_spec))


def _mean_over_all_nodes(tree: Any) -> Any:
  """Inside a mapping, the mean over all nodes of one node's float ``tree``, on every node."""
  current = mapping()
  assert current is not None
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    if not _is_float(jnp.asarray(x)):
      raise TypeError(f"gj.node_mean inside {current.where}: leaf {jax.tree_util.keystr(path) or '<root>'} has dtype "
                      f"{jnp.asarray(x).dtype}; the mean over all nodes takes floating-point leaves")
  return node_average(current.backend, jax.tree.map(jnp.asarray, tree), "gj.node_mean")


def consensus_distance(tree: Any) -> jax.Array:
  r"""How far the nodes are from agreeing: the mean squared distance to the average model.

  .. math::
    \Xi = \frac{1}{n} \sum_i \|x_i - \bar x\|^2, \qquad \bar x = \frac{1}{n} \sum_i x_i,

  summed over the floating-point leaves. Other leaves (PRNG keys, step and RNG counters) are
  no part of the model that gossip averages and are not counted, so the full state of an
  NNX model (``nnx.state(model)``) can be passed as it is. 16-bit leaves are summed in
  float32.

  Args:
    tree: a pytree whose leaves carry a leading node axis of size n.

  Returns:
    A scalar array (of the float leaves' dtype, at least float32), 0 exactly when every node
    holds the same model.

  Raises:
    TypeError: a leaf is not an array (a Python number), or neither a number nor a PRNG key.
    ValueError: a leaf has no node axis, or a node axis of another size; the message names it.

  Example:
    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> x = {"w": jnp.array([[0.0, 2.0], [2.0, 4.0]])}  # each node is at distance^2 2 from [1, 3]
    >>> float(gj.consensus_distance(x))
    2.0
    >>> float(gj.consensus_distance({**x, "step": jnp.array([1, 7]), "key": jax.random.split(jax.random.key(0))}))
    2.0

  References:
    Kong, Lin, Koloskova, Jaggi, Stich (2021), Consensus Control for Decentralized Deep
    Learning, ICML.
  """
  floats = [x for _, x in _node_leaves(tree, "gj.consensus_distance") if _is_float(x)]
  dtype = jnp.result_type(jnp.float32, *(jnp.real(jnp.zeros((), x.dtype)).dtype for x in floats))

  def leaf(x):
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    d = x - x[:1]  # from node 0 first: nodes that agree are at distance 0 exactly
    d = d - jnp.sum(mean_terms(d, x.shape[0]), axis=0, keepdims=True)
    return jnp.sum(jnp.real(d * jnp.conj(d)) / x.shape[0]).astype(dtype)

  return auto_where_explicit(lambda xs: sum((leaf(x) for x in xs), start=jnp.zeros([], dtype)), floats,
                             lambda specs: P())


def nonfinite_nodes(tree: Any) -> np.ndarray:
  """Indices of the nodes with a NaN or inf anywhere in their params (host-side check).

  Integer, bool and PRNG-key leaves are always finite and are skipped.

  Args:
    tree: a pytree whose leaves carry a leading node axis.

  Returns:
    A NumPy integer array of the node indices, in increasing order (empty when all finite).

  Raises:
    TypeError: a leaf is not an array (a Python number), or neither a number nor a PRNG key.
    ValueError: a leaf has no node axis, or a node axis of another size; the message names it.

  Example:
    >>> import jax.numpy as jnp, gossipjax as gj
    >>> gj.nonfinite_nodes(jnp.array([[1.0, 2.0], [jnp.nan, 0.0], [0.0, jnp.inf]])).tolist()
    [1, 2]
  """
  floats = [x for _, x in _node_leaves(tree, "gj.nonfinite_nodes") if _is_float(x)]
  return np.flatnonzero(np.asarray(_nonfinite_mask(floats))) if floats else np.array([], int)


@jax.jit
def _nonfinite_mask(leaves: list[jax.Array]) -> jax.Array:
  # One program for the whole tree (not a few per leaf, eagerly).
  bad = [~jnp.isfinite(x).all(axis=tuple(range(1, x.ndim))) for x in leaves]  # a reduction: a leaf may be model-split
  return functools.reduce(jnp.logical_or, bad)


def check_finite(tree: Any, step: int, what: str = "params") -> None:
  """Raises ``FloatingPointError`` naming the nodes and the step where ``tree`` is not finite.

  Args:
    tree: a pytree whose leaves carry a leading node axis.
    step: the step, for the message.
    what: what ``tree`` is, for the message.

  Raises:
    FloatingPointError: a node has a NaN or inf in some leaf.

  Example:
    >>> import jax.numpy as jnp, gossipjax as gj
    >>> gj.check_finite(jnp.array([[1.0], [jnp.nan], [2.0]]), step=7)
    Traceback (most recent call last):
    ...
    FloatingPointError: params of node(s) 1 became NaN/inf at step 7 (1 node(s) in all)
  """
  bad = nonfinite_nodes(tree)
  if bad.size:
    shown = ", ".join(map(str, bad[:10])) + (" ..." if bad.size > 10 else "")
    raise FloatingPointError(f"{what} of node(s) {shown} became NaN/inf at step {step} ({bad.size} node(s) in all)")


def evaluate_nodes(metric_fn: Callable[[Any, Any], Any], params: Any, batch: Any) -> Any:
  """``metric_fn(params_i, batch)`` for every node i on the same batch (vmapped).

  Args:
    metric_fn: ``(params, batch) -> metric`` for one node's params.
    params: node-stacked params (a leading node axis on every leaf).
    batch: one batch, shared by every node.

  Returns:
    The metric of every node, with a leading node axis.

  Example:
    >>> import jax.numpy as jnp, gossipjax as gj
    >>> loss = lambda w, b: jnp.mean((b["x"] * w - b["y"]) ** 2)
    >>> batch = {"x": jnp.array([1.0, 2.0]), "y": jnp.array([2.0, 4.0])}  # y = 2 x
    >>> gj.evaluate_nodes(loss, jnp.array([1.0, 3.0]), batch).tolist()
    [2.5, 2.5]
  """
  return jax.vmap(metric_fn, in_axes=(0, None))(params, batch)


def evaluate_mean(metric_fn: Callable[[Any, Any], Any], params: Any, batch: Any) -> Any:
  """``metric_fn`` of the average model on ``batch``.

  Args:
    metric_fn: ``(params, batch) -> metric`` for one node's params.
    params: node-stacked params (a leading node axis on every leaf).
    batch: one batch.

  Returns:
    ``metric_fn(node_mean(params), batch)``.

  Example:
    The average of two models can be better than either (compare `evaluate_nodes`):

    >>> import jax.numpy as jnp, gossipjax as gj
    >>> loss = lambda w, b: jnp.mean((b["x"] * w - b["y"]) ** 2)
    >>> batch = {"x": jnp.array([1.0, 2.0]), "y": jnp.array([2.0, 4.0])}  # y = 2 x
    >>> float(gj.evaluate_mean(loss, jnp.array([1.0, 3.0]), batch))
    0.0
  """
  return metric_fn(node_mean(params), batch)
