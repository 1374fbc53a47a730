"""A compiled block plan applied to this device's packed buckets.

Each exchange of the plan (see `gossipjax.backend._block_plan`) moves one message per
bucket (see `gossipjax.backend._buckets`), and the mixing below runs once per bucket.
The receiver rebuilds each node-level round from its own block and the received
buffers, and sums ``self_weight * x + sum_r weight_r * received_r`` in the same order as
the simulator, so the numbers match it to round-off.

A rank-one term ``u v^T`` of the plan (a star's hub, exact averaging) is no exchange: each
device sums ``v_j x_j`` over its own nodes, one all-reduce (``psum``, an MPI allreduce) of
that (1, ...) partial sum gives ``v^T x`` everywhere, and each node adds ``u_i v^T x``.

A traced step over a period of plans reads the step's rows and weights from a `StepTable`,
whose branches (one per exchange pattern, or per slot and message length) only move rows.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gossipjax.backend._block_plan import BlockPlan, BlockRound, Exchange, StepTable
from gossipjax.backend._buckets import (DEFAULT_BUCKET_BYTES, Wire, _compact_travel, _dense_travel, _floats_only, _pack,
                                        _received, _Travel, buckets, unpack)
from gossipjax.backend._precision import accumulation_dtype

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
    if idx.size and idx[-1] - idx[0] == idx.size - 1 and np.array_equal(idx, np.arange(idx[0], idx[0] + idx.size)):
      return x if idx.size == x.shape[0] else jax.lax.slice_in_dim(x, int(idx[0]), int(idx[0]) + idx.size)
  return jnp.take(x, jnp.asarray(idx), axis=0)


def _assemble(bufs: Sequence[jax.Array | None], r: BlockRound, device: Any) -> jax.Array:
  """The (B, ...) rows a round reads: the compiled runs of slices where known, else one gather."""
  if isinstance(device, (int, np.integer)):
    slices = r.slices[int(device)]
  elif all(s == r.slices[0] for s in r.slices):
    slices = r.slices[0]
  else:
    slices = None
  if slices is not None:
    pieces = [_take(_received(bufs[buf]), np.arange(start, start + length)) for buf, start, length in slices]
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=0)
  buffer, row = _row(r.buffer, device), _row(r.row, device)
  own = _received(bufs[0])
  present = [b if b is not None else jnp.zeros((0,) + own.shape[1:], own.dtype) for b in bufs]
  starts = np.cumsum([0] + [b.shape[0] for b in present[:-1]])
  flat = (starts[buffer] if isinstance(buffer, np.ndarray) else jnp.asarray(starts)[buffer]) + row
  return jnp.take(jnp.concatenate(present, axis=0), jnp.asarray(flat), axis=0)


def _partial_sum(v: np.ndarray | jax.Array, x: jax.Array) -> jax.Array:
  """``sum_j v[j] x[j]`` over this device's block, shape (...)."""
  if isinstance(v, np.ndarray):
    if np.all(v == v[0]):
      return jnp.sum(float(v[0]) * x, axis=0)  # scaled first: a sum of n large rows could overflow
    nz = np.flatnonzero(v)
    if len(nz) == 1:
      return float(v[nz[0]]) * x[int(nz[0])]
  return jnp.tensordot(jnp.asarray(v, x.dtype), x, axes=1)


def _senders(source: Any, send_rows: Any, block: int) -> Any:
  """Global indices of the nodes whose rows arrive from device ``source`` (its ``send_rows``)."""
  if isinstance(source, (int, np.integer)):
    return max(int(source), 0) * block + np.asarray(send_rows)
  return jnp.maximum(source, 0) * block + send_rows


