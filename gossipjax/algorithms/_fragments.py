"""Streaming DiLoCo's fragments: the parts of the params that synchronise in turn.

A fragment is a list of pieces, each a contiguous range of one float leaf's entries (one
node's, row-major). Two splits:

* ``"layers"``: whole leaves, in order, in groups of about equal size. One leaf is never
  cut, so a model whose layers differ in size (a wide hidden layer and a small head) has
  fragments of different sizes, and the peak bytes a step are its largest fragment's.
* ``"balanced"``: the float leaves end to end, cut into F ranges of equal bytes, at the
  entry nearest each k/F of the total (a leaf may be cut between fragments). Every
  fragment is then within one entry of 1/F of the params' bytes.

Either way a fragment's sync exchanges its pieces as the leaves of one tree, so the backends
pack them into one message per bucket as they pack a model's leaves.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import Any, NamedTuple, Sequence

import jax
import jax.core  # jax.core.Tracer: a type checker sees the submodule only where it is imported
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from gossipjax._axis import mapping

FRAGMENT_SPLITS = ("layers", "balanced")


class Piece(NamedTuple):
  """Entries ``[start, stop)`` of one node's float leaf ``leaf`` (row-major), which has ``size`` entries."""

  leaf: int
  start: int
  stop: int
  size: int

  @property
  def whole(self) -> bool:
    return self.start == 0 and self.stop == self.size


def layer_fragments(sizes: Sequence[int], num_fragments: int) -> list[list[int]]:
  """Splits leaf indices, in order, into ``num_fragments`` contiguous groups of about equal size.

  A group closes once it reaches its share of the total (or when every later leaf is needed
  to give each remaining group one).
  """
  total, groups, current, filled = sum(sizes), [], [], 0
  for i, size in enumerate(sizes):
    current.append(i)
    filled += size
    left = num_fragments - len(groups) - 1
    if left and (filled >= total * (len(groups) + 1) / num_fragments or len(sizes) - i - 1 == left):
      groups.append(current)
      current = []
  groups.append(current)
  return groups


def balanced_cuts(sizes: Sequence[int], itemsizes: Sequence[int], num_fragments: int) -> list[int]:
  """Where the float leaves, end to end, are cut into ``num_fragments`` ranges of about equal bytes.

  Returns the F + 1 boundaries as entry offsets into the concatenated leaves: cut k is the
  entry boundary nearest to k/F of the total bytes (the later one on a tie), moved only as
  far as it takes for every range to hold at least one entry. Exact integer arithmetic, in
  O(F x leaves).
  """
  entries, total = sum(sizes), sum(s * b for s, b in zip(sizes, itemsizes))
  cuts = [0]
  for k in range(1, num_fragments):
    target = Fraction(k * total, num_fragments)
    start_bytes = start_entry = 0
    for size, itemsize in zip(sizes, itemsizes):
      if size and start_bytes + size * itemsize >= target:  # the leaf the target falls in
        nearest = start_entry + math.floor((target - start_bytes) / itemsize + Fraction(1, 2))
        break
      start_bytes, start_entry = start_bytes + size * itemsize, start_entry + size
    else:
      nearest = entries
    cuts.append(min(max(nearest, cuts[-1] + 1), entries - (num_fragments - k)))
  return cuts + [entries]


@functools.lru_cache(maxsize=64)
def fragment_plan(shapes: tuple[tuple[int, ...], ...], itemsizes: tuple[int, ...], num_fragments: int,
                  split: str) -> tuple[tuple[Piece, ...], ...]:
  """The pieces of each fragment, for float leaves of one node's ``shapes`` (see the module docstring)."""
  sizes = [math.prod(s) for s in shapes]
  if split == "layers":
    return tuple(tuple(Piece(i, 0, sizes[i], sizes[i]) for i in group) for group in layer_fragments(sizes, num_fragments))
  cuts, starts = balanced_cuts(sizes, itemsizes, num_fragments), np.cumsum([0] + sizes)
  plan = []
  for lo, hi in zip(cuts[:-1], cuts[1:]):
    plan.append(tuple(Piece(i, int(max(lo, start) - start), int(min(hi, start + size) - start), size)
                      for i, (start, size) in enumerate(zip(starts, sizes))
                      if max(lo, start) < min(hi, start + size) or (size == 0 and lo <= start < hi)))
  return tuple(plan)


