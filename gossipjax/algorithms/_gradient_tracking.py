"""Gradient tracking (DIGing): exact convergence on static and time-varying graphs, and its tracker alone."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import DTypeLike

from gossipjax._validation import check_learning_rate, check_node_axis
from gossipjax.algorithms._common import check_state_dtype, start_step
from gossipjax.mixing import Backend, float_leaves_only, make_mixer
from gossipjax.mixing._contract import next_count
from gossipjax.algorithms._node_hyperparams import node_hyperparameters



class GradientTrackingState(NamedTuple):
  """State of `gradient_tracking` and of `gradient_tracker`.

  Attributes:
    count: int32 scalar, the number of steps taken (the schedule's step and W's index).
    correction: ``c^k = W^{(k-1)} y^{k-1} - g^{k-1}`` of every node (``c^0 = 0``), so that
      the tracker is ``y^k = c^k + g^k``; shaped like the params.
  """

  shared_over_nodes = ("count",)  # the step count every node holds alike (it picks W(k) and the rounds)

  count: jax.Array
  correction: Any  # W(k-1) y^{k-1} - g^{k-1}, so that the tracker is y^k = correction + g^k


@node_hyperparameters("learning_rate")
def gradient_tracking(
    topology: Any,
    *,
    learning_rate: optax.ScalarOrSchedule,
    backend: Backend | None = None,
    state_dtype: DTypeLike | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Gradient tracking, DIGing (Nedic, Olshevsky and Shi, SIAM J. Optim. 2017).

  Each node keeps a tracker ``y_i`` of the network-average gradient and descends along it,
  so the data heterogeneity causes no bias: with full-batch gradients every node converges
  to the exact global minimiser, on static or time-varying doubly stochastic W:

  .. math::
    x^{k+1} = W^{(k)} x^k - \gamma y^k, \qquad
    y^{k+1} = W^{(k)} y^k + \nabla f(x^{k+1}) - \nabla f(x^k), \qquad y^0 = \nabla f(x^0).

  An optax update at step k receives only ``g^k = \nabla f(x^k)``, so the state carries
  ``c^k = W^{(k-1)} y^{k-1} - g^{k-1}`` (``c^0 = 0``) and the step reads
  ``y^k = c^k + g^k``, ``x^{k+1} = W^{(k)} x^k - \gamma y^k``, ``c^{k+1} = W^{(k)} y^k - g^k``:
  the same iterates, and x and y travel in one gossip round per step.

  Args:
    topology: doubly stochastic mixing, static or time-varying.
    learning_rate: a float or an optax schedule (``gamma_k`` multiplies ``y^k``).
    backend: where the nodes live (default: simulate).
    state_dtype: the dtype of the correction, hence of the tracker ``y`` (which is formed
      and mixed in it), e.g. ``jnp.float32`` for bfloat16 params; ``None`` keeps the params'.
      The updates are in the params' dtype.

  Returns:
    An optax transform over node-stacked params (its ``update`` needs ``params``) whose
    state is a `GradientTrackingState`.

  Example:
    >>> import jax.numpy as jnp, gossipjax as gj
    >>> tx = gj.gradient_tracking(gj.topology.one_peer_exponential(8), learning_rate=0.1)
    >>> x = jnp.zeros((8, 3))
    >>> updates, state = tx.update(jnp.ones((8, 3)), tx.init(x), x)  # y^0 = g^0
    >>> round(float(updates[0, 0]), 6)
    -0.1

  References:
    Nedić, Olshevsky, Shi (2017), Achieving Geometric Convergence for Distributed
    Optimization over Time-Varying Graphs, SIAM Journal on Optimization 27(4).
  """
  check_learning_rate(learning_rate, "gj.gradient_tracking")
  state_dtype = check_state_dtype(state_dtype, "gj.gradient_tracking")
  mixer = make_mixer(topology, backend, name="gj.gradient_tracking")

  def init_fn(params):
    return GradientTrackingState(count=jnp.zeros([], jnp.int32), correction=optax.tree.zeros_like(params, state_dtype))

  def update_fn(updates, state, params=None, **extra_args):
    grads = updates  # optax's name for the incoming tree; these methods take gradients
    del extra_args
    lr = start_step("gj.gradient_tracking", mixer, params, learning_rate, state.count)
    tracker = jax.tree.map(lambda c, g: c + g.astype(c.dtype), state.correction, grads)
    mixed_x, mixed_y = mixer.mix((params, tracker), state.count)
    updates = jax.tree.map(lambda wx, x, y: (wx - lr * y).astype(x.dtype) - x, mixed_x, params, tracker)
    correction = jax.tree.map(lambda wy, g: wy - g.astype(wy.dtype), mixed_y, grads)
    return updates, GradientTrackingState(count=next_count(state.count), correction=correction)

  return float_leaves_only(optax.GradientTransformationExtraArgs(init_fn, update_fn))


