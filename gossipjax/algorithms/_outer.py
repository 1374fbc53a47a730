"""Local training with an outer optimizer: DiLoCo, NoLoCo and their gossip form."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.core  # jax.core.Tracer: a type checker sees the submodule only where it is imported
import jax.numpy as jnp
from jax.extend.core import Var
import numpy as np
import optax
from jax import lax
from jax.typing import DTypeLike

from gossipjax._guard import SkipNodes, zero_skipped
from gossipjax._mapping import per_node
from gossipjax._validation import (FLOAT32_MAX, check_in_range, check_learning_rate, check_node_axis, check_period,
                                   require_params)
from gossipjax.algorithms._choco import _DecodeReceived, _raw_key
from gossipjax.algorithms._common import check_state_dtype, copy_of
from gossipjax.mixing import Backend, Wire, float_leaves_only, follow_placement, make_mixer, resolve_backend
from gossipjax.mixing._named import gathered_nodes, node_all_to_all, node_average, node_fractions, node_gather, node_index, node_shape, on_nodes, varies_over_nodes
from gossipjax._axis import mapping
from gossipjax.compress import Compressor
from gossipjax.compress._base import leaf_keys
from gossipjax.topology import as_topology
from gossipjax.mixing._contract import accumulation_dtype, next_count


class OuterState(NamedTuple):
  """State of `outer_optimizer`, `diloco` and `noloco`.

  Attributes:
    count: int32 scalar, the number of inner steps taken; the outer step ends the steps with
      ``count % inner_steps == inner_steps - 1``.
    anchor: the outer params ``phi``: each node's params at the start of its round, shaped
      like the params (leading node axis).
    inner_state: the inner transform's state, one per node (leading node axis on every leaf).
    outer_state: the outer transform's state, one per node (leading node axis on every leaf).
    residual: with a ``compressor``, each node's error-feedback residual: what its
      compressed pseudo-gradients have not sent yet, shaped like the anchor; else ``None``.
    key: with a ``compressor``, (nodes, 2) uint32, one PRNG key per node; node i compresses
      outer round r with ``fold_in(key_i, r)``; else ``None``.
    outer_steps: int32 scalar, the outer steps taken so far (rounds in which some node took
      part).
    synced: int32 (nodes,), for each node the ``outer_steps`` whose result its anchor holds;
      a node with ``synced < outer_steps`` missed an outer step and rejoins at the next one.
  """

  count: jax.Array
  anchor: Any
  inner_state: Any
  outer_state: Any
  residual: Any = None
  key: Any = None
  outer_steps: Any = None
  synced: Any = None

  zeroes_skipped_nodes = True  # tells gj.guard_finite that a skipping node's update is zeroed before it is combined


def _decoding_reads_key(c: Compressor, compact: Any, key: Any, like: Any) -> bool:
  """Whether decoding one node's ``compact`` tree reads the sender's key (a random index set does, a scale does not)."""
  leaf_key = jax.eval_shape(lambda k: leaf_keys(k, 1)[0], key)
  leaves, treedef = jax.tree.flatten(like)
  return any(_reads_second(lambda p, k, x=x: c.decode_leaf(p, k, x.shape, x.dtype), parts, leaf_key)
             for parts, x in zip(treedef.flatten_up_to(compact), leaves))


def _reads_second(fn: Any, first: Any, second: Any) -> bool:
  """Whether ``fn(first, second)`` reads its second argument (traced abstractly, on shapes)."""
  jaxpr = jax.make_jaxpr(fn)(first, second).jaxpr
  wanted = set(jaxpr.invars[len(jax.tree.leaves(first)):])
  used = {v for eqn in jaxpr.eqns for v in eqn.invars if isinstance(v, Var)}
  used |= {v for v in jaxpr.outvars if isinstance(v, Var)}
  return bool(wanted & used)



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
  key_like = jax.ShapeDtypeStruct((2,), jnp.uint32)
  if chunks is not None:
    compact, chunk_keys = compact
    like_piece = chunks.piece
    reads_key = _decoding_reads_key(c, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[first + 1:], x.dtype),
                                                    compact), key_like, like_piece)
    received = node_all_to_all(backend, (compact, chunk_keys) if reads_key else compact, name)
    their, their_keys = received if reads_key else (received, chunk_keys)
    reduced, reduced_keys = node_map(lambda r, rk, k: chunks.reduce(c, r, rk, k))(their, their_keys, keys)
    if reads_key:
      pieces, piece_keys = node_gather(backend, (reduced, reduced_keys), name)
    else:
      pieces = node_gather(backend, reduced, name)
      piece_keys = jnp.zeros((chunks.n, 2), jnp.uint32)
    return chunks.join(jax.vmap(lambda p, k: c.decode(p, k, like_piece))(pieces, piece_keys))
  reads_key = _decoding_reads_key(c, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[first:], x.dtype), compact),
                                  key_like, one_node)
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


def _node_mask(up: Any, params: Any, name: str) -> jax.Array:
  """``up`` as a bool per node, checked against the node axis of ``params``."""
  mask = jnp.asarray(up)
  want = node_shape(params)
  if mask.dtype != jnp.bool_ or mask.shape != want:
    raise ValueError(f"{name}: up must be a bool array with one entry per node, of shape {want}, got "
                     f"{mask.dtype} of shape {mask.shape}")
  return mask


def _per_node_leaf(x: Any, n: int) -> bool:
  return (isinstance(x, jax.Array) and x.ndim >= 1 and x.shape[0] == n
          and not jnp.issubdtype(x.dtype, jax.dtypes.prng_key))


def select_nodes(mask: jax.Array, new: Any, old: Any, own: list[bool] | None = None) -> Any:
  """Per node, ``new`` where ``mask`` holds and ``old`` elsewhere.

  On stacked trees the leaves without the node axis (what every node shares) are taken from
  ``new``. For one node (inside ``gj.nodes``) ``own`` says which leaves differ per node (the
  others are taken from ``new``); ``None`` selects every leaf.
  """
  leaves, treedef = jax.tree.flatten(new)
  olds = treedef.flatten_up_to(old)
  if mapping() is not None:
    own = [True] * len(leaves) if own is None else own
    return jax.tree.unflatten(treedef, [jnp.where(mask, a, b) if f else a for a, b, f in zip(leaves, olds, own)])
  n = mask.shape[0]
  pick = lambda a, b: jnp.where(mask.reshape((n,) + (1,) * (a.ndim - 1)), a, b) if _per_node_leaf(a, n) else a
  return jax.tree.unflatten(treedef, [pick(a, b) for a, b in zip(leaves, olds)])


class _Participation:
  """The nodes that take part in an outer step, and the means and mixes over them.

  ``mask`` is a bool per node and ``frac`` the fraction of all nodes it holds for (shared).
  """

  def __init__(self, mask: jax.Array, frac: jax.Array, backend: Backend, name: str):
    self.mask, self.frac, self.backend, self.name = mask, frac, backend, name

  def zero_others(self, tree: Any) -> Any:
    return select_nodes(self.mask, tree, jax.tree.map(jnp.zeros_like, tree))

  def divide(self, total: Any) -> Any:
    """A mean over all nodes of values zero outside the participants, as their mean (zero if there are none)."""
    frac = jnp.where(self.frac > 0, self.frac, 1)
    return jax.tree.map(lambda t: (t.astype(frac.dtype) / frac).astype(t.dtype), total)

  def mean(self, tree: Any, own: list[bool] | None = None) -> Any:
    """The participants' mean of each leaf that differs per node (``own`` for one node; ``None``: all)."""
    leaves, treedef = jax.tree.flatten(tree)
    if mapping() is not None:
      own = [True] * len(leaves) if own is None else own
    else:
      own = [_per_node_leaf(x, self.mask.shape[0]) for x in leaves]
    picked = [x for x, f in zip(leaves, own) if f]
    as_float = [x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(self.frac.dtype) for x in picked]
    means = self.divide(node_average(self.backend, self.zero_others(as_float), self.name))
    means = iter([m if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.round(m).astype(x.dtype)
                  for m, x in zip(means, picked)])
    return jax.tree.unflatten(treedef, [next(means) if f else x for x, f in zip(leaves, own)])

  def fill_self(self, mixed: Any, own: Any, mixer: Any, step: Any) -> Any:
    """A gossip round among the participants: ``mixed`` (of the zeroed others) plus the weight they left to ``own``."""
    weight = mixer.mix(self.mask.astype(self.frac.dtype), step)
    kept = 1 - weight
    if mapping() is None:
      per_node = lambda x: kept.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype)
    else:
      per_node = lambda x: kept.astype(x.dtype)
    return jax.tree.map(lambda m, x: m + per_node(x) * x, mixed, own)


