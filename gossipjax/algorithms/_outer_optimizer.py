"""Local training with an outer optimizer: H local steps per node, then one combined outer step.

The frame of DiLoCo and NoLoCo (`gj.diloco`, `gj.noloco`): `outer_optimizer` with any inner
and outer optax transform, the end-of-round models combined by an all-reduce or by one
gossip round.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.typing import DTypeLike

from gossipjax._axis import mapping, own_leaves
from gossipjax._guard import SkipNodes, zero_skipped
from gossipjax._mapping import StateNotStackableError, per_node
from gossipjax._validation import (FLOAT32_MAX, check_in_range, check_learning_rate, check_node_axis, check_period,
                                   require_params)
from gossipjax.algorithms._choco import _DecodeReceived, _raw_key
from gossipjax.algorithms._common import check_state_dtype, copy_of
from gossipjax.algorithms._compressed_mean import (check_compressor, check_mean_form, compress_with_feedback,
                                                   mean_of_compressed)
from gossipjax.algorithms._participation import live_nodes, node_mask, participants, select_nodes
from gossipjax.compress import Compressor
from gossipjax.mixing import Backend, Wire, float_leaves_only, follow_placement, make_mixer, resolve_backend
from gossipjax.mixing._collectives import node_average, node_index, node_shape
from gossipjax.mixing._contract import next_count


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

  shared_over_nodes = ("count", "outer_steps")  # the steps and outer steps every node holds alike

  count: jax.Array
  anchor: Any
  inner_state: Any
  outer_state: Any
  residual: Any = None
  key: Any = None
  outer_steps: Any = None
  synced: Any = None

  zeroes_skipped_nodes = True  # tells gj.guard_finite that a skipping node's update is zeroed before it is combined


def check_outer_rates(learning_rate: Any, momentum: Any, name: str) -> None:
  """The outer learning rate: a number in [0, float32's largest] or a schedule of one number per round; momentum in [0, 1).

  A rate past float32's range (1e300) becomes inf in float32 params, every outer step would
  then be non-finite (and skipped under ``gj.guard_finite``): refused here, as is a schedule
  that returns an array (a per-coordinate rate).
  """
  check_learning_rate(learning_rate, name, "outer_learning_rate", high=FLOAT32_MAX)
  check_in_range(momentum, name, "outer_momentum", 0.0, 1.0, high_open=True)


def check_transform(tx: Any, name: str, arg: str, example: str) -> None:
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
  changes (its params and its whole inner state, step counts included, are kept, as if the
  node had paused). An outer step is taken over the nodes that take part, the live ones:

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
    inner_steps: H, a positive integer, the local steps per round.
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
  form = check_mean_form(compressed_mean, name)
  check_compressor(compressor, name, "gj.compress.top_k(0.1)")
  base_key = _raw_key(key, name)
  check_transform(inner, name, "inner", "optax.adamw(4e-4)")
  check_transform(outer, name, "outer", "optax.sgd(0.7, momentum=0.9, nesterov=True)")
  period = check_period(inner_steps, name, "inner_steps")
  state_dtype = check_state_dtype(state_dtype, name)
  backend = resolve_backend(backend)
  mixer = None if topology is None else make_mixer(topology, backend, name=name)
  inner_pn, outer_pn = per_node(inner, backend=backend), per_node(outer, backend=backend)

  def stacked_init(tx, params, arg):
    try:
      return tx.init(params)
    except StateNotStackableError as e:
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

    With ``takes_part`` (a `Participation`), the nodes outside it send nothing and keep their
    residuals; the mean is over the participants, and in the mix a participant keeps for
    itself the weight of the neighbours that do not take part.
    """
    c = compressor
    assert c is not None
    sent = compress_with_feedback(c, backend, name, pseudo_grads, residual, node_keys, outer_round,
                                  error_feedback=error_feedback,
                                  form="reduce_scatter" if mixer is None and form == "reduce_scatter" else None,
                                  takes_part=takes_part)
    if mixer is None:
      return mean_of_compressed(c, backend, name, sent, takes_part), sent.residual
    q = sent.decoded if takes_part is None else takes_part.zero_others(sent.decoded)
    like = tuple((x.shape, x.dtype) for x in jax.tree.leaves(sent.one_node))
    decode = _DecodeReceived(c, tuple(np.asarray(base_key).tolist()), like)
    wire = Wire([tuple(c) for c in jax.tree.structure(q).flatten_up_to(sent.compact)], decode, outer_round)
    mixed = mixer.mix(q, outer_round, wire)
    return (mixed if takes_part is None else takes_part.fill_self(mixed, q, mixer, outer_round)), sent.residual

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
    up = None if up is None else node_mask(up, params, name)
    inner_updates, inner_state = inner_pn.update(grads, state.inner_state, params, **extra_args)
    inner_updates = jax.tree.map(lambda u, x: u.astype(x.dtype), inner_updates, params)
    in_mapping = mapping() is not None
    if up is not None:  # a node that is down neither computes nor changes
      own = own_leaves(inner_state) if in_mapping else None
      inner_state = select_nodes(up, inner_state, state.inner_state, own)
      inner_updates = select_nodes(up, inner_updates, jax.tree.map(jnp.zeros_like, inner_updates))
    # A node that skips (gj.guard_finite) sends its current params and keeps them.
    inner_updates = zero_skipped(inner_updates, skip_nodes)
    outer_round = state.count // period
    # Which leaves of the outer state are one node's own inside gj.nodes: all but those its state
    # classes declare one value for every node.
    own_outer = own_leaves(state.outer_state) if in_mapping else None

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
      ok = live_nodes(up, skip_nodes, params)
      dtype = jnp.result_type(jnp.float32, *[x.dtype for x in jax.tree.leaves(anchor)])
      theta = jax.tree.map(lambda x, u: x + u, params, inner_updates)
      # DiLoCo's rule (see `participants`): the nodes that hold the last result take part; one that
      # missed an outer step takes the participants' outer params and state, then steps with them.
      takes_part, anchor, outer_state = participants(ok, synced, outer_steps, anchor, outer_state, own_outer,
                                                     backend, name, dtype, shared_result=mixer is None)
      start = jax.tree.map(lambda phi, x: phi.astype(x.dtype).astype(phi.dtype), anchor, params)
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
