"""The node axis sharded over a device mesh: mixing is ``lax.ppermute`` inside ``jax.shard_map``.

The algorithm sees GLOBAL arrays (leading axis n, sharded on the mesh axis), so its
elementwise code runs as it does in simulation; only the mixing drops into
``shard_map``, where each device holds B = n / K nodes and exchanges rows with the devices
its nodes' neighbours live on. The same code spans hosts after ``jax.distributed.initialize``
(the mesh then holds every process's devices).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.core  # jax.core.Tracer: a type checker sees the submodule only where it is imported
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gossipjax._axis import pieces_over
from gossipjax.backend import _cpu_threads
from gossipjax.backend._base import mesh_of_explicit
from gossipjax.backend._map import InAxes, check_node_axes, per_argument_axes
from gossipjax.backend._precision import mean_terms
from gossipjax.backend._traffic import note_all_to_all, note_gather, note_gossip, note_mean
from gossipjax.backend._block_plan import (BlockPlan, StepTable, check_divisible, check_rounds_apart, compile_topology,
                                           step_table_or_none)
from gossipjax.backend._blocks import mix_block_rounds, mix_blocks
from gossipjax.backend._buckets import DEFAULT_BUCKET_BYTES, Wire, buckets, check_bucket_bytes, unpack
from gossipjax.topology import Topology


def _explicit(mesh: Mesh, axis: str) -> bool:
  return dict(zip(mesh.axis_names, mesh.axis_types)).get(axis) == jax.sharding.AxisType.Explicit


def check_axes_free(mesh: Mesh, where: str) -> None:
  """Refuses a call made where one of the mesh's axis names is already bound, by a ``jax.vmap`` of the user's.

  The backend's exchanges run over the mesh's axes inside a ``shard_map``; an enclosing
  mapping of the same name would take their place, and the gossip would land on the user's
  axis. Any other name works: the exchanges then see the whole mesh.
  """
  for name in mesh.axis_names:
    try:
      size = lax.axis_size(name)
    except NameError:  # not bound here: the usual case
      continue
    raise ValueError(f"{where}: this call runs inside a mapping over an axis named {name!r} (of size {size}), which "
                     f"is also the name of the mesh axis the backend exchanges over; name your axis otherwise, "
                     "e.g. jax.vmap(..., axis_name='ensemble')")


def conform(tree: Any, mesh: Mesh, specs: Any) -> Any:
  """Puts each leaf where its spec says before a ``shard_map``, so unplaced params are placed, not refused.

  Eagerly, a leaf placed otherwise (a host array, one device, replicated) is copied to the
  spec's sharding. Under ``jax.jit`` on an Explicit mesh, where ``shard_map`` accepts only
  inputs typed with its ``in_specs``, it is resharded; on an Auto mesh ``shard_map`` does it.
  """

  def put(x, spec):
    target = NamedSharding(mesh, spec)
    if isinstance(x, jax.core.Tracer):
      if not any(_explicit(mesh, a) for a in mesh.axis_names):
        return x
      current = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
      if current is not None and tuple(current) == tuple(spec) + (None,) * (x.ndim - len(spec)):
        return x
      return jax.sharding.reshard(x, target)
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(target, x.ndim):
      return x
    return jax.device_put(x, target)

  return jax.tree.map(put, tree, specs)


def leaf_spec(x: Any, mesh: Mesh, axis: str, where: str) -> P | None:
  """A node-stacked leaf's layout, ``P(axis, ...its layout on the other mesh axes)``, or ``None`` where unknown.

  Read from a placed array, or under ``jax.jit`` from an Explicit mesh's sharding type; a
  traced leaf on an Auto mesh carries none (``None``). An unplaced leaf is laid out
  ``P(axis)``.

  Raises:
    ValueError: the leaf splits its node axis over two mesh axes, or puts the node axis on
      another of its dimensions.
  """
  if isinstance(x, jax.core.Tracer):
    if not _explicit(mesh, axis):
      return None
    sharding = getattr(jax.typeof(x), "sharding", None)
  else:
    sharding = getattr(x, "sharding", None)
  if not isinstance(sharding, NamedSharding) or tuple(sharding.mesh.axis_names) != tuple(mesh.axis_names):
    return P(axis)
  spec = list(sharding.spec) + [None] * (len(x.shape) - len(sharding.spec))
  names = lambda entry: entry if isinstance(entry, tuple) else (entry,)
  if len([a for a in names(spec[0]) if a is not None]) > 1:
    raise ValueError(f"{where}: a leaf of shape {tuple(x.shape)} splits its node axis over the mesh axes "
                     f"{spec[0]}; the node axis must lie on mesh axis {axis!r} alone: place it with "
                     f"P({axis!r}, ...) (backend.shard does), and split the model over the other axes")
  if any(axis in names(entry) for entry in spec[1:]):
    raise ValueError(f"{where}: a leaf of shape {tuple(x.shape)} is laid out {P(*spec)}, which puts mesh axis "
                     f"{axis!r} on a dimension other than the leading node axis; place it with P({axis!r}, ...)")
  rest = spec[1:]
  while rest and rest[-1] is None:
    rest.pop()
  return P(axis, *rest)


def _broadcast_spec(spec: Any, arg: Any) -> Any:
  """A pytree-prefix of specs (as ``in_specs`` takes) expanded to one spec per leaf of ``arg``."""
  return jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), spec, arg,
                      is_leaf=lambda x: isinstance(x, P))


def _share(rows: jax.Array, split_axis: str | tuple[str, ...]) -> tuple[jax.Array, int]:
  """This device's 1/D of the columns of (m, ...) rows a node's D devices all hold, and the rows' width."""
  flat = rows.reshape(rows.shape[0], -1)
  width, size = flat.shape[1], lax.axis_size(split_axis)
  share = -(-width // size)
  flat = jnp.pad(flat, ((0, 0), (0, share * size - width)))
  return lax.dynamic_slice_in_dim(flat, lax.axis_index(split_axis) * share, share, axis=1), width


def _gathered(share: jax.Array, width: int, split_axis: str | tuple[str, ...]) -> jax.Array:
  """The (m, width) rows whose columns a node's devices hold in shares: an all-gather inside the node."""
  return lax.all_gather(share, split_axis, axis=1, tiled=True, to="invarying")[:, :width]


def mix_split(tree: Any, mix_shares: Callable[[list[jax.Array]], list[jax.Array]], bucket_bytes: int,
              split_axis: str) -> Any:
  """Mixes a tree that a node's devices hold alike in D shares: each device sends 1/D of every bucket.

  Horovod's hierarchical all-reduce applied to gossip: the leaves are packed into buckets,
  each device of a node keeps its 1/D of every bucket's columns (a node's copy is the same on
  its devices, so the reduce-scatter inside the node is a slice), ``mix_shares`` exchanges and
  mixes the shares with the peer devices of the neighbour nodes (the devices of the same
  ``split_axis`` index), and an all-gather inside the node rebuilds the buckets. What crosses
  between nodes is one copy per neighbour, spread over the D links, where every device sending
  the whole copy would send D.
  """
  leaves, treedef = jax.tree.flatten(tree)
  keep = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.inexact)]  # counters, keys pass through
  groups = [[keep[j] for j in idx] for idx in buckets([leaves[i] for i in keep], bucket_bytes)]
  shares, widths = [], []
  for idx in groups:
    share, width = _share(jnp.concatenate([leaves[i].reshape(leaves[i].shape[0], -1) for i in idx], axis=1),
                          split_axis)
    shares.append(share)
    widths.append(width)
  out = list(leaves)
  for idx, y, width in zip(groups, mix_shares(shares), widths):
    for i, part in zip(idx, unpack(_gathered(y, width, split_axis), [leaves[i] for i in idx])):
      out[i] = part
  return jax.tree.unflatten(treedef, out)


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedMixer:
  """W(step) on global arrays whose leading (node) axis is sharded over ``mesh[axis]``.

  With ``split_axis`` (nodes made of devices, `hierarchical`), a node's devices each send
  1/D of its buckets to their peers in the neighbour nodes (`mix_split`).
  """

  topology: Topology
  mesh: Mesh
  axis: str
  plans: tuple[BlockPlan, ...]
  bucket_bytes: int = DEFAULT_BUCKET_BYTES
  table: StepTable | None = None
  split_axis: str | None = None
  _compiled: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

  @property
  def local_nodes(self) -> int:
    return self.topology.num_nodes  # the transforms see global arrays

  def first_node(self) -> int:
    return 0

  def mix(self, tree: Any, step: jax.Array | int = 0, wire: Wire | None = None) -> Any:
    note_gossip(self.topology, tree, step, wire, 0)
    return self._run(tree, step, wire, apart=False)

  def mix_rounds(self, tree: Any, wire: Wire | None = None) -> tuple[Any, ...]:
    """Each round of a static W apart, one tree per round, from one set of exchanges for all rounds."""
    check_rounds_apart(self.topology)
    note_gossip(self.topology, tree, 0, wire, 0)
    return self._run(tree, 0, wire, apart=True)

  def _run(self, tree: Any, step: jax.Array | int, wire: Wire | None, apart: bool) -> Any:
    axis, plans = self.axis, self.plans

    leaves, treedef = jax.tree.flatten(tree)
    where = f"gj.backend.sharded(mesh, axis={axis!r})"
    check_axes_free(self.mesh, where)
    # A node spanning devices splits its messages over them where every leaf is a whole copy on
    # each of its devices (laid out P(axis), or hidden by an Auto mesh under jit); rounds taken
    # apart send whole copies of dense rows.
    split_on = self.split_axis if self.split_axis is not None and (wire is not None or not apart) and all(
        leaf_spec(x, self.mesh, axis, where) in (None, P(axis)) for x in leaves) else None

    def exchange(ex, send, x):
      del x
      split = split_on if split_on is not None else wire_split
      if split is not None and wire is not None:  # compact parts: each device sends 1/D, the node gathers
        share, width = _share(send, split)
        got = lax.ppermute(share, axis, perm=ex.pairs)
        return _gathered(got, width, split).reshape(send.shape)
      return lax.ppermute(send, axis, perm=ex.pairs)

    def body(tree, parts, context, step):
      w = None if wire is None else Wire(parts, wire.decode, context)
      if apart:
        return mix_block_rounds(plans[0], tree, lax.axis_index(axis), exchange, self.bucket_bytes, w, layouts)
      mix = lambda t, lay: mix_blocks(plans, t, step, lax.axis_index(axis), exchange, lambda v: lax.psum(v, axis),
                                      self.bucket_bytes, self.table, w, lay)
      if split_on is not None and wire is None:  # the shares are the buckets: each one mixed alone
        return mix_split(tree, lambda shares: mix(shares, list(range(len(shares)))), self.bucket_bytes, split_on)
      return mix(tree, layouts)

    layouts, manual, wire_split = None, None, None  # default: every mesh axis manual, every leaf P(axis)
    if split_on is not None:
      specs = jax.tree.map(lambda _: P(axis), tree)
    elif any(self.mesh.shape[a] > 1 for a in self.mesh.axis_names if a != axis):
      found = [leaf_spec(x, self.mesh, axis, where) for x in leaves]
      if all(f is not None for f in found):
        # Model-sharded nodes: each device mixes its own pieces, so every leaf keeps its layout
        # on the other axes, and only leaves split alike are packed together.
        specs = jax.tree.unflatten(treedef, found)
        layouts = [tuple(f[1:]) for f in found if f is not None]
        # A compressor's compact parts are whole on each device of a node: each sends its 1/D of them.
        wire_split = tuple(a for a in self.mesh.axis_names if a != axis and self.mesh.shape[a] > 1)
      else:
        # An Auto mesh under jit hides the layouts: manual over the node axis only, the other
        # axes left to the compiler, and no packing across leaves whose layouts may differ.
        specs, manual = jax.tree.map(lambda _: P(axis), tree), frozenset({axis})
        layouts = list(range(len(leaves)))
    else:
      specs = jax.tree.map(lambda _: P(axis), tree)
    tree = conform(tree, self.mesh, specs)
    parts = None if wire is None else [tuple(p) for p in wire.parts]
    part_specs = jax.tree.map(lambda _: P(axis), parts)
    parts = conform(parts, self.mesh, part_specs)
    context = None if wire is None else wire.context
    static = len(plans) == 1 or isinstance(step, (int, np.integer))
    # One jitted program per tree structure (and static step): called eagerly, the mixing
    # then compiles once, not op by op on every call; under an outer jit it is inlined.
    fixed = (0 if len(plans) == 1 else int(step) % len(plans)) if static else None
    key = (jax.tree.structure(tree), fixed, jax.tree.structure(parts), jax.tree.structure(context),
           None if wire is None else wire.decode, None if layouts is None else tuple(layouts), manual, split_on,
           wire_split, apart)
    fn = self._compiled.get(key)
    if fn is None:
      in_specs = (specs, part_specs, jax.tree.map(lambda _: P(), context), P())
      run = (lambda t, p, c, s: body(t, p, c, fixed)) if static else body
      extra: dict[str, Any] = {} if manual is None else {"axis_names": manual}
      out_specs = (specs,) * len(plans[0].rounds) if apart else specs
      fn = jax.jit(jax.shard_map(run, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, **extra))
      self._compiled[key] = fn
    return fn(tree, parts, context, jnp.asarray(0 if static else step))