def apply_block_plan(plan: BlockPlan, packed: Sequence[jax.Array], device: Any, exchange: ExchangeFn,
                     reduce: ReduceFn | None = None, travel: _Travel | None = None, apart: bool = False) -> list[Any]:
  """``(W x)`` for this device's block of every bucket (B, width): one exchange per exchange and bucket.

  Args:
    plan: the compiled plan.
    packed: this device's nodes on axis 0 of every bucket (see `buckets`).
    device: this device's index, a Python int (MPI: the rank) or a traced scalar
      (``lax.axis_index`` under ``shard_map`` / ``pmap``).
    exchange: does the communication of one exchange (ppermute or sendrecv) of one
      bucket: ``exchange(ex, rows to send or None, the bucket)``.
    reduce: sums a (terms, width) array over the devices (psum or an MPI allreduce);
      needed when the plan has rank-one terms, one call per bucket for all of them.
    travel: what crosses (default: the dense buckets themselves).
    apart: return each round's terms apart, ``[round][bucket]`` (the plan's exchanges serve
      every round; no self weight, no rank-one terms).
  """
  static = isinstance(device, (int, np.integer))
  travel = travel or _dense_travel(list(packed))
  bufs: list[list[jax.Array | None]] = [[x] for x in packed]
  for ex in plan.exchanges:
    c = int(ex.count[int(device)]) if static else ex.send_rows.shape[1]
    rows = ex.send_rows[int(device), :c] if static else _row(ex.send_rows, device)
    got = [exchange(ex, _take(t, rows) if c else None, t) for t in travel.arrays]

    def nodes(ex=ex):
      if static:
        src = int(ex.source[int(device)])
        return _senders(src, ex.send_rows[max(src, 0), :ex.count[src] if src >= 0 else 0], plan.block)
      src = jnp.asarray(ex.source)[device]
      return _senders(src, jnp.asarray(ex.send_rows)[jnp.maximum(src, 0)], plan.block)

    for b, g in enumerate(travel.to_dense(got, nodes)):
      bufs[b].append(g)

  def terms(r: BlockRound, acc: jax.Array, xb: list[jax.Array | None]) -> jax.Array:
    return _weight(_row(r.weight, device), acc) * _assemble(xb, r, device).astype(acc.dtype)

  if apart:
    return [[terms(r, x.astype(accumulation_dtype(x.dtype)), xb).astype(x.dtype) for x, xb in zip(packed, bufs)]
            for r in plan.rounds]
  out = []
  for x, xb in zip(packed, bufs):
    # Rows travel in the leaf's dtype; 16-bit floats are summed in float32 and rounded once.
    acc = x.astype(accumulation_dtype(x.dtype))
    y = _weight(_row(plan.self_weight, device), acc) * acc
    for r in plan.rounds:
      y = y + terms(r, acc, xb)
    if plan.rank_one:
      if reduce is None:
        raise ValueError("this backend cannot apply rank-one terms (it has no all-reduce)")
      totals = reduce(jnp.stack([_partial_sum(_row(t.v, device), acc) for t in plan.rank_one]))
      for k, t in enumerate(plan.rank_one):
        y = y + _weight(_row(t.u, device), acc) * totals[k][None]
    out.append(y if y.dtype == x.dtype else y.astype(x.dtype))
  return out


def apply_step_table(table: StepTable, packed: Sequence[jax.Array], step: jax.Array, device: Any,
                     exchange: ExchangeFn, travel: _Travel | None = None) -> list[jax.Array]:
  """``W(step) x`` of every bucket for a traced step: the step's pattern's exchanges, then the tables' rows and weights."""
  k = jnp.asarray(step) % len(table.pattern_of)
  static = isinstance(device, (int, np.integer))
  m, num_ex = table.max_rows, table.send_rows.shape[1]
  travel = travel or _dense_travel(list(packed))
  block = packed[0].shape[0]

  def pick(t: np.ndarray) -> jax.Array:
    """This device's entries of a (period, ..., K, last) table at the traced step."""
    if static:
      return jnp.asarray(np.take(t, int(device), axis=-2))[k]
    return jnp.asarray(t)[k][..., device, :]

  # Every slot's rows are gathered outside the branches, which then hold only the exchanges:
  # a branch per pattern costs little to compile.
  send_rows = pick(table.send_rows)
  sends = [[jnp.take(t, send_rows[e], axis=0) for t in travel.arrays] for e in range(num_ex)]

  def pad(got: jax.Array | None, like: jax.Array) -> jax.Array:
    """Received rows padded to m (zeros shaped, and under shard_map varying, like the sends)."""
    if got is None:
      return jnp.zeros_like(like)
    return jnp.pad(got, [(0, m - got.shape[0])] + [(0, 0)] * (got.ndim - 1))

  def branch(plan: BlockPlan) -> Callable[[list], list]:
    def run(sends):
      received = []
      for e, ex in enumerate(plan.exchanges):
        c = int(ex.count[int(device)]) if static else ex.send_rows.shape[1]
        received.append([pad(exchange(ex, send[:c] if c else None, t), send)
                         for send, t in zip(sends[e], travel.arrays)])
      return received + [[jnp.zeros_like(send) for send in sends[e]] for e in range(len(received), num_ex)]
    return run

  def slot_branch(ex: Exchange) -> Callable[[list], list]:
    def run(sends_e):
      c = int(ex.count[int(device)]) if static else ex.send_rows.shape[1]
      if not ex.send_rows.shape[1]:
        return [jnp.zeros_like(send) for send in sends_e]
      return [pad(exchange(ex, send[:c] if c else None, t), send) for send, t in zip(sends_e, travel.arrays)]
    return run

  if table.slots:  # the fixed form: each slot's exchange, as long as this step's longest message
    assert table.slot_size is not None
    received, size_now = [], jnp.asarray(table.slot_size)[k]
    for e, options in enumerate(table.slots):
      runs = [slot_branch(ex) for ex in options]
      received.append(runs[0](sends[e]) if len(runs) == 1 else jax.lax.switch(size_now[e], runs, sends[e]))
  else:
    branches = [branch(p) for p in table.patterns]
    if len(branches) == 1:
      received = branches[0](sends)
    else:
      received = jax.lax.switch(jnp.asarray(table.pattern_of)[k], branches, sends)
  source = jnp.asarray(table.source)[k][:, int(device)] if static else jnp.asarray(table.source)[k][:, device]
  all_rows = jnp.asarray(table.send_rows)[k]  # (E, K, M)
  dense = [travel.to_dense(received[e], lambda e=e: _senders(source[e], all_rows[e][jnp.maximum(source[e], 0)],
                                                             block))
           for e in range(num_ex)]
  rows, weight, self_weight = pick(table.rows), pick(table.weight), pick(table.self_weight)
  out = []
  for b, x in enumerate(packed):
    # Rows travel in the leaf's dtype; 16-bit floats are summed in float32 and rounded once.
    acc = x.astype(accumulation_dtype(x.dtype))
    bufs = jnp.concatenate([x] + [_received(got[b]) for got in dense], axis=0).astype(acc.dtype)
    y = _weight(self_weight, acc) * acc
    for r in range(table.rows.shape[1]):
      y = y + _weight(weight[r], acc) * jnp.take(bufs, rows[r], axis=0)
    out.append(y if y.dtype == x.dtype else y.astype(x.dtype))
  return out