def _check_outer_rates(learning_rate: Any, momentum: Any, name: str) -> None:
  """The outer learning rate: a number in [0, float32's largest] or a schedule of one number per round; momentum in [0, 1).

  A rate past float32's range (1e300) becomes inf in float32 params, every outer step would
  then be non-finite (and skipped under ``gj.guard_finite``): refused here, as is a schedule
  that returns an array (a per-coordinate rate).
  """
  check_learning_rate(learning_rate, name, "outer_learning_rate", high=FLOAT32_MAX)
  check_in_range(momentum, name, "outer_momentum", 0.0, 1.0)
  if not isinstance(momentum, jax.core.Tracer) and float(momentum) == 1.0:
    raise ValueError(f"{name}: outer_momentum must be in [0, 1), got {momentum!r}")


def _check_transform(tx: Any, name: str, arg: str, example: str) -> None:
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(f"{name}: {arg} must be an optax transform (an optax.GradientTransformation such as "
                    f"{example}), got {type(tx).__name__} {tx!r}")


def outer_optimizer(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    *,
    inner_steps: int,
    topology: Any = None,
    backend: Backend | None = None,
    state_dtype: DTypeLike | None = None,
    compressor: Compressor | None = None,
    error_feedback: bool = True,
    key: jax.Array | int = 0,
    compressed_mean: str = "reduce_scatter",
) -> optax.GradientTransformationExtraArgs:
  r"""Local training with an outer optimizer: ``inner_steps`` local steps, then one combined outer step.

  Every node runs ``inner`` on its own for H = ``inner_steps`` steps from its outer params
  :math:`\phi_i`, reaching :math:`\theta_i`. The end of the round is the only communication:
  the end-of-round models are combined, by the global average (an all-reduce) or by one
  gossip round over ``topology``, and every node takes one step of ``outer`` on its
  pseudo-gradient against the combined model:

  .. math::
    g_i = \phi_i - (C\theta)_i, \qquad \phi_i \leftarrow \phi_i + \mathrm{outer}(g_i),
    \qquad \theta_i \leftarrow \phi_i,

  with :math:`C = \frac1n \mathbf{1}\mathbf{1}^\top` without a topology and :math:`C = W(r)`
  in outer round r with one. Where every node holds the same :math:`\phi` (the average, from
  a common start) :math:`g = \frac1n\sum_j (\phi - \theta_j)`, the averaged pseudo-gradient of
  DiLoCo; over a pairing with heavy-ball SGD as ``outer`` it is NoLoCo (see `diloco`,
  `noloco`). Since :math:`g_i = (W\Delta)_i + (\phi_i - (W\phi)_i)` with
  :math:`\Delta = \phi - \theta`, the gossip form adds to the mixed pseudo-gradient a pull of
  :math:`\phi_i` towards its neighbours' outer params, so the nodes stay close without an
  all-reduce. Each exchange carries one model per node.

  ``inner`` and ``outer`` are any optax transforms, run per node (`gj.per_node`): a node's
  inner steps never communicate, and a whole-tree transform (``clip_by_global_norm``) sees one
  node. The inner state persists across rounds, as in DiLoCo.

  **Partial participation.** ``update`` takes ``up`` (bool, one per node; what
  `gj.asynchrony.synchronous` passes under faults): a node that is down neither computes nor
  changes (its params and its inner state's own leaves are kept; step counts every node
  shares advance). An outer step is taken over the nodes that take part, the live ones:

  * without a topology (DiLoCo), the mean is over the participants, as torchft's quorum
    takes it: :math:`\frac{1}{|P|}\sum_{j \in P}\theta_j`. Only a node that holds the last
    outer result takes part; a live node that missed an outer step (down at it, or skipped
    by ``gj.guard_finite``) rejoins: it takes the participants' outer params and outer
    state, then steps with them, so every live node leaves the step with one model. Where
    no live node holds the last result (all were held back alike), every live node takes
    part. The rejoin costs one more all-reduce of the outer params and state, in the rounds
    that have one (`gj.bytes_per_step` does not count it);
  * over a topology (NoLoCo, gossip), a participant averages with the participants among
    its neighbours and keeps the weight of the others: :math:`\sum_j w_{ij} p_j\theta_j +
    (1 - \sum_j w_{ij} p_j)\theta_i`; a node that does not take part keeps its params and
    state, and takes part again at the next outer step it is live for.

  A round in which no node takes part changes no outer params. Under ``gj.guard_finite`` a
  node whose gradient is not finite at the last inner step of a round skips that step and
  is not averaged in: it missed the outer step (its state is held back by the guard) and
  rejoins as above. With a ``compressor`` only the participants send; the others keep
  their residuals.

  With a ``compressor`` the exchange carries each node's compressed pseudo-gradient instead
  of its model, with error feedback (Seide et al. 2014; Karimireddy et al. 2019): node i
  sends :math:`q_i = C(\Delta_i + e_i)`, :math:`\Delta_i = \phi_i - \theta_i`, keeps
  :math:`e_i \leftarrow \Delta_i + e_i - q_i` (in ``OuterState.residual``), and steps along
  the mean :math:`\frac1n \sum_j q_j` (without a topology) or the mix :math:`(Wq)_i` (with
  one) of the decoded messages. The mean equals the uncompressed pseudo-gradient where
  every node holds the same :math:`\phi` (DiLoCo); in the gossip form the messages carry no
  :math:`\phi_j`, so the pull towards the neighbours' outer params is not part of the step:
  nodes paired in a round take the same step, and outer params that differ stay apart.
  A gossip round sends the compact form (``compressor.bits``, e.g. a quarter of float32
  for 8-bit ``qsgd``) to each neighbour. The mean travels compact in one of two forms
  (``compressed_mean``):

  * ``"reduce_scatter"`` (the default; a quantized all-reduce, as torchft's): each node's
    vector (its leaves end to end, zero-padded) is cut into n pieces, each compressed on
    its own with error feedback; node j receives every node's piece j (an all-to-all),
    averages the decoded pieces, compresses that mean again and sends it to all (an
    all-gather). Each node sends ``2 (n - 1) / n`` of its compact size, the ring
    all-reduce's count on the compact form; the second compression is not fed back.
  * ``"all_gather"``: every node's whole compact message goes to the ``n - 1`` others,
    which decode all n and average: the exact mean of the decoded messages, for
    ``(n - 1)`` compact messages a node.

  A message carries its 8-byte key where decoding reads it (``random_k``'s indices).
  ``gj.bytes_per_step`` counts these bytes; on the sharded backend with one node per device
  the compiled step's all-to-alls and all-gathers move exactly them (with several, the
  pieces between nodes of one device stay on it).

  Args:
    inner: the local optimizer, e.g. ``optax.adamw(4e-4, weight_decay=0.1)``.
    outer: the outer optimizer on the pseudo-gradients, e.g.
      ``optax.sgd(0.7, momentum=0.9, nesterov=True)``; ``optax.sgd(1.0)`` replaces each node's
      model by the combined one (periodic averaging, or local SGD with gossip).
    inner_steps: H, the local steps per round (at least 1).
    topology: ``None`` for the global average (an all-reduce), or a doubly stochastic
      topology for one gossip round; W advances one step of its period per outer round.
    backend: where the nodes live (default: simulate); provides the all-reduce, the mixer
      and the per-node map.
    state_dtype: the dtype of the outer params ``phi`` (the anchor) and of ``outer``'s
      state, which the pseudo-gradients and the outer step are computed in, e.g.
      ``jnp.float32`` for bfloat16 params; ``None`` keeps the params'. ``inner``'s state
      follows ``inner`` (e.g. ``optax.adamw(..., mu_dtype=jnp.float32)``). The updates are in
      the params' dtype.
    compressor: ``None`` (the models travel densely) or a ``gj.compress`` compressor for the
      pseudo-gradients, e.g. ``gj.compress.top_k(0.1)`` or ``gj.compress.qsgd(127)`` (8 bits).
    error_feedback: with a ``compressor``, carry what it did not send into the next round.
    key: with a random ``compressor``, the PRNG key (``jax.random.key(0)``, a raw key or an
      int seed); node i draws round r from ``fold_in(fold_in(key, i), r)``.
    compressed_mean: with a ``compressor`` and no topology, how the compact messages are
      averaged: ``"reduce_scatter"`` (compressed pieces, ``2 (n - 1) / n`` of a message a
      node) or ``"all_gather"`` (the exact mean of the decoded messages, ``n - 1``
      messages a node); see above.

  Returns:
    An optax transform over node-stacked params (its ``update`` needs ``params`` and takes
    ``up``, see above) whose state is an `OuterState`; non-float leaves are left alone.

  Raises:
    TypeError: ``inner`` or ``outer`` is not an optax transform, or ``compressor`` is not a
      compressor; at ``init``, ``inner``'s or ``outer``'s state cannot be stacked per node.
    ValueError: ``inner_steps`` is not a positive integer, or the topology is not doubly
      stochastic and connected; at ``update``, ``up`` is not a bool per node.

  Example:
    With ``optax.sgd(1.0)`` as the outer step, a round ends in the average of the nodes'
    models (periodic averaging); here two nodes at 0 and 4 take two local steps towards
    their own targets 1 and 3, then average:

    >>> import jax.numpy as jnp, optax, gossipjax as gj
    >>> tx = gj.outer_optimizer(optax.sgd(0.5), optax.sgd(1.0), inner_steps=2)
    >>> x = jnp.array([[0.0], [4.0]])
    >>> state = tx.init(x)
    >>> for _ in range(2):
    ...   u, state = tx.update(x - jnp.array([[1.0], [3.0]]), state, x)
    ...   x = x + u
    ...   print(x.ravel().tolist())
    [0.5, 3.5]
    [2.0, 2.0]

    The same round with the pseudo-gradients sparsified to their largest entry; the rest
    waits in the residual for the next round:

    >>> tx = gj.outer_optimizer(optax.sgd(0.5), optax.sgd(1.0), inner_steps=1, compressor=gj.compress.top_k(0.5),
    ...                         compressed_mean="all_gather")
    >>> x = jnp.zeros((2, 2))
    >>> u, state = tx.update(x - jnp.array([[1.0, 2.0], [4.0, 3.0]]), tx.init(x), x)
    >>> (x + u)[0].tolist(), state.residual.tolist()  # node 0 sent its -1, node 1 its -2
    ([1.0, 0.5], [[-0.5, 0.0], [0.0, -1.5]])

  References:
    Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen (2023), DiLoCo:
    Distributed Low-Communication Training of Language Models, arXiv:2311.08105.

    Kolehmainen, Blagoev, Donaghy, Ersoy, Nies (2025), NoLoCo: No-all-reduce Low
    Communication Training Method for Large Models, arXiv:2506.10911.

    Seide, Fu, Droppo, Li, Yu (2014), 1-Bit Stochastic Gradient Descent and its Application
    to Data-Parallel Distributed Training of Speech DNNs, Interspeech.

    Karimireddy, Rebjock, Stich, Jaggi (2019), Error Feedback Fixes SignSGD and other
    Gradient Compression Schemes, ICML.
  """
  return _outer_optimizer(inner, outer, inner_steps, topology, backend, "gj.outer_optimizer", state_dtype,
                          compressor, error_feedback, key, compressed_mean)