@dataclasses.dataclass(frozen=True, eq=False)
class Sharded:
  """Params are global arrays sharded along the node axis over ``mesh[axis]``.

  Attributes:
    mesh: a ``jax.sharding.Mesh`` with an axis named ``axis`` (other axes see replicated params).
    axis: the mesh axis the nodes are split over.
    bucket_bytes: the most bytes of one node's leaves packed into one message: a gossip
      round sends one ``ppermute`` per exchange and bucket, not one per leaf.
    data_axis: for nodes made of several devices (`hierarchical`), the mesh axis a node's
      batch is split over; ``shard_batch`` places batches so.

  Example:
    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> be = gj.backend.Sharded(jax.make_mesh((len(jax.devices()),), ("nodes",)))
    >>> x = be.shard(jnp.arange(2.0 * be.num_devices))  # 2 nodes per device
    >>> x.sharding == be.sharding, bool((be.mean(x) == x.mean()).all())
    (True, True)
  """

  mesh: Mesh
  axis: str = "nodes"
  bucket_bytes: int = DEFAULT_BUCKET_BYTES
  data_axis: str | None = None
  _compiled: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

  def __post_init__(self):
    check_bucket_bytes(self.bucket_bytes, "gj.backend.sharded")
    if self.data_axis is not None and (self.data_axis == self.axis or self.data_axis not in self.mesh.axis_names):
      raise ValueError(f"gj.backend.sharded: data_axis={self.data_axis!r} must be a mesh axis other than the node "
                       f"axis {self.axis!r}; the mesh has {tuple(self.mesh.axis_names)}")
    if not isinstance(self.mesh, Mesh):
      raise TypeError(f"gj.backend.sharded needs a jax.sharding.Mesh, got {type(self.mesh).__name__}")
    if self.axis not in self.mesh.axis_names:
      raise ValueError(
          f"gj.backend.sharded: the mesh has axes {tuple(self.mesh.axis_names)} but no axis named "
          f"{self.axis!r}; build it with e.g. jax.make_mesh(({len(self.mesh.devices.flat)},), "
          f"({self.axis!r},)) or pass axis= one of its names"
      )
    _cpu_threads.check_collective_threads(self.mesh.devices.flat, "gj.backend.sharded")

  @property
  def num_devices(self) -> int:
    return int(self.mesh.shape[self.axis])

  @property
  def _other_axes(self) -> tuple[str, ...]:
    """The mesh's axes besides the node axis that hold more than one device."""
    return tuple(a for a in self.mesh.axis_names if a != self.axis and self.mesh.shape[a] > 1)

  @property
  def sharding(self) -> NamedSharding:
    """Where a node-stacked leaf lives: its leading axis split over ``mesh[axis]``."""
    return NamedSharding(self.mesh, P(self.axis))

  def shard(self, tree: Any) -> Any:
    """Places a tree of node-stacked host arrays on the mesh (every process passes the full arrays)."""

    def put(x):
      if isinstance(x, jax.Array) and x.sharding == self.sharding:
        return x
      if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        if x.ndim == 0 or x.shape[0] % self.num_devices:
          raise ValueError(f"gj.backend.sharded: a key leaf of shape {x.shape} cannot be split over the "
                           f"{self.num_devices} devices of mesh axis {self.axis!r} (one key per node, a multiple)")
        return jax.device_put(x, self.sharding)  # typed PRNG keys (an NNX model's RNG streams)
      host = np.asarray(x)
      if host.ndim == 0 or host.shape[0] % self.num_devices:
        raise ValueError(
            f"gj.backend.sharded: a leaf of shape {host.shape} cannot be split over the "
            f"{self.num_devices} devices of mesh axis {self.axis!r} (its leading node axis must be a multiple)"
        )
      return jax.make_array_from_callback(host.shape, self.sharding, lambda idx: host[idx])

    return jax.tree.map(put, tree)

  def shard_batch(self, tree: Any) -> Any:
    """Places node-stacked batches (nodes, batch, ...) with each node's batch split over its devices.

    On a backend built by `hierarchical`, a node's samples go to its ``devices_per_node``
    devices, so its gradient is computed in parts and averaged inside the node; elsewhere
    this is `shard`.

    Example:
      >>> import jax, jax.numpy as jnp, gossipjax as gj
      >>> k = len(jax.devices())
      >>> be = gj.backend.hierarchical(k)   # one node made of every device
      >>> be.shard_batch(jnp.zeros((1, 2 * k, 3))).sharding.spec   # its 2k samples split over them
      P('nodes', 'data')
    """
    if self.data_axis is None:
      return self.shard(tree)
    per_node = int(self.mesh.shape[self.data_axis])

    def put(x):
      host = np.asarray(x)
      if host.ndim < 2 or host.shape[0] % self.num_devices or host.shape[1] % per_node:
        raise ValueError(
            f"gj.backend.hierarchical: a batch of shape {host.shape} cannot be split: its leading node axis must "
            f"be a multiple of {self.num_devices} nodes and its second (samples) axis a multiple of the "
            f"{per_node} devices of a node")
      sharding = NamedSharding(self.mesh, P(self.axis, self.data_axis))
      return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree.map(put, tree)

  def mixer(self, topology: Topology) -> ShardedMixer:
    check_divisible(topology, self.num_devices, f"devices of mesh axis {self.axis!r}", "gj.backend.sharded")
    plans = compile_topology(topology, self.num_devices)
    # Nodes of several devices (and no other axis splitting them) send their messages in shares.
    split = self.data_axis if self._other_axes == (self.data_axis,) else None
    return ShardedMixer(topology, self.mesh, self.axis, plans, self.bucket_bytes, step_table_or_none(plans, topology), split)

  def mean(self, tree: Any) -> Any:
    axis = self.axis
    check_axes_free(self.mesh, f"gj.backend.sharded(mesh, axis={axis!r}).mean")
    leaves = jax.tree.leaves(tree)
    note_mean(tree, jnp.shape(leaves[0])[0] if leaves and jnp.ndim(leaves[0]) else 1)

    def body(x):  # scaled before the sums (see `mean_terms`), which then cannot overflow
      n = x.shape[0] * lax.axis_size(axis)
      total = lax.psum(jnp.sum(mean_terms(x, n), axis=0, keepdims=True), axis)
      return jnp.broadcast_to(total, x.shape).astype(x.dtype)

    fn = jax.shard_map(body, mesh=self.mesh, in_specs=P(axis), out_specs=P(axis))
    return jax.tree.map(fn, conform(tree, self.mesh, jax.tree.map(lambda _: P(axis), tree)))

  def first_of_block(self, local: int) -> int:
    """The global index of the first node of a block of ``local`` nodes where a transform runs."""
    return 0

  def gathered_nodes(self, local: int) -> int:
    """How many nodes `gather` returns from blocks of ``local`` nodes."""
    return local

  def gather(self, tree: Any) -> Any:
    """Every node's values, on every device (an all-gather over the node axis), replicated."""
    axis = self.axis
    check_axes_free(self.mesh, f"gj.backend.sharded(mesh, axis={axis!r}).gather")
    leaves = jax.tree.leaves(tree)
    note_gather(tree, jnp.shape(leaves[0])[0] if leaves and jnp.ndim(leaves[0]) else 1)
    # The gathered rows are the same on every device: replicated, which shard_map cannot infer.
    fn = jax.shard_map(lambda x: lax.all_gather(x, axis, tiled=True), mesh=self.mesh, in_specs=P(axis),
                       out_specs=P(), check_vma=False)
    return jax.tree.map(fn, conform(tree, self.mesh, jax.tree.map(lambda _: P(axis), tree)))

  def all_to_all(self, tree: Any) -> Any:
    """Node j's piece j of every node: leaves ``(b, n, ...)`` (piece k of local node i at ``[i, k]``) become
    ``(b, n, ...)`` with ``[i, s]`` the piece of local node i that node s sent."""
    axis = self.axis
    check_axes_free(self.mesh, f"gj.backend.sharded(mesh, axis={axis!r}).all_to_all")
    note_all_to_all(tree)

    def body(x):  # (b, n, ...) -> pieces for each device's b nodes -> (n senders, b, ...) -> (b, n, ...)
      return jnp.swapaxes(lax.all_to_all(x, axis, 1, 0, tiled=True), 0, 1)

    fn = jax.shard_map(body, mesh=self.mesh, in_specs=P(axis), out_specs=P(axis))
    return jax.tree.map(fn, conform(tree, self.mesh, jax.tree.map(lambda _: P(axis), tree)))

  def local_nodes(self, num_nodes: int) -> int:
    return num_nodes

  def map(self, fn: Callable[..., Any], in_axes: InAxes = 0, num_nodes: int | None = None) -> Callable[..., Any]:
    """``fn`` on each node's slice, computed on the device that holds the node.

    Reads as ``jax.vmap(fn, in_axes)`` over the global node axis, but runs as
    ``jax.shard_map`` of the vmapped ``fn`` over ``mesh[axis]``: each device applies ``fn``
    to its own B = n / K nodes and no data crosses devices. Arguments with ``in_axes=None``
    are replicated to every device. Leaving a plain ``jax.vmap`` to the compiler is not
    the same: a vmapped convolution's gradient, for one, is partitioned with an
    all-gather of the whole batch, so every device computes every node.

    Args:
      fn: a per-node function (one node's params, batch, ...) with no collectives.
      in_axes: ``0`` for arguments whose leading axis is the node axis, ``None`` for
        arguments every node shares; one entry per positional argument, as in ``jax.vmap``.
      num_nodes: when given, every mapped leaf must have this leading size.

    Returns:
      A function of the same arguments whose outputs carry the node axis, sharded as
      ``backend.sharding``.

    Example:
      >>> import jax, jax.numpy as jnp, gossipjax as gj
      >>> be = gj.backend.sharded(jax.make_mesh((len(jax.devices()),), ("nodes",)))
      >>> w = be.shard(jnp.ones((2 * len(jax.devices()), 3)))
      >>> grads = jax.jit(be.map(jax.grad(lambda w, x: jnp.sum(w * x)), in_axes=(0, None)))(w, jnp.arange(3.0))
      >>> grads.shape == w.shape, grads.sharding.spec[0]
      (True, 'nodes')
    """
    where = f"gj.backend.sharded(mesh, axis={self.axis!r}).map"
    axis = self.axis

    def mapped(*args):
      axes = per_argument_axes(in_axes, args, where)
      check_node_axes(axes, args, num_nodes, where, divisor=self.num_devices,
                      divisor_what=f"devices of mesh axis {axis!r}")
      specs = tuple(jax.tree.map(lambda a: P() if a is None else P(axis), a, is_leaf=lambda x: x is None)
                    for a in axes)
      flat_axes, axes_def = jax.tree.flatten(axes, is_leaf=lambda x: x is None)
      key = (fn, tuple(flat_axes), axes_def, tuple(jax.tree.structure(a) for a in args))
      body = self._compiled.get(key)
      if body is None:
        # Under jit the inputs are resharded to the specs as needed; called eagerly, shard_map
        # would instead require arguments already placed as the specs say. One jitted function
        # per (fn, in_axes, argument structure): a second eager call does not compile again.
        # On a mesh with other axes, manual over the node axis only: a node's work (a model
        # split over a 'model' axis, a batch split over a node's devices) is left to the compiler.
        extra: dict[str, Any] = {"axis_names": frozenset({axis})} if self._other_axes else {}
        explicit = tuple(a for a in self._other_axes if _explicit(self.mesh, a))
        # Inside, a node's leaves may be split over its model axes (not the data axis, where its
        # params are copies): a compressor then selects from each device's piece (gj.compress.top_k).
        node_fn = _pieces_over(fn, tuple(a for a in self._other_axes if a != self.data_axis))
        if explicit:
          body = jax.jit(_auto_inside(node_fn, axes, self.mesh, axis, specs, explicit, where))
        else:
          body = jax.jit(jax.shard_map(jax.vmap(node_fn, in_axes=axes), mesh=self.mesh, in_specs=specs,
                                       out_specs=P(axis), **extra))
        self._compiled[key] = body
      def keep_layout(spec, x):  # a node-stacked argument keeps its layout on the other axes
        if spec == P() or not self._other_axes:
          return spec
        return leaf_spec(x, self.mesh, axis, where) or spec

      args = tuple(conform(arg, self.mesh, jax.tree.map(keep_layout, _broadcast_spec(spec, arg), arg,
                                                        is_leaf=lambda v: isinstance(v, P)))
                   for arg, spec in zip(args, specs))
      # Called eagerly, the mesh context gives the program its devices where no input it uses has
      # them (a message's bit count that depends on the shapes alone).
      with mesh_of_explicit(self.mesh, args):
        return body(*args)

    return mapped


