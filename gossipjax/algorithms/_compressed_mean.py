"""The mean over the nodes of their compressed messages, moved in compact form, with error feedback.

What compressed DiLoCo and Streaming DiLoCo send instead of an all-reduce of dense values:
each node's pseudo-gradient plus residual, compressed with the node's key; then either a
quantized all-reduce (a reduce-scatter of compressed pieces and an all-gather of their
compressed means) or an all-gather of every node's compact message. Only the compact form
crosses devices or ranks.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from gossipjax._axis import mapping
from gossipjax.algorithms._participation import Participation, select_nodes
from gossipjax.compress import Compressor
from gossipjax.mixing import Backend, follow_placement
from gossipjax.mixing._collectives import gathered_nodes, node_all_to_all, node_gather
from gossipjax.mixing._contract import accumulation_dtype
from gossipjax.mixing._stacked_adapter import on_nodes

MEAN_FORMS = ("reduce_scatter", "all_gather")


def check_mean_form(compressed_mean: str, name: str) -> str:
  if compressed_mean not in MEAN_FORMS:
    raise ValueError(f"{name}: compressed_mean must be 'reduce_scatter' or 'all_gather', got {compressed_mean!r}")
  return compressed_mean


def check_compressor(compressor: Any, name: str, example: str) -> None:
  if compressor is not None and not isinstance(compressor, Compressor):
    raise TypeError(f"{name}: compressor must be a gj.compress compressor (e.g. {example}) or None, "
                    f"got {type(compressor).__name__} {compressor!r}")


class Compressed(NamedTuple):
  """Each node's compressed message (see `compress_with_feedback`).

  Attributes:
    compact: what crosses the network: the compressor's parts, or ``(pieces, their keys)`` in
      the reduce-scatter form.
    decoded: what each node's message decodes to, shaped like what it compressed.
    chunks: the `_Chunks` that cut each node's vector in the reduce-scatter form, else ``None``.
    keys: each node's key for this exchange.
    one_node: one node's shapes and dtypes (``jax.ShapeDtypeStruct`` leaves).
    residual: each node's new error-feedback residual.
  """

  compact: Any
  decoded: Any
  chunks: Any
  keys: jax.Array
  one_node: Any
  residual: Any


def compress_with_feedback(c: Compressor, backend: Backend, name: str, pseudo_grads: Any, residual: Any,
                           node_keys: jax.Array, index: Any, *, error_feedback: bool, form: str | None,
                           takes_part: Participation | None = None) -> Compressed:
  r"""Each node's ``pseudo_grads`` plus ``residual``, compressed with ``fold_in(key_i, index)``.

  Error feedback (Seide et al. 2014; Karimireddy et al. 2019): node i sends
  :math:`q_i = C(\Delta_i + e_i)` and keeps :math:`e_i \leftarrow \Delta_i + e_i - q_i`.
  With ``takes_part`` the nodes outside it send zeros and keep their residuals.
  ``form="reduce_scatter"`` cuts each node's vector into one piece per node first.
  """
  sent = jax.tree.map(lambda g, e: g + e, pseudo_grads, residual) if error_feedback else pseudo_grads
  if takes_part is not None:
    sent = takes_part.zero_others(sent)
  keys = jnp.vectorize(lambda k: jax.random.fold_in(k, index), signature="(k)->(k)")(node_keys)
  first = 0 if mapping() is not None else 1  # one node's shape: without the stacked node axis
  one_node = jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape[first:]), jnp.dtype(x.dtype)), sent)
  compact, decoded, chunks = compress_nodes(c, backend, name, sent, keys, one_node, form)
  new_residual = jax.tree.map(lambda v, d: v - d, sent, decoded) if error_feedback else residual
  if takes_part is not None and error_feedback:
    new_residual = select_nodes(takes_part.mask, new_residual, residual)
  return Compressed(compact, decoded, chunks, keys, one_node, new_residual)


def mean_of_compressed(c: Compressor, backend: Backend, name: str, sent: Compressed,
                       takes_part: Participation | None = None) -> Any:
  """The mean of the decoded messages, on every node (over the participants with ``takes_part``)."""
  mean = compact_mean(c, backend, name, sent.compact, sent.keys, sent.one_node, sent.chunks)
  if mapping() is None:
    mean = follow_placement(jax.tree.map(lambda m, x: jnp.broadcast_to(m, x.shape), mean, sent.decoded),
                            sent.decoded)
  return mean if takes_part is None else takes_part.divide(mean)


def compress_nodes(c: Compressor, backend: Any, name: str, sent: Any, keys: jax.Array, one_node: Any,
                   form: str | None) -> tuple[Any, Any, Any]:
  """Each node's ``sent`` compressed with its key: ``(compact, decoded, chunks)``.

  With ``form="reduce_scatter"`` each node's vector is cut into one piece per node first,
  and ``compact`` is ``(pieces, their keys)`` with ``chunks`` the `_Chunks` that cut them;
  otherwise ``compact`` is the compressor's parts and ``chunks`` is ``None``.
  """
  node_map = lambda fn: on_nodes(fn, backend)
  if form == "reduce_scatter":
    current = mapping()
    local = current.num_nodes if current is not None else jax.tree.leaves(sent)[0].shape[0]
    chunks = _Chunks(one_node, gathered_nodes(backend, local, name))
    compact, chunk_keys, q = node_map(lambda x, k: chunks.encode(c, x, k))(sent, keys)
    return (compact, chunk_keys), q, chunks
  compact = node_map(c.encode)(sent, keys)
  return compact, node_map(lambda parts, k: c.decode(parts, k, one_node))(compact, keys), None


def compact_mean(c: Compressor, backend: Any, name: str, compact: Any, keys: jax.Array, one_node: Any,
                 chunks: Any = None) -> Any:
  """The mean over the nodes of their compact messages (`compress_nodes`' ``compact`` and ``chunks``), one node's shape.

  With ``chunks`` (the reduce-scatter form), node j receives every node's piece j (an
  all-to-all), averages the decoded pieces and compresses the mean again, and the
  compressed means are all-gathered; otherwise every node's compact message is all-gathered
  and every node decodes all n and averages, the exact mean of the decoded messages.
  """
  node_map = lambda fn: on_nodes(fn, backend)
  first = 0 if mapping() is not None else 1  # one node's shape: without the stacked node axis
  if chunks is not None:
    compact, chunk_keys = compact
    like_piece = chunks.piece
    reads_key = c.decode_reads_key
    received = node_all_to_all(backend, (compact, chunk_keys) if reads_key else compact, name)
    their, their_keys = received if reads_key else (received, chunk_keys)
    reduced, reduced_keys = node_map(lambda r, rk, k: chunks.reduce(c, r, rk, k))(their, their_keys, keys)
    if reads_key:
      pieces, piece_keys = node_gather(backend, (reduced, reduced_keys), name)
    else:
      pieces = node_gather(backend, reduced, name)
      piece_keys = jnp.zeros((chunks.n, 2), jnp.uint32)
    return chunks.join(jax.vmap(lambda p, k: c.decode(p, k, like_piece))(pieces, piece_keys))
  reads_key = c.decode_reads_key
  return _gathered_mean(c, backend, name, compact, keys, one_node, first, reads_key)


def _gathered_mean(c: Compressor, backend: Backend, name: str, compact: Any, keys: jax.Array, like: Any, first: int,
                   reads_key: bool) -> Any:
  """The mean over all nodes of the decoded ``compact`` messages: an all-gather, then every node decodes all n.

  The keys travel only where decoding reads them (a random index set does, a scale does not).
  """
  if reads_key:
    their_parts, their_keys = node_gather(backend, (compact, keys), name)
  else:
    their_parts, their_keys = node_gather(backend, compact, name), None
  count = jax.tree.leaves(their_parts)[0].shape[0]
  key_like = jnp.zeros(jnp.shape(keys)[first:], jnp.asarray(keys).dtype)

  def add(total, item):
    decoded = c.decode(item[0], item[1] if their_keys is not None else key_like, like)
    return jax.tree.map(lambda t, v: t + v.astype(t.dtype) / count, total, decoded), None

  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, accumulation_dtype(s.dtype)), like)
  items = (their_parts, their_keys if their_keys is not None else jnp.zeros((count,), jnp.int32))
  return jax.tree.map(lambda t, s: t.astype(s.dtype), lax.scan(add, zeros, items)[0], like)


class _Chunks:
  """One node's pytree as ``n`` equal pieces of one flat vector, the pieces of a reduce-scatter.

  The leaves are concatenated in the widest float dtype among them and zero-padded to a
  multiple of ``n``; piece k goes to node k.
  """

  def __init__(self, like: Any, n: int):
    self.like, self.n = like, n
    self.leaves, self.treedef = jax.tree.flatten(like)
    self.dtype = jnp.result_type(*[x.dtype for x in self.leaves])
    self.size = sum(math.prod(x.shape) for x in self.leaves)
    self.width = -(-self.size // n)
    self.piece = jax.ShapeDtypeStruct((self.width,), self.dtype)

  def split(self, tree: Any) -> jax.Array:
    flat = jnp.concatenate([x.astype(self.dtype).ravel() for x in jax.tree.leaves(tree)])
    return jnp.pad(flat, (0, self.n * self.width - self.size)).reshape(self.n, self.width)

  def join(self, pieces: jax.Array) -> Any:
    flat, out, start = pieces.reshape(-1)[:self.size], [], 0
    for x in self.leaves:
      size = math.prod(x.shape)
      out.append(flat[start:start + size].reshape(x.shape).astype(x.dtype))
      start += size
    return jax.tree.unflatten(self.treedef, out)

  def encode(self, c: Compressor, tree: Any, key: jax.Array) -> tuple[Any, jax.Array, Any]:
    """One node's pieces compressed (piece k with ``fold_in(key, k)``), their keys, and what they decode to."""
    keys = jax.vmap(lambda k: jax.random.fold_in(key, k))(jnp.arange(self.n))
    compact = jax.vmap(c.encode)(self.split(tree), keys)
    decoded = jax.vmap(lambda p, k: c.decode(p, k, self.piece))(compact, keys)
    return compact, keys, self.join(decoded)

  def reduce(self, c: Compressor, received: Any, keys: jax.Array, key: jax.Array) -> tuple[Any, jax.Array]:
    """The mean of the n received pieces, compressed again with ``fold_in(key, n)``."""
    decoded = jax.vmap(lambda p, k: c.decode(p, k, self.piece))(received, keys)
    wide = accumulation_dtype(self.dtype)
    mean = jnp.sum(decoded.astype(wide) / self.n, axis=0).astype(self.dtype)
    key = jax.random.fold_in(key, self.n)
    return c.encode(mean, key), key