def check_fragments(leaves: list[Any], num_fragments: int, split: str, name: str) -> tuple[tuple[Piece, ...], ...]:
  """The fragments of the float ``leaves`` (node-stacked, or one node's inside ``gj.nodes``)."""
  first = 0 if mapping() is not None else 1
  shapes = tuple(tuple(jnp.shape(x)[first:]) for x in leaves)
  if split == "layers" and len(leaves) < num_fragments:
    raise ValueError(f"{name}: num_fragments={num_fragments} needs at least as many float leaves, but the params "
                     f"have {len(leaves)} (fragment_split='balanced' cuts leaves)")
  entries = sum(math.prod(s) for s in shapes)
  if entries < num_fragments:
    raise ValueError(f"{name}: num_fragments={num_fragments} needs at least as many float entries a node, but the "
                     f"params have {entries}")
  return fragment_plan(shapes, tuple(jnp.dtype(x.dtype).itemsize for x in leaves), num_fragments, split)


def _explicit_sharding(x: Any) -> NamedSharding | None:
  """``x``'s sharding (its type under a trace) where its mesh has Explicit axes, else ``None``."""
  sharding = jax.typeof(x).sharding if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding) and jax.sharding.AxisType.Explicit in sharding.mesh.axis_types:
    return sharding
  return None


def _rows(x: Any, keep: int) -> Any:
  """``x`` reshaped to ``x.shape[:keep] + (-1,)``, on an Explicit mesh the merged axis whole on each device.

  JAX asks a reshape for its result's layout where the merged axes are split (a leaf laid out
  ``P("nodes", None, "model")``), and a slice of a split merged axis would ask again; the kept
  (node) axes keep theirs.
  """
  shape = tuple(jnp.shape(x)[:keep]) + (-1,)
  sharding = _explicit_sharding(x)
  if sharding is None:
    return jnp.reshape(x, shape)
  spec = tuple(sharding.spec) + (None,) * keep
  return jnp.reshape(x, shape, out_sharding=NamedSharding(sharding.mesh, P(*spec[:keep])))


def _reshaped_as(x: Any, like: Any) -> Any:
  """``x`` reshaped to ``like``'s shape, on an Explicit mesh laid out as ``like`` is (`_rows` undone)."""
  sharding = _explicit_sharding(like)
  if sharding is None or _explicit_sharding(x) is None:
    return jnp.reshape(x, jnp.shape(like))
  return jnp.reshape(x, jnp.shape(like), out_sharding=sharding)


def take(x: Any, piece: Piece) -> Any:
  """The piece of leaf ``x`` (node-stacked: every node's piece)."""
  if piece.whole:
    return x
  return _rows(x, 0 if mapping() is not None else 1)[..., piece.start:piece.stop]


def split_leaves(plan: tuple[tuple[Piece, ...], ...], leaves: list[Any]) -> list[list[Any]]:
  """Each fragment's pieces of ``leaves``."""
  return [[take(leaves[piece.leaf], piece) for piece in fragment] for fragment in plan]


def join_leaves(plan: tuple[tuple[Piece, ...], ...], parts: list[list[Any]], like: list[Any]) -> list[Any]:
  """The leaves (shaped as ``like``) from each fragment's pieces: `split_leaves` undone."""
  pieces: list[list[Any]] = [[] for _ in like]
  for fragment, values in zip(plan, parts):
    for piece, value in zip(fragment, values):
      pieces[piece.leaf].append(value)
  return [own[0] if len(own) == 1 and own[0].shape == jnp.shape(x) else
          _reshaped_as(jnp.concatenate(own, axis=-1), x) for own, x in zip(pieces, like)]
