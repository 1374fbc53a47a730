"""The leaves of a tree packed into buckets, and the compact wire that may cross instead of them.

Before exchanging, the leaves of a tree are packed into **buckets**: the leaves of one
dtype, flattened to (B, size) and concatenated, up to ``bucket_bytes`` per node (as PyTorch
DDP's gradient buckets and Horovod's fusion buffer do). One exchange then moves one message
per bucket, however many leaves the model has, and the mixing runs once per bucket.

With a `Wire`, what crosses is each leaf's compact form (a compressor's) instead of its
rows, packed by dtype into buckets of its own and decoded to dense rows on arrival.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# PyTorch DDP's default bucket (``bucket_cap_mb=25``): large enough that a ResNet-50's 160
# leaves travel as a few messages, small enough that the packing copy stays in cache-sized pieces.
DEFAULT_BUCKET_BYTES = 25 * 2**20


def check_bucket_bytes(bucket_bytes: Any, where: str) -> int:
  """``bucket_bytes`` as a positive int, or a ``ValueError`` that starts with ``where``."""
  if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, np.integer)) or bucket_bytes < 1:
    raise ValueError(f"{where}: bucket_bytes must be a positive number of bytes (the most of one node's "
                     f"leaves packed into one message; default {DEFAULT_BUCKET_BYTES}), got {bucket_bytes!r}")
  return int(bucket_bytes)


def _received(x: jax.Array | None) -> jax.Array:
  """Rows the plan says this device received (``None`` stands for an exchange that sent it none)."""
  if x is None:
    raise AssertionError("gj.backend: a mixing plan read rows from an exchange that sent this device none")
  return x


def _width(x: Any) -> int:
  """Entries of one node's slice of a node-stacked leaf."""
  return int(np.prod(x.shape[1:])) if len(x.shape) > 1 else 1


def buckets(leaves: Sequence[Any], bucket_bytes: int, layouts: Sequence[Any] | None = None) -> list[list[int]]:
  """Groups leaves into buckets: the leaves of one dtype (and layout) in order, up to ``bucket_bytes`` per node.

  A leaf larger than the cap is a bucket of its own (leaves are never split). ``layouts``,
  one hashable per leaf, keeps leaves laid out differently on a mesh's other axes apart
  (each device packs its own pieces of leaves that are split alike).

  >>> import numpy as np
  >>> leaves = [np.zeros((2, 10), np.float32), np.zeros((2, 3), np.int32), np.zeros((2, 20), np.float32)]
  >>> buckets(leaves, 1 << 20), buckets(leaves, 100)
  ([[0, 2], [1]], [[0], [1], [2]])
  """
  out: list[list[int]] = []
  open_bucket: dict[Any, tuple[int, int]] = {}  # (dtype, layout) -> (its open bucket, bytes per node in it)
  for i, x in enumerate(leaves):
    kind = (np.dtype(x.dtype), None if layouts is None else layouts[i])
    size = _width(x) * np.dtype(x.dtype).itemsize
    if kind in open_bucket and open_bucket[kind][1] + size <= bucket_bytes:
      b, used = open_bucket[kind]
      out[b].append(i)
      open_bucket[kind] = (b, used + size)
    else:
      open_bucket[kind] = (len(out), size)
      out.append([i])
  return out


def _pack(parts: Sequence[jax.Array]) -> jax.Array:
  """Rows of several leaves side by side: (m, sum of widths)."""
  if len(parts) == 1:  # a bucket of one keeps its shape (and its layout on a mesh's other axes)
    return parts[0]
  return jnp.concatenate([p.reshape((p.shape[0], -1)) for p in parts], axis=1)


def unpack(y: jax.Array, like: Sequence[Any]) -> list[jax.Array]:
  """Splits packed rows back into leaves shaped like ``like`` beyond the row axis."""
  out, start = [], 0
  for x in like:
    w = _width(x)
    part = y if len(like) == 1 else jax.lax.slice_in_dim(y, start, start + w, axis=1)
    out.append(part.reshape((y.shape[0],) + tuple(x.shape[1:])))
    start += w
  return out


