"""Where the main job keeps its n nodes: the same loop on one device, sharded devices, or MPI ranks.

The loop builds global, node-stacked host values (the initial params, each step's batch
draw) exactly as a simulation does, and a placement turns them into what this process
holds: all of them (simulate), the same global arrays sharded over a mesh (sharded), or
this rank's block of B = n / K nodes (mpi). For metrics it gives back every node's params,
so every backend reports the simulation's numbers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gossipjax.backend import Backend


@dataclasses.dataclass(frozen=True)
class Placement:
  """The nodes a process holds, for one backend.

  Attributes:
    backend: where the nodes live.
    num_nodes: n, the global node count.
  """

  backend: Backend
  num_nodes: int

  def __post_init__(self):
    if not isinstance(self.backend, Backend):
      raise TypeError(f"the main job needs a backend (mixer, mean, local_nodes and map), got {self.backend!r}")
    k = self.num_devices
    if self.num_nodes % k:
      raise ValueError(f"{self.num_nodes} nodes do not split evenly over {k} {self.unit}; "
                       f"use a multiple of {k} nodes")

  # What a backend offers beyond the protocol says how the job places nodes: a ``comm`` and
  # ``node_slice`` (each process holds a block, as under MPI), or ``shard`` (global arrays
  # placed on a mesh); a backend with neither holds every node in this process.
  def _offered(self, name: str) -> Any:
    """The backend's ``name`` (``comm``, ``node_slice``, ``shard``, ...), which the protocol does not declare."""
    return getattr(self.backend, name)

  @property
  def _ranks(self) -> bool:
    return hasattr(self.backend, "comm") and hasattr(self.backend, "node_slice")

  @property
  def _placed(self) -> bool:
    return hasattr(self.backend, "shard") and not self._ranks

  @property
  def num_devices(self) -> int:
    if self._ranks:
      return int(self._offered("comm").Get_size())
    return int(getattr(self.backend, "num_devices", 1))

  @property
  def unit(self) -> str:
    return "MPI ranks" if self._ranks else "devices"

  @property
  def is_main(self) -> bool:
    """The process that writes files, prints and shows progress (MPI rank 0; otherwise the only one)."""
    return not self._ranks or int(self._offered("comm").Get_rank()) == 0

  @property
  def first_node(self) -> int:
    return self._offered("node_slice")(self.num_nodes).start if self._ranks else 0

  def local(self, tree: Any) -> Any:
    """This process's share of a tree whose every leaf has the global node axis first (traceable)."""
    if self._ranks:
      rows = self._offered("node_slice")(self.num_nodes)
      return jax.tree.map(lambda x: x[rows], tree)
    return tree

  def batch(self, tree: Any) -> Any:
    """This process's share of a node-stacked batch (traceable); with nodes made of several
    devices (`gj.backend.hierarchical`), each node's samples split over its devices."""
    tree = self.local(tree)
    if self._placed and getattr(self.backend, "data_axis", None) is not None:
      sharding = jax.sharding.NamedSharding(self._offered("mesh"), jax.sharding.PartitionSpec(
          self._offered("axis"), self._offered("data_axis")))
      return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding), tree)
    return tree

  def place(self, tree: Any) -> Any:
    """Global node-stacked host values -> this process's arrays, on its devices."""
    if self._placed:
      return self._offered("shard")(tree)
    return jax.tree.map(jnp.asarray, self.local(tree))

  def like(self, tree: Any, fresh: Any) -> Any:
    """``tree`` (e.g. restored from a checkpoint) placed as ``fresh`` is, leaf by leaf.

    A leaf of ``fresh`` that no computation has pinned to its device (a scalar counter made
    by ``jnp.zeros``) stays free: pinned to that one device, it could not join the params
    sharded over several devices in the jitted step.
    """

    def put(x, f):
      if isinstance(f, jax.Array) and not f.committed:
        return x if isinstance(x, jax.Array) and not x.committed else jnp.asarray(x, f.dtype)
      return jax.device_put(x if isinstance(x, jax.Array) else np.asarray(x), f.sharding)

    return jax.tree.map(put, tree, fresh)

  def gather(self, tree: Any) -> Any:
    """Every node's values, in node order, on every process (MPI: an all-gather of the blocks)."""
    if self._ranks:
      blocks = self._offered("comm").allgather(jax.tree.map(np.asarray, tree))
      return jax.tree.map(lambda *b: jnp.asarray(np.concatenate(b)), *blocks)
    return tree

  def total(self, value: int) -> int:
    """A per-process count summed over processes."""
    if self._ranks:
      return int(self._offered("comm").allreduce(int(value)))
    return int(value)

  def maximum(self, value: float) -> float:
    """The largest ``value`` of every process (under MPI, of every rank; else ``value``)."""
    if self._ranks:
      return float(self._offered("comm").allreduce(float(value), op=_mpi_max()))
    return float(value)

  def check_together(self, check: Any, *args: Any) -> None:
    """Runs a host-side check on every process; if it raises on any, it raises on all (no rank waits alone)."""
    error = None
    try:
      check(*args)
    except FloatingPointError as e:
      error = str(e)
    if self._ranks:
      errors = [e for e in self._offered("comm").allgather(error) if e is not None]
      error = errors[0] if errors else None
    if error is not None:
      raise FloatingPointError(error)


def _mpi_max() -> Any:
  from mpi4py import MPI

  return MPI.MAX
