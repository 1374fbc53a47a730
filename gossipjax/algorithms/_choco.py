"""CHOCO-SGD: decentralized SGD that gossips compressed differences."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import DTypeLike

from gossipjax._validation import check_in_range, check_learning_rate
from gossipjax.algorithms._common import check_state_dtype, start_step
from gossipjax.compress._base import Identity, leaf_keys
from gossipjax.mixing import Backend, Wire, float_leaves_only, follow_placement, make_mixer, resolve_backend
from gossipjax.mixing._collectives import node_index, node_shape
from gossipjax.mixing._contract import next_count
from gossipjax.mixing._node_mixer import NodeMixer
from gossipjax.mixing._stacked_adapter import on_nodes
from gossipjax.topology import MixingPlan, Topology
from gossipjax.topology._plan import plan_from_edges
from gossipjax._axis import mapping

from gossipjax.compress import Compressor
from gossipjax.algorithms._node_hyperparams import node_hyperparameters


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
    message_bits: (nodes,) the bits of the message each node sent (to each of its
      receivers) in the last step.
    neighbour_copies: on a time-varying W with ``time_varying="compact"``, one tree per round
      r of the union graph: node i's copy of ``x_hat_j`` for the node j it receives from in
      round r (zeros where it has none), shaped like the params; ``()`` otherwise.
  """

  shared_over_nodes = ("count",)  # the step count every node holds alike (it picks W(k) and the rounds)

  count: jax.Array
  public: Any  # x_hat_i: the copy of x_i that node i and its neighbours share
  neighbour_sum: Any  # s_i = sum_j w_ij x_hat_j, kept up to date from the compressed messages
  key: jax.Array  # (nodes, 2) uint32: node i's base key, fold_in(key, i)
  message_bits: jax.Array  # (nodes,) bits of the message each node sent in the last step
  neighbour_copies: tuple[Any, ...] = ()  # per round of the union graph: the copy of x_hat_j node i keeps


def _raw_key(key: Any, name: str) -> jax.Array:
  """A PRNG key as raw uint32 words: from an int seed, a typed key (``jax.random.key``) or a raw key.

  Concrete even where a method is built inside a trace (``optax.inject_hyperparams``, a
  per-node hyperparameter's method built for one node inside the mapping), and there outside
  the trace's abstract mesh, under which JAX computes nothing eagerly.
  """
  with jax.ensure_compile_time_eval(), jax.sharding.use_abstract_mesh(_NO_MESH):
    return _raw_key_words(key, name)


_NO_MESH = jax.sharding.AbstractMesh((), ())


def _raw_key_words(key: Any, name: str) -> jax.Array:
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


@dataclasses.dataclass(frozen=True, eq=False)
class _UnionRounds:
  """A time-varying W(k) as the rounds of its union graph, each delivering one sender's row.

  The union graph (i receives from j at some step of the period) is edge-coloured into c
  partial permutations; round r of the mixer's plan gives node i the row of the node
  ``src_r(i)`` it receives from in that round (weight 1, self weight 0: zero where it has no
  edge), and ``mixer.mix_rounds`` delivers every round at once. W(k) is then
  ``self_weight[k]`` on a node's own row plus ``weight[k, r]`` on its round-r copy.

  Attributes:
    mixer: the union graph's mixer, one round per colour.
    rounds: c, the number of rounds.
    self_weight: (period, n), the diagonal of W(k).
    weight: (period, c, n), ``W(k)[i, src_r(i)]`` (0 where round r has no edge into i).
  """

  mixer: NodeMixer
  rounds: int
  self_weight: np.ndarray
  weight: np.ndarray


