"""A node-level mixing plan compiled to device-level exchanges over a block layout.

With n nodes on K devices (or MPI ranks), device d holds the block of B = n / K nodes
``d*B ... d*B + B - 1``. A node-level round is a partial permutation over nodes; its edges
that cross devices are grouped by device offset ``o = (dst_device - src_device) mod K``.
For one offset every device sends to exactly one other, so the offset is one ``ppermute``
(one ``sendrecv`` per rank), and it carries only the rows a neighbour reads, merged over
all rounds of the plan. A cyclic node shift ``h`` therefore needs at most two exchanges,
and the data a device sends is O(degree * B * d), never an all-gather.

The receiver then rebuilds each node-level round from its own block and the received
buffers, and sums ``self_weight * x + sum_r weight_r * received_r`` in the same order as
the simulator, so the numbers match it to round-off.

A rank-one term ``u v^T`` of the plan (a star's hub, exact averaging) is no exchange: each
device sums ``v_j x_j`` over its own nodes, one all-reduce (``psum``, an MPI allreduce) of
that (1, ...) partial sum gives ``v^T x`` everywhere, and each node adds ``u_i v^T x``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gossipjax.backend._precision import accumulation_dtype
from gossipjax.topology import MixingPlan, Topology


@dataclasses.dataclass(frozen=True, eq=False)
class Exchange:
  """One device offset of a plan: device ``s`` sends ``send_rows[s, :count[s]]`` to ``(s + offset) % K``.

  Attributes:
    offset: the device offset, in ``1 ... K - 1``.
    pairs: ``(source device, destination device)`` for every device that sends (the ppermute perm).
    send_rows: int (K, m), the local rows each device sends, padded with 0 to the longest, m.
    count: int (K,), how many rows each device really sends (0 where it sends nothing).
  """

  offset: int
  pairs: tuple[tuple[int, int], ...]
  send_rows: np.ndarray
  count: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class BlockRound:
  """A node-level round seen by each device: local receiver ``i`` reads row ``row[d, i]`` of buffer ``buffer[d, i]``.

  Buffer 0 is the device's own block, buffer ``1 + e`` what exchange ``e`` delivered.
  Receivers with weight 0 read their own row (as the simulator's gather does).
  """

  buffer: np.ndarray
  row: np.ndarray
  weight: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class BlockRankOne:
  """A rank-one term ``u v^T`` split into the devices' blocks: ``u`` and ``v`` of shape (K, B)."""

  u: np.ndarray
  v: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class BlockPlan:
  """A ``MixingPlan`` for K devices with B nodes each."""

  num_devices: int
  block: int
  self_weight: np.ndarray  # (K, B)
  exchanges: tuple[Exchange, ...]
  rounds: tuple[BlockRound, ...]
  rank_one: tuple[BlockRankOne, ...] = ()


def check_divisible(topology: Topology, num_devices: int, where: str) -> int:
  """Returns B = n / K, or raises ``ValueError`` saying how to fix an uneven split."""
  n = topology.num_nodes
  if num_devices < 1 or n % num_devices:
    raise ValueError(
        f"{topology.name} has {n} nodes, which do not split evenly over the {num_devices} {where}: "
        f"every one must hold the same number of nodes, so use a node count that is a multiple of "
        f"{num_devices} (or run on a number of {where.split()[-1]} that divides {n})"
    )
  return n // num_devices


def compile_plan(plan: MixingPlan, num_devices: int) -> BlockPlan:
  """Groups a plan's cross-device edges by device offset (see the module docstring).

  Array operations over all edges at once, O(edges log edges): at 65,536 nodes of an
  exponential graph on 2 devices this is about 0.1 s, where a loop over edges took seconds.
  """
  n, k = plan.num_nodes, num_devices
  b = n // k
  live = [np.flatnonzero(r.weight) for r in plan.rounds]
  dst = np.concatenate(live or [np.zeros(0, np.int64)])
  src = np.concatenate([r.src[i] for r, i in zip(plan.rounds, live)] or [np.zeros(0, np.int64)]).astype(np.int64)
  off = (dst // b - src // b) % k
  # Every row a device sends at an offset, once, sorted by (offset, source device, local row).
  cross = off != 0
  sent = np.unique((off[cross] * k + src[cross] // b) * b + src[cross] % b)
  sent_off, sent_dev, sent_row = sent // (k * b), (sent // b) % k, sent % b
  offsets = np.unique(sent_off)
  which = np.searchsorted(offsets, sent_off)  # the exchange each sent row travels in
  group = which * k + sent_dev
  position = np.arange(len(sent)) - np.searchsorted(group, group)  # its slot in that device's send buffer
  counts = np.bincount(group, minlength=len(offsets) * k).reshape(len(offsets), k)
  exchanges = []
  for e, o in enumerate(offsets.tolist()):
    mine = which == e
    send = np.zeros((k, int(counts[e].max())), np.int64)
    send[sent_dev[mine], position[mine]] = sent_row[mine]
    pairs = tuple((s, (s + o) % k) for s in range(k) if counts[e, s])
    exchanges.append(Exchange(o, pairs, send, counts[e].astype(np.int64)))
  rounds = []
  bounds = np.cumsum([0] + [len(i) for i in live])
  for r, a, z in zip(plan.rounds, bounds[:-1], bounds[1:]):
    d, j, o = dst[a:z], src[a:z], off[a:z]
    buffer = np.zeros((k, b), np.int64)
    row = np.tile(np.arange(b), (k, 1))
    weight = np.zeros((k, b))
    slot = np.searchsorted(sent, (o * k + j // b) * b + j % b)  # meaningful where o != 0
    far = o != 0
    buffer[d // b, d % b] = np.where(far, 1 + which[np.minimum(slot, len(sent) - 1)] if len(sent) else 0, 0)
    row[d // b, d % b] = np.where(far, position[np.minimum(slot, len(sent) - 1)] if len(sent) else 0, j % b)
    weight[d // b, d % b] = r.weight[d]
    rounds.append(BlockRound(buffer, row, weight))
  rank_one = tuple(BlockRankOne(t.u.reshape(k, b).copy(), t.v.reshape(k, b).copy()) for t in plan.rank_one)
  return BlockPlan(k, b, plan.self_weight.reshape(k, b).copy(), tuple(exchanges), tuple(rounds), rank_one)


def compile_topology(topology: Topology, num_devices: int) -> tuple[BlockPlan, ...]:
  return tuple(compile_plan(p, num_devices) for p in topology.plans())


# An exchange function: (exchange, rows this device sends or None) -> rows received or None.
ExchangeFn = Callable[[Exchange, "jax.Array | None", Any], "jax.Array | None"]
# A reduce function: this device's partial sums (k, ...) -> the sums over every device (all-reduce).
ReduceFn = Callable[[jax.Array], jax.Array]


def _row(table: np.ndarray, device: Any) -> np.ndarray | jax.Array:
  """This device's row of a per-device table: static where the device (or the row) is known."""
  if isinstance(device, (int, np.integer)):
    return table[int(device)]
  if np.all(table == table[0]):
    return table[0]
  return jnp.asarray(table)[device]


def _weight(w: np.ndarray | jax.Array, like: jax.Array) -> Any:
  if isinstance(w, np.ndarray):
    if np.all(w == w[0]):
      return float(w[0])
    return jnp.asarray(w, like.dtype).reshape((-1,) + (1,) * (like.ndim - 1))
  return w.astype(like.dtype).reshape((-1,) + (1,) * (like.ndim - 1))


def _take(x: jax.Array, idx: np.ndarray | jax.Array) -> jax.Array:
  if isinstance(idx, np.ndarray):
    if idx.size and np.array_equal(idx, np.arange(idx[0], idx[0] + idx.size)):
      return x if idx.size == x.shape[0] else jax.lax.slice_in_dim(x, int(idx[0]), int(idx[0]) + idx.size)
  return jnp.take(x, jnp.asarray(idx), axis=0)


def _assemble(bufs: Sequence[jax.Array | None], buffer: Any, row: Any) -> jax.Array:
  """The (B, ...) rows a round reads: static runs of slices where possible, else one gather."""
  if isinstance(buffer, np.ndarray) and isinstance(row, np.ndarray):
    pieces, start = [], 0
    for i in range(1, len(buffer) + 1):
      if i == len(buffer) or buffer[i] != buffer[start] or row[i] != row[i - 1] + 1:
        pieces.append(_take(bufs[buffer[start]], np.arange(row[start], row[start] + i - start)))
        start = i
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=0)
  starts = np.cumsum([0] + [b.shape[0] for b in bufs[:-1]])
  flat = jnp.asarray(starts)[jnp.asarray(buffer)] + jnp.asarray(row)
  return jnp.take(jnp.concatenate(bufs, axis=0), flat, axis=0)


def _partial_sum(v: np.ndarray | jax.Array, x: jax.Array) -> jax.Array:
  """``sum_j v[j] x[j]`` over this device's block, shape (...)."""
  if isinstance(v, np.ndarray):
    if np.all(v == v[0]):
      return float(v[0]) * jnp.sum(x, axis=0)
    nz = np.flatnonzero(v)
    if len(nz) == 1:
      return float(v[nz[0]]) * x[int(nz[0])]
  return jnp.tensordot(jnp.asarray(v, x.dtype), x, axes=1)


def apply_block_plan(plan: BlockPlan, x: jax.Array, device: Any, exchange: ExchangeFn,
                     reduce: ReduceFn | None = None) -> jax.Array:
  """``(W x)`` for this device's block ``x`` (B, ...).

  Args:
    plan: the compiled plan.
    x: this device's nodes on axis 0.
    device: this device's index, a Python int (MPI: the rank) or a traced scalar
      (``lax.axis_index`` under ``shard_map`` / ``pmap``).
    exchange: does the communication of one exchange (ppermute or sendrecv).
    reduce: sums a (k, ...) array over the devices (psum or an MPI allreduce); needed
      when the plan has rank-one terms, one call for all of them.
  """
  bufs: list[jax.Array | None] = [x]
  for ex in plan.exchanges:
    if isinstance(device, (int, np.integer)):
      c = int(ex.count[device])
      send = _take(x, ex.send_rows[device, :c]) if c else None
    else:
      send = _take(x, _row(ex.send_rows, device))
    bufs.append(exchange(ex, send, x))
  # Rows travel in the leaf's dtype; 16-bit floats are summed in float32 and rounded once.
  acc = x.astype(accumulation_dtype(x.dtype))
  out = _weight(_row(plan.self_weight, device), acc) * acc
  for r in plan.rounds:
    received = _assemble(bufs, _row(r.buffer, device), _row(r.row, device))
    out = out + _weight(_row(r.weight, device), acc) * received.astype(acc.dtype)
  if plan.rank_one:
    if reduce is None:
      raise ValueError("this backend cannot apply rank-one terms (it has no all-reduce)")
    totals = reduce(jnp.stack([_partial_sum(_row(t.v, device), acc) for t in plan.rank_one]))
    for k, t in enumerate(plan.rank_one):
      out = out + _weight(_row(t.u, device), acc) * totals[k][None]
  return out if acc.dtype == x.dtype else out.astype(x.dtype)


def mix_blocks(plans: Sequence[BlockPlan], tree: Any, step: Any, device: Any, exchange: ExchangeFn,
               reduce: ReduceFn | None = None) -> Any:
  """Applies W(step) to every leaf of a tree of local blocks; ``lax.switch`` over a traced step."""
  apply = lambda p: (lambda t: jax.tree.map(lambda x: apply_block_plan(p, x, device, exchange, reduce), t))
  if len(plans) == 1:
    return apply(plans[0])(tree)
  if isinstance(step, (int, np.integer)):
    return apply(plans[int(step) % len(plans)])(tree)
  return jax.lax.switch(jnp.asarray(step) % len(plans), [apply(p) for p in plans], tree)
