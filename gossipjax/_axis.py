"""The node axis that `gj.nodes` binds: whether a transform runs for one node or on stacked trees.

A gossipjax transform runs in one of two places. Called on node-stacked trees (every leaf with
a leading node axis), it computes for all nodes at once. Called inside `gj.nodes` (and so
inside `gj.chain`, under any optax combinator), it sees one node's values, and its
communication is a collective over the node axis that `gj.nodes` binds with ``jax.vmap``.

Which of the two holds is JAX's answer, not Python state: the axis name is a `NodeAxis`
(private to gossipjax, so a user's own axis named ``"nodes"`` never meets it), and a
transform asks whether it is bound where it is traced (``lax.axis_size``). JAX keys its
trace caches on the bound axis names, so a jitted or scanned helper traced on stacked trees
and again inside the mapping is traced once for each, and the node's index comes from
``lax.axis_index`` in the trace that needs it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.custom_batching import custom_vmap


@dataclasses.dataclass(frozen=True, eq=False)
class NodeAxis:
  """The name of the node axis that `gj.nodes` binds: one per backend.

  Attributes:
    backend: the backend of the mapping transform; its collectives run the backend's kernels.
    where: the public name of the mapping transform (``"gj.chain"``), for errors.
    local: ``True`` for `gj.per_node`, which maps a local transform: a collective inside it
      is refused.
  """

  backend: Any
  where: str = "gj.nodes"
  local: bool = False

  def __eq__(self, other: object) -> bool:
    return (isinstance(other, NodeAxis) and self.local == other.local
            and (self.backend is other.backend or self.backend == other.backend))

  def __hash__(self) -> int:
    return hash((NodeAxis, type(self.backend).__name__, self.local))

  def __repr__(self) -> str:
    return f"<the node axis of {self.where}>"


@dataclasses.dataclass(frozen=True)
class Mapping:
  """What a one-node transform needs to know about the mapping it runs under.

  Attributes:
    axis: the bound node axis.
    num_nodes: the size of the mapped node axis where it runs (all n nodes, or an MPI rank's
      block).
  """

  axis: NodeAxis
  num_nodes: int

  @property
  def backend(self) -> Any:
    return self.axis.backend

  @property
  def where(self) -> str:
    return self.axis.where

  @property
  def index(self) -> jax.Array:
    """This node's index on the mapped axis, in the trace that asks for it."""
    return lax.axis_index(self.axis)


# The axis the enclosing `gj.nodes` binds, while it traces its mapped function (a static value,
# never a tracer); `None` inside a collective's batching rule, where the code sees stacked trees.
_AXIS: contextvars.ContextVar[NodeAxis | None] = contextvars.ContextVar("gossipjax_node_axis", default=None)


def mapping() -> Mapping | None:
  """The mapping a transform is being traced under, or ``None`` on stacked trees."""
  axis = _AXIS.get()
  if axis is None:
    return None
  try:
    size = lax.axis_size(axis)
  except NameError:  # JAX's answer where the axis is not bound: this trace sees stacked trees
    return None
  return Mapping(axis, int(size))


@contextlib.contextmanager
def mapped(axis: NodeAxis | None) -> Iterator[None]:
  """Within the block, transforms traced where ``axis`` is bound see one node (``None``: stacked trees)."""
  token = _AXIS.set(axis)
  try:
    yield
  finally:
    _AXIS.reset(token)


def shared_leaves(tree: Any) -> list[bool]:
  """For each leaf of a state, whether every node holds it alike (declared by its state class).

  A state class lists the fields that are one value for every node, as the step count that
  picks W(k) and the gossip rounds is, in its class attribute ``shared_over_nodes``; every
  other leaf is per node. Inside `gj.nodes` a shared leaf is kept as one value, so a
  ``lax.cond`` on it stays a branch and every node gossips on the same steps.
  """
  marked = lambda s: isinstance(s, tuple) and bool(getattr(type(s), "shared_over_nodes", ()))
  flags: list[bool] = []
  for x in jax.tree.leaves(tree, is_leaf=marked):
    if not marked(x):
      flags.append(False)
      continue
    for field in x._fields:
      sub = getattr(x, field)
      flags.extend([True] * len(jax.tree.leaves(sub)) if field in type(x).shared_over_nodes else shared_leaves(sub))
  return flags


def _declared(x: Any) -> bool:
  return isinstance(x, tuple) and hasattr(type(x), "shared_over_nodes")


def unguarded_under_gate(state: Any) -> list[str]:
  """The gossipjax states under an ``optax.apply_if_finite`` whose exchanges would pass a skipped node's NaN on.

  A per-node gate skips a node's step, but the collective inside it still runs for every node
  (a collective has no per-node branch), so the node sends what its NaN step produced. A
  gossipjax state class that declares ``guards_what_it_sends`` (`gj.mix`'s, and
  `gj.guard_finite`'s around any method) keeps the NaN home; the outermost other ones are
  returned by class name.
  """
  is_gate = lambda x: isinstance(x, optax.ApplyIfFiniteState)
  return [type(s).__name__
          for gate in jax.tree.leaves(state, is_leaf=is_gate) if is_gate(gate)
          for s in jax.tree.leaves(gate.inner_state, is_leaf=_declared)
          if _declared(s) and not getattr(type(s), "guards_what_it_sends", False)]


def own_leaves(tree: Any) -> list[bool]:
  """For each leaf of a state, whether it is one node's own inside `gj.nodes` (not declared shared)."""
  return [not shared for shared in shared_leaves(tree)]


def settle_shared(tree: Any, flags: list[bool]) -> Any:
  """Inside `gj.nodes`, each leaf flagged shared as one value for every node: the furthest-on node's.

  A shared count differs between nodes only where a per-node gate (``optax.apply_if_finite``)
  held one node's state back; the maximum keeps every node on the same schedule. A leaf that
  is already one value passes through, at no cost.
  """
  current = mapping()
  leaves, treedef = jax.tree.flatten(tree)
  picked = [x for x, f in zip(leaves, flags) if f]
  if current is None or not picked:
    return tree

  @custom_vmap
  def settle(picked, witness):
    del witness
    return picked

  @settle.def_vmap
  def rule(axis_size, in_batched, picked, witness):
    del axis_size, witness
    out = [jnp.max(x, axis=0) if b else x for x, b in zip(picked, in_batched[0])]
    return out, [False] * len(out)

  settled = iter(settle(picked, current.index))
  return jax.tree.unflatten(treedef, [next(settled) if f else x for x, f in zip(leaves, flags)])


_PIECES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("gossipjax_pieces", default=())


def piece_axes() -> tuple[str, ...]:
  """Inside a backend's per-node map, the mesh axes a node's leaves may be split over (a model over a node's
  devices, not a batch's data axis); ``()`` elsewhere."""
  return _PIECES.get()


@contextlib.contextmanager
def pieces_over(axes: tuple[str, ...]) -> Iterator[None]:
  """Within the block, per-node code may find a node's leaves split over ``axes``."""
  token = _PIECES.set(tuple(axes))
  try:
    yield
  finally:
    _PIECES.reset(token)