class Wire(NamedTuple):
  """What crosses devices instead of the dense rows: each leaf's compact form (a compressor's).

  Attributes:
    parts: for every leaf of the mixed tree (in ``jax.tree.leaves`` order), the tuple of
      node-stacked arrays that encode it (leading axis: the local nodes).
    decode: ``decode(leaf index, parts' received rows, global indices of their sender
      nodes, context)`` gives the dense rows ``(m, *leaf.shape[1:])`` the receiver mixes.
    context: arrays every node shares that ``decode`` reads (e.g. the step, for keys).

  What ``gj.choco_sgd`` passes to ``mixer.mix``, and what a new compressed method would:
  the simulation mixes the decoded tree and ignores the wire; the sharded, pmapped and MPI
  backends send the parts (packed by dtype into buckets) and decode them on arrival.

  Example:
    Sending only the top entry of each node's row, and decoding it on arrival:

    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> c = gj.compress.top_k(0.5)
    >>> x = jnp.array([[3.0, -1.0], [0.5, -4.0]])               # 2 nodes, one leaf
    >>> key = jax.random.PRNGKey(0)
    >>> parts = jax.vmap(lambda r: c.encode_leaf(r, key))(x)    # values and indices per node
    >>> decode = lambda i, p, senders, ctx: jax.vmap(lambda p: c.decode_leaf(p, key, (2,), x.dtype))(p)
    >>> q = decode(0, parts, jnp.arange(2), None)                # what the senders' rows decode to
    >>> wire = gj.mixing.Wire([parts], decode)
    >>> gj.mixing.make_mixer(gj.topology.complete(2)).mix(q, 0, wire).tolist()
    [[1.5, -2.0], [1.5, -2.0]]
  """

  parts: Sequence[tuple[jax.Array, ...]]
  decode: Callable[[int, tuple[jax.Array, ...], jax.Array, Any], jax.Array]
  context: Any = None


class _Travel(NamedTuple):
  """The packed arrays that cross, and how received rows of them become rows of the dense buckets."""

  arrays: list[jax.Array]
  to_dense: Callable[[list[jax.Array | None], Callable[[], Any]], list[jax.Array | None]]


def _dense_travel(packed: list[jax.Array]) -> _Travel:
  return _Travel(packed, lambda got, nodes: got)


def _compact_travel(wire: Wire, leaves: Sequence[jax.Array], groups: Sequence[Sequence[int]],
                    bucket_bytes: int) -> _Travel:
  """The leaves' compact parts packed by dtype into their own buckets, decoded on arrival."""
  flat = [p for parts in wire.parts for p in parts]
  owner = [i for i, parts in enumerate(wire.parts) for _ in parts]
  wire_groups = buckets(flat, bucket_bytes)
  arrays = [_pack([flat[j] for j in idx]) for idx in wire_groups]

  def to_dense(got: list[jax.Array | None], nodes: Callable[[], Any]) -> list[jax.Array | None]:
    if all(g is None for g in got):
      return [None] * len(groups)
    rows: list[Any] = [None] * len(flat)
    for idx, g in zip(wire_groups, got):
      for j, part in zip(idx, unpack(_received(g), [flat[j] for j in idx])):
        rows[j] = part
    senders = jnp.asarray(nodes(), jnp.int32)
    dense = [wire.decode(i, tuple(r for r, o in zip(rows, owner) if o == i), senders, wire.context)
             for i in range(len(leaves))]
    return [_pack([dense[i] for i in idx]) for idx in groups]

  return _Travel(arrays, to_dense)


def _floats_only(keep: Sequence[int], wire: Wire | None, layouts: Sequence[Any] | None) -> tuple[Any, Any]:
  """The wire and layouts of the leaves ``keep`` alone (the float leaves, which are mixed)."""
  sub_wire = None if wire is None else Wire([wire.parts[i] for i in keep],
                                            lambda j, p, s, c: wire.decode(keep[j], p, s, c), wire.context)
  return sub_wire, None if layouts is None else [layouts[i] for i in keep]
