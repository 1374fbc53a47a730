"""CHOCO-SGD: decentralized SGD that gossips compressed differences."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import DTypeLike

from gossipjax._validation import check_in_range, check_learning_rate
from gossipjax.algorithms._common import check_state_dtype, start_step
from gossipjax.compress._base import Identity, leaf_keys
from gossipjax.mixing import Backend, Wire, float_leaves_only, follow_placement, make_mixer, resolve_backend
from gossipjax.mixing._contract import next_count
from gossipjax.mixing._named import node_index, node_shape, on_nodes
from gossipjax._axis import mapping

from gossipjax.compress import Compressor


class ChocoState(NamedTuple):
  """State of `choco_sgd`.

  Attributes:
    count: int32 scalar, the number of steps taken (the schedule's step and W's index).
    public: ``x_hat_i``, the copy of ``x_i`` that node i and its neighbours share, shaped
      like the params.
    neighbour_sum: ``s_i = sum_j w_ij x_hat_j``, kept up to date from the compressed
      messages, shaped like the params.
    key: (nodes, 2) uint32, one PRNG key per node for random compressors; node i
      compresses step k with ``fold_in(key_i, k)``, which its neighbours can rebuild from
      the seed, i and k (so ``random_k`` sends its values alone).
    message_bits: (nodes,) the bits of the message ``q_i`` each node sent in the last step.
  """

  count: jax.Array
  public: Any  # x_hat_i: the copy of x_i that node i and its neighbours share
  neighbour_sum: Any  # s_i = sum_j w_ij x_hat_j, kept up to date from the compressed messages
  key: jax.Array  # (nodes, 2) uint32: node i's base key, fold_in(key, i)
  message_bits: jax.Array  # (nodes,) bits of the message q_i each node sent in the last step


def _raw_key(key: Any, name: str) -> jax.Array:
  """A PRNG key as raw uint32 words: from an int seed, a typed key (``jax.random.key``) or a raw key."""
  if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
    return jax.random.PRNGKey(int(key))
  if isinstance(key, (jax.Array, np.ndarray)) and key.shape == () and jnp.issubdtype(key.dtype, jnp.integer):
    raise TypeError(f"{name}: the seed arrived as an array ({key!r}); under optax.inject_hyperparams pass "
                    "static_args=('key', 'seed'): receivers rebuild the senders' keys from it, so it must be fixed")
  if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ():
    return jax.random.key_data(key)
  if isinstance(key, (jax.Array, np.ndarray)) and key.dtype == np.uint32 and key.ndim == 1:
    return jnp.asarray(key)
  raise TypeError(f"{name}: key must be an int seed or one PRNG key (jax.random.key(0)), got {key!r}")


@dataclasses.dataclass(frozen=True)
class _DecodeReceived:
  """What a receiver does with the compact parts of one leaf: rebuild each sender's key and decode.

  Node j compresses step k with ``fold_in(fold_in(key, j), k)``, so a receiver that
  knows the sender needs no key on the wire. Static data (equal configurations compare equal),
  so a backend's compiled mixing is reused from step to step.
  """

  compressor: Compressor
  base: tuple[int, ...]  # the transform's key, as raw uint32 words
  like: tuple[tuple[tuple[int, ...], Any], ...]  # one node's leaves: (shape, dtype)

  def __call__(self, i: int, parts: tuple[jax.Array, ...], senders: jax.Array, count: jax.Array) -> jax.Array:
    shape, dtype = self.like[i]

    def one(p, j):
      key = jax.random.fold_in(jax.random.fold_in(jnp.asarray(self.base, jnp.uint32), j), count)
      return self.compressor.decode_leaf(p, leaf_keys(key, len(self.like))[i], shape, dtype)

    return jax.vmap(one)(parts, senders)


def choco_sgd(
    topology: Any,
    compressor: Compressor,
    *,
    learning_rate: optax.ScalarOrSchedule,
    consensus_step: float,
    key: jax.Array | int = 0,
    seed: int | None = None,
    backend: Backend | None = None,
    state_dtype: DTypeLike | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""CHOCO-SGD (Koloskova, Stich and Jaggi, ICML 2019, Algorithm 2).

  Every node keeps a public copy ``\hat x_i`` known to its neighbours and only sends the
  compressed change ``q_i = C(x_i^{k+1/2} - \hat x_i)``; the gossip step is a damped
  average of the public copies:

  .. math::
    x_i^{k+1/2} &= x_i^k - \gamma_k \nabla F_i(x_i^k), \qquad
    q_i^k = C\big(x_i^{k+1/2} - \hat x_i^k\big), \qquad \hat x_i^{k+1} = \hat x_i^k + q_i^k, \\
    x_i^{k+1} &= x_i^{k+1/2} + \eta \sum_j w_{ij} \big(\hat x_j^{k+1} - \hat x_i^{k+1}\big),
    \qquad \hat x^0 = 0.

  For a static W each node keeps ``s_i = \sum_j w_ij \hat x_j`` and updates it with
  ``s += W q``, so only the compressed q travels (one gossip round). For a time-varying
  W the term ``W^{(k)} \hat x^{k+1}`` is computed by mixing the public copies, which then
  travel densely: a neighbour met for the first time since many steps cannot rebuild
  ``\hat x_j`` from the compressed messages it did not receive (keeping the copies of every
  neighbour of the period, fed by compressed messages every step, would cost a copy and a
  message per neighbour of the whole period). With ``\eta`` small enough for the
  compressor's contraction ``delta`` the public copies track the models and the nodes
  reach consensus; the node average is preserved by the gossip step for doubly
  stochastic W. An unbiased compressor (``random_k``, ``qsgd``) is used through its
  ``contraction()``, scaled by ``1 / (1 + omega)`` as in the paper.

  The order of the steps is the paper's Algorithm 2. The authors' public code orders them
  differently: it takes the consensus step with the *old* public copies, then compresses
  (``x+ = x - lr g + eta (W - I) x_hat``, then ``x_hat += C(x+ - x_hat)``). The two
  trajectories part from the first step, and their full-batch limits differ by
  ``O(lr)``: adapt-then-combine ``x = W_eta (x - lr g)`` here, combine-then-adapt
  ``x = W_eta x - lr g`` in that code, with ``W_eta = I + eta (W - I)``
  (``tests/test_compress.py`` runs both).

  ``state.message_bits[i]`` is the size of the message node i sent in the last step
  (each node sends it to each of its out-neighbours): the compact ``q_i`` on a static W,
  the dense public copy ``\hat x_i`` (in ``state_dtype``) on a time-varying one; compare to
  ``gj.compress.identity().bits`` of the same params for the uncompressed size.

  Args:
    topology: doubly stochastic mixing, static or time-varying.
    learning_rate: a float or an optax schedule.
    compressor: a ``gj.compress`` compressor, e.g. ``gj.compress.top_k(0.1)``.
    consensus_step: ``eta`` in (0, 1]; ``eta = 1`` with ``gj.compress.identity()`` is D-PSGD.
    key: the PRNG key (``jax.random.key(0)``, a raw ``PRNGKey``, or an int seed) of random
      compressors; node i draws from ``fold_in(key, i)``.
    seed: an int seed, the same as ``key=seed`` (give one or the other).
    backend: where the nodes live (default: simulate).
    state_dtype: the dtype of the public copies and the neighbour sums, e.g. ``jnp.float32``
      for bfloat16 params (the difference ``x - \hat x`` is then compressed in it);
      ``None`` keeps the params'. The updates are in the params' dtype.

  Returns:
    An optax transform over node-stacked params (its ``update`` needs ``params``) whose
    state is a `ChocoState`.

  Raises:
    TypeError: ``compressor`` is not a ``gj.compress`` compressor.

  Example:
    >>> import jax.numpy as jnp, gossipjax as gj
    >>> tx = gj.choco_sgd(gj.topology.ring(4), gj.compress.sign(), learning_rate=0.1, consensus_step=0.5)
    >>> x = jnp.ones((4, 10), jnp.float32)
    >>> u, state = tx.update(jnp.zeros_like(x), tx.init(x), x)
    >>> state.message_bits.tolist()  # 10 sign bits packed in 2 bytes and a 32-bit scale per node
    [48.0, 48.0, 48.0, 48.0]

  References:
    Koloskova, Stich, Jaggi (2019), Decentralized Stochastic Optimization and Gossip
    Algorithms with Compressed Communication, ICML.
  """
  if not isinstance(compressor, Compressor):
    raise TypeError(f"choco_sgd: compressor must be a gj.compress compressor, got {type(compressor).__name__}")
  check_learning_rate(learning_rate, "gj.choco_sgd")
  check_in_range(consensus_step, "gj.choco_sgd", "consensus_step", 0.0, 1.0, low_open=True)
  state_dtype = check_state_dtype(state_dtype, "gj.choco_sgd")
  mixer = make_mixer(topology, backend, name="gj.choco_sgd")
  contraction = compressor.contraction()
  with jax.ensure_compile_time_eval():  # concrete even when built inside a trace (optax.inject_hyperparams)
    base_key = _raw_key(key if seed is None else seed, "gj.choco_sgd")
  if seed is not None and not (isinstance(key, int) and key == 0):
    raise ValueError("gj.choco_sgd: give key or seed, not both (seed=s is key=s)")
  # Compression is per node; on stacked trees the backend's map keeps it on the device that holds
  # the node (a vmapped top-k or random permutation over a sharded node axis would otherwise be
  # all-gathered); for one node (inside gj.nodes) it is the node's own computation.
  backend = resolve_backend(backend)

  def init_fn(params):
    shape = node_shape(params) if jax.tree.leaves(params) else (mixer.local_nodes,)
    state = ChocoState(
        count=jnp.zeros([], jnp.int32),
        public=optax.tree.zeros_like(params, state_dtype),
        neighbour_sum=optax.tree.zeros_like(params, state_dtype),
        # Keyed by the global node index, so a node draws the same bits on every backend.
        key=jnp.vectorize(lambda i: jax.random.fold_in(base_key, i), signature="()->(k)")(
            node_index(mixer.first_node(), shape[0] if shape else 1)),
        message_bits=jnp.zeros(shape, float),
    )
    return state._replace(**follow_placement({"key": state.key, "message_bits": state.message_bits}, params))

  def update_fn(updates, state, params=None, **extra_args):
    grads = updates  # optax's name for the incoming tree; these methods take gradients
    del extra_args
    lr = start_step("gj.choco_sgd", mixer, params, learning_rate, state.count)
    half = jax.tree.map(lambda x, g: x - (lr * g).astype(x.dtype), params, grads)
    keys = jnp.vectorize(lambda k: jax.random.fold_in(k, state.count), signature="(k)->(k)")(state.key)
    node_map = lambda fn: on_nodes(fn, backend)
    diff = jax.tree.map(lambda h, p: h - p, half, state.public)
    treedef = jax.tree.structure(diff)
    first = 0 if mapping() is not None else 1  # one node's shape: without the stacked node axis
    like = tuple((tuple(x.shape[first:]), jnp.dtype(x.dtype)) for x in jax.tree.leaves(diff))
    # What node i sends is the compact form of C(diff_i); it updates its own public copy with
    # the same decoded message its neighbours receive.
    compact = node_map(contraction.encode)(diff, keys)
    one_node = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(*sd) for sd in like])
    q = node_map(lambda c, k: contraction.decode(c, k, one_node))(compact, keys)
    public = jax.tree.map(lambda p, qi: p + qi, state.public, q)
    if mixer.topology.is_time_varying:
      # A new neighbour's public copy is not the sum of the messages this node received, so the
      # copies themselves travel, densely, and that is the message counted.
      neighbour_sum = mixer.mix(public, state.count)
      message = Identity()
    else:
      decode = _DecodeReceived(contraction, tuple(np.asarray(base_key).tolist()), like)
      wire = Wire([tuple(c) for c in treedef.flatten_up_to(compact)], decode, state.count)
      neighbour_sum = jax.tree.map(lambda s, wq: s + wq, state.neighbour_sum, mixer.mix(q, state.count, wire))
      message = contraction
    eta = consensus_step
    updates = jax.tree.map(lambda h, s, p, x: (h + eta * (s - p)).astype(x.dtype) - x,
                           half, neighbour_sum, public, params)
    return updates, ChocoState(
        count=next_count(state.count),
        public=public,
        neighbour_sum=neighbour_sum,
        key=state.key,
        message_bits=node_map(message.bits)(diff if message is contraction else public).astype(
            state.message_bits.dtype),
    )

  return float_leaves_only(optax.GradientTransformationExtraArgs(init_fn, update_fn))