def mix_blocks(plans: Sequence[BlockPlan], tree: Any, step: Any, device: Any, exchange: ExchangeFn,
               reduce: ReduceFn | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
               table: StepTable | None = None, wire: Wire | None = None, layouts: Sequence[Any] | None = None) -> Any:
  """Applies W(step) to a tree of local blocks, packed into buckets: one exchange per bucket.

  A traced step over a period of plans uses ``table`` (see `step_table`); a period with
  rank-one terms is a ``lax.switch`` over whole plans. With ``wire``, the leaves' compact
  parts cross instead of their rows (in buckets of their own) and are decoded on arrival;
  rank-one terms still all-reduce dense partial sums. ``layouts`` (one hashable per leaf)
  packs only leaves laid out alike on a mesh's other axes. A leaf that is not a float
  (an integer counter, a key) is returned unchanged, on every backend.
  """
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    return tree
  keep = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.inexact)]
  if len(keep) < len(leaves):
    # Integer, bool and key leaves (counters, seeds) pass through unchanged, as the simulation leaves them.
    mixed = mix_blocks(plans, [leaves[i] for i in keep], step, device, exchange, reduce, bucket_bytes, table,
                       *_floats_only(keep, wire, layouts))
    out = list(leaves)
    for i, y in zip(keep, mixed):
      out[i] = y
    return jax.tree.unflatten(treedef, out)
  groups = buckets(leaves, bucket_bytes, layouts)
  packed = [_pack([leaves[i] for i in idx]) for idx in groups]
  travel = None if wire is None else _compact_travel(wire, leaves, groups, bucket_bytes)
  apply = lambda p: (lambda bs: apply_block_plan(p, bs, device, exchange, reduce, travel))
  if len(plans) == 1:
    mixed = apply(plans[0])(packed)
  elif isinstance(step, (int, np.integer)):
    mixed = apply(plans[int(step) % len(plans)])(packed)
  elif table is not None:
    mixed = apply_step_table(table, packed, step, device, exchange, travel)
  else:
    mixed = jax.lax.switch(jnp.asarray(step) % len(plans), [apply(p) for p in plans], packed)
  out: list[Any] = [None] * len(leaves)
  for idx, y in zip(groups, mixed):
    for i, part in zip(idx, unpack(y, [leaves[i] for i in idx])):
      out[i] = part
  return jax.tree.unflatten(treedef, out)


def mix_block_rounds(plan: BlockPlan, tree: Any, device: Any, exchange: ExchangeFn,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES, wire: Wire | None = None,
                     layouts: Sequence[Any] | None = None) -> tuple[Any, ...]:
  """Each round of a static plan apart, one tree per round, from one set of exchanges (a mixer's ``mix_rounds``).

  Rounds whose rows travel between the same devices share their exchanges: a union graph of
  c rounds at several nodes per device sends at most one message per device pair and bucket,
  where mixing the rounds one by one sends one per round and pair. Leaves that are not floats
  are returned unchanged in every round.
  """
  leaves, treedef = jax.tree.flatten(tree)
  out = [list(leaves) for _ in plan.rounds]
  keep = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.inexact)]
  if keep:
    floats = [leaves[i] for i in keep]
    sub_wire, sub_layouts = _floats_only(keep, wire, layouts)
    groups = buckets(floats, bucket_bytes, sub_layouts)
    packed = [_pack([floats[i] for i in idx]) for idx in groups]
    travel = None if sub_wire is None else _compact_travel(sub_wire, floats, groups, bucket_bytes)
    for r, mixed in enumerate(apply_block_plan(plan, packed, device, exchange, None, travel, apart=True)):
      for idx, y in zip(groups, mixed):
        for i, part in zip(idx, unpack(y, [floats[i] for i in idx])):
          out[r][keep[i]] = part
  return tuple(jax.tree.unflatten(treedef, o) for o in out)