def _pieces_over(fn: Callable[..., Any], axes: tuple[str, ...]) -> Callable[..., Any]:
  """``fn``, traced where per-node code may find a node's leaves split over ``axes`` (its model axes)."""
  if not axes:
    return fn

  def run(*args):
    with pieces_over(axes):
      return fn(*args)

  return run


def _auto_inside(fn: Callable[..., Any], axes: Any, mesh: Mesh, axis: str, specs: Any, explicit: tuple[str, ...],
                 where: str) -> Callable[..., Any]:
  """``backend.map`` on a mesh with Explicit axes besides the node axis: those axes are Auto inside.

  A ``shard_map`` manual over the node axis alone would gather the leaves the other Explicit
  axes split (jax 0.10 lowers its inputs replicated on them), so each device would compute
  its whole node; inside ``jax.sharding.auto_axes`` the compiler splits a node's work over
  its devices, as on an Auto mesh. Each output keeps the layout of the first mapped argument
  of its shape and dtype (a gradient its param's), else ``P(axis)``.
  """

  def run(*args):
    layouts = {}
    for arg, spec in zip(args, specs):
      per_leaf = jax.tree.leaves(_broadcast_spec(spec, arg), is_leaf=lambda v: isinstance(v, P))
      for x, leaf in zip(jax.tree.leaves(arg), per_leaf):
        if leaf != P():
          layouts.setdefault((tuple(x.shape), jnp.dtype(x.dtype)), leaf_spec(x, mesh, axis, where) or P(axis))
    plain = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), args)  # no layouts
    out = jax.eval_shape(jax.vmap(fn, in_axes=axes), *plain)
    out_specs = jax.tree.map(lambda o: layouts.get((tuple(o.shape), jnp.dtype(o.dtype)), P(axis)), out)
    mapped = jax.shard_map(jax.vmap(fn, in_axes=axes), in_specs=specs, out_specs=P(axis), axis_names=frozenset({axis}))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return jax.sharding.auto_axes(mapped, axes=explicit, out_sharding=out_specs)(*args)

  return run


