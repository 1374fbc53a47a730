"""Collectives over the named node axis, implemented by the stacked kernels.

Inside `gj.nodes` a transform sees one node; its gossip round and its all-reduce mean are
collectives over the axis ``"nodes"``. Each is a ``jax.custom_batching.custom_vmap`` whose
batching rule receives the node-stacked values and calls the backend's stacked mixer or mean
(the circulant rolls, sparse plans, step tables, buckets and compact wire stay the
implementation), so the named form costs what the stacked call costs. The same functions
called on stacked trees, outside any mapping, call the stacked kernels directly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from gossipjax._axis import Mapping, mapped, mapping
from gossipjax.backend._base import Mixer
from gossipjax.backend._block_plan import check_rounds_apart, rounds_alone
from gossipjax.backend._buckets import Wire
from gossipjax.topology import Topology


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


@dataclasses.dataclass(frozen=True, eq=False)
class NodeMixer:
  """A backend's mixer that also runs inside `gj.nodes`, where it is a collective over ``"nodes"``.

  On stacked trees ``mix`` is the backend's mixer as it is. For one node (inside a mapping)
  ``mix(tree, step)`` returns ``sum_j W(step)[i, j] x_j`` for this node i: a
  ``custom_vmap`` whose batching rule hands the node-stacked tree to the same mixer.

  Attributes:
    stacked: the backend's `Mixer`.
    backend: the backend it was built for.
    name: the public name of the transform that built it, for errors.
  """

  stacked: Mixer
  backend: Any
  name: str

  @property
  def topology(self) -> Topology:
    return self.stacked.topology

  @property
  def local_nodes(self) -> int:
    return self.stacked.local_nodes

  def first_node(self) -> jax.Array | int:
    return self.stacked.first_node()

  def mix(self, tree: Any, step: jax.Array | int = 0, wire: Wire | None = None) -> Any:
    return self._collective(tree, step, wire, self.stacked.mix, lambda tree: tree)

  def mix_rounds(self, tree: Any, wire: Wire | None = None) -> tuple[Any, ...]:
    """Each round of a static W apart: ``(W_1 x, ..., W_c x)`` with ``W = diag(self weight) + sum_r W_r``.

    Round r of the topology's plan gives node i the term ``W[i, src_r(i)] x_{src_r(i)}`` (zero
    where it has no edge in that round). The backends that hold nodes apart send every round's
    rows in one set of exchanges, at most one message per pair of devices and bucket, where
    mixing the rounds one by one sends one per round. A backend's mixer without ``mix_rounds``
    mixes each round alone. A static W without rank-one terms only.
    """
    check_rounds_apart(self.topology)
    rounds = len(self.topology.plans()[0].rounds)
    return self._collective(tree, 0, wire, lambda t, step, w: self._rounds_stacked(t, w),
                            lambda tree: (tree,) * rounds)

  def _rounds_stacked(self, tree: Any, wire: Wire | None) -> tuple[Any, ...]:
    fn = getattr(self.stacked, "mix_rounds", None)
    if fn is not None:
      return fn(tree, wire)
    return tuple(self.backend.mixer(Topology.from_plans(p, name=f"round {c} of {self.topology.name}")).mix(tree, 0, wire)
                 for c, p in enumerate(rounds_alone(self.topology)))

  def _collective(self, tree: Any, step: jax.Array | int, wire: Wire | None,
                  call: Callable[[Any, Any, Wire | None], Any], shapes: Callable[[Any], Any]) -> Any:
    """``call(tree, step, wire)`` on stacked trees; inside a mapping, a collective whose rule stacks the nodes' trees."""
    current = mapping()
    if current is None:
      return call(tree, step, wire)
    check_same_backend(current, self.backend, self.name)
    stacked = self.stacked
    parts = None if wire is None else wire.parts
    context = None if wire is None else wire.context

    @custom_vmap
    def gossip(tree, step, parts, context, witness):
      del step, parts, context, witness
      return shapes(tree)  # the shape only: under the mapping the rule below runs instead

    @gossip.def_vmap
    def rule(axis_size, in_batched, tree, step, parts, context, witness):
      del witness
      b_tree, b_step, b_parts, b_context, _ = in_batched
      tree = jax.tree.map(lambda x, b: _stacked(x, b, axis_size), tree, b_tree)
      # A static W needs no step: it is not read, so a stacked count costs no reduction.
      step = 0 if not stacked.topology.is_time_varying and wire is None else _shared(step, b_step)
      with mapped(None):
        if wire is None:
          out = call(tree, step, None)
        else:
          parts = jax.tree.map(lambda x, b: _stacked(x, b, axis_size), parts, b_parts)
          context = jax.tree.map(_shared, context, b_context)
          out = call(tree, step, Wire(parts, wire.decode, context))
      return out, jax.tree.map(lambda _: True, out)

    return gossip(tree, jnp.asarray(step), parts, context, _witness())


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

    @custom_vmap
    def init(params, witness):
      # Shapes only (the rule below runs under the mapping): the stacked state's, less the
      # node axis of its per-node leaves.
      del witness
      stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((size,) + jnp.shape(x), x.dtype), params)
      with mapped(None):
        shapes = jax.eval_shape(tx.init, stacked)
      one = lambda x, per_node: jnp.zeros(x.shape[1:] if per_node else x.shape, x.dtype)
      return jax.tree.map(one, shapes, out_flags(shapes, size))

    @init.def_vmap
    def rule(axis_size, in_batched, params, witness):
      del witness
      params = jax.tree.map(lambda x, b: _stacked(x, b, axis_size), params, in_batched[0])
      with mapped(None):
        state = _arrays(tx.init(params))
      return state, out_flags(state, axis_size)

    return init(params, _witness())

  def update_fn(updates, state, params=None, **extra_args):
    if mapping() is None:
      return tx.update(updates, state, params, **extra_args)
    extra_args = _arrays(extra_args)

    @custom_vmap
    def update(updates, state, params, extra, witness):
      del params, extra, witness
      return updates, state  # shapes only: an optax update keeps the shapes of both

    @update.def_vmap
    def rule(axis_size, in_batched, updates, state, params, extra, witness):
      del witness
      b_u, b_s, b_p, _, _ = in_batched
      updates = jax.tree.map(lambda x, b: _stacked(x, b, axis_size), updates, b_u)
      if params is not None:
        params = jax.tree.map(lambda x, b: _stacked(x, b, axis_size), params, b_p)
      with mapped(None):
        new, new_state = tx.update(updates, state, params, **extra)
      return (new, new_state), (jax.tree.map(lambda _: True, new), b_s)

    return update(updates, state, params, extra_args, _witness())

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
