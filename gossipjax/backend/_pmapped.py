"""Transforms called inside ``jax.pmap``: each device holds its block of nodes, mixing by ``lax.ppermute``."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap

from gossipjax.backend import _cpu_threads
from gossipjax.backend._map import InAxes, vmap_nodes
from gossipjax.backend._precision import mean_terms
from gossipjax.backend._traffic import note_gossip, note_all_to_all, note_gather, note_mean
from gossipjax.backend._block_plan import (BlockPlan, StepTable, check_divisible, check_rounds_apart, compile_topology,
                                           step_table_or_none)
from gossipjax.backend._blocks import mix_block_rounds, mix_blocks
from gossipjax.backend._buckets import DEFAULT_BUCKET_BYTES, Wire, check_bucket_bytes
from gossipjax.topology import Topology


def _shadowed(axis: str) -> bool:
  """Whether the innermost binding of ``axis`` here is a ``jax.vmap``'s (whose index is batched), not the pmap's."""
  found: list[bool] = []

  @custom_vmap
  def probe(index):
    return index

  @probe.def_vmap
  def rule(axis_size, in_batched, index):
    del axis_size
    found.append(bool(in_batched[0]))
    return index, in_batched[0]

  probe(lax.axis_index(axis))
  return any(found)


def check_pmap_size(axis: str, num_devices: int, block: int) -> None:
  """Refuses a pmap over ``axis`` whose size is not the ``num_devices`` the backend was built for.

  ``lax.axis_size`` reads the innermost axis of that name. A user's own ``jax.vmap`` inside the
  pmap with the pmap axis's name would take its place, and the exchanges and means would run
  over the user's axis: that is refused, whatever the sizes, with the way out.
  """
  del block
  if _shadowed(axis):
    raise ValueError(f"gj.backend.pmapped: this step runs inside a jax.vmap whose axis is named {axis!r}, the name of "
                     f"the pmap axis the backend exchanges over, which it hides; name your vmap's axis otherwise, e.g. "
                     "jax.vmap(..., axis_name='ensemble')")
  size = lax.axis_size(axis)
  if size != num_devices:
    raise ValueError(f"gj.backend.pmapped: the pmap over {axis!r} has {size} devices but the backend was built for "
                     f"{num_devices}; pass gj.backend.pmapped(axis_size={size})")


@dataclasses.dataclass(frozen=True, eq=False)
class PmappedMixer:
  """W(step) on this device's block of ``local_nodes`` nodes, inside ``pmap(..., axis_name=axis_name)``."""

  topology: Topology
  axis_name: str
  num_devices: int
  plans: tuple[BlockPlan, ...]
  bucket_bytes: int = DEFAULT_BUCKET_BYTES
  table: StepTable | None = None

  @property
  def local_nodes(self) -> int:
    return self.topology.num_nodes // self.num_devices

  def first_node(self) -> jax.Array:
    return lax.axis_index(self.axis_name) * self.local_nodes

  def mix(self, tree: Any, step: jax.Array | int = 0, wire: Wire | None = None) -> Any:
    axis = self.axis_name
    check_pmap_size(axis, self.num_devices, self.local_nodes)

    def exchange(ex, send, x):
      del x
      return lax.ppermute(send, axis, perm=ex.pairs)

    note_gossip(self.topology, tree, step, wire, self.first_node())
    return mix_blocks(self.plans, tree, step, lax.axis_index(axis), exchange, lambda t: lax.psum(t, axis),
                      self.bucket_bytes, self.table, wire)

  def mix_rounds(self, tree: Any, wire: Wire | None = None) -> tuple[Any, ...]:
    """Each round of a static W apart, one tree per round, from one set of exchanges for all rounds."""
    axis = self.axis_name
    check_rounds_apart(self.topology)
    check_pmap_size(axis, self.num_devices, self.local_nodes)
    note_gossip(self.topology, tree, 0, wire, self.first_node())
    return mix_block_rounds(self.plans[0], tree, lax.axis_index(axis), lambda ex, send, x: lax.ppermute(
        send, axis, perm=ex.pairs), self.bucket_bytes, wire)