def hierarchical(devices_per_node: int, *, devices: Any = None, axis: str = "nodes", data_axis: str = "data",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Sharded:
  """Nodes made of several devices: a node's batch is split over its devices, only nodes gossip.

  The two-level layout of BlueFog's hierarchical neighbour allreduce (Yuan's lecture on
  decentralized optimization names it): the devices of a node average their gradients
  among themselves (an all-reduce inside the node, which the compiler inserts when
  ``backend.map`` computes a node's gradient from its split batch), and nodes exchange
  params with their neighbours in W. A node's devices hold the same copy, so each sends
  1/D of every bucket to its peer device in the neighbour node and an all-gather inside the
  node puts the buckets back together (Horovod's hierarchical all-reduce splits its message
  so): between nodes, one copy per neighbour spread over D links, one collective-permute
  per exchange and bucket. The mesh is
  ``(len(devices) // devices_per_node, devices_per_node)`` with axes ``(axis, data_axis)``
  and Auto axis types, devices grouped in order, so with ``jax.distributed`` and
  ``devices_per_node = jax.local_device_count()`` each host is one node.

  Place params with ``backend.shard`` (a node's params are replicated on its devices) and
  batches with ``backend.shard_batch``; W is over the nodes.

  Args:
    devices_per_node: how many devices make one node.
    devices: the devices to use (default: ``jax.devices()``), a multiple of ``devices_per_node``.
    axis: the mesh axis of the nodes.
    data_axis: the mesh axis of a node's devices.
    bucket_bytes: as in `sharded`.

  Returns:
    A `Sharded` backend over the two-level mesh.

  Raises:
    ValueError: ``devices_per_node`` is not a positive divisor of the number of devices, or
      ``devices`` lists a device twice.

  Example:
    >>> import jax, gossipjax as gj
    >>> be = gj.backend.hierarchical(1)   # every device a node of its own: the plain sharded layout
    >>> be.mesh.axis_names, be.num_devices == len(jax.devices())
    (('nodes', 'data'), True)
  """
  devices = list(jax.devices() if devices is None else devices)
  if isinstance(devices_per_node, bool) or not isinstance(devices_per_node, (int, np.integer)) or \
      devices_per_node < 1 or len(devices) % devices_per_node:
    raise ValueError(f"gj.backend.hierarchical: devices_per_node must be a positive divisor of the {len(devices)} "
                     f"devices, got {devices_per_node!r}")
  repeated = next((d for i, d in enumerate(devices) if d in devices[:i]), None)
  if repeated is not None:
    raise ValueError(f"gj.backend.hierarchical: devices lists {repeated} more than once; give each device once")
  auto = jax.sharding.AxisType.Auto
  mesh = Mesh(np.asarray(devices).reshape(len(devices) // devices_per_node, devices_per_node), (axis, data_axis),
              axis_types=(auto, auto))
  return Sharded(mesh, axis, bucket_bytes, data_axis)


def sharded(mesh: Mesh, axis: str = "nodes", *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Sharded:
  """Nodes split over the devices of ``mesh[axis]`` (B = n / K per device), mixing by ``ppermute``.

  Params and gradients are global ``jax.Array`` s whose leading node axis is sharded with
  ``NamedSharding(mesh, P(axis))`` (``backend.shard(tree)`` puts host arrays there). Works
  across hosts after ``jax.distributed.initialize``.

  Args:
    mesh: a ``jax.sharding.Mesh`` with an axis named ``axis``.
    axis: the mesh axis the nodes are split over.
    bucket_bytes: the most bytes of one node's leaves packed into one message (the leaves
      of each dtype are concatenated up to this size; a larger leaf is a message of its own).
      The default, 25 MiB, is PyTorch DDP's bucket size.

  Returns:
    A `Sharded` backend.

  Example:
    One gossip round on a ring of 2 nodes per device, against the dense ``W x``:

    >>> import jax, jax.numpy as jnp, numpy as np, gossipjax as gj
    >>> mesh = jax.make_mesh((len(jax.devices()),), ("nodes",))
    >>> be = gj.backend.sharded(mesh)
    >>> n = 2 * be.num_devices
    >>> tx = gj.gossip_sgd(gj.topology.ring(n), beta=0.9, learning_rate=0.1, backend=be)
    >>> x = be.shard(jnp.arange(float(n))[:, None])
    >>> u, _ = jax.jit(tx.update)(jnp.zeros_like(x), tx.init(x), x)
    >>> np.allclose(x + u, gj.topology.ring(n).matrix() @ np.arange(n)[:, None])
    True
  """
  return Sharded(mesh, axis, bucket_bytes)
