"""What a backend provides: a mixer per topology, an all-reduce mean, and ``map`` for per-node work."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Protocol, runtime_checkable

import jax
import jax.core  # jax.core.Tracer: a type checker sees the submodule only where it is imported

from gossipjax.topology import Topology


class Mixer(Protocol):
  """Applies W(step) to pytrees whose leaves carry the (local block of the) node axis.

  What an algorithm gets from `gj.mixing.make_mixer`: every backend builds one per
  topology, and the algorithm only calls ``mix`` (and ``first_node`` for per-node
  randomness), so the same algorithm runs on every backend.

  Attributes:
    topology: the validated topology whose W it applies.
    local_nodes: the size of the leading (node) axis where the transform runs: n in one
      process, the local block under MPI or inside ``shard_map``.

  Example:
    >>> import jax.numpy as jnp, gossipjax as gj
    >>> mixer = gj.mixing.make_mixer(gj.topology.ring(4))
    >>> mixer.topology.name, mixer.local_nodes, int(mixer.first_node())
    ('ring(4)', 4, 0)
    >>> [round(float(v), 4) for v in mixer.mix({"w": jnp.arange(4.0)}, 0)["w"]]
    [1.3333, 1.0, 2.0, 1.6667]
  """

  # Read-only, as a frozen dataclass's fields or a property are in the backends' mixers.
  @property
  def topology(self) -> Topology: ...

  @property
  def local_nodes(self) -> int: ...  # the leading-axis size the transform sees where it runs

  def mix(self, tree: Any, step: jax.Array | int, wire: Any = None) -> Any:
    """``x_i <- sum_j W(step)[i, j] x_j`` for every node, on every leaf.

    ``wire`` (optional) gives each leaf's compact form (a compressor's, see
    ``gossipjax.backend._buckets.Wire``): a backend whose nodes live apart sends that form
    and decodes it on arrival; ``tree`` must then be its decoded value. A backend that
    holds every node may ignore it.
    """
    ...

  def first_node(self) -> jax.Array | int:
    """Global index of the first node on the local leading axis (per-node randomness uses it)."""
    ...

  # Optional: ``mix_rounds(tree, wire=None)``, a static W's rounds apart from one set of
  # exchanges. The built-in mixers have it; on the mixer `gj.mixing.make_mixer` returns, a
  # backend's mixer without it has each round mixed alone.


@runtime_checkable
class Backend(Protocol):
  """Where the nodes live. Backends are data (frozen dataclasses), not callables.

  A protocol: a class of your own with these four methods is a backend, as the built-in
  ones are (nothing needs to inherit from this class).

  A backend provides what the algorithms need besides the math: a `Mixer` per topology,
  the all-reduce ``mean``, the local block size and ``map`` for per-node work. The
  algorithms take one as their ``backend=`` argument (``gj.backend.simulate()`` when
  omitted).

  Example:
    >>> import jax.numpy as jnp, gossipjax as gj
    >>> backend = gj.backend.simulate()
    >>> backend.mean(jnp.arange(4.0)).tolist()  # every node gets the average
    [1.5, 1.5, 1.5, 1.5]
    >>> backend.map(jnp.sum)(jnp.ones((4, 3))).tolist()  # one sum per node
    [3.0, 3.0, 3.0, 3.0]
  """

  def mixer(self, topology: Topology) -> Mixer:
    """The `Mixer` that applies ``topology``'s W where this backend keeps the nodes."""
    ...

  def mean(self, tree: Any) -> Any:
    """Every node gets the average over all n nodes (the all-reduce)."""
    ...

  def local_nodes(self, num_nodes: int) -> int:
    """How many nodes sit on the leading axis where a transform runs."""
    ...

  def map(self, fn: Callable[..., Any], in_axes: Any = 0, num_nodes: int | None = None) -> Callable[..., Any]:
    """``fn`` on each node's slice, as ``jax.vmap(fn, in_axes)``, run where the nodes live."""
    ...