@dataclasses.dataclass(frozen=True)
class Pmapped:
  """Transforms run inside ``jax.pmap(..., axis_name=axis_name)`` over ``axis_size`` devices.

  Device d holds nodes ``d*B ... d*B + B - 1`` with B = n / axis_size; every leaf keeps a
  leading axis of B (1 for one node per device).

  Attributes:
    axis_name: the pmap axis name.
    axis_size: the number of devices the pmap runs over (default: ``jax.device_count()``).
    bucket_bytes: the most bytes of one node's leaves packed into one message (one
      ``ppermute`` per exchange and bucket).

  Example:
    >>> import gossipjax as gj
    >>> be = gj.backend.Pmapped("devices", axis_size=2)
    >>> be.num_devices, be.local_nodes(8)  # 4 nodes per device
    (2, 4)
  """

  axis_name: str = "devices"
  axis_size: int | None = None
  bucket_bytes: int = DEFAULT_BUCKET_BYTES

  def __post_init__(self):
    check_bucket_bytes(self.bucket_bytes, "gj.backend.pmapped")
    if self.axis_name == "nodes":
      raise ValueError("gj.backend.pmapped: the pmap axis runs over devices, each with a block of nodes, so it may not "
                       "be named 'nodes' (a collective over it would miss the nodes of a block); name it otherwise in "
                       "both places, e.g. gj.backend.pmapped('devices') and jax.pmap(..., axis_name='devices'), and "
                       "take the mean over all nodes with gj.node_mean")

  @property
  def num_devices(self) -> int:
    return int(self.axis_size) if self.axis_size is not None else jax.device_count()

  def mixer(self, topology: Topology) -> PmappedMixer:
    k = self.num_devices
    check_divisible(topology, k, f"devices of pmap axis {self.axis_name!r}", "gj.backend.pmapped")
    _cpu_threads.check_collective_threads(jax.local_devices()[:k], "gj.backend.pmapped")
    plans = compile_topology(topology, k)
    return PmappedMixer(topology, self.axis_name, k, plans, self.bucket_bytes, step_table_or_none(plans, topology))

  def mean(self, tree: Any) -> Any:
    leaves = jax.tree.leaves(tree)
    if leaves and jnp.ndim(leaves[0]):
      check_pmap_size(self.axis_name, self.num_devices, jnp.shape(leaves[0])[0])

    def leaf(x):  # scaled before the sums (see `mean_terms`), which then cannot overflow
      n = x.shape[0] * lax.axis_size(self.axis_name)
      total = lax.psum(jnp.sum(mean_terms(x, n), axis=0, keepdims=True), self.axis_name)
      return jnp.broadcast_to(total.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else total, x.shape)

    if leaves and jnp.ndim(leaves[0]):
      note_mean(tree, jnp.shape(leaves[0])[0] * lax.axis_size(self.axis_name))
    return jax.tree.map(leaf, tree)

  def first_of_block(self, local: int) -> jax.Array | int:
    """The global index of the first node of a block of ``local`` nodes where a transform runs."""
    return lax.axis_index(self.axis_name) * local

  def gathered_nodes(self, local: int) -> int:
    """How many nodes `gather` returns from blocks of ``local`` nodes."""
    return local * self.num_devices

  def gather(self, tree: Any) -> Any:
    """Every node's values, on every device of the pmap axis (an all-gather of the blocks)."""
    leaves = jax.tree.leaves(tree)
    if leaves and jnp.ndim(leaves[0]):
      check_pmap_size(self.axis_name, self.num_devices, jnp.shape(leaves[0])[0])
      note_gather(tree, jnp.shape(leaves[0])[0] * lax.axis_size(self.axis_name))
    return jax.tree.map(lambda x: lax.all_gather(x, self.axis_name, tiled=True), tree)

  def all_to_all(self, tree: Any) -> Any:
    """Node j's piece j of every node: leaves ``(b, n, ...)`` (piece k of local node i at ``[i, k]``) become
    ``(b, n, ...)`` with ``[i, s]`` the piece of local node i that node s sent."""
    note_all_to_all(tree)
    return jax.tree.map(lambda x: jnp.swapaxes(lax.all_to_all(x, self.axis_name, 1, 0, tiled=True), 0, 1), tree)

  def local_nodes(self, num_nodes: int) -> int:
    return num_nodes // self.num_devices

  def map(self, fn: Callable[..., Any], in_axes: InAxes = 0, num_nodes: int | None = None) -> Callable[..., Any]:
    """``fn`` on each node of this device's block, called inside the ``jax.pmap``.

    Reads as ``jax.vmap(fn, in_axes)`` over the node axis; inside the pmap each device maps
    over its own B = n / axis_size nodes, so a step written with ``backend.map`` is the
    same as under the other backends.

    Args:
      fn: a per-node function with no collectives.
      in_axes: ``0`` for arguments that carry this device's nodes on their leading axis,
        ``None`` for arguments every node shares, as in ``jax.vmap``.
      num_nodes: the global n; when given, every mapped leaf must have B = n / axis_size rows.
    """
    where = f"gj.backend.pmapped({self.axis_name!r}).map"
    expected = None if num_nodes is None else self.local_nodes(num_nodes)
    return vmap_nodes(fn, in_axes, expected, where)


def pmapped(axis_name: str = "devices", axis_size: int | None = None, *,
            bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Pmapped:
  """For transforms called inside ``jax.pmap(..., axis_name=axis_name)``.

  Each device passes its own block of B = n / axis_size nodes (leading axis B); the
  mixing is ``lax.ppermute`` over the pmap axis, at most two per cyclic shift.

  The pmap axis runs over devices, not nodes, so it may not be named ``"nodes"``: inside
  `gj.chain` a raw collective over that name would run over the devices only. The mean over
  all nodes there is `gj.node_mean`, on every backend.

  Args:
    axis_name: the ``axis_name`` of the ``jax.pmap`` the transforms are called in (default
      ``"devices"``).
    axis_size: the number of devices the pmap runs over (default: ``jax.device_count()``).
    bucket_bytes: the most bytes of one node's leaves packed into one message (default
      25 MiB, PyTorch DDP's bucket size).

  Returns:
    A `Pmapped` backend.

  Example:
    One gossip round on a ring of 2 nodes per device, against the dense ``W x``:

    >>> import jax, jax.numpy as jnp, numpy as np, gossipjax as gj
    >>> k = jax.device_count()
    >>> tx = gj.gossip_sgd(gj.topology.ring(2 * k), learning_rate=0.1, backend=gj.backend.pmapped("devices"))
    >>> x = jnp.arange(2.0 * k).reshape(k, 2, 1)  # (device, node of the block, parameter)
    >>> step = jax.pmap(lambda x: x + tx.update(jnp.zeros_like(x), tx.init(x), x)[0], axis_name="devices")
    >>> np.allclose(step(x).reshape(2 * k), gj.topology.ring(2 * k).matrix() @ np.arange(2 * k))
    True
  """
  return Pmapped(axis_name, axis_size, bucket_bytes)