def _outer_optimizer(inner: optax.GradientTransformation, outer: optax.GradientTransformation, inner_steps: int,
                     topology: Any, backend: Backend | None, name: str,
                     state_dtype: DTypeLike | None = None, compressor: Compressor | None = None,
                     error_feedback: bool = True, key: Any = 0,
                     compressed_mean: str = "reduce_scatter") -> optax.GradientTransformationExtraArgs:
  """`outer_optimizer`, with ``name`` (the public function called) in its error messages."""
  if compressed_mean not in ("reduce_scatter", "all_gather"):
    raise ValueError(f"{name}: compressed_mean must be 'reduce_scatter' or 'all_gather', got {compressed_mean!r}")
  mean_form = compressed_mean
  if compressor is not None and not isinstance(compressor, Compressor):
    raise TypeError(f"{name}: compressor must be a gj.compress compressor (e.g. gj.compress.top_k(0.1)) or None, "
                    f"got {type(compressor).__name__} {compressor!r}")
  with jax.ensure_compile_time_eval():  # concrete even when built inside a trace (optax.inject_hyperparams)
    base_key = _raw_key(key, name)
  _check_transform(inner, name, "inner", "optax.adamw(4e-4)")
  _check_transform(outer, name, "outer", "optax.sgd(0.7, momentum=0.9, nesterov=True)")
  period = check_period(inner_steps, name, "inner_steps")
  state_dtype = check_state_dtype(state_dtype, name)
  backend = resolve_backend(backend)
  mixer = None if topology is None else make_mixer(topology, backend, name=name)
  inner_pn, outer_pn = per_node(inner, backend=backend), per_node(outer, backend=backend)

  def stacked_init(tx, params, arg):
    try:
      return tx.init(params)
    except TypeError as e:
      raise TypeError(f"{name}: the state of {arg} cannot be stacked per node ({e}); every node runs its own "
                      f"{arg}, so its state must be a pytree of arrays") from e

  def first_node(local):
    if mixer is not None:
      return mixer.first_node()
    first_of_block = getattr(backend, "first_of_block", None)  # where the ranks or devices split the nodes
    return 0 if first_of_block is None else first_of_block(local)

  def init_fn(params):
    anchor = copy_of(params, state_dtype)
    shape = node_shape(params)
    current = mapping()
    local = shape[0] if shape else (current.num_nodes if current is not None else 1)
    index = node_index(first_node(local), shape[0] if shape else 1)
    state = OuterState(
        count=jnp.zeros([], jnp.int32),
        anchor=anchor,
        inner_state=stacked_init(inner_pn, params, "inner"),
        outer_state=stacked_init(outer_pn, anchor, "outer"),
        outer_steps=jnp.zeros([], jnp.int32),
        # One count per node (the product keeps it per node inside gj.nodes).
        synced=follow_placement((0 * index).astype(jnp.int32), params),
    )
    if compressor is None:
      return state
    keys = jnp.vectorize(lambda i: jax.random.fold_in(base_key, i), signature="()->(k)")(index)
    return state._replace(residual=optax.tree.zeros_like(anchor), key=follow_placement(keys, params))

  def compressed(pseudo_grads, residual, node_keys, outer_round, takes_part=None):
    """Each node's pseudo-gradient plus residual, compressed; their mean or mix; the new residuals.

    With ``takes_part`` (a `_Participation`), the nodes outside it send nothing and keep their
    residuals; the mean is over the participants, and in the mix a participant keeps for
    itself the weight of the neighbours that do not take part.
    """
    c = compressor
    assert c is not None
    sent = jax.tree.map(lambda g, e: g + e, pseudo_grads, residual) if error_feedback else pseudo_grads
    if takes_part is not None:
      sent = takes_part.zero_others(sent)
    keys = jnp.vectorize(lambda k: jax.random.fold_in(k, outer_round), signature="(k)->(k)")(node_keys)
    treedef = jax.tree.structure(sent)
    first = 0 if mapping() is not None else 1  # one node's shape: without the stacked node axis
    like = tuple((tuple(x.shape[first:]), jnp.dtype(x.dtype)) for x in jax.tree.leaves(sent))
    one_node = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(*sd) for sd in like])
    compact, q, chunks = compress_nodes(c, backend, name, sent, keys, one_node,
                                        "reduce_scatter" if mixer is None and mean_form == "reduce_scatter" else None)
    new_residual = jax.tree.map(lambda v, d: v - d, sent, q) if error_feedback else residual
    if takes_part is not None:
      q = takes_part.zero_others(q)
      if error_feedback:
        new_residual = select_nodes(takes_part.mask, new_residual, residual)
    residual = new_residual
    if mixer is None:
      mean = compact_mean(c, backend, name, compact, keys, one_node, chunks)
      if mapping() is None:
        mean = follow_placement(jax.tree.map(lambda m, x: jnp.broadcast_to(m, x.shape), mean, q), q)
      return (mean if takes_part is None else takes_part.divide(mean)), residual
    decode = _DecodeReceived(c, tuple(np.asarray(base_key).tolist()), like)
    wire = Wire([tuple(c) for c in treedef.flatten_up_to(compact)], decode, outer_round)
    mixed = mixer.mix(q, outer_round, wire)
    return (mixed if takes_part is None else takes_part.fill_self(mixed, q, mixer, outer_round)), residual

  def combined(theta, outer_round):
    if mixer is None:
      return node_average(backend, theta, name)
    return mixer.mix(theta, outer_round)

  def update_fn(updates, state, params=None, skip_nodes: SkipNodes | None = None, up: Any = None, **extra_args):
    grads = updates  # optax's name for the incoming tree; these methods take gradients
    require_params(params, name)
    if mixer is not None:
      check_node_axis(params, mixer.local_nodes, name, mixer.topology.name)
    for fault_arg in ("loss_key", "loss_prob", "delivered"):  # gj.asynchrony.synchronous's, for gj.asynchrony.faulty_mix
      extra_args.pop(fault_arg, None)
    up = None if up is None else _node_mask(up, params, name)
    inner_updates, inner_state = inner_pn.update(grads, state.inner_state, params, **extra_args)
    inner_updates = jax.tree.map(lambda u, x: u.astype(x.dtype), inner_updates, params)
    in_mapping = mapping() is not None
    if up is not None:  # a node that is down neither computes nor changes
      own = varies_over_nodes(inner_state, unknown=True) if in_mapping else None
      inner_state = select_nodes(up, inner_state, state.inner_state, own)
      inner_updates = select_nodes(up, inner_updates, jax.tree.map(jnp.zeros_like, inner_updates))
    # A node that skips (gj.guard_finite) sends its current params and keeps them.
    inner_updates = zero_skipped(inner_updates, skip_nodes)
    outer_round = state.count // period
    # Which leaves of the outer state are one node's own (inside gj.nodes), read here: a cond's
    # branch is traced before it is mapped.
    own_outer = varies_over_nodes(state.outer_state, unknown=True) if in_mapping else None

    def outer_step(operands):
      inner_updates, anchor, outer_state, residual, outer_steps, synced = operands
      theta = jax.tree.map(lambda x, u: x + u, params, inner_updates)
      # Measured from where the round started, phi in the params' dtype: phi's extra digits
      # (state_dtype) are not fed back as a pseudo-gradient.
      start = jax.tree.map(lambda phi, x: phi.astype(x.dtype).astype(phi.dtype), anchor, params)
      if compressor is None:
        pseudo_grads = jax.tree.map(lambda phi, c: phi - c, start, combined(theta, outer_round))
      else:
        local = jax.tree.map(lambda phi, t: phi - t.astype(phi.dtype), start, theta)
        pseudo_grads, residual = compressed(local, residual, state.key, outer_round)
      steps, outer_state = outer_pn.update(pseudo_grads, outer_state, anchor)
      anchor = jax.tree.map(lambda phi, s: (phi + s).astype(phi.dtype), anchor, steps)
      updates = jax.tree.map(lambda phi, x: phi.astype(x.dtype) - x, anchor, params)
      return updates, anchor, outer_state, residual, outer_steps + 1, synced + 1

    def partial_step(operands):
      """The outer step over the nodes that take part; the others keep theirs, or rejoin from the result."""
      inner_updates, anchor, outer_state, residual, outer_steps, synced = operands
      ok = jnp.ones(node_shape(params), bool) if up is None else up
      if skip_nodes is not None:
        ok = ok & ~skip_nodes.mask
      dtype = jnp.result_type(jnp.float32, *[x.dtype for x in jax.tree.leaves(anchor)])
      theta = jax.tree.map(lambda x, u: x + u, params, inner_updates)
      start = jax.tree.map(lambda phi, x: phi.astype(x.dtype).astype(phi.dtype), anchor, params)
      if mixer is None:
        # DiLoCo's form: the nodes that hold the last result take part; one that missed an
        # outer step takes the participants' outer params and state, then steps with them.
        current = synced == outer_steps
        frac_current, frac_ok, frac_stale = node_fractions(
            backend, (ok & current, ok, ok & ~current), name, dtype)
        anyone_current = frac_current > 0
        mask = ok & (current | ~anyone_current)  # nobody current (all held back alike): every live node
        takes_part = _Participation(mask, jnp.where(anyone_current, frac_current, frac_ok), backend, name)

        own = None if own_outer is None else [True] * len(jax.tree.leaves(anchor)) + own_outer

        def rejoin(phi_and_state):
          return select_nodes(ok & ~mask, takes_part.mean(phi_and_state, own), phi_and_state, own)

        anchor, outer_state = lax.cond(anyone_current & (frac_stale > 0), rejoin, lambda x: x, (anchor, outer_state))
        start = jax.tree.map(lambda phi, x: phi.astype(x.dtype).astype(phi.dtype), anchor, params)
      else:
        (frac,) = node_fractions(backend, (ok,), name, dtype)
        mask = ok
        takes_part = _Participation(mask, frac, backend, name)
      if compressor is None:
        if mixer is None:
          combined_theta = takes_part.mean(theta)
        else:
          combined_theta = takes_part.fill_self(mixer.mix(takes_part.zero_others(theta), outer_round), theta,
                                                mixer, outer_round)
        pseudo_grads = jax.tree.map(lambda phi, c: phi - c.astype(phi.dtype), start, combined_theta)
      else:
        local = jax.tree.map(lambda phi, t: phi - t.astype(phi.dtype), start, theta)
        pseudo_grads, residual = compressed(local, residual, state.key, outer_round, takes_part)
      steps, new_outer_state = outer_pn.update(pseudo_grads, outer_state, anchor)
      new_anchor = jax.tree.map(lambda phi, s: (phi + s).astype(phi.dtype), anchor, steps)
      receives = ok & (takes_part.frac > 0)
      anchor = select_nodes(receives, new_anchor, anchor)
      outer_state = select_nodes(receives, new_outer_state, outer_state, own_outer)
      stepped = jax.tree.map(lambda phi, x: phi.astype(x.dtype) - x, anchor, params)
      updates = select_nodes(receives, stepped, inner_updates)
      synced = jnp.where(receives, outer_steps + 1, synced)
      return updates, anchor, outer_state, residual, outer_steps + (takes_part.frac > 0).astype(jnp.int32), synced

    participation = up is not None or skip_nodes is not None
    updates, anchor, outer_state, residual, outer_steps, synced = lax.cond(
        state.count % period == period - 1, partial_step if participation else outer_step,
        lambda operands: operands,
        (inner_updates, state.anchor, state.outer_state, state.residual, state.outer_steps, state.synced))
    updates = zero_skipped(updates, skip_nodes)
    return updates, OuterState(count=next_count(state.count), anchor=anchor, inner_state=inner_state,
                               outer_state=outer_state, residual=residual, key=state.key, outer_steps=outer_steps,
                               synced=synced)

  return float_leaves_only(optax.GradientTransformationExtraArgs(init_fn, update_fn))


