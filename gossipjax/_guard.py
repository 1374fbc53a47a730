"""``guard_finite``: a node whose gradient or update has a NaN or inf skips its step instead of poisoning the graph."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gossipjax._axis import mapping, shared_leaves
from gossipjax.backend._base import follow_placement


class GuardFiniteState(NamedTuple):
  """State of `guard_finite`.

  Attributes:
    inner_state: the wrapped transform's state.
    nonfinite_count: int32 (nodes,), how many steps each node has skipped in all.
    consecutive: int32 (nodes,), how many steps in a row each node has skipped, up to now.
    max_consecutive: int32 scalar, the streak at which `check_guard` raises (0: never).
  """

  shared_over_nodes = ("max_consecutive",)  # the streak limit, the same for every node
  # A node's non-finite step is skipped before the method inside exchanges: a per-node gate
  # (optax.apply_if_finite inside gj.chain) around it passes no NaN on.
  guards_what_it_sends = True

  inner_state: Any
  nonfinite_count: jax.Array
  consecutive: jax.Array
  max_consecutive: jax.Array


class SkipNodes(NamedTuple):
  """The nodes that skip this step: the extra arg ``skip_nodes`` that `gj.guard_finite` hands down.

  A value, not a channel: the guard and the transforms it wraps agree through what they
  declare and pass, never by writing to a shared object while tracing. A transform that
  mixes (``gj.mix``, the outer-optimizer transforms, or a custom method) takes part by

  1. saying so in its state: its state class sets the class attribute
     ``zeroes_skipped_nodes = True`` (as `gj.MixState` does). The guard looks for such a
     state anywhere in the wrapped transform's state (chains, ``inject_hyperparams``,
     ``MultiSteps``); only then does it pass ``skip_nodes``;
  2. zeroing the local update (or gradient) of these nodes before it mixes, with
     `zero_skipped`, so a skipped node sends its current params and still receives its
     neighbours'.

  Where the guard finds no such state, it zeroes the skipped nodes' final updates itself:
  they are frozen for the step.

  Attributes:
    mask: bool (nodes,), True for the nodes that skip this step; the node axis is the
      leading axis of the node-stacked updates (inside ``gj.per_node`` a transform sees
      one node and has no node axis: `zero_skipped` refuses such leaves).

  Example:
    >>> import jax.numpy as jnp, gossipjax as gj
    >>> skip = gj.SkipNodes(jnp.array([False, True, False, False]))
    >>> gj.zero_skipped(jnp.ones((4, 2)), skip)[:, 0].tolist()  # what gj.mix does before it mixes
    [1.0, 0.0, 1.0, 1.0]
    >>> gj.MixState.zeroes_skipped_nodes  # how gj.mix tells the guard it does
    True
  """

  mask: jax.Array


def _per_node(mask: jax.Array, x: jax.Array) -> jax.Array:
  return mask.reshape((-1,) + (1,) * (x.ndim - 1))


def zero_skipped(updates: Any, skip_nodes: SkipNodes | None) -> Any:
  """Zeroes the updates of the nodes in ``skip_nodes`` (a no-op when it is ``None``).

  The hook by which a custom method cooperates with `gj.guard_finite` (see `SkipNodes`):
  call it on the local update (or gradient) before mixing, so that a node with a
  non-finite gradient sends its current params and still receives its neighbours'.

  Args:
    updates: a pytree whose leaves carry the node axis.
    skip_nodes: the extra arg ``skip_nodes`` the transform's ``update`` received, or ``None``.

  Returns:
    ``updates`` with the skipped nodes' rows set to zero.

  Raises:
    ValueError: a leaf's leading axis is not the mask's node axis (e.g. one node's leaf,
      inside ``gj.per_node``).

  Example:
    >>> import jax.numpy as jnp, gossipjax as gj
    >>> skip = gj.SkipNodes(jnp.array([False, True, False]))
    >>> gj.zero_skipped(jnp.ones((3, 2)), skip).tolist()
    [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
  """
  if skip_nodes is None:
    return updates
  mask = skip_nodes.mask
  if jnp.ndim(mask) == 0:  # one node, inside gj.nodes: its own flag
    return jax.tree.map(lambda u: jnp.where(mask, jnp.zeros_like(u), u), updates)
  n = mask.shape[0]

  def zero(u):
    if jnp.ndim(u) == 0 or jnp.shape(u)[0] != n:
      raise ValueError(f"gj.zero_skipped: a leaf of shape {jnp.shape(u)} has no leading node axis of {n}, the "
                       "size of the skip mask; call it on node-stacked updates (inside gj.per_node a transform "
                       "sees one node, and gj.guard_finite skips that node's step itself)")
    return jnp.where(_per_node(mask, u), jnp.zeros_like(u), u)

  return jax.tree.map(zero, updates)


def _zeroes_skipped_nodes(state: Any) -> bool:
  """Whether a transform whose state is (in) ``state`` zeroes skipped nodes before mixing (see `SkipNodes`)."""
  marked = lambda s: getattr(type(s), "zeroes_skipped_nodes", False) is True
  return any(marked(s) for s in jax.tree.leaves(state, is_leaf=marked))


def _num_nodes(tree: Any, what: str) -> int | None:
  """The leading node axis of ``tree``; ``None`` for one node (inside ``gj.nodes``)."""
  if mapping() is not None:
    return None
  leaves = jax.tree.leaves(tree)
  if not leaves:
    raise ValueError(f"gj.guard_finite: {what} has no leaves")
  sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
  if len(sizes) != 1 or None in sizes:
    raise ValueError(f"gj.guard_finite: every leaf of {what} needs the same leading node axis, got sizes {sizes}")
  (n,) = sizes
  assert n is not None  # refused above
  return n


def _bad_nodes(tree: Any, n: int | None) -> jax.Array:
  """Per node, whether any floating-point leaf of ``tree`` holds a NaN or inf (other leaves are finite)."""
  # A sum over a node's axes, not a (n, -1) reshape, which a leaf split over a node's devices on an
  # Explicit mesh (P("nodes", None, "model")) cannot take without a layout for the merged axis.
  counts = [(~jnp.isfinite(x)).sum(dtype=jnp.float32) if n is None
            else (~jnp.isfinite(x)).sum(axis=tuple(range(1, x.ndim)), dtype=jnp.float32)
            for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  if not counts:
    return jnp.zeros(() if n is None else (n,), bool)
  # XLA copies a chain of cheap element-wise ops into the fusion of every consumer (here each leaf's select):
  # an ``|`` over 130 leaves, copied into 130 selects, made a ResNet-20 step compile in 26 s (10 s now). A square root
  # is an op XLA does not copy, so the sum over the leaves is computed once.
  return jnp.sqrt(functools.reduce(jnp.add, counts)) > 0


def _keep_old_for_bad(new: Any, old: Any, bad: jax.Array, n: int | None) -> Any:
  """Per-node leaves (leading axis n, numeric) of bad nodes go back to their old values.

  For one node (``n`` is ``None``, inside ``gj.nodes``) every leaf is kept, its own step
  counts included, but those its state classes declare one value for every node
  (``shared_over_nodes``: the count that picks W(k)), which advance.
  """
  if n is None:
    # One node: all of its state (moments, trackers, its own step counts) is kept; the leaves
    # its state classes declare one value for every node (the count that picks W(k)) advance.
    leaves, treedef = jax.tree.flatten(new)
    shared = shared_leaves(new)

    def pick_one(a, b, shared):
      keep = not shared and jnp.shape(a) == jnp.shape(b) and not jnp.issubdtype(a.dtype, jax.dtypes.prng_key)
      return jnp.where(bad, b, a) if keep else a

    return jax.tree.unflatten(treedef, [pick_one(a, b, f) for a, b, f in zip(leaves, treedef.flatten_up_to(old), shared)])

  def pick(a, b):
    if (isinstance(a, jax.Array) and a.ndim >= 1 and a.shape[0] == n and a.shape == jnp.shape(b)
        and not jnp.issubdtype(a.dtype, jax.dtypes.prng_key)):
      return jnp.where(_per_node(bad, a), b, a)
    return a

  return jax.tree.map(pick, new, old)


def guard_finite(inner: optax.GradientTransformation,
                 max_consecutive: int | None = 10) -> optax.GradientTransformationExtraArgs:
  r"""Wraps ``inner`` so that a node with a NaN/inf gradient or update skips its step.

  At every step each node's gradient is checked (all leaves). For a node ``i`` with a
  non-finite entry anywhere:

  1. its gradient is replaced by zeros before ``inner`` sees it, so nothing non-finite
     enters any computation;
  2. its local update is zero: ``gj.mix`` (hence ``gossip_sgd``, ``chain(adam, mix)`` and
     every chain built on it) is told which nodes skip (the extra arg ``skip_nodes``, a
     `SkipNodes`) and mixes ``x_i + 0``, so node i still sends its current, finite params
     and still receives its neighbours':
     :math:`x_i^{k+1} = \sum_j w_{ij}(x_j^k + u_j^k)` with :math:`u_i^k = 0`. The average
     over nodes is preserved as usual. A custom method takes part in the same way (see
     `SkipNodes`): its state class declares ``zeroes_skipped_nodes = True`` and its
     ``update`` passes its local update (or gradient) through `gj.zero_skipped` before it
     mixes. For an ``inner`` whose state declares no such transform (a purely local
     optimizer, ``gj.per_node(...)``, ``decentlam``) the guard zeroes node i's final update
     instead: node i is frozen for the step (its neighbours then mixed its finite params,
     computed with a zero gradient);
  3. its per-node state (every leaf of ``inner``'s state whose leading axis is the node
     axis: momentum, Adam moments, trackers) is kept as it was before the step, so the
     skipped gradient leaves no trace. Inside ``gj.chain`` / ``gj.nodes`` a node's whole
     state is its own and is kept, its optimizer's step counts included; the counts that
     gossipjax's states declare one value for every node (the schedule and the time-varying
     W(k)) advance, so the nodes stay in step.

  The update ``inner`` returns is checked too, node by node: a NaN learning rate from a
  schedule, or a step that overflows, makes it non-finite from finite gradients. Such a
  node skips the step in the same way: its update is zero and its per-node state is kept
  (a NaN learning rate therefore skips the step on every node). Where a node's NaN
  reached its neighbours through mixing, they skip too.

  ``nonfinite_count`` (see `gj.nonfinite_counts`) counts the skipped steps per node, for
  either cause, and
  ``consecutive`` the current streak; `gj.check_guard` raises ``FloatingPointError``
  naming the node once a streak reaches ``max_consecutive``. Under a backend that splits
  the nodes (MPI, sharded) the guard sees, and counts, the local block of nodes.

  Args:
    inner: any optax transform over stacked (node-axis) params.
    max_consecutive: the streak of skipped steps at which `check_guard` raises; ``None``
      or 0 never raises.

  Returns:
    An optax transform with the same updates as ``inner`` for the nodes whose gradient and
    update are finite, whose state is a `GuardFiniteState` around ``inner``'s.

  Raises:
    ValueError: ``max_consecutive`` is not a non-negative integer or ``None``.

  Example:
    >>> import jax.numpy as jnp, gossipjax as gj
    >>> tx = gj.guard_finite(gj.gossip_sgd(gj.topology.ring(4), learning_rate=0.1))
    >>> x = jnp.zeros((4, 2))
    >>> g = jnp.ones((4, 2)).at[1, 0].set(jnp.nan)
    >>> u, state = tx.update(g, tx.init(x), x)
    >>> gj.nonfinite_counts(state).tolist(), bool(jnp.isfinite(u).all())
    ([0, 1, 0, 0], True)
  """
  if max_consecutive is None:
    max_consecutive = 0
  if isinstance(max_consecutive, bool) or not isinstance(max_consecutive, (int, np.integer)) or max_consecutive < 0:
    raise ValueError(f"gj.guard_finite: max_consecutive must be a non-negative integer or None, got {max_consecutive!r}")
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    n = _num_nodes(params, "params")
    # Two buffers, not one array twice: a jitted step may donate the whole state.
    zeros = lambda: jnp.zeros([], jnp.int32) if n is None else follow_placement(jnp.zeros((n,), jnp.int32), params)
    return GuardFiniteState(inner.init(params), zeros(), zeros(), jnp.asarray(max_consecutive, jnp.int32))

  def update_fn(updates, state, params=None, **extra_args):
    grads = updates  # optax's name for the incoming tree; the guard checks gradients
    n = _num_nodes(grads, "the gradients")
    if n is not None and n != state.nonfinite_count.shape[0]:
      n = state.nonfinite_count.shape[0]
      raise ValueError(f"gj.guard_finite: the gradients have {_num_nodes(grads, 'the gradients')} nodes on the "
                       f"leading axis but the state was initialised for {n}")
    bad = _bad_nodes(grads, n)
    outer_skip = extra_args.pop("skip_nodes", None)  # a guard around this one
    if outer_skip is not None:
      bad = bad | outer_skip.mask
    safe = jax.tree.map(lambda g: jnp.where(_per_node(bad, g), jnp.zeros_like(g), g), grads)
    # Decided from the state's structure, so the same at every trace and on every backend.
    cooperates = _zeroes_skipped_nodes(state.inner_state)
    if cooperates:
      extra_args = {**extra_args, "skip_nodes": SkipNodes(bad)}
    updates, inner_state = inner.update(safe, state.inner_state, params, **extra_args)
    # The gradient check cannot see a NaN learning rate or an overflow inside ``inner``.
    bad_update = _bad_nodes(updates, n)
    skipped = bad | bad_update
    updates = zero_skipped(updates, SkipNodes(bad_update if cooperates else skipped))
    inner_state = _keep_old_for_bad(inner_state, state.inner_state, skipped, n)
    bad_i = skipped.astype(jnp.int32)
    return updates, GuardFiniteState(
        inner_state=inner_state,
        nonfinite_count=state.nonfinite_count + bad_i,
        consecutive=(state.consecutive + 1) * bad_i,
        max_consecutive=state.max_consecutive,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _find_guard_state(state: Any) -> GuardFiniteState:
  found = [s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, GuardFiniteState))
           if isinstance(s, GuardFiniteState)]
  if not found:
    raise ValueError("no guard_finite state in this optimizer state: wrap the optimizer with gj.guard_finite")
  if len(found) > 1:
    raise ValueError(f"this optimizer state holds {len(found)} guard_finite states; pass the one you mean")
  return found[0]


def nonfinite_counts(state: Any) -> np.ndarray:
  """Per node, how many steps `guard_finite` skipped for a NaN/inf gradient or update (a host NumPy array).

  Args:
    state: the optimizer state, or any tree holding exactly one `guard_finite` state.

  Returns:
    An int32 NumPy array of shape (nodes,): the skipped steps of every node so far.

  Raises:
    ValueError: ``state`` holds no `guard_finite` state, or more than one.

  Example:
    >>> import jax.numpy as jnp, optax, gossipjax as gj
    >>> tx = gj.chain(optax.scale(2.0), gj.guard_finite(gj.gossip_sgd(gj.topology.ring(4), learning_rate=0.1)))
    >>> x = jnp.zeros((4, 1))
    >>> state = tx.init(x)
    >>> for g in (jnp.ones((4, 1)).at[2].set(jnp.nan), jnp.ones((4, 1)).at[2:].set(jnp.inf)):
    ...   _, state = tx.update(g, state, x)
    >>> gj.nonfinite_counts(state).tolist()  # found inside the chain's state
    [0, 0, 2, 1]
  """
  return np.asarray(_find_guard_state(state).nonfinite_count)


def check_guard(state: Any, step: int, first_node: int = 0) -> None:
  """Raises ``FloatingPointError`` when a node has skipped ``max_consecutive`` steps in a row.

  Call it on the host in the training loop (it reads a few integers from the device), e.g.
  after every step or every log interval; a node that keeps producing NaN gradients is a
  bug or a diverged run, not noise to skip forever.

  Args:
    state: the optimizer state (holding one `guard_finite` state).
    step: the step just taken, for the message.
    first_node: the global index of the first local node (MPI ranks hold a block of nodes).

  Raises:
    FloatingPointError: a node's streak of skipped steps reached ``max_consecutive``.
    ValueError: ``state`` holds no `guard_finite` state, or more than one.

  Example:
    >>> import jax.numpy as jnp, gossipjax as gj
    >>> tx = gj.guard_finite(gj.gossip_sgd(gj.topology.ring(4), learning_rate=0.1), max_consecutive=2)
    >>> x, g = jnp.zeros((4, 1)), jnp.ones((4, 1)).at[3].set(jnp.nan)
    >>> state = tx.init(x)
    >>> for step in range(2):
    ...   _, state = tx.update(g, state, x)
    ...   gj.check_guard(state, step)
    Traceback (most recent call last):
    ...
    FloatingPointError: node 3 had a NaN/inf gradient or update at 2 consecutive steps, the last at step 1 ...
  """
  guard = _find_guard_state(state)
  limit = int(guard.max_consecutive)
  if limit <= 0:
    return
  streak = np.asarray(guard.consecutive)
  stuck = np.flatnonzero(streak >= limit)
  if stuck.size:
    i = int(stuck[0])
    others = f" (also node(s) {', '.join(str(int(j) + first_node) for j in stuck[1:6])})" if stuck.size > 1 else ""
    raise FloatingPointError(
        f"node {i + first_node} had a NaN/inf gradient or update at {int(streak[i])} consecutive steps, "
        f"the last at step {step} (limit max_consecutive={limit}){others}; its data or its params have gone bad"
    )
