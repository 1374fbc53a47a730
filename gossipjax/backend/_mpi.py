"""One block of nodes per MPI rank: mixing is ``mpi4jax.sendrecv`` rounds under ``jax.jit``.

Launch with ``mpiexec -n K python script.py``. Rank r holds nodes ``r*B ... r*B + B - 1``
with B = n / K. A rank's program is built for that rank, so it sends exactly the rows a
neighbour reads and receives exactly the rows it reads, with one ``sendrecv`` per exchange
of the plan (two for a ring) and bucket of packed leaves.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from gossipjax.backend._map import InAxes, vmap_nodes
from gossipjax.backend._block_plan import (BlockPlan, Exchange, StepTable, check_divisible, check_rounds_apart,
                                           compile_topology, step_table_or_none)
from gossipjax.backend._blocks import mix_block_rounds, mix_blocks
from gossipjax.backend._buckets import DEFAULT_BUCKET_BYTES, Wire, buckets, check_bucket_bytes, unpack
from gossipjax.backend._precision import mean_terms
from gossipjax.backend._traffic import note_gossip, note_all_to_all, note_gather, note_mean
from gossipjax.topology import Topology

INSTALL_HINT = (
    "gj.backend.mpi needs mpi4jax (and mpi4py with an MPI library). Install them with `make install-mpi` "
    "from the gossipjax checkout, which runs `pip install mpich 'mpi4py>=4.0'` and then builds mpi4jax "
    "against that MPI with an empty CUDA_PATH: `mkdir -p /tmp/no-cuda && CUDA_PATH=/tmp/no-cuda "
    "MPI4JAX_BUILD_MPICC=$(which mpicc) pip install 'mpi4jax>=0.9'`"
)


# glibc settings for the ranks' environment: every ``sendrecv`` receives into a fresh XLA buffer,
# and by default glibc gives large ones new mappings (from per-thread arenas) with small pages,
# which the kernel must fault in and zero while MPI copies into them. One heap arena that never
# maps or trims keeps the pages of freed buffers, and transparent huge pages make the copy and the
# pinning of shared-memory MPI cheaper. ``benchmarks/mpi_gossip.py``, 4 ranks, 16 MiB messages:
# the two exchanges of a ring round took 41.3 ms by default and 9.8 ms with these (raw mpi4py
# ``Sendrecv``: 8.9 ms). glibc reads them at process start, so they go before ``mpiexec``.
LAUNCH_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": "2000000000",
    "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
}


def launch_prefix() -> str:
  """``env MALLOC_ARENA_MAX=1 ...``: the shell prefix that puts ``LAUNCH_ENV`` before ``mpiexec``.

  Returns:
    The prefix, a string: ``env`` and each glibc setting of ``gj.backend.mpi_launch_env``.

  Example:
    >>> import gossipjax as gj
    >>> gj.backend.mpi_launch_prefix().split()[:2]
    ['env', 'MALLOC_ARENA_MAX=1']
  """
  return "env " + " ".join(f"{k}={v}" for k, v in LAUNCH_ENV.items())


def _import_mpi():
  try:
    import mpi4jax
    from mpi4py import MPI
  except ImportError as e:
    raise ImportError(f"{INSTALL_HINT} (import failed: {e})") from e
  return mpi4jax, MPI


# The dtypes mpi4jax maps to an MPI datatype; a leaf of another dtype (bfloat16, float16, the
# float8 formats) crosses as raw unsigned words of its width, bit for bit, in as many bytes.
_MPI_DTYPES = frozenset({"float32", "float64", "complex64", "complex128", "int8", "int16", "int32", "int64", "uint8",
                         "uint16", "uint32", "uint64", "bool"})


def as_words(x: jax.Array) -> jax.Array:
  """``x`` as MPI can send it: itself, or (a dtype MPI lacks) its bits as unsigned words of the same width.

  >>> as_words(jnp.ones(2, jnp.bfloat16)).dtype, as_words(jnp.ones(2, jnp.float32)).dtype
  (dtype('uint16'), dtype('float32'))
  """
  if jnp.dtype(x.dtype).name in _MPI_DTYPES:
    return x
  return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * jnp.dtype(x.dtype).itemsize}"))


def from_words(x: jax.Array, dtype: Any) -> jax.Array:
  """The inverse of `as_words`: received words read back as ``dtype``."""
  return x if x.dtype == jnp.dtype(dtype) else jax.lax.bitcast_convert_type(x, dtype)


_HOST_COMMS: dict[int, Any] = {}


def _host_comm(comm: Any) -> Any:
  """A clone of ``comm`` for the host-side messages of ``mean``'s tracing, one per communicator.

  A jitted step that is still running may be inside an mpi4jax call on ``comm`` while the
  next function is traced; the host's message then travels on a communicator of its own.
  Cloning is collective: it happens when a backend is built, on every rank.
  """
  _, MPI = _import_mpi()
  key = int(MPI._handleof(comm))
  if key not in _HOST_COMMS:
    _HOST_COMMS[key] = comm.Clone()
  return _HOST_COMMS[key]


@functools.cache
def _world_clone() -> Any:
  # One clone of COMM_WORLD for every default backend, as mpi4jax keeps for itself: gossip traffic
  # cannot match a user's own messages on COMM_WORLD. Cloning is collective, as building a backend is.
  _, MPI = _import_mpi()
  return MPI.COMM_WORLD.Clone()


@dataclasses.dataclass(frozen=True, eq=False)
class MpiMixer:
  """W(step) on this rank's block of ``local_nodes`` nodes."""

  topology: Topology
  comm: Any
  rank: int
  size: int
  plans: tuple[BlockPlan, ...]
  bucket_bytes: int = DEFAULT_BUCKET_BYTES
  table: StepTable | None = None

  @property
  def local_nodes(self) -> int:
    return self.topology.num_nodes // self.size

  def first_node(self) -> int:
    return self.rank * self.local_nodes

  def mix(self, tree: Any, step: jax.Array | int = 0, wire: Wire | None = None) -> Any:
    exchange, reduce = self._exchange()
    note_gossip(self.topology, tree, step, wire, self.first_node())
    return mix_blocks(self.plans, tree, step, self.rank, exchange, reduce, self.bucket_bytes, self.table, wire)

  def mix_rounds(self, tree: Any, wire: Wire | None = None) -> tuple[Any, ...]:
    """Each round of a static W apart, one tree per round, from one set of sendrecvs for all rounds."""
    check_rounds_apart(self.topology)
    exchange, _ = self._exchange()
    note_gossip(self.topology, tree, 0, wire, self.first_node())
    return mix_block_rounds(self.plans[0], tree, self.rank, exchange, self.bucket_bytes, wire)

  def _exchange(self) -> tuple[Callable[..., Any], Callable[[jax.Array], jax.Array]]:
    mpi4jax, MPI = _import_mpi()
    rank, comm = self.rank, self.comm

    def exchange(ex: Exchange, send: jax.Array | None, x: Any) -> jax.Array | None:
      src = int(ex.source[rank])
      recv_rows = int(ex.count[src]) if src >= 0 else 0
      if send is None and not recv_rows:
        return None
      recv_shape = (recv_rows,) + tuple(x.shape[1:])
      template = send if send is not None and send.shape == recv_shape else jnp.zeros(recv_shape, x.dtype)
      received = mpi4jax.sendrecv(
          as_words(send if send is not None else template),
          as_words(template),
          source=src if recv_rows else MPI.PROC_NULL,
          dest=int(ex.dest[rank]) if send is not None else MPI.PROC_NULL,
          sendtag=ex.index,
          recvtag=ex.index,
          comm=comm,
      )
      return from_words(received, template.dtype) if recv_rows else None

    def reduce(partial: jax.Array) -> jax.Array:
      return mpi4jax.allreduce(partial, op=MPI.SUM, comm=comm)

    return exchange, reduce