def _union_rounds(topology: Topology, backend: Backend, name: str) -> _UnionRounds:
  """The rounds of ``topology``'s union graph and the weights of every step on them (arrays, no loop over edges)."""
  n, period = topology.num_nodes, topology.period
  union = topology.union_graph().tocoo()
  off = union.row != union.col
  dst, src = union.row[off].astype(np.int64), union.col[off].astype(np.int64)
  plan = plan_from_edges(n, dst, src, np.ones(len(dst)), np.zeros(n), name)
  mixer = make_mixer(Topology.from_plans(MixingPlan(self_weight=np.zeros(n), rounds=plan.rounds),
                                         name=f"the union graph of {topology.name}"),
                     backend, "none", name=name, connected=False)
  self_weight = np.zeros((period, n))
  weight = np.zeros((period, len(plan.rounds), n))
  for k in range(period):
    w = topology.sparse(k).tocoo()
    w.sum_duplicates()
    self_weight[k] = topology.sparse(k).diagonal()
    keys = w.row.astype(np.int64) * n + w.col
    order = np.argsort(keys)
    keys, data = keys[order], w.data[order]
    for c, r in enumerate(plan.rounds):
      receivers = np.flatnonzero(r.weight)
      want = receivers * n + r.src[receivers]
      at = np.minimum(np.searchsorted(keys, want), max(len(keys) - 1, 0))
      found = (keys[at] == want) if len(keys) else np.zeros(len(want), bool)
      weight[k, c, receivers] = np.where(found, data[at] if len(keys) else 0.0, 0.0)
  return _UnionRounds(mixer, len(plan.rounds), self_weight, weight)


def _per_node(w: jax.Array, x: jax.Array) -> jax.Array:
  """Per-node weights ``(nodes,)`` (or one node's scalar) shaped to scale the leaf ``x`` node by node."""
  return jnp.reshape(w, jnp.shape(w) + (1,) * (x.ndim - jnp.ndim(w))).astype(x.dtype)


def _weigh(union: _UnionRounds, count: jax.Array, first_node: jax.Array | int, params: Any) -> Any:
  """``(x_hat_i, copies_i...) -> sum_j W(count)[i, j] x_hat_j`` for a leaf, from the union rounds' weights."""
  k = count % union.weight.shape[0]
  local = node_shape(params)
  index = node_index(first_node, local[0] if local else 1)
  self_weight = jnp.asarray(union.self_weight)[k][index]
  weight = jnp.moveaxis(jnp.asarray(union.weight)[k][:, index], 0, -1)  # (nodes, c), or (c,) for one node
  if mapping() is None:
    self_weight, weight = follow_placement((self_weight, weight), params)

  def leaf(public, *copies):
    total = _per_node(self_weight, public) * public
    for r, c in enumerate(copies):
      total = total + _per_node(weight[..., r], c) * c
    return total

  return leaf