def diloco(
    inner: optax.GradientTransformation,
    *,
    inner_steps: int = 500,
    outer_learning_rate: float = 0.7,
    outer_momentum: float = 0.9,
    nesterov: bool = True,
    backend: Backend | None = None,
    state_dtype: DTypeLike | None = None,
    compressor: Compressor | None = None,
    error_feedback: bool = True,
    key: jax.Array | int = 0,
    compressed_mean: str = "reduce_scatter",
) -> optax.GradientTransformationExtraArgs:
  r"""DiLoCo: H local steps of ``inner`` per node, then an all-reduce and an outer Nesterov step.

  Douillard et al. (2023), Algorithm 1. Every node starts a round at the shared outer params
  :math:`\phi`, takes H steps of ``inner`` (AdamW in the paper) on its own data, and the
  pseudo-gradients are averaged (the round's only communication, one all-reduce) and
  applied by Nesterov-momentum SGD:

  .. math::
    \Delta = \frac1n \sum_j (\phi - \theta_j), \qquad
    m \leftarrow \mu m + \Delta, \qquad
    \phi \leftarrow \phi - \eta (\Delta + \mu m), \qquad \theta_j \leftarrow \phi.

  (PyTorch's and optax's Nesterov convention; ``nesterov=False`` gives heavy-ball
  :math:`\phi \leftarrow \phi - \eta m`.) The inner optimizer's state persists across
  rounds. Built as `outer_optimizer` with ``optax.sgd(eta, momentum=mu, nesterov=True)`` and
  no topology. Outer SGD with :math:`\eta = 1` and no momentum is periodic averaging of the
  inner optimizer; with H = 1 and inner SGD it is AllReduce-SGD.

  Args:
    inner: the local optimizer, e.g. ``optax.adamw(4e-4, weight_decay=0.1)`` (the paper's).
    inner_steps: H, the local steps per round; the paper uses 500 for language models.
    outer_learning_rate: :math:`\eta` (0.7 in the paper), or an optax schedule, called with
      the outer round.
    outer_momentum: :math:`\mu` in [0, 1) (0.9 in the paper).
    nesterov: Nesterov momentum (the paper's) or heavy-ball.
    backend: where the nodes live (default: simulate); provides the all-reduce. ``update``
      takes ``up`` (a bool per node): the outer step averages the live nodes that hold the
      last result, and a node back from missing a round rejoins from it (see
      `outer_optimizer`).
    state_dtype: the dtype of :math:`\phi` and :math:`m`, e.g. ``jnp.float32`` for bfloat16
      params (as in `outer_optimizer`); ``None`` keeps the params'.
    compressor: ``None``, or a ``gj.compress`` compressor for each node's pseudo-gradient
      (e.g. ``gj.compress.qsgd(7)``, 4 bits), averaged as decoded values (see
      `outer_optimizer`).
    error_feedback: with a ``compressor``, carry what it did not send into the next round.
    key: the PRNG key or int seed of a random ``compressor``.
    compressed_mean: with a ``compressor``, ``"reduce_scatter"`` (a quantized all-reduce:
      compressed pieces, ``2 (n - 1) / n`` of a compact message a node) or ``"all_gather"``
      (the exact mean of the decoded messages, ``n - 1`` compact messages a node); see
      `outer_optimizer`.

  Returns:
    An optax transform over node-stacked params (its ``update`` needs ``params``) whose
    state is an `OuterState`.

  Raises:
    TypeError: ``inner`` is not an optax transform, or its state cannot be stacked per node.
    ValueError: ``inner_steps`` is not a positive integer, a rate is out of range, or
      ``compressed_mean`` is neither form.

  Example:
    Two nodes pull towards 1 and 3; one round of two local steps, then the outer step from
    the shared start 0 along the averaged pseudo-gradient:

    >>> import jax.numpy as jnp, optax, gossipjax as gj
    >>> tx = gj.diloco(optax.sgd(0.5), inner_steps=2)
    >>> x = jnp.zeros((2, 1))
    >>> state = tx.init(x)
    >>> for _ in range(2):
    ...   u, state = tx.update(x - jnp.array([[1.0], [3.0]]), state, x)
    ...   x = x + u
    >>> [round(float(v), 4) for v in x.ravel()]  # 0 + 0.7 * (1 + 0.9) * 1.5, on both nodes
    [1.995, 1.995]

    Partial participation (see `outer_optimizer`): node 2 is down for the first round, which
    averages nodes 0 and 1 only; in the next it rejoins from that result and takes part:

    >>> tx = gj.diloco(optax.sgd(0.5), inner_steps=1, outer_learning_rate=1.0, outer_momentum=0.0)
    >>> x, target = jnp.zeros((3, 1)), jnp.array([[1.0], [3.0], [8.0]])
    >>> state = tx.init(x)
    >>> for up in ([True, True, False], [True, True, True]):
    ...   u, state = tx.update(x - target, state, x, up=jnp.array(up))
    ...   x = x + u
    ...   print(x.ravel().tolist())
    [1.0, 1.0, 0.0]
    [1.5, 1.5, 1.5]

  References:
    Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen (2023), DiLoCo:
    Distributed Low-Communication Training of Language Models, arXiv:2311.08105.
  """
  _check_outer_rates(outer_learning_rate, outer_momentum, "gj.diloco")
  _check_transform(inner, "gj.diloco", "inner", "optax.adamw(4e-4)")
  outer = optax.sgd(outer_learning_rate, momentum=outer_momentum, nesterov=nesterov)
  return _outer_optimizer(inner, outer, inner_steps, None, backend, "gj.diloco", state_dtype, compressor,
                          error_feedback, key, compressed_mean)


