"""All n nodes stacked on one device: mixing is rolls / gathers on the leading axis."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from gossipjax.backend._base import auto_where_explicit, node_sharding
from gossipjax.backend._block_plan import rounds_alone
from gossipjax.backend._cpu_threads import check_placed_threads
from gossipjax.backend._map import InAxes, vmap_nodes
from gossipjax.backend._precision import accumulation_dtype, mean_terms
from gossipjax.backend._traffic import note_gossip, note_all_to_all, note_gather, note_mean
from gossipjax.backend._table import mix_from_table, plan_table
from gossipjax.topology import MixingPlan, Topology


def _weight(w: np.ndarray, like: jax.Array) -> Any:
  """A Python scalar when all nodes share the weight (fuses best), else a (n, 1, ...) array."""
  if np.all(w == w[0]):
    return float(w[0])
  return jnp.asarray(w, like.dtype).reshape((-1,) + (1,) * (like.ndim - 1))


def apply_plan(plan: MixingPlan, x: jax.Array) -> jax.Array:
  """``W x`` for one leaf with all n nodes on axis 0, in O((degree + rank-one terms) * n * d).

  16-bit floats are summed in float32 and rounded once (see `accumulation_dtype`); a leaf
  that is not a float is returned unchanged, as `mix_from_table` leaves it.
  """
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    return x
  leaf_dtype, x = x.dtype, x.astype(accumulation_dtype(x.dtype))
  out = _weight(plan.self_weight, x) * x
  for r in plan.rounds:
    if r.shift is not None:
      received = jnp.roll(x, -r.shift, axis=0)  # row i <- x[(i + shift) % n]
    else:
      received = jnp.take(x, jnp.asarray(r.src), axis=0)
    out = out + _weight(r.weight, x) * received
  for t in plan.rank_one:
    out = out + scale_rows(t.u, weighted_sum(t.v, x), x)
  return out if x.dtype == leaf_dtype else out.astype(leaf_dtype)


def weighted_sum(v: np.ndarray, x: jax.Array) -> jax.Array:
  """``sum_j v[j] x[j]`` over the node axis, shape (1, ...): a plain sum where v is constant, else one row or a dot."""
  if np.all(v == v[0]):
    return jnp.sum(float(v[0]) * x, axis=0, keepdims=True)  # scaled first: a sum of n large rows could overflow
  nz = np.flatnonzero(v)
  if len(nz) == 1:  # a hub's column: one node's row
    return float(v[nz[0]]) * x[int(nz[0]):int(nz[0]) + 1]
  return jnp.tensordot(jnp.asarray(v, x.dtype), x, axes=1)[None]


def scale_rows(u: np.ndarray, total: jax.Array, like: jax.Array) -> jax.Array:
  """``u[i] * total`` for every node i, as an (n, ...) array shaped like ``like``."""
  if np.all(u == u[0]):
    return jnp.broadcast_to(float(u[0]) * total, like.shape)
  nz = np.flatnonzero(u)
  if len(nz) == 1:  # a hub's row: only the hub receives
    return jnp.zeros_like(like).at[int(nz[0])].set(float(u[nz[0]]) * total[0])
  return _weight(u, like) * total


def warn_if_placed(tree: Any, topology_name: str) -> None:
  """Warns, with the fix, when params sharded over a mesh reach a transform built for the simulation.

  It would still compute the right numbers, but as one program over all nodes that the
  compiler partitions (gathering rows), not as neighbour exchanges: the transform was built
  without ``backend=``.
  """
  for leaf in jax.tree.leaves(tree):
    sharding = node_sharding(leaf)
    if sharding is not None and sharding.mesh.shape[sharding.spec[0]] > 1:
      warnings.warn(
          f"gj.backend.simulate: the params mixed over {topology_name} are sharded over mesh axis "
          f"{sharding.spec[0]!r}, but the transform was built for the simulation (no backend=); build it "
          f"with backend=gj.backend.sharded(mesh, axis={sharding.spec[0]!r}), or inside "
          f"`with gj.backend.use(gj.backend.sharded(mesh)):`, so that mixing is neighbour exchanges",
          stacklevel=3)
      return


def _is_spec(x: Any) -> bool:
  return isinstance(x, P)


def _unsplit_nodes(spec: P) -> P:
  return P(None, *spec[1:])


@dataclasses.dataclass(frozen=True)
class SimulateMixer:
  topology: Topology

  @property
  def local_nodes(self) -> int:
    return self.topology.num_nodes

  def first_node(self) -> int:
    return 0

  def mix(self, tree: Any, step: jax.Array | int = 0, wire: Any = None) -> Any:
    note_gossip(self.topology, tree, step, wire, 0)  # the compact form is what would cross
    del wire  # every node is here: the dense rows are mixed, and a compact form has nothing to cross
    check_placed_threads(tree, _WHERE)
    warn_if_placed(tree, self.topology.name)
    # Params placed on an Explicit mesh: the rolls along the node axis are left to the compiler
    # (a traced step goes in as an argument, typed for the compiler's context).
    if isinstance(step, (int, np.integer)):
      return auto_where_explicit(lambda t: self._mix(t, step), tree, lambda specs: specs)
    return auto_where_explicit(lambda a: self._mix(*a), (tree, step), lambda specs: specs[0])

  def _mix(self, tree: Any, step: jax.Array | int) -> Any:
    plans = self.topology.plans()
    apply = lambda p: (lambda t: jax.tree.map(lambda x: apply_plan(p, x), t))
    if len(plans) == 1:
      return apply(plans[0])(tree)
    if isinstance(step, (int, np.integer)):
      return apply(plans[int(step) % len(plans)])(tree)
    # The step is traced: one compiled program serves every step of the period.
    if len(plans) <= _MAX_SWITCH_BRANCHES or any(p.rank_one for p in plans):
      return lax.switch(jnp.asarray(step) % len(plans), [apply(p) for p in plans], tree)
    # A long period (e.g. a pool of random matchings) compiles one branch per step under
    # lax.switch; a gather from a (period, rounds, n) table compiles once.
    table = plan_table(self.topology)
    k = jnp.asarray(step) % len(plans)
    self_w, src, w = (jnp.asarray(a)[k] for a in table)
    return jax.tree.map(lambda x: mix_from_table(self_w, src, w, x), tree)


  def mix_rounds(self, tree: Any, wire: Any = None) -> tuple[Any, ...]:
    """Each round of a static W apart, one tree per round (``W = diag(self weight) + sum_r W_r``)."""
    alone = rounds_alone(self.topology)
    note_gossip(self.topology, tree, 0, wire, 0)
    check_placed_threads(tree, _WHERE)
    warn_if_placed(tree, self.topology.name)
    return auto_where_explicit(lambda t: tuple(jax.tree.map(lambda x: apply_plan(p, x), t) for p in alone), tree,
                               lambda specs: (specs,) * len(alone))


_MAX_SWITCH_BRANCHES = 16

# What a refusal names: params the user placed on several CPU devices make each simulated step a program over them.
_WHERE = "gj.backend.simulate"


@dataclasses.dataclass(frozen=True)
class Simulate:
  """All n nodes stacked on one device (the default backend).

  Mixing is rolls and gathers on the leading node axis (one per exchange round), the mean
  is a mean over that axis, and ``map`` is ``jax.vmap``. Built by `simulate`.

  Example:
    >>> import jax.numpy as jnp, gossipjax as gj
    >>> mixer = gj.backend.Simulate().mixer(gj.topology.ring(4))
    >>> print(mixer.mix(jnp.arange(4.0), 0).round(4))
    [1.3333 1.     2.     1.6667]
  """

  def mixer(self, topology: Topology) -> SimulateMixer:
    return SimulateMixer(topology)

  def mean(self, tree: Any) -> Any:
    """Every node gets the average over the node axis, scaled before it is summed (see `mean_terms`)."""
    leaves = jax.tree.leaves(tree)
    note_mean(tree, jnp.shape(leaves[0])[0] if leaves and jnp.ndim(leaves[0]) else 1)
    check_placed_threads(tree, _WHERE)

    def leaf(x):
      total = jnp.sum(mean_terms(x, x.shape[0]), axis=0, keepdims=True)
      return jnp.broadcast_to(total.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else total, x.shape)

    return jax.tree.map(leaf, tree)

  def first_of_block(self, local: int) -> int:
    """The global index of the first node of a block of ``local`` nodes where a transform runs."""
    return 0

  def gathered_nodes(self, local: int) -> int:
    """How many nodes `gather` returns from blocks of ``local`` nodes."""
    return local

  def gather(self, tree: Any) -> Any:
    """Every node's values, on every node (the all-gather): the stacked tree itself."""
    leaves = jax.tree.leaves(tree)
    note_gather(tree, jnp.shape(leaves[0])[0] if leaves and jnp.ndim(leaves[0]) else 1)
    check_placed_threads(tree, _WHERE)
    # On an Explicit mesh every node's values are made whole on each device (one all-gather).
    return auto_where_explicit(lambda t: t, tree, lambda specs: jax.tree.map(_unsplit_nodes, specs, is_leaf=_is_spec))

  def all_to_all(self, tree: Any) -> Any:
    """Node j's piece j of every node: leaves ``(b, n, ...)`` (piece k of local node i at ``[i, k]``) become
    ``(b, n, ...)`` with ``[i, s]`` the piece of local node i that node s sent."""
    note_all_to_all(tree)
    check_placed_threads(tree, _WHERE)
    # On an Explicit mesh the result keeps the node axis where it was, on the leading axis.
    return auto_where_explicit(lambda t: jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), t), tree, lambda specs: specs)

  def local_nodes(self, num_nodes: int) -> int:
    return num_nodes

  def map(self, fn: Callable[..., Any], in_axes: InAxes = 0, num_nodes: int | None = None) -> Callable[..., Any]:
    """``fn`` on each node's slice of its arguments: ``jax.vmap(fn, in_axes)`` over the node axis.

    Args:
      fn: a per-node function (one node's params, batch, ...).
      in_axes: ``0`` for arguments whose leading axis is the node axis, ``None`` for
        arguments every node shares; one entry per positional argument, as in ``jax.vmap``.
      num_nodes: when given, every mapped leaf must have this leading size.

    Example:
      >>> import jax, jax.numpy as jnp, gossipjax as gj
      >>> be = gj.backend.simulate()
      >>> grads = be.map(jax.grad(lambda w, x: jnp.sum(w * x)), in_axes=(0, None))(jnp.ones((4, 3)), jnp.arange(3.0))
      >>> grads.shape
      (4, 3)
    """
    where = "gj.backend.simulate().map"
    mapped = vmap_nodes(fn, in_axes, num_nodes, where)

    def run(*args):
      check_placed_threads(args, where)
      return mapped(*args)

    return run


def simulate() -> Simulate:
  """The default backend: every node's params stacked on a leading axis of one array.

  What every algorithm uses when given no ``backend``.

  Returns:
    A `Simulate` backend.

  Example:
    One D-PSGD step with zero gradients is one gossip round, ``x <- W x``:

    >>> import jax.numpy as jnp, gossipjax as gj
    >>> tx = gj.gossip_sgd(gj.topology.ring(4), learning_rate=0.1, backend=gj.backend.simulate())
    >>> x = jnp.arange(4.0)[:, None]
    >>> u, _ = tx.update(jnp.zeros_like(x), tx.init(x), x)
    >>> [round(float(v), 4) for v in (x + u)[:, 0]]
    [1.3333, 1.0, 2.0, 1.6667]
  """
  return Simulate()