@node_hyperparameters("learning_rate", "consensus_step")
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
    time_varying: Literal["compact", "dense"] = "compact",
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
  ``s += W q``, so only the compressed q travels (one gossip round, a compact message to each
  neighbour).

  On a time-varying W(k) (``time_varying="compact"``, the default) the update is the same,
  with ``W^{(k)}``: the public copy ``\hat x_j`` is one value that every node holding it must
  move by the same ``q_j`` at every step, or the copies drift apart. So node i keeps a copy
  of ``\hat x_j`` for every node j it receives from at some step of the period (its
  in-neighbours in the union graph), every node sends its compact ``q_j`` to all of its
  out-neighbours in the union graph at every step, and ``s_i = \sum_j w^{(k)}_{ij} \hat x_j``
  is summed from the copies with the weights of the step. What this costs, per step and
  node: one compact message to each union out-neighbour (``random_pairs(16)``: 9.75 on
  average, 8 to 12, against 1 for W(k) itself; ``one_peer_exponential(n)``: ``log2 n``
  against 1), every round of the union graph's edge colouring in one set of exchanges (at
  most one message per pair of devices and bucket); and a copy of the params per round of
  that colouring in ``state.neighbour_copies`` (as many as the largest union in-degree, or a few more). It
  pays where ``union degree x compact size`` is below the dense row: on ``random_pairs(16)``
  with float32 params, ``top_k(0.01)`` sends 0.59 bytes a parameter and ``sign()`` 1.22,
  against 4 for the dense row; ``top_k(0.1)`` (5.9) and ``qsgd`` (int8, 9.75) send more. ``time_varying="dense"`` sends the public copies ``\hat x_j``
  themselves, densely, along the edges of W(k) only (no copies kept; one dense row per
  neighbour of the step). Both forms compute the same iterates (to round-off), which are
  the paper's Algorithm 2 with ``W^{(k)}`` in place of W. With ``\eta`` small enough for the
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

  ``state.message_bits[i]`` is the size of the message node i sent in the last step to each
  of its receivers: the compact ``q_i`` on a static W (to its out-neighbours in W) and with
  ``time_varying="compact"`` (to its out-neighbours in the union graph); the dense public
  copy ``\hat x_i`` (in ``state_dtype``) with ``time_varying="dense"`` (to its
  out-neighbours in W(k)). ``gj.bytes_per_step`` sums them over the receivers; on the
  sharded backend with one node per device this is what the compiled collective-permutes
  move. Compare to ``gj.compress.identity().bits`` of the same params for the uncompressed
  size.

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
    time_varying: on a time-varying W, ``"compact"`` (keep the public copies of the
      union graph's in-neighbours and send the compact ``q`` to its out-neighbours every
      step) or ``"dense"`` (send the public copies along W(k)'s edges); ignored on a static W.

  Returns:
    An optax transform over node-stacked params (its ``update`` needs ``params``) whose
    state is a `ChocoState`.

  Raises:
    TypeError: ``compressor`` is not a ``gj.compress`` compressor.
    ValueError: ``time_varying`` is neither ``"compact"`` nor ``"dense"``.

  Example:
    >>> import jax.numpy as jnp, gossipjax as gj
    >>> tx = gj.choco_sgd(gj.topology.ring(4), gj.compress.sign(), learning_rate=0.1, consensus_step=0.5)
    >>> x = jnp.ones((4, 10), jnp.float32)
    >>> u, state = tx.update(jnp.zeros_like(x), tx.init(x), x)
    >>> state.message_bits.tolist()  # 10 sign bits packed in 2 bytes and a 32-bit scale per node
    [48.0, 48.0, 48.0, 48.0]

    On ``random_pairs(4)`` each node meets all 3 others over the period, keeps their 3 public
    copies and sends them its 6-byte message at every step:

    >>> tx = gj.choco_sgd(gj.topology.random_pairs(4), gj.compress.sign(), learning_rate=0.1, consensus_step=0.5)
    >>> state = tx.init(x)
    >>> len(state.neighbour_copies), gj.bytes_per_step(tx, x).tolist()
    (3, [18.0])

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
  base_key = _raw_key(key if seed is None else seed, "gj.choco_sgd")
  if seed is not None and not (isinstance(key, int) and key == 0):
    raise ValueError("gj.choco_sgd: give key or seed, not both (seed=s is key=s)")
  # Compression is per node; on stacked trees the backend's map keeps it on the device that holds
  # the node (a vmapped top-k or random permutation over a sharded node axis would otherwise be
  # all-gathered); for one node (inside gj.nodes) it is the node's own computation.
  backend = resolve_backend(backend)
  if time_varying not in ("compact", "dense"):
    raise ValueError(f"gj.choco_sgd: time_varying must be 'compact' (keep the public copies of the neighbours of "
                     f"the period and send them q) or 'dense' (send the public copies), got {time_varying!r}")
  union = (_union_rounds(mixer.topology, backend, "gj.choco_sgd")
           if mixer.topology.is_time_varying and time_varying == "compact" else None)

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
        neighbour_copies=() if union is None else tuple(
            optax.tree.zeros_like(params, state_dtype) for _ in range(union.rounds)),
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
    decode = _DecodeReceived(contraction, tuple(np.asarray(base_key).tolist()), like)
    wire = Wire([tuple(c) for c in treedef.flatten_up_to(compact)], decode, state.count)
    copies = state.neighbour_copies
    message = contraction
    if union is not None:
      # Every node j this node receives from at some step sends q_j every step, so the copy of
      # x_hat_j kept here moves with x_hat_j itself; W(k) then weighs the copies.
      copies = tuple(jax.tree.map(lambda c, r: (c + r).astype(c.dtype), c, received)
                     for c, received in zip(state.neighbour_copies, union.mixer.mix_rounds(q, wire)))
      neighbour_sum = jax.tree.map(_weigh(union, state.count, mixer.first_node(), params), public, *copies)
    elif mixer.topology.is_time_varying:
      # The public copies themselves travel, densely, and that is the message counted.
      neighbour_sum = mixer.mix(public, state.count)
      message = Identity()
    else:
      neighbour_sum = jax.tree.map(lambda s, wq: s + wq, state.neighbour_sum, mixer.mix(q, state.count, wire))
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
        neighbour_copies=copies,
    )

  return float_leaves_only(optax.GradientTransformationExtraArgs(init_fn, update_fn))
