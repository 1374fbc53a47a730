"""Streaming DiLoCo: DiLoCo's outer step, one fragment of the params at a time, overlapping communication."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gossipjax._axis import mapping, own_leaves
from gossipjax._guard import SkipNodes, zero_skipped
from gossipjax._mapping import per_node
from gossipjax._overlap import overlapping
from gossipjax._validation import check_in_range, check_period, check_positive_int, is_integer, require_params
from gossipjax.algorithms._choco import _raw_key
from gossipjax.algorithms._compressed_mean import (check_compressor, check_mean_form, compress_with_feedback,
                                                   mean_of_compressed)
from gossipjax.algorithms._fragments import FRAGMENT_SPLITS, check_fragments, join_leaves, split_leaves
from gossipjax.algorithms._outer_optimizer import check_outer_rates, check_transform
from gossipjax.algorithms._participation import Participation, live_nodes, node_mask, participants, select_nodes
from gossipjax.compress import Compressor
from gossipjax.mixing import Backend, float_leaves_only, follow_placement, resolve_backend
from gossipjax.mixing._collectives import node_average, node_index, node_shape
from gossipjax.mixing._contract import next_count
from gossipjax.algorithms._node_hyperparams import node_hyperparameters


class StreamingDiLoCoState(NamedTuple):
  """State of `streaming_diloco`.

  Attributes:
    count: int32 scalar, the inner steps taken.
    anchor: the outer params ``phi`` (each node's copy), shaped like the params.
    pending: each fragment's averaged pseudo-gradient, sent at its sync step and applied
      ``overlap`` steps later; shaped like the params.
    inner_state: the inner transform's state, one per node.
    outer_states: one outer optimizer state per fragment (over that fragment's pieces of
      leaves: whole leaves with ``fragment_split="layers"``).
    residual: with a ``compressor``, each node's error-feedback residual (what its
      compressed pseudo-gradients have not sent yet), shaped like the params; else ``None``.
    key: with a ``compressor``, (nodes, 2) uint32, one PRNG key per node; else ``None``.
    outer_steps: per fragment, an int32 scalar: the syncs of that fragment in which some
      node took part.
    synced: per fragment, int32 (nodes,): the ``outer_steps`` of that fragment whose result
      the node's outer params hold; a node with ``synced < outer_steps`` missed one and
      rejoins at the fragment's next sync.
    joined: per fragment, int32 (nodes,): the round (``count // inner_steps`` at the sync
      step) of the last sync of that fragment the node took part in; its outer step lands
      on the nodes that joined it and are live ``overlap`` steps later.
  """

  shared_over_nodes = ("count", "outer_steps")  # the steps and outer steps every node holds alike

  count: jax.Array
  anchor: Any
  pending: Any
  inner_state: Any
  outer_states: tuple
  residual: Any = None
  key: Any = None
  outer_steps: tuple = ()
  synced: tuple = ()
  joined: tuple = ()

  zeroes_skipped_nodes = True  # tells gj.guard_finite that a skipping node's update is zeroed before it is combined


class _Step(NamedTuple):
  """What every fragment's step reads: the shared step count, the live nodes and the nodes' keys."""

  count: jax.Array
  ok: jax.Array  # the live nodes, a bool per node
  participation: bool  # whether some node may be down (``up`` given, or under gj.guard_finite)
  key: Any
  dtype: Any  # of the fractions of nodes


class _Fragment(NamedTuple):
  """One fragment's part of the state, and its pieces of the params after the inner step."""

  anchor: list
  pending: list
  residual: list | None
  theta: list
  outer_state: Any
  outer_steps: jax.Array
  synced: jax.Array
  joined: jax.Array