def node_sharding(leaf: Any) -> Any:
  """The ``NamedSharding`` of a node-stacked leaf's node axis, or ``None`` where it has none.

  Reads a concrete ``jax.Array``'s sharding, or under ``jax.jit`` the sharding type of an
  Explicit mesh; Auto meshes under ``jit`` carry no type, and then there is nothing to follow.
  """
  if isinstance(leaf, jax.core.Tracer):
    try:
      sharding = jax.typeof(leaf).sharding
    except (AttributeError, TypeError):
      return None
  else:
    sharding = getattr(leaf, "sharding", None)
  spec = getattr(sharding, "spec", None)
  if not isinstance(sharding, jax.sharding.NamedSharding) or not spec or spec[0] is None:
    return None
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(spec[0]))


def _sharding_of(leaf: Any) -> Any:
  """A concrete array's sharding, or under ``jax.jit`` its sharding type (``None`` where there is none)."""
  if isinstance(leaf, jax.core.Tracer):
    try:
      return jax.typeof(leaf).sharding
    except (AttributeError, TypeError):
      return None
  return getattr(leaf, "sharding", None)


def _explicit_names(mesh: Any) -> tuple[str, ...]:
  return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit)


def explicit_mesh(tree: Any) -> Any:
  """The mesh of the first leaf of ``tree`` placed on a mesh with Explicit axes, or ``None``.

  A concrete array gives its ``Mesh``; under ``jax.jit`` a leaf's sharding type gives an
  ``AbstractMesh``. Leaves on Auto meshes, on one device or on the host give ``None``.
  """
  for leaf in jax.tree.leaves(tree):
    sharding = _sharding_of(leaf)
    mesh = getattr(sharding, "mesh", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and mesh is not None and _explicit_names(mesh):
      return mesh
  return None


def mesh_of_explicit(mesh: Any, tree: Any) -> contextlib.AbstractContextManager[Any, None]:
  """The mesh context of ``mesh``, or of the mesh ``tree`` is placed on, where that mesh has Explicit axes.

  JAX types the values a function builds of its own (zeros, iotas, ``lax.axis_index`` under a
  ``jax.vmap`` over an Explicit node axis) with the context's mesh, and refuses a spec whose
  axes that mesh lacks. Eagerly that is ``jax.set_mesh`` (a ``jax.jit`` called on arrays of an
  Explicit mesh needs it); under a trace, which ``set_mesh`` refuses, the mesh's abstract form
  (``jax.sharding.use_abstract_mesh``). Where there is no such mesh it does nothing.
  """
  if mesh is None or not _explicit_names(mesh):
    mesh = explicit_mesh(tree)
  if mesh is None:
    return contextlib.nullcontext()
  if not isinstance(mesh, jax.sharding.Mesh):
    return jax.sharding.use_abstract_mesh(mesh)
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree)):
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
  return jax.sharding.set_mesh(mesh)


def auto_where_explicit(fn: Callable[[Any], Any], tree: Any, out_specs: Callable[[Any], Any]) -> Any:
  """``fn(tree)`` with the Explicit axes of ``tree``'s mesh treated as Auto; elsewhere plain ``fn(tree)``.

  Stacked-node code that slices, rolls or gathers along the node axis (a simulated gossip
  round, node 0's row of an average) is refused by JAX on an axis typed Explicit, where it
  asks for each result's sharding. Inside ``jax.sharding.auto_axes`` the compiler partitions
  it, as on an Auto mesh (a roll along the node axis becomes collective-permutes), and the
  results are placed as ``out_specs`` says, eagerly and under jit.

  Args:
    fn: a function of ``tree`` alone.
    tree: its argument, whose leaves may be placed on a mesh.
    out_specs: maps the ``PartitionSpec`` s of ``tree``'s leaves (a tree like ``tree``) to
      those of ``fn``'s result.
  """
  mesh = explicit_mesh(tree)
  if mesh is None:
    return fn(tree)
  abstract = getattr(mesh, "abstract_mesh", mesh)

  def spec(leaf):
    sharding = _sharding_of(leaf)
    same = isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh.axis_names == mesh.axis_names
    return sharding.spec if same else jax.sharding.PartitionSpec()

  with jax.sharding.use_abstract_mesh(abstract):
    return jax.sharding.auto_axes(fn, axes=_explicit_names(abstract),
                                  out_sharding=out_specs(jax.tree.map(spec, tree)))(tree)


