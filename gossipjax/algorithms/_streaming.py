"""Streaming DiLoCo: DiLoCo's outer step, one fragment of the params at a time, overlapping communication."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gossipjax._nodes import per_node
from gossipjax._validation import check_in_range, check_period, check_positive_int, require_params
from gossipjax.algorithms._outer import _check_outer_rates, _check_transform
from gossipjax.mixing import Backend, float_leaves_only, resolve_backend
from gossipjax.mixing._contract import next_count
from gossipjax.mixing._named import node_average


class StreamingDiLoCoState(NamedTuple):
  """State of `streaming_diloco`.

  Attributes:
    count: int32 scalar, the inner steps taken.
    anchor: the outer params ``phi`` (each node's copy), shaped like the params.
    pending: each fragment's averaged pseudo-gradient, sent at its sync step and applied
      ``overlap`` steps later; shaped like the params.
    inner_state: the inner transform's state, one per node.
    outer_states: one outer optimizer state per fragment (over that fragment's leaves).
  """

  count: jax.Array
  anchor: Any
  pending: Any
  inner_state: Any
  outer_states: tuple


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
  :math:`\tau = 0` and :math:`\alpha = 0` it is `diloco`.

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

  Returns:
    An optax transform over node-stacked params (its ``update`` needs ``params``) whose
    state is a `StreamingDiLoCoState`; non-float leaves are left alone.

  Raises:
    TypeError: ``inner`` is not an optax transform.
    ValueError: a count or rate is out of range, or the params have fewer float leaves
      than fragments (at ``init``).

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

  References:
    Douillard, Donchev, Rush, Kale, Rusu, Charles, Garrett, Ranzato, Szlam et al. (2025),
    Streaming DiLoCo with overlapping communication: Towards a Distributed Free Lunch,
    arXiv:2501.18512.
  """
  name = "gj.streaming_diloco"
  _check_transform(inner, name, "inner", "optax.adamw(4e-4)")
  _check_outer_rates(outer_learning_rate, outer_momentum, name)
  num_fragments = check_positive_int(num_fragments, name, "num_fragments")
  period = check_period(inner_steps, name, "inner_steps")
  if not isinstance(period, int) or period < num_fragments:
    raise ValueError(f"{name}: inner_steps must be an integer of at least num_fragments ({num_fragments}), "
                     f"got {inner_steps!r}")
  if isinstance(overlap, bool) or not isinstance(overlap, int) or not 0 <= overlap < period // num_fragments:
    raise ValueError(f"{name}: overlap must be an integer in [0, inner_steps / num_fragments) = "
                     f"[0, {period // num_fragments}), got {overlap!r}")
  check_in_range(mixing, name, "mixing", 0.0, 1.0)
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
    return StreamingDiLoCoState(
        count=jnp.zeros([], jnp.int32), anchor=anchor, pending=jax.tree.map(jnp.zeros_like, params),
        inner_state=inner_pn.init(params),
        outer_states=tuple(outer_pn.init([leaves[i] for i in g]) for g in groups_of(params)))

  def update_fn(updates, state, params=None, **extra_args):
    require_params(params, name)
    inner_updates, inner_state = inner_pn.update(updates, state.inner_state, params, **extra_args)
    treedef = jax.tree.structure(params)
    x = jax.tree.leaves(params)
    theta = [p + u.astype(p.dtype) for p, u in zip(x, jax.tree.leaves(inner_updates))]
    anchor, pending = jax.tree.leaves(state.anchor), jax.tree.leaves(state.pending)
    outer_states = list(state.outer_states)
    phase = state.count % period
    for p, group in enumerate(groups_of(params)):

      def sync(pend, group=group):  # the fragment's all-reduce: its averaged pseudo-gradient
        return node_average(backend, [anchor[i] - theta[i] for i in group], name)

      frag_pending = lax.cond(phase == sync_at[p], sync, lambda pend: pend, [pending[i] for i in group])

      def apply(operands, group=group):
        phi, th, outer_state, pend = operands
        steps, outer_state = outer_pn.update(pend, outer_state, phi)
        phi = [a + s.astype(a.dtype) for a, s in zip(phi, jax.tree.leaves(steps))]
        th = [mixing * t + (1 - mixing) * a for t, a in zip(th, phi)]
        return phi, th, outer_state, pend

      phi, th, outer_states[p], frag_pending = lax.cond(
          (phase == (sync_at[p] + overlap) % period) & (state.count >= sync_at[p] + overlap), apply, lambda operands: operands,
          ([anchor[i] for i in group], [theta[i] for i in group], outer_states[p], frag_pending))
      for k, i in enumerate(group):
        anchor[i], theta[i], pending[i] = phi[k], th[k], frag_pending[k]
    new_updates = [t - p for t, p in zip(theta, x)]
    return jax.tree.unflatten(treedef, new_updates), StreamingDiLoCoState(
        count=next_count(state.count), anchor=jax.tree.unflatten(treedef, anchor),
        pending=jax.tree.unflatten(treedef, pending), inner_state=inner_state, outer_states=tuple(outer_states))

  return float_leaves_only(optax.GradientTransformationExtraArgs(init_fn, update_fn))