def _check_pairing(topology: Any, name: str) -> None:
  """Raises unless every W(k) pairs the nodes: each averages with at most one peer, weight 1/2."""
  topo = as_topology(topology)
  if topo.max_degree() > 1:
    raise ValueError(f"{name}: topology must pair the nodes (each averages with at most one peer per step), "
                     f"but in {topo.name} a node receives from {topo.max_degree()} peers; "
                     f"use gj.topology.random_pairs({topo.num_nodes})")
  for k in range(topo.period):
    w = topo.sparse(k).tocoo()
    off = w.row != w.col
    rows, cols, vals = w.row[off], w.col[off], w.data[off]
    bad = ~np.isclose(vals, 0.5)
    pairs = set(zip(rows.tolist(), cols.tolist()))
    unpaired = [(i, j) for i, j in pairs if (j, i) not in pairs]
    if bad.any() or unpaired:
      i, j = (int(rows[bad][0]), int(cols[bad][0])) if bad.any() else unpaired[0]
      raise ValueError(f"{name}: topology must pair the nodes (i and j average, each with weight 1/2), but in "
                       f"{topo.name} at step {k} node {i} receives from {j} with weight {topo.sparse(k)[i, j]:g} "
                       f"and node {j} from {i} with weight {topo.sparse(k)[j, i]:g}; "
                       f"use gj.topology.random_pairs({topo.num_nodes})")