@dataclasses.dataclass(frozen=True, eq=False)
class Mpi:
  """Each MPI rank holds its own block of B = n / size nodes.

  Attributes:
    comm: the ``mpi4py`` communicator (default: a clone of ``COMM_WORLD``, one per process).
    bucket_bytes: the most bytes of one node's leaves packed into one message (one
      ``sendrecv`` per exchange and bucket).

  Example:
    Run alone, a program is rank 0 of 1 and holds every node:

    >>> import gossipjax as gj
    >>> be = gj.backend.Mpi()
    >>> be.rank, be.size, be.node_slice(8)
    (0, 1, slice(0, 8, None))
  """

  comm: Any = None
  bucket_bytes: int = DEFAULT_BUCKET_BYTES

  def __post_init__(self):
    check_bucket_bytes(self.bucket_bytes, "gj.backend.mpi")
    _import_mpi()
    if self.comm is None:
      object.__setattr__(self, "comm", _world_clone())
    _host_comm(self.comm)

  @property
  def rank(self) -> int:
    return int(self.comm.Get_rank())

  @property
  def size(self) -> int:
    return int(self.comm.Get_size())

  def node_slice(self, num_nodes: int) -> slice:
    """The nodes this rank holds: ``x_global[backend.node_slice(n)]`` is its block."""
    b = num_nodes // self.size
    return slice(self.rank * b, (self.rank + 1) * b)

  def mixer(self, topology: Topology) -> MpiMixer:
    """W on this rank's block; a collective: every rank builds it, from the same topology (else ``ValueError``)."""
    from gossipjax.backend._mpi_fault import check_same_topology

    check_same_topology(self.comm, topology)  # before any rank can raise alone, leaving the others waiting
    check_divisible(topology, self.size, "MPI ranks", "gj.backend.mpi")
    plans = compile_topology(topology, self.size)
    return MpiMixer(topology, self.comm, self.rank, self.size, plans, self.bucket_bytes, step_table_or_none(plans, topology))

  def mean(self, tree: Any) -> Any:
    """Every node gets the average over the nodes of every rank, each node weighted once.

    The ranks' blocks may differ in size: while ``mean`` is traced, the ranks sum their
    block sizes on the host (every rank traces the same program, so they do it together),
    and each leaf is scaled by the total before its sum (see `mean_terms`), so the sum
    cannot overflow. The leaves' partial sums are packed by dtype into buckets of at most
    ``bucket_bytes``, as the gossip's rows are: one all-reduce per bucket, not per leaf.
    16-bit floats travel widened to float32, which MPI sums (4 bytes a value, not 2).
    """
    mpi4jax, MPI = _import_mpi()
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
      return tree
    blocks = {int(x.shape[0]) if getattr(x, "ndim", 0) else None for x in leaves}
    if len(blocks) != 1 or None in blocks:
      raise ValueError(f"gj.backend.mpi().mean on rank {self.rank}: every leaf needs the same leading node axis "
                       f"(this rank's block of nodes), got leaves of shapes {[tuple(jnp.shape(x)) for x in leaves]}")
    count = int(_host_comm(self.comm).allreduce(blocks.pop()))
    note_mean(tree, count)

    partials = [jnp.sum(mean_terms(x, count), axis=0, keepdims=True) for x in leaves]
    totals: list[Any] = [None] * len(leaves)
    for idx in buckets(partials, self.bucket_bytes):
      packed = jnp.concatenate([partials[i].reshape(1, -1) for i in idx], axis=1) if len(idx) > 1 else partials[idx[0]]
      summed = mpi4jax.allreduce(packed, op=MPI.SUM, comm=self.comm)
      for i, total in zip(idx, unpack(summed, [partials[i] for i in idx])):
        totals[i] = total
    return jax.tree.unflatten(treedef, [jnp.broadcast_to(t, x.shape).astype(x.dtype) for t, x in zip(totals, leaves)])

  def first_of_block(self, local: int) -> int:
    """The global index of the first node of a block of ``local`` nodes where a transform runs."""
    return self.rank * local

  def gathered_nodes(self, local: int) -> int:
    """How many nodes `gather` returns from blocks of ``local`` nodes."""
    return local * self.size

  def gather(self, tree: Any) -> Any:
    """Every node's values, on every rank (one ``MPI_Allgather`` per leaf); the ranks' blocks must be equal."""
    mpi4jax, _ = _import_mpi()
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
      return tree
    local = int(jnp.shape(leaves[0])[0])
    sizes = _host_comm(self.comm).allgather(local)
    if len(set(sizes)) != 1:
      raise ValueError(f"gj.backend.mpi().gather on rank {self.rank}: the ranks hold blocks of {sizes} nodes; "
                       "an all-gather of compressed messages needs equal blocks")
    note_gather(tree, local * self.size)

    def leaf(x):
      got = mpi4jax.allgather(as_words(x), comm=self.comm)
      return from_words(got.reshape((local * self.size,) + tuple(x.shape[1:])), x.dtype)

    return jax.tree.unflatten(treedef, [leaf(x) for x in leaves])

  def all_to_all(self, tree: Any) -> Any:
    """Node j's piece j of every node: leaves ``(b, n, ...)`` (piece k of local node i at ``[i, k]``) become
    ``(b, n, ...)`` with ``[i, s]`` the piece of local node i that node s sent."""
    mpi4jax, _ = _import_mpi()
    note_all_to_all(tree)
    size = self.size

    def leaf(x):
      b, n = x.shape[:2]
      rest = tuple(x.shape[2:])
      by_rank = jnp.moveaxis(as_words(x).reshape((b, size, n // size) + rest), 1, 0)  # (ranks, b, b, ...)
      got = mpi4jax.alltoall(by_rank, comm=self.comm)  # [s]: rank s's b nodes' pieces for my b nodes
      return from_words(jnp.swapaxes(got.reshape((n, n // size) + rest), 0, 1), x.dtype)

    return jax.tree.map(leaf, tree)

  def local_nodes(self, num_nodes: int) -> int:
    return num_nodes // self.size

  def map(self, fn: Callable[..., Any], in_axes: InAxes = 0, num_nodes: int | None = None) -> Callable[..., Any]:
    """``fn`` on each of this rank's nodes: ``jax.vmap(fn, in_axes)`` over the rank's block.

    Args:
      fn: a per-node function with no collectives.
      in_axes: ``0`` for arguments that carry this rank's nodes on their leading axis
        (e.g. ``x[backend.node_slice(n)]``), ``None`` for arguments every node shares.
      num_nodes: the global n; when given, every mapped leaf must have B = n / size rows.
    """
    where = f"gj.backend.mpi().map on rank {self.rank}"
    expected = None if num_nodes is None else self.local_nodes(num_nodes)
    return vmap_nodes(fn, in_axes, expected, where)


def mpi(comm: Any = None, *, abort_on_error: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Mpi:
  """Nodes split over MPI ranks; launch with ``mpiexec -n K python script.py``.

  Rank r passes its own block of B = n / K nodes (leading axis B, e.g.
  ``x[backend.node_slice(n)]``); each gossip round is one ``mpi4jax.sendrecv`` per device
  offset, carrying only the rows the neighbour needs.

  A rank that raises, or leaves early, would leave the others waiting in their next exchange
  until a wall-clock limit ends the job; by default (``abort_on_error=True``, which calls
  ``gj.backend.mpi_abort_on_error(comm)``) such a job ends within seconds instead, with a
  line naming the rank. That hooks ``sys.excepthook`` and ``sys.exit`` and registers an
  ``atexit`` function; on a communicator of one process it does nothing.
  ``abort_on_error=False`` leaves the process's hooks alone (a program with exit handling
  of its own).

  For messages of more than a few hundred KiB, launch with ``gj.backend.mpi_launch_env``
  set (``$(python -c "import gossipjax as gj; print(gj.backend.mpi_launch_prefix())") mpiexec -n 4
  python script.py``): with glibc's defaults each exchange receives into freshly mapped pages,
  and a 16 MiB ring round's exchanges took 4x longer (see the MPI benchmark).

  Args:
    comm: an ``mpi4py`` communicator; ``None`` uses a clone of ``COMM_WORLD``.
    abort_on_error: install `mpi_abort_on_error` on this communicator (the default): an
      uncaught exception on one rank, or its exit while the others still run, aborts every
      rank. ``False``: a failing rank leaves the others waiting.
    bucket_bytes: the most bytes of one node's leaves packed into one message (the leaves
      of each dtype are concatenated up to this size; default 25 MiB, PyTorch DDP's bucket size).

  Returns:
    The backend: its ``mixer(topology)``, ``map(fn)`` and ``mean(tree)`` work on this
    rank's block of nodes.

  Example:
    Each rank of ``mpiexec -n K`` passes its own block; run alone, the one rank holds all 4
    nodes and the step is one gossip round, ``x <- W x``:

    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> be = gj.backend.mpi()
    >>> tx = gj.gossip_sgd(gj.topology.ring(4), learning_rate=0.1, backend=be)
    >>> x = jnp.arange(4.0)[be.node_slice(4)][:, None]
    >>> u, _ = jax.jit(tx.update)(jnp.zeros_like(x), tx.init(x), x)
    >>> [round(float(v), 4) for v in (x + u)[:, 0]]
    [1.3333, 1.0, 2.0, 1.6667]

  Raises:
    ImportError: mpi4jax is not installed (the message says how to install it).
  """
  backend = Mpi(comm, bucket_bytes)
  if abort_on_error:
    from gossipjax.backend._mpi_fault import abort_on_error as install

    install(backend.comm)
  return backend
