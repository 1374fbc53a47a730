"""The node mixer: a backend's stacked mixer that is also a gossip round over the node axis.

Inside `gj.nodes` a transform sees one node, and its gossip round is a collective over the
node axis that the mapping binds (a private axis object, not a string name): a
``jax.custom_batching.custom_vmap`` whose batching rule hands the node-stacked tree to the
backend's stacked mixer. On stacked trees the mixer is called directly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from gossipjax._axis import mapping
from gossipjax.backend._base import Mixer
from gossipjax.backend._block_plan import check_rounds_apart, rounds_alone
from gossipjax.backend._buckets import Wire
from gossipjax.mixing._collectives import _shared, _stacked, check_same_backend, node_collective
from gossipjax.topology import Topology


@dataclasses.dataclass(frozen=True, eq=False)
class NodeMixer:
  """A backend's mixer that also runs inside `gj.nodes`, where it is a collective over the node axis.

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

  def call_stacked(self, fn: Callable[[Callable[[Any, Any], Any], Any, Any], Any], tree: Any,
                   step: jax.Array | int, like: Callable[[Any], Any]) -> Any:
    """``fn(mix, tree, step)`` on the nodes' stacked trees, ``mix(tree, step)`` the backend's stacked mixer.

    On stacked trees this is the call itself. For one node (inside a mapping) it is one
    collective whose batching rule runs ``fn`` on the node-stacked ``tree``: the entry-wise
    work around a gossip round is traced once on stacked arrays, not per node under
    ``jax.vmap``. ``like(tree)`` has the structure, shapes and dtypes of one node's output.
    """
    stacked_mix = self.stacked.mix
    return self._collective(tree, step, None, lambda t, s, w: fn(lambda x, k: stacked_mix(x, k, w), t, s), like)

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
    if current.num_nodes != self.local_nodes:
      raise ValueError(f"{self.name}: params has a leading node axis of {current.num_nodes} (in {current.where}), but "
                       f"{self.topology.name} expects {self.local_nodes} nodes on the leading axis (stack every "
                       "node's params, e.g. with gj.init_nodes)")
    # A static W needs no step: it is not read, so a stacked count costs no reduction.
    reads_step = self.stacked.topology.is_time_varying or wire is not None
    parts = None if wire is None else wire.parts
    context = None if wire is None else wire.context

    def rule(num_nodes, in_batched, args):
      tree, step, parts, context = args
      b_tree, b_step, b_parts, b_context = in_batched
      tree = jax.tree.map(lambda x, b: _stacked(x, b, num_nodes), tree, b_tree)
      step = _shared(step, b_step) if reads_step else 0
      if wire is None:
        out = call(tree, step, None)
      else:
        parts = jax.tree.map(lambda x, b: _stacked(x, b, num_nodes), parts, b_parts)
        context = jax.tree.map(_shared, context, b_context)
        out = call(tree, step, Wire(parts, wire.decode, context))
      return out, jax.tree.map(lambda _: True, out)

    return node_collective(lambda args: shapes(args[0]), rule, (tree, jnp.asarray(step), parts, context))