def noloco(
    inner: optax.GradientTransformation,
    topology: Any,
    *,
    inner_steps: int = 50,
    outer_learning_rate: float = 0.7,
    outer_momentum: float = 0.5,
    backend: Backend | None = None,
    state_dtype: DTypeLike | None = None,
    compressor: Compressor | None = None,
    error_feedback: bool = True,
    key: jax.Array | int = 0,
) -> optax.GradientTransformationExtraArgs:
  r"""NoLoCo: H local steps of ``inner``, then one exchange with a random peer and a modified momentum step.

  Kolehmainen et al. (2025). No all-reduce: at the end of a round each node i averages with
  the one peer j that ``topology`` pairs it with in that round, and its outer momentum
  carries, next to the pair's averaged pseudo-gradient, a term that pulls its outer params
  towards the pair's:

  .. math::
    \delta_i &\leftarrow \mu \delta_i - \eta \Big(\tfrac12(\Delta_i + \Delta_j)
              + \phi_i - \tfrac12(\phi_i + \phi_j)\Big), \qquad \Delta = \phi - \theta, \\
    \phi_i &\leftarrow \phi_i + \delta_i, \qquad \theta_i \leftarrow \phi_i.

  The bracket is :math:`\phi_i - \frac12(\theta_i + \theta_j)`, so one exchange of the
  end-of-round models suffices. This is the rule of the authors' code (its
  ``SparseOptimizerC`` with groups of 2, which the paper's NoLoCo runs select), where the
  weight of the consensus term equals the outer learning rate; defaults are theirs
  (H = 50, :math:`\eta = 0.7`, :math:`\mu = 0.5`, inner Adam). Built as `outer_optimizer`
  with heavy-ball ``optax.sgd(eta, momentum=mu)`` over ``topology``.

  Round r pairs the nodes by W(r): ``gj.topology.random_pairs(n, period=P)`` draws P
  matchings and repeats them, so round P pairs as round 0 did. The authors draw a fresh
  matching every round: give P at least the number of rounds (``gossipjax train`` does).

  With a schedule :math:`\eta_r` (r the outer round) the rate scales the whole momentum, as
  optax's ``sgd`` applies it after the trace: :math:`m_i \leftarrow \mu m_i + b_i`,
  :math:`\phi_i \leftarrow \phi_i - \eta_r m_i`, with :math:`b_i` the bracket above. For a
  constant :math:`\eta` this is the recurrence above (:math:`\delta_i = -\eta m_i`); for a
  varying one it is not the authors' :math:`\delta_i \leftarrow \mu \delta_i - \eta_r b_i`,
  which applies each rate to its own round's term only.

  Args:
    inner: the local optimizer, e.g. ``optax.adam(2e-4)``.
    topology: a pairing of the nodes at every step, e.g. ``gj.topology.random_pairs(n,
      period=rounds)``; W advances one step of its period per outer round.
    inner_steps: H, the local steps per round.
    outer_learning_rate: :math:`\eta`, or an optax schedule, called with the outer round
      (see above for the recurrence it then computes).
    outer_momentum: :math:`\mu` in [0, 1).
    backend: where the nodes live (default: simulate). ``update`` takes ``up`` (a bool per
      node): a live node whose peer is down keeps its own model for the peer's half (see
      `outer_optimizer`).
    state_dtype: the dtype of :math:`\phi` and :math:`\delta` (as in `outer_optimizer`);
      ``None`` keeps the params'.
    compressor: ``None``, or a ``gj.compress`` compressor: each node then sends its compressed
      pseudo-gradient :math:`\Delta_i` (top-k with error feedback, as the authors offer) in
      its compact form, and the bracket becomes the pair's mean of the decoded messages,
      without the pull towards :math:`\frac12(\phi_i + \phi_j)` (see `outer_optimizer`).
    error_feedback: with a ``compressor``, carry what it did not send into the next round.
    key: the PRNG key or int seed of a random ``compressor``.

  Returns:
    An optax transform over node-stacked params (its ``update`` needs ``params``) whose
    state is an `OuterState`.

  Raises:
    TypeError: ``inner`` is not an optax transform, or its state cannot be stacked per node.
    ValueError: ``topology`` is not a pairing, ``inner_steps`` is not a positive integer,
      or a rate is out of range.

  Example:
    Four nodes from 0, 1, 2, 3 with zero gradients: one round of one step, and each node
    moves half way towards its random peer (0 with 2, 1 with 3):

    >>> import jax.numpy as jnp, optax, gossipjax as gj
    >>> tx = gj.noloco(optax.sgd(0.1), gj.topology.random_pairs(4), inner_steps=1, outer_learning_rate=1.0)
    >>> x = jnp.arange(4.0)[:, None]
    >>> u, state = tx.update(jnp.zeros_like(x), tx.init(x), x)
    >>> (x + u).ravel().tolist()
    [1.0, 2.0, 1.0, 2.0]

  References:
    Kolehmainen, Blagoev, Donaghy, Ersoy, Nies (2025), NoLoCo: No-all-reduce Low
    Communication Training Method for Large Models, arXiv:2506.10911 (code:
    github.com/jkolehm/noloco).
  """
  _check_outer_rates(outer_learning_rate, outer_momentum, "gj.noloco")
  _check_transform(inner, "gj.noloco", "inner", "optax.adam(2e-4)")
  _check_pairing(topology, "gj.noloco")
  outer = optax.sgd(outer_learning_rate, momentum=outer_momentum)
  return _outer_optimizer(inner, outer, inner_steps, topology, backend, "gj.noloco", state_dtype, compressor,
                          error_feedback, key)
