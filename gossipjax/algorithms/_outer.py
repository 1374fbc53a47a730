"""Local training with an outer optimizer: DiLoCo, NoLoCo and their gossip form."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.core  # jax.core.Tracer: a type checker sees the submodule only where it is imported
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.typing import DTypeLike

from gossipjax._guard import SkipNodes, zero_skipped
from gossipjax._nodes import per_node
from gossipjax._validation import (FLOAT32_MAX, check_in_range, check_learning_rate, check_node_axis, check_period,
                                   require_params)
from gossipjax.algorithms._choco import _DecodeReceived, _raw_key
from gossipjax.algorithms._common import check_state_dtype, copy_of
from gossipjax.mixing import Backend, Wire, float_leaves_only, follow_placement, make_mixer, resolve_backend
from gossipjax.mixing._named import node_average, node_index, node_shape, on_nodes
from gossipjax._axis import mapping
from gossipjax.compress import Compressor
from gossipjax.compress._base import wire_bits
from gossipjax.topology import as_topology
from gossipjax.mixing._contract import gathered_mean, next_count


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
  """

  count: jax.Array
  anchor: Any
  inner_state: Any
  outer_state: Any
  residual: Any = None
  key: Any = None

  zeroes_skipped_nodes = True  # tells gj.guard_finite that a skipping node's update is zeroed before it is combined


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

  Under ``gj.guard_finite`` a node that skips the last inner step of a round sends its
  current params and keeps them (and its state) through the outer step: it rejoins at the
  next one, where the combined model pulls it back.

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
  for 8-bit ``qsgd``) to each neighbour; the mean is counted by ``gj.bytes_per_step`` as an
  all-gather of the compact messages, ``(n - 1)`` of them per node, which is what the
  exact mean of differently sparsified or scaled messages needs (a ring all-reduce of the
  dense pseudo-gradient sends ``2 (n - 1) / n`` of the dense size).

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

  Returns:
    An optax transform over node-stacked params (its ``update`` needs ``params``) whose
    state is an `OuterState`; non-float leaves are left alone.

  Raises:
    TypeError: ``inner`` or ``outer`` is not an optax transform, or ``compressor`` is not a
      compressor; at ``init``, ``inner``'s or ``outer``'s state cannot be stacked per node.
    ValueError: ``inner_steps`` is not a positive integer, or the topology is not doubly
      stochastic and connected.

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

    >>> tx = gj.outer_optimizer(optax.sgd(0.5), optax.sgd(1.0), inner_steps=1, compressor=gj.compress.top_k(0.5))
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
                          compressor, error_feedback, key)