def gradient_tracker(
    topology: Any,
    *,
    backend: Backend | None = None,
    state_dtype: DTypeLike | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Replaces each node's gradient by its gradient tracker, for any local optimizer to follow.

  The tracking half of gradient tracking as a transform of its own: node i's incoming
  update ``g_i^k`` (its gradient) leaves as its tracker of the network-average gradient,

  .. math::
    y^k = W^{(k-1)} y^{k-1} + g^k - g^{k-1}, \qquad y^0 = g^0,

  one gossip round of ``y`` per step. ``gj.chain(gj.gradient_tracker(W), optax.adam(lr),
  gj.mix(W))`` is gradient tracking with a per-node Adam step of the tracker, as in GTAdam
  (Carnevale, Farina, Notarnicola and Notarstefano 2023), each node stepping before it
  gossips: ``x^{k+1} = W^{(k)}(x^k - lr adam(y^k))``, x and y each a round per step. At a
  fixed point every tracker holds the average gradient, which must then be zero, so on
  heterogeneous data the nodes converge to the global minimiser where decentralized Adam
  (``gj.chain(optax.adam(lr), gj.mix(W))``) stops short of it. With ``optax.sgd(lr)`` in
  place of Adam the step is ``x^{k+1} = W^{(k)}(x^k - lr y^k)``, where `gradient_tracking`
  (DIGing) takes ``W^{(k)} x^k - lr y^k`` and sends x and y in one round.

  The trackers sum to the gradients at every step (W doubly stochastic). Put the tracker
  first in the chain: a transform before it (Adam's direction, clipping) would be tracked
  in place of the gradient, and its bias kept (the algorithms guide measures both orders).

  Args:
    topology: doubly stochastic mixing, static or time-varying (the ``y`` round of step
      k uses ``W^{(k)}``, as `gradient_tracking` does).
    backend: where the nodes live (default: the ``gj.backend.use`` block's, else simulate).
    state_dtype: the dtype in which the tracker is formed, mixed and kept, e.g.
      ``jnp.float32`` for bfloat16 gradients; ``None`` keeps the gradients'. The tracker
      leaves in the gradients' dtype.

  Returns:
    An optax transform (on stacked trees, or for one node inside ``gj.chain``) whose state is a
    `GradientTrackingState`; its ``update`` does not need ``params``. Non-float leaves
    pass through untracked.

  Raises:
    ValueError: W is not doubly stochastic (a directed graph: see `sgp`, or row and
      column mixing in `gj.mixing.make_mixer`), or the gradients' node axis does not
      match the topology.

  Example:
    >>> import jax.numpy as jnp, optax, gossipjax as gj
    >>> tracker = gj.gradient_tracker(gj.topology.ring(4))
    >>> g = jnp.arange(4.0)[:, None]
    >>> y, state = tracker.update(g, tracker.init(g))       # y^0 = g^0
    >>> y, state = tracker.update(g, state)                 # W y^0 + g - g
    >>> [round(float(v), 4) for v in y.ravel()], float(y.sum())   # the sum is kept
    ([1.3333, 1.0, 2.0, 1.6667], 6.0)
    >>> tx = gj.chain(gj.gradient_tracker(gj.topology.ring(4)), optax.adam(1e-3), gj.mix(gj.topology.ring(4)))

  References:
    Nedić, Olshevsky, Shi (2017), Achieving Geometric Convergence for Distributed
    Optimization over Time-Varying Graphs, SIAM Journal on Optimization 27(4).

    Carnevale, Farina, Notarnicola, Notarstefano (2023), GTAdam: Gradient Tracking with
    Adaptive Momentum for Distributed Online Optimization, IEEE Transactions on Control of
    Network Systems 10(3).
  """
  state_dtype = check_state_dtype(state_dtype, "gj.gradient_tracker")
  mixer = make_mixer(topology, backend, name="gj.gradient_tracker")

  def init_fn(params):
    return GradientTrackingState(count=jnp.zeros([], jnp.int32), correction=optax.tree.zeros_like(params, state_dtype))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    check_node_axis(updates, mixer.local_nodes, "gj.gradient_tracker", mixer.topology.name, what="gradients")
    tracker = jax.tree.map(lambda c, g: c + g.astype(c.dtype), state.correction, updates)
    correction = jax.tree.map(lambda wy, g: wy - g.astype(wy.dtype), mixer.mix(tracker, state.count), updates)
    tracked = jax.tree.map(lambda y, g: y.astype(g.dtype), tracker, updates)
    return tracked, GradientTrackingState(count=next_count(state.count), correction=correction)

  return float_leaves_only(optax.GradientTransformationExtraArgs(init_fn, update_fn), keep_other_updates=True)