def follow_placement(tree: Any, params: Any) -> Any:
  """Places the per-node arrays of ``tree`` (leading axis n) as the node axis of ``params`` is placed.

  What an algorithm's ``init`` calls on the per-node arrays it builds from scratch (PRNG
  keys, push-sum weights, counters per node): on a sharded node axis they are then sharded
  the same way, as a state built by ``zeros_like(params)`` already is, and a later
  ``shard_map`` over the node axis accepts them on Explicit meshes too. An array whose node
  axis is placed so already keeps its layout (a moment split over a node's devices as its
  param is). Unplaced params leave ``tree`` as it is.

  Args:
    tree: arrays built by an ``init``; those whose leading axis is the params' node count
      are placed, the rest (scalars, counters) are left alone.
    params: the node-stacked params the state belongs to.

  Returns:
    ``tree``, with its per-node arrays placed like the params' node axis.

  Example:
    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> be = gj.backend.sharded(jax.make_mesh((len(jax.devices()),), ("nodes",)))
    >>> params = be.shard(jnp.zeros((2 * be.num_devices, 3)))
    >>> keys = gj.mixing.follow_placement(jnp.zeros((2 * be.num_devices, 2), jnp.uint32), params)
    >>> keys.sharding.spec[0]
    'nodes'
  """
  leaves = [x for x in jax.tree.leaves(params) if getattr(x, "ndim", 0) >= 1]
  if not leaves:
    return tree
  target = node_sharding(leaves[0])
  if target is None:
    return tree
  n = leaves[0].shape[0]

  def put(x):
    if getattr(x, "ndim", 0) == 0 or x.shape[0] != n:
      return x
    placed = node_sharding(x)
    if placed is not None and placed.mesh == target.mesh and placed.spec == target.spec:
      return x  # its node axis is placed already; its layout on the other axes (a model split) is kept
    if isinstance(x, jax.core.Tracer):
      if target.spec[0] in _explicit_names(target.mesh):
        return jax.sharding.reshard(x, target)
      return jax.lax.with_sharding_constraint(x, target)  # an Auto axis: a hint, which reshard refuses
    return jax.device_put(x, target)

  return jax.tree.map(put, tree)


_CURRENT: contextvars.ContextVar[Any] = contextvars.ContextVar("gossipjax_backend", default=None)


@contextlib.contextmanager
def use(backend: Backend) -> Iterator[Backend]:
  """Within the block, every transform built without ``backend=`` runs on ``backend``.

  One place to choose where the nodes live: the algorithms, `gj.mix`, `gj.per_node`,
  `gj.chain` and the averages built inside the block take this backend (an explicit
  ``backend=`` still wins). The choice is made when a transform is built, so a transform
  keeps its backend after the block ends.

  Args:
    backend: a backend (``gj.backend.sharded(mesh)``, ``gj.backend.mpi()``, ... or your own
      class with ``mixer``, ``mean``, ``local_nodes`` and ``map``).

  Returns:
    A context manager; ``with gj.backend.use(b) as b:`` gives ``b`` back.

  Example:
    >>> import jax, gossipjax as gj
    >>> be = gj.backend.sharded(jax.make_mesh((len(jax.devices()),), ("nodes",)))
    >>> with gj.backend.use(be):
    ...   tx = gj.gossip_sgd(gj.topology.ring(2 * be.num_devices), learning_rate=0.1)
    ...   clip = gj.per_node(__import__("optax").clip_by_global_norm(1.0))
    >>> gj.mixing.resolve_backend(None)   # outside the block: the simulation again
    Simulate()
  """
  if not isinstance(backend, Backend):
    raise TypeError(f"gj.backend.use: {backend!r} is not a backend: it needs mixer, mean, local_nodes and map")
  token = _CURRENT.set(backend)
  try:
    yield backend
  finally:
    _CURRENT.reset(token)


def current() -> Any:
  """The backend of the innermost `use` block, or ``None`` outside one.

  Returns:
    The backend a transform built without ``backend=`` would take from a block, or ``None``.

  Example:
    >>> import gossipjax as gj
    >>> gj.backend.current() is None
    True
    >>> with gj.backend.use(gj.backend.simulate()):
    ...   gj.backend.current()
    Simulate()
  """
  return _CURRENT.get()