@node_hyperparameters("mixing", "outer_learning_rate", "outer_momentum")
def streaming_diloco(
    inner: optax.GradientTransformation,
    *,
    num_fragments: int,
    fragment_split: str = "layers",
    inner_steps: int = 100,
    overlap: int = 0,
    mixing: float = 0.0,
    outer_learning_rate: float = 0.7,
    outer_momentum: float = 0.9,
    nesterov: bool = True,
    backend: Backend | None = None,
    compressor: Compressor | None = None,
    error_feedback: bool = True,
    key: jax.Array | int = 0,
    compressed_mean: str = "reduce_scatter",
) -> optax.GradientTransformationExtraArgs:
  r"""Streaming DiLoCo: DiLoCo's outer step on one of F fragments of the params at a time.

  Douillard et al. (2025). The params are split, in order, into F fragments (see
  ``fragment_split``). Every node runs ``inner`` on all its params at every step; fragment p
  is synchronised every H steps, at the steps t with :math:`t \bmod H = (p+1)H/F - 1`, so
  the fragments take turns and at most one fragment crosses the network at a time: the peak
  bytes per step are the largest fragment's, 1/F of DiLoCo's when the fragments are of
  equal size (``gj.bytes_per_step`` reports them). At its sync step the fragment's pseudo-gradients are
  averaged (one all-reduce of the fragment) and sent; ``overlap`` = :math:`\tau` steps later
  (the communication overlapping :math:`\tau` inner steps) the outer step is applied and the
  fragment's result is mixed into the local params with weight :math:`\alpha` = ``mixing``:

  .. math::
    \Delta_p = \frac1n \sum_j (\phi_p - \theta_{j,p})\ \text{(at the sync step)}, \qquad
    \phi_p \leftarrow \phi_p + \mathrm{outer}_p(\Delta_p), \qquad
    \theta_{i,p} \leftarrow \alpha\, \theta_{i,p} + (1 - \alpha)\, \phi_p
    \ \text{(}\tau\text{ steps later)},

  with ``outer`` Nesterov SGD as in `diloco`, a state of its own per fragment. With F = 1,
  :math:`\tau = 0` and :math:`\alpha = 0` it is `diloco`, also with ``up`` and a
  ``compressor``.

  **Partial participation.** ``update`` takes ``up`` (bool, one per node; the local block
  under MPI), as `diloco` does, with DiLoCo's rules applied fragment by fragment. A node
  that is down neither computes nor changes: its params and its whole inner state, step
  counts included, are kept. At fragment p's sync step the mean
  is over the live nodes that hold the fragment's last outer result (all live nodes where
  none does); a live node that missed one of the fragment's outer steps rejoins: it takes
  the participants' outer params and outer state of that fragment, so its outer step lands
  with theirs and every live node leaves the sync with the same :math:`\phi_p`
  (``StreamingDiLoCoState.synced`` counts, per fragment, the outer steps a node holds). A
  sync is two events :math:`\tau` steps apart: the nodes live at the sync step take part
  in it, and its outer step lands on those of them that are live :math:`\tau` steps later.
  A node down at the sync step sends nothing and receives nothing; a node down at the
  landing step keeps its params, outer params and outer state of the fragment and counts
  as not synced for it. Either way it rejoins at the fragment's next sync it is live for.
  The rejoin costs one more all-reduce of the fragment's outer params and state, in the
  syncs that have one (`gj.bytes_per_step` does not count it). Under ``gj.guard_finite`` a
  node whose gradient is not finite at a step skips it as a down node does: it is not
  averaged into a fragment that syncs at that step, and no outer step lands on it.

  **Compressed exchanges.** With a ``compressor`` each node sends its compressed fragment
  pseudo-gradient with error feedback, :math:`q_{i,p} = C(\Delta_{i,p} + e_{i,p})`,
  :math:`e_{i,p} \leftarrow \Delta_{i,p} + e_{i,p} - q_{i,p}`, and the outer step takes
  the mean of the decoded messages, moved in compact form as `diloco`'s
  (``compressed_mean``: ``"reduce_scatter"``, compressed pieces of the fragment, or
  ``"all_gather"``, every node's compact message; see `outer_optimizer`). With a
  ``compressor``, node i compresses fragment p's sync in round r with
  ``fold_in(key_i, r F + p)``. Only the participants send; the others keep their residuals.
  ``gj.bytes_per_step`` counts the compact messages of each fragment at its sync step, and
  on the sharded backend with one node per device the compiled all-to-alls and all-gathers
  move exactly them. The 4-bit exchanges of the paper's quantized variant (there a 4-bit
  float format, E3M0) are approached with ``gj.compress.qsgd(7)``: 15 signed levels, a
  4-bit code, sent as int8 with one norm per leaf.

  Args:
    inner: the local optimizer, e.g. ``optax.adamw(4e-4)``.
    num_fragments: F, at least 1 and at most the number of float leaves (``"layers"``) or
      of float entries a node (``"balanced"``).
    fragment_split: how the params are cut into fragments. ``"layers"`` (the default, the
      paper's pattern): whole leaves, in order, in groups of about equal size; a leaf is
      never cut, so each fragment's outer step sees whole layers, but a model whose layers
      differ in size (a wide hidden layer, a small head) gets a peak of its largest
      fragment's bytes. ``"balanced"``: the float leaves end to end cut into F ranges of
      equal bytes (to one entry), cutting leaves where it must, so the peak a step is 1/F of
      DiLoCo's on any model. A fragment's sync is one exchange of its pieces either way.
      The default keeps the paper's layer fragments, which are already equal on models
      built of equal blocks (a transformer's layers).
    inner_steps: H, the steps between two syncs of one fragment (a multiple of F keeps the
      fragments evenly staggered).
    overlap: :math:`\tau`, in [0, H / F): the inner steps the communication overlaps.
    mixing: :math:`\alpha` in [0, 1], the weight of the local params in the merge.
    outer_learning_rate: :math:`\eta` of the outer Nesterov step, or a schedule of each
      fragment's outer round.
    outer_momentum: :math:`\mu` in [0, 1).
    nesterov: Nesterov momentum (the paper's) or heavy-ball.
    backend: where the nodes live (default: simulate); provides the all-reduce.
    compressor: ``None`` (the fragments travel densely) or a ``gj.compress`` compressor for
      each node's fragment pseudo-gradient, e.g. ``gj.compress.qsgd(7)`` (4 bits) or
      ``gj.compress.top_k(0.1)``.
    error_feedback: with a ``compressor``, carry what it did not send into the fragment's
      next sync.
    key: the PRNG key or int seed of a random ``compressor``.
    compressed_mean: with a ``compressor``, ``"reduce_scatter"`` (``2 (n - 1) / n`` of a
      compact fragment a node) or ``"all_gather"`` (the exact mean of the decoded messages,
      ``n - 1`` compact fragments a node), as in `diloco`.

  Returns:
    An optax transform over node-stacked params (its ``update`` needs ``params`` and takes
    ``up``, see above) whose state is a `StreamingDiLoCoState`; non-float leaves are left
    alone.

  Raises:
    TypeError: ``inner`` is not an optax transform, or ``compressor`` is not a compressor.
    ValueError: a count or rate is out of range, ``compressed_mean`` or ``fragment_split``
      is none of its forms, or the params have fewer float leaves (entries, for
      ``"balanced"``) than fragments (at ``init``); at ``update``, ``up`` is not a bool per
      node.

  Example:
    Two fragments (one leaf each), H = 2: fragment 0 syncs at step 0, fragment 1 at step 1;
    from the same start, inner SGD keeps the nodes apart, and each sync gives that leaf one value:

    >>> import jax.numpy as jnp, optax, gossipjax as gj
    >>> tx = gj.streaming_diloco(optax.sgd(0.5), num_fragments=2, inner_steps=2, outer_momentum=0.0,
    ...                          outer_learning_rate=1.0)
    >>> x = {"a": jnp.zeros((2, 1)), "b": jnp.zeros((2, 1))}
    >>> target = jnp.array([[1.0], [3.0]])
    >>> state = tx.init(x)
    >>> u, state = tx.update({"a": x["a"] - target, "b": x["b"] - target}, state, x)
    >>> x = optax.apply_updates(x, u)
    >>> x["a"].ravel().tolist(), x["b"].ravel().tolist()
    ([1.0, 1.0], [0.5, 1.5])

    Partial participation: three nodes, node 2 down at step 0, when fragment 0 syncs over
    nodes 0 and 1 only; fragment 1 syncs at step 1 over all three; node 2, which missed
    fragment 0's outer step, keeps its own ``a`` until that fragment's next sync (step 2),
    where it rejoins from the others' outer params:

    >>> x = {"a": jnp.zeros((3, 1)), "b": jnp.zeros((3, 1))}
    >>> target = jnp.array([[1.0], [3.0], [6.0]])
    >>> state, show = tx.init(x), lambda v: [round(float(t), 4) for t in v.ravel()]
    >>> for up in ([True, True, False], [True, True, True], [True, True, True]):
    ...   u, state = tx.update({"a": x["a"] - target, "b": x["b"] - target}, state, x, up=jnp.array(up))
    ...   x = optax.apply_updates(x, u)
    ...   print(show(x["a"]), show(x["b"]))
    [1.0, 1.0, 0.0] [0.5, 1.5, 0.0]
    [1.0, 2.0, 3.0] [2.0, 2.0, 2.0]
    [1.75, 1.75, 1.75] [1.5, 2.5, 4.0]

    Compressed: each node's fragment pseudo-gradient quantized to 15 levels (4 bits, sent as
    int8 with a norm); the peak bytes a step are one compact fragment's:

    >>> x = {"a": jnp.zeros((4, 64), jnp.float32), "b": jnp.zeros((4, 64), jnp.float32)}
    >>> tx = gj.streaming_diloco(optax.sgd(0.1), num_fragments=2, inner_steps=2, compressor=gj.compress.qsgd(7))
    >>> gj.bytes_per_step(tx, x, steps=2).tolist()  # 3 int8 pieces of 16 and their norms, out and back
    [120.0, 120.0]

  References:
    Douillard, Donchev, Rush, Kale, Rusu, Charles, Garrett, Ranzato, Szlam et al. (2025),
    Streaming DiLoCo with overlapping communication: Towards a Distributed Free Lunch,
    arXiv:2501.18512.

    Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen (2023), DiLoCo:
    Distributed Low-Communication Training of Language Models, arXiv:2311.08105.
  """
  name = "gj.streaming_diloco"
  check_transform(inner, name, "inner", "optax.adamw(4e-4)")
  check_outer_rates(outer_learning_rate, outer_momentum, name)
  num_fragments = check_positive_int(num_fragments, name, "num_fragments")
  period = check_period(inner_steps, name, "inner_steps")
  if not isinstance(period, int) or period < num_fragments:
    raise ValueError(f"{name}: inner_steps must be an integer of at least num_fragments ({num_fragments}), "
                     f"got {inner_steps!r}")
  if not is_integer(overlap) or not (0 <= overlap and overlap * num_fragments < period):  # tau < H / F, exactly
    bound = (f"{period // num_fragments}" if period % num_fragments == 0
             else f"{period}/{num_fragments} = {period / num_fragments:.2f}")
    raise ValueError(f"{name}: overlap must be an integer in [0, inner_steps / num_fragments) = [0, {bound}), "
                     f"got {overlap!r}")
  overlap = int(overlap)
  check_in_range(mixing, name, "mixing", 0.0, 1.0)
  if fragment_split not in FRAGMENT_SPLITS:
    raise ValueError(f"{name}: fragment_split must be 'layers' or 'balanced', got {fragment_split!r}")
  check_mean_form(compressed_mean, name)
  check_compressor(compressor, name, "gj.compress.qsgd(7)")
  base_key = _raw_key(key, name)
  backend = resolve_backend(backend)
  outer = optax.sgd(outer_learning_rate, momentum=outer_momentum, nesterov=nesterov)
  inner_pn, outer_pn = per_node(inner, backend=backend), per_node(outer, backend=backend)
  sync_at = [((p + 1) * period) // num_fragments - 1 for p in range(num_fragments)]

  def plan_of(params):
    return check_fragments(jax.tree.leaves(params), num_fragments, fragment_split, name)

  def init_fn(params):
    anchor = jax.tree.map(jnp.copy, params)
    shape = node_shape(params)
    current = mapping()
    local = shape[0] if shape else (current.num_nodes if current is not None else 1)
    first_of_block = getattr(backend, "first_of_block", None)  # where the ranks or devices split the nodes
    index = node_index(0 if first_of_block is None else first_of_block(local), shape[0] if shape else 1)
    plan = plan_of(params)
    # One count per node (the product keeps it per node inside gj.nodes); two buffers each, as
    # a jitted step may donate the whole state.
    per_node_count = lambda start: follow_placement((0 * index + start).astype(jnp.int32), params)
    state = StreamingDiLoCoState(
        count=jnp.zeros([], jnp.int32), anchor=anchor, pending=jax.tree.map(jnp.zeros_like, params),
        inner_state=inner_pn.init(params),
        outer_states=tuple(outer_pn.init(pieces) for pieces in split_leaves(plan, jax.tree.leaves(params))),
        outer_steps=tuple(jnp.zeros([], jnp.int32) for _ in plan),
        synced=tuple(per_node_count(0) for _ in plan),
        joined=tuple(per_node_count(-1) for _ in plan))
    if compressor is None:
      return state
    keys = jnp.vectorize(lambda i: jax.random.fold_in(base_key, i), signature="()->(k)")(index)
    return state._replace(residual=optax.tree.zeros_like(params), key=follow_placement(keys, params))

  def fragment_mean(step: _Step, p: int, f: _Fragment, phi: list, takes_part: Participation | None) -> tuple:
    """The fragment's pseudo-gradient averaged over the nodes (the participants), and the new residuals."""
    with overlapping(overlap):  # gj.time_per_step hides this exchange behind the tau inner steps it overlaps
      if compressor is None:
        mean = node_average(backend, f.theta, name) if takes_part is None else takes_part.mean(f.theta)
        return [a - m for a, m in zip(phi, mean)], f.residual
      sent = compress_with_feedback(compressor, backend, name, [a - t for a, t in zip(phi, f.theta)], f.residual,
                                    step.key, (step.count // period) * num_fragments + p,
                                    error_feedback=error_feedback, form=compressed_mean, takes_part=takes_part)
      return mean_of_compressed(compressor, backend, name, sent, takes_part), sent.residual

  def sync(step: _Step, p: int, own: list[bool] | None, f: _Fragment) -> _Fragment:
    """Fragment p's sync: its pseudo-gradient averaged over the nodes that take part, pending until it lands."""
    r = step.count // period
    if not step.participation:
      pending, residual = fragment_mean(step, p, f, f.anchor, None)
      return f._replace(pending=pending, residual=residual, outer_steps=f.outer_steps + 1,
                        joined=jnp.zeros_like(f.joined) + r)
    # DiLoCo's rule, over this fragment: the nodes that hold its last result take part; one that
    # missed an outer step of the fragment takes the participants' outer params and state.
    takes_part, phi, outer_state = participants(step.ok, f.synced, f.outer_steps, f.anchor, f.outer_state, own,
                                                backend, name, step.dtype)
    pending, residual = fragment_mean(step, p, f, phi, takes_part)
    anyone = takes_part.frac > 0
    joins = step.ok & anyone
    return f._replace(anchor=phi, pending=select_nodes(joins, pending, f.pending), residual=residual,
                      outer_state=outer_state, outer_steps=f.outer_steps + anyone.astype(jnp.int32),
                      joined=jnp.where(joins, r, f.joined))

  def land(step: _Step, own: list[bool] | None, f: _Fragment) -> _Fragment:
    """``overlap`` steps after the sync: the outer step, on the nodes that took part and are live."""
    steps, new_state = outer_pn.update(f.pending, f.outer_state, f.anchor)
    new_phi = [a + s.astype(a.dtype) for a, s in zip(f.anchor, jax.tree.leaves(steps))]
    new_theta = [mixing * t + (1 - mixing) * a for t, a in zip(f.theta, new_phi)]
    if not step.participation:
      return f._replace(anchor=new_phi, theta=new_theta, outer_state=new_state, synced=f.synced + 1)
    receives = step.ok & (f.joined == (step.count - overlap) // period)
    return f._replace(anchor=select_nodes(receives, new_phi, f.anchor), theta=select_nodes(receives, new_theta, f.theta),
                      outer_state=select_nodes(receives, new_state, f.outer_state, own),
                      synced=jnp.where(receives, f.outer_steps, f.synced))

  def fragment_step(step: _Step, p: int, f: _Fragment) -> _Fragment:
    """Fragment p at one inner step: its sync at phase ``sync_at[p]``, its outer step ``overlap`` steps later."""
    # Which leaves of the outer state are one node's own (inside gj.nodes), read here: a cond's
    # branch is traced before it is mapped.
    own = own_leaves(f.outer_state) if mapping() is not None else None
    phase = step.count % period
    f = lax.cond(phase == sync_at[p], functools.partial(sync, step, p, own), lambda f: f, f)
    lands = (phase == (sync_at[p] + overlap) % period) & (step.count >= sync_at[p] + overlap)
    return lax.cond(lands, functools.partial(land, step, own), lambda f: f, f)

  def update_fn(updates, state, params=None, skip_nodes: SkipNodes | None = None, up: Any = None, **extra_args):
    require_params(params, name)
    for fault_arg in ("loss_key", "loss_prob", "delivered"):  # gj.asynchrony.synchronous's, for gj.asynchrony.faulty_mix
      extra_args.pop(fault_arg, None)
    up = None if up is None else node_mask(up, params, name)
    inner_updates, inner_state = inner_pn.update(updates, state.inner_state, params, **extra_args)
    inner_updates = jax.tree.map(lambda u, x: u.astype(x.dtype), inner_updates, params)
    participation = up is not None or skip_nodes is not None
    ok = live_nodes(up, skip_nodes, params)
    if participation:  # a node that is down (or skips, under gj.guard_finite) neither computes nor changes
      own_inner = own_leaves(inner_state) if mapping() is not None else None
      inner_state = select_nodes(ok, inner_state, state.inner_state, own_inner)
      inner_updates = select_nodes(ok, inner_updates, jax.tree.map(jnp.zeros_like, inner_updates))
    treedef, x = jax.tree.structure(params), jax.tree.leaves(params)
    theta = [p + u for p, u in zip(x, jax.tree.leaves(inner_updates))]
    anchor = jax.tree.leaves(state.anchor)
    dtype = jnp.result_type(jnp.float32, *[a.dtype for a in anchor])
    step = _Step(state.count, ok, participation, state.key, dtype)
    plan = plan_of(params)
    pieces = lambda tree: split_leaves(plan, jax.tree.leaves(tree))
    no_residual = [None] * len(plan)
    fragments = [fragment_step(step, p, _Fragment(*f)) for p, f in enumerate(zip(
        pieces(state.anchor), pieces(state.pending), no_residual if compressor is None else pieces(state.residual),
        split_leaves(plan, theta), state.outer_states, state.outer_steps, state.synced, state.joined))]
    leaves = lambda field: jax.tree.unflatten(treedef, join_leaves(plan, [getattr(f, field) for f in fragments], x))
    new_updates = zero_skipped(jax.tree.map(lambda t, p: t - p, leaves("theta"), params), skip_nodes)
    return new_updates, StreamingDiLoCoState(
        count=next_count(state.count), anchor=leaves("anchor"), pending=leaves("pending"), inner_state=inner_state,
        outer_states=tuple(f.outer_state for f in fragments),
        residual=None if compressor is None else leaves("residual"), key=state.key,
        outer_steps=tuple(f.outer_steps for f in fragments), synced=tuple(f.synced for f in fragments),
        joined=tuple(f.joined for f in fragments))

  return float_leaves_only(optax.GradientTransformationExtraArgs(init_fn, update_fn))
