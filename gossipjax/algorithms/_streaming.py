"""Streaming DiLoCo: DiLoCo's outer step, one fragment of the params at a time, overlapping communication."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gossipjax._axis import mapping
from gossipjax._guard import SkipNodes, zero_skipped
from gossipjax._mapping import per_node
from gossipjax._validation import check_in_range, check_period, check_positive_int, require_params
from gossipjax.algorithms._choco import _raw_key
from gossipjax.algorithms._compressed_mean import compress_with_feedback, mean_of_compressed
from gossipjax.algorithms._outer_optimizer import check_outer_rates, check_transform
from gossipjax.algorithms._participation import node_mask, participants, select_nodes
from gossipjax.compress import Compressor
from gossipjax.mixing import Backend, float_leaves_only, follow_placement, resolve_backend
from gossipjax.mixing._contract import next_count
from gossipjax.mixing._named import (node_average, node_index, node_shape, varies_over_nodes)


class StreamingDiLoCoState(NamedTuple):
  """State of `streaming_diloco`.

  Attributes:
    count: int32 scalar, the inner steps taken.
    anchor: the outer params ``phi`` (each node's copy), shaped like the params.
    pending: each fragment's averaged pseudo-gradient, sent at its sync step and applied
      ``overlap`` steps later; shaped like the params.
    inner_state: the inner transform's state, one per node.
    outer_states: one outer optimizer state per fragment (over that fragment's leaves).
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


def fragments(leaves: list[Any], num_fragments: int) -> list[list[int]]:
  """Splits leaf indices, in order, into ``num_fragments`` contiguous groups of about equal size."""
  sizes = [int(jnp.size(x)) for x in leaves]
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


def streaming_diloco(
    inner: optax.GradientTransformation,
    *,
    num_fragments: int,
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

  Douillard et al. (2025). The params' leaves are split, in order, into F fragments of about
  equal size. Every node runs ``inner`` on all its params at every step; fragment p is
  synchronised every H steps, at the steps t with :math:`t \bmod H = (p+1)H/F - 1`, so the
  fragments take turns and at most one fragment crosses the network at a time: the peak
  bytes per step are 1/F of DiLoCo's. At its sync step the fragment's pseudo-gradients are
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
  that is down neither computes nor changes: its params and its own inner-state leaves are
  kept, and the step counts every node shares advance. At fragment p's sync step the mean
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
    num_fragments: F, at least 1 and at most the number of float leaves.
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
    ValueError: a count or rate is out of range, ``compressed_mean`` is neither form, or the
      params have fewer float leaves than fragments (at ``init``); at ``update``, ``up`` is
      not a bool per node.

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
  if isinstance(overlap, bool) or not isinstance(overlap, int) or not 0 <= overlap < period // num_fragments:
    raise ValueError(f"{name}: overlap must be an integer in [0, inner_steps / num_fragments) = "
                     f"[0, {period // num_fragments}), got {overlap!r}")
  check_in_range(mixing, name, "mixing", 0.0, 1.0)
  if compressed_mean not in ("reduce_scatter", "all_gather"):
    raise ValueError(f"{name}: compressed_mean must be 'reduce_scatter' or 'all_gather', got {compressed_mean!r}")
  if compressor is not None and not isinstance(compressor, Compressor):
    raise TypeError(f"{name}: compressor must be a gj.compress compressor (e.g. gj.compress.qsgd(7)) or None, "
                    f"got {type(compressor).__name__} {compressor!r}")
  with jax.ensure_compile_time_eval():  # concrete even when built inside a trace (optax.inject_hyperparams)
    base_key = _raw_key(key, name)
  backend = resolve_backend(backend)
  outer = optax.sgd(outer_learning_rate, momentum=outer_momentum, nesterov=nesterov)
  inner_pn, outer_pn = per_node(inner, backend=backend), per_node(outer, backend=backend)
  sync_at = [((p + 1) * period) // num_fragments - 1 for p in range(num_fragments)]

  def groups_of(params):
    leaves = jax.tree.leaves(params)
    if len(leaves) < num_fragments:
      raise ValueError(f"{name}: num_fragments={num_fragments} needs at least as many float leaves, but the params "
                       f"have {len(leaves)}")
    return fragments(leaves, num_fragments)

  def init_fn(params):
    leaves = jax.tree.leaves(params)
    anchor = jax.tree.map(jnp.copy, params)
    shape = node_shape(params)
    current = mapping()
    local = shape[0] if shape else (current.num_nodes if current is not None else 1)
    first_of_block = getattr(backend, "first_of_block", None)  # where the ranks or devices split the nodes
    index = node_index(0 if first_of_block is None else first_of_block(local), shape[0] if shape else 1)
    groups = groups_of(params)
    # One count per node (the product keeps it per node inside gj.nodes); two buffers each, as
    # a jitted step may donate the whole state.
    per_node_count = lambda start: follow_placement((0 * index + start).astype(jnp.int32), params)
    state = StreamingDiLoCoState(
        count=jnp.zeros([], jnp.int32), anchor=anchor, pending=jax.tree.map(jnp.zeros_like, params),
        inner_state=inner_pn.init(params),
        outer_states=tuple(outer_pn.init([leaves[i] for i in g]) for g in groups),
        outer_steps=tuple(jnp.zeros([], jnp.int32) for _ in groups),
        synced=tuple(per_node_count(0) for _ in groups),
        joined=tuple(per_node_count(-1) for _ in groups))
    if compressor is None:
      return state
    keys = jnp.vectorize(lambda i: jax.random.fold_in(base_key, i), signature="()->(k)")(index)
    return state._replace(residual=optax.tree.zeros_like(params), key=follow_placement(keys, params))

  def update_fn(updates, state, params=None, skip_nodes: SkipNodes | None = None, up: Any = None, **extra_args):
    require_params(params, name)
    for fault_arg in ("loss_key", "loss_prob", "delivered"):  # gj.asynchrony.synchronous's, for gj.asynchrony.faulty_mix
      extra_args.pop(fault_arg, None)
    up = None if up is None else node_mask(up, params, name)
    inner_updates, inner_state = inner_pn.update(updates, state.inner_state, params, **extra_args)
    inner_updates = jax.tree.map(lambda u, x: u.astype(x.dtype), inner_updates, params)
    in_mapping = mapping() is not None
    participation = up is not None or skip_nodes is not None
    ok = jnp.ones(node_shape(params), bool)
    if participation:  # a node that is down (or skips, under gj.guard_finite) neither computes nor changes
      ok = ok if up is None else up
      if skip_nodes is not None:
        ok = ok & ~skip_nodes.mask
      own_inner = varies_over_nodes(inner_state, unknown=True) if in_mapping else None
      inner_state = select_nodes(ok, inner_state, state.inner_state, own_inner)
      inner_updates = select_nodes(ok, inner_updates, jax.tree.map(jnp.zeros_like, inner_updates))
    treedef = jax.tree.structure(params)
    x = jax.tree.leaves(params)
    theta = [p + u for p, u in zip(x, jax.tree.leaves(inner_updates))]
    anchor, pending = jax.tree.leaves(state.anchor), jax.tree.leaves(state.pending)
    residual = None if compressor is None else jax.tree.leaves(state.residual)
    outer_states, outer_steps = list(state.outer_states), list(state.outer_steps)
    synced, joined = list(state.synced), list(state.joined)
    # Which leaves of the outer states are one node's own (inside gj.nodes), read here: a cond's
    # branch is traced before it is mapped.
    own_outer = [varies_over_nodes(s, unknown=True) if in_mapping else None for s in outer_states]
    dtype = jnp.result_type(jnp.float32, *[a.dtype for a in anchor])
    count, phase = state.count, state.count % period
    for p, group in enumerate(groups_of(params)):
      th_p = [theta[i] for i in group]

      def send(operands, p=p, th_p=th_p):
        """The fragment's sync: its pseudo-gradient averaged over the nodes that take part."""
        phi, pend, res, outer_state, steps, syn, jnd = operands
        r = count // period
        if not participation:
          if compressor is None:
            new_pend = [a - m for a, m in zip(phi, node_average(backend, th_p, name))]
          else:
            sent = compress_with_feedback(compressor, backend, name, [a - t for a, t in zip(phi, th_p)], res,
                                          state.key, r * num_fragments + p, error_feedback=error_feedback,
                                          form=compressed_mean)
            new_pend, res = mean_of_compressed(compressor, backend, name, sent), sent.residual
          return phi, new_pend, res, outer_state, steps + 1, syn, jnp.zeros_like(jnd) + r
        # DiLoCo's rule: the nodes that hold the fragment's last result take part; one that
        # missed an outer step of the fragment takes the participants' outer params and state.
        takes_part, phi, outer_state = participants(ok, syn, steps, phi, outer_state, own_outer[p], backend, name,
                                                    dtype)
        if compressor is None:
          new_pend = [a - m for a, m in zip(phi, takes_part.mean(th_p))]
        else:
          sent = compress_with_feedback(compressor, backend, name, [a - t for a, t in zip(phi, th_p)], res,
                                        state.key, r * num_fragments + p, error_feedback=error_feedback,
                                        form=compressed_mean, takes_part=takes_part)
          new_pend, res = mean_of_compressed(compressor, backend, name, sent, takes_part), sent.residual
        anyone = takes_part.frac > 0
        joins = ok & anyone
        return (phi, select_nodes(joins, new_pend, pend), res, outer_state, steps + anyone.astype(jnp.int32), syn,
                jnp.where(joins, r, jnd))

      frag_res = None if residual is None else [residual[i] for i in group]
      phi, frag_pending, frag_res, outer_states[p], outer_steps[p], synced[p], joined[p] = lax.cond(
          phase == sync_at[p], send, lambda operands: operands,
          ([anchor[i] for i in group], [pending[i] for i in group], frag_res, outer_states[p], outer_steps[p],
           synced[p], joined[p]))

      def land(operands, p=p, pend=frag_pending):
        """``overlap`` steps after the sync: the outer step, on the nodes that took part and are live."""
        phi, th, outer_state, syn = operands
        steps, new_state = outer_pn.update(pend, outer_state, phi)
        new_phi = [a + s.astype(a.dtype) for a, s in zip(phi, jax.tree.leaves(steps))]
        new_th = [mixing * t + (1 - mixing) * a for t, a in zip(th, new_phi)]
        if not participation:
          return new_phi, new_th, new_state, syn + 1
        receives = ok & (joined[p] == (count - overlap) // period)
        return (select_nodes(receives, new_phi, phi), select_nodes(receives, new_th, th),
                select_nodes(receives, new_state, outer_state, own_outer[p]), jnp.where(receives, outer_steps[p], syn))

      phi, th, outer_states[p], synced[p] = lax.cond(
          (phase == (sync_at[p] + overlap) % period) & (count >= sync_at[p] + overlap), land, lambda o: o,
          (phi, th_p, outer_states[p], synced[p]))
      for k, i in enumerate(group):
        anchor[i], theta[i], pending[i] = phi[k], th[k], frag_pending[k]
        if residual is not None and frag_res is not None:
          residual[i] = frag_res[k]
    new_updates = zero_skipped(jax.tree.unflatten(treedef, [t - p for t, p in zip(theta, x)]), skip_nodes)
    return new_updates, StreamingDiLoCoState(
        count=next_count(state.count), anchor=jax.tree.unflatten(treedef, anchor),
        pending=jax.tree.unflatten(treedef, pending), inner_state=inner_state, outer_states=tuple(outer_states),
        residual=None if residual is None else jax.tree.unflatten(treedef, residual), key=state.key,
        outer_steps=tuple(outer_steps), synced=tuple(synced), joined=tuple(joined))

  return float_leaves_only(optax.GradientTransformationExtraArgs(init_fn, update_fn))