def _outer_optimizer(inner: optax.GradientTransformation, outer: optax.GradientTransformation, inner_steps: int,
                     topology: Any, backend: Backend | None, name: str,
                     state_dtype: DTypeLike | None = None, compressor: Compressor | None = None,
                     error_feedback: bool = True, key: Any = 0) -> optax.GradientTransformationExtraArgs:
  """`outer_optimizer`, with ``name`` (the public function called) in its error messages."""
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

  def first_node():
    return 0 if mixer is None else mixer.first_node()

  def init_fn(params):
    anchor = copy_of(params, state_dtype)
    state = OuterState(
        count=jnp.zeros([], jnp.int32),
        anchor=anchor,
        inner_state=stacked_init(inner_pn, params, "inner"),
        outer_state=stacked_init(outer_pn, anchor, "outer"),
    )
    if compressor is None:
      return state
    shape = node_shape(params)
    keys = jnp.vectorize(lambda i: jax.random.fold_in(base_key, i), signature="()->(k)")(
        node_index(first_node(), shape[0] if shape else 1))
    return state._replace(residual=optax.tree.zeros_like(anchor), key=follow_placement(keys, params))

  def compressed(pseudo_grads, residual, node_keys, outer_round):
    """Each node's pseudo-gradient plus residual, compressed; their mean or mix; the new residuals."""
    node_map = lambda fn: on_nodes(fn, backend)
    c = compressor
    assert c is not None
    sent = jax.tree.map(lambda g, e: g + e, pseudo_grads, residual) if error_feedback else pseudo_grads
    keys = jnp.vectorize(lambda k: jax.random.fold_in(k, outer_round), signature="(k)->(k)")(node_keys)
    treedef = jax.tree.structure(sent)
    first = 0 if mapping() is not None else 1  # one node's shape: without the stacked node axis
    like = tuple((tuple(x.shape[first:]), jnp.dtype(x.dtype)) for x in jax.tree.leaves(sent))
    one_node = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(*sd) for sd in like])
    compact = node_map(c.encode)(sent, keys)
    q = node_map(lambda parts, k: c.decode(parts, k, one_node))(compact, keys)
    residual = jax.tree.map(lambda v, d: v - d, sent, q) if error_feedback else residual
    if mixer is None:
      with gathered_mean(sum(wire_bits(c.wire_spec(*sd)) for sd in like) / 8):
        return node_average(backend, q, name), residual
    decode = _DecodeReceived(c, tuple(np.asarray(base_key).tolist()), like)
    wire = Wire([tuple(c) for c in treedef.flatten_up_to(compact)], decode, outer_round)
    return mixer.mix(q, outer_round, wire), residual

  def combined(theta, outer_round):
    if mixer is None:
      return node_average(backend, theta, name)
    return mixer.mix(theta, outer_round)

  def update_fn(updates, state, params=None, skip_nodes: SkipNodes | None = None, **extra_args):
    grads = updates  # optax's name for the incoming tree; these methods take gradients
    require_params(params, name)
    if mixer is not None:
      check_node_axis(params, mixer.local_nodes, name, mixer.topology.name)
    inner_updates, inner_state = inner_pn.update(grads, state.inner_state, params, **extra_args)
    # A node that skips (gj.guard_finite) sends its current params and keeps them.
    inner_updates = zero_skipped(jax.tree.map(lambda u, x: u.astype(x.dtype), inner_updates, params), skip_nodes)

    def outer_step(operands):
      inner_updates, anchor, outer_state, residual = operands
      theta = jax.tree.map(lambda x, u: x + u, params, inner_updates)
      # Measured from where the round started, phi in the params' dtype: phi's extra digits
      # (state_dtype) are not fed back as a pseudo-gradient.
      start = jax.tree.map(lambda phi, x: phi.astype(x.dtype).astype(phi.dtype), anchor, params)
      if compressor is None:
        pseudo_grads = jax.tree.map(lambda phi, c: phi - c, start, combined(theta, state.count // period))
      else:
        local = jax.tree.map(lambda phi, t: phi - t.astype(phi.dtype), start, theta)
        pseudo_grads, residual = compressed(local, residual, state.key, state.count // period)
      steps, outer_state = outer_pn.update(pseudo_grads, outer_state, anchor)
      anchor = jax.tree.map(lambda phi, s: (phi + s).astype(phi.dtype), anchor, steps)
      updates = jax.tree.map(lambda phi, x: phi.astype(x.dtype) - x, anchor, params)
      return updates, anchor, outer_state, residual

    updates, anchor, outer_state, residual = lax.cond(
        state.count % period == period - 1, outer_step, lambda operands: operands,
        (inner_updates, state.anchor, state.outer_state, state.residual))
    updates = zero_skipped(updates, skip_nodes)
    return updates, OuterState(count=next_count(state.count), anchor=anchor,
                               inner_state=inner_state, outer_state=outer_state, residual=residual, key=state.key)

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
    backend: where the nodes live (default: simulate); provides the all-reduce.
    state_dtype: the dtype of :math:`\phi` and :math:`m`, e.g. ``jnp.float32`` for bfloat16
      params (as in `outer_optimizer`); ``None`` keeps the params'.
    compressor: ``None``, or a ``gj.compress`` compressor for each node's pseudo-gradient
      (e.g. ``gj.compress.qsgd(7)``, 4 bits), averaged as decoded values (see
      `outer_optimizer`).
    error_feedback: with a ``compressor``, carry what it did not send into the next round.
    key: the PRNG key or int seed of a random ``compressor``.

  Returns:
    An optax transform over node-stacked params (its ``update`` needs ``params``) whose
    state is an `OuterState`.

  Raises:
    TypeError: ``inner`` is not an optax transform, or its state cannot be stacked per node.
    ValueError: ``inner_steps`` is not a positive integer, or a rate is out of range.

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

  References:
    Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen (2023), DiLoCo:
    Distributed Low-Communication Training of Language Models, arXiv:2311.08105.
  """
  _check_outer_rates(outer_learning_rate, outer_momentum, "gj.diloco")
  _check_transform(inner, "gj.diloco", "inner", "optax.adamw(4e-4)")
  outer = optax.sgd(outer_learning_rate, momentum=outer_momentum, nesterov=nesterov)
  return _outer_optimizer(inner, outer, inner_steps, None, backend, "gj.diloco", state_dtype, compressor,
                          error_feedback, key)


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
    backend: where the nodes live (default: simulate).
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
