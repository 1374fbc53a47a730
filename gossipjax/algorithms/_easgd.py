"""Elastic averaging SGD (EASGD): workers tied to a moving center by an elastic force."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.typing import DTypeLike

from gossipjax._validation import check_in_range, check_learning_rate, check_period, require_node_axis, require_params
from gossipjax.algorithms._common import check_state_dtype, copy_of, in_state_dtype, is_abstract, learning_rate_at
from gossipjax.mixing import Backend, float_leaves_only, resolve_backend
from gossipjax.mixing._collectives import node_average
from gossipjax.mixing._contract import next_count
from gossipjax.algorithms._node_hyperparams import node_hyperparameters



class EASGDState(NamedTuple):
  """State of `easgd`.

  Attributes:
    count: int32 scalar, the number of steps taken (the elastic terms apply when
      ``count % every == 0``).
    center: the center variable ``x_tilde``, one equal copy per node (leading node axis),
      shaped like the params.
  """

  shared_over_nodes = ("count",)  # the step count every node holds alike (it picks W(k) and the rounds)

  count: jax.Array
  center: Any  # the center variable x_tilde, one (equal) copy per node


@node_hyperparameters("learning_rate", "alpha", "center_rate")
def easgd(
    *,
    learning_rate: optax.ScalarOrSchedule,
    alpha: float = 0.05,
    center_rate: float = 0.9,
    every: int = 1,
    backend: Backend | None = None,
    state_dtype: DTypeLike | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Synchronous elastic averaging SGD (EASGD), the centralized elastic baseline.

  From Zhang, Choromanska and LeCun (NeurIPS 2015); the baseline of Wongpanich, You and
  Demmel, "Rethinking the Value of Asynchronous Solvers for Distributed Deep Learning"
  (HPC Asia 2020).

  Each worker is pulled towards a center variable ``\tilde x`` and the center towards the
  workers' average (the paper's equations (5)-(6); the elastic terms are applied every
  ``tau = every`` steps, the communication period):

  .. math::
    x_i^{k+1} &= x_i^k - \gamma_k \nabla F_i(x_i^k) - \alpha (x_i^k - \tilde x^k), \\
    \tilde x^{k+1} &= \tilde x^k + \beta \Big(\frac{1}{n} \sum_i x_i^k - \tilde x^k\Big),
    \qquad \tilde x^0 = \frac{1}{n} \sum_i x_i^0.

  ``center_rate`` is the paper's ``beta`` (renamed here because ``beta`` is the momentum in
  every other gossipjax method). The paper's symmetric choice is ``beta = n alpha`` (then
  ``sum_i x_i + \tilde x`` is conserved); it recommends ``beta = 0.9``. The center lives on a parameter server in the
  paper; here every node holds a copy, updated with the backend's all-reduce mean.
  EASGD has no gossip topology: it is the centralized baseline next to gossip methods.

  Args:
    learning_rate: a float or an optax schedule.
    alpha: elastic pull of each worker towards the center, in [0, 1].
    center_rate: ``beta`` in the paper, the moving rate of the center towards the
      workers' average, in [0, 1].
    every: tau, a positive integer: apply the elastic terms every ``every`` steps (local
      SGD in between).
    backend: where the nodes live (default: simulate); provides the all-reduce mean.
    state_dtype: the center's dtype, e.g. ``jnp.float32`` for bfloat16 params (the workers'
      average is then taken in it); ``None`` keeps the params'. The updates are in the
      params' dtype.

  Returns:
    An optax transform over node-stacked params (its ``update`` needs ``params``) whose
    state is an `EASGDState`; ``init`` sets the center to the node average.

  Example:
    With a zero gradient every worker moves a quarter of the way to the center (the
    average, 1.5), and the center, already at the workers' average, stays:

    >>> import jax.numpy as jnp, gossipjax as gj
    >>> tx = gj.easgd(learning_rate=0.1, alpha=0.25, center_rate=0.5)
    >>> x = jnp.arange(4.0)[:, None]
    >>> u, state = tx.update(jnp.zeros_like(x), tx.init(x), x)
    >>> (x + u).ravel().tolist()
    [0.375, 1.125, 1.875, 2.625]
    >>> state.center.ravel().tolist()
    [1.5, 1.5, 1.5, 1.5]

  References:
    Zhang, Choromanska, LeCun (2015), Deep Learning with Elastic Averaging SGD, NeurIPS.

    Wongpanich, You, Demmel (2020), Rethinking the Value of Asynchronous Solvers for
    Distributed Deep Learning, HPC Asia (International Conference on High Performance
    Computing in Asia-Pacific Region).
  """
  check_learning_rate(learning_rate, "gj.easgd")
  check_in_range(alpha, "gj.easgd", "alpha", 0.0, 1.0)
  check_in_range(center_rate, "gj.easgd", "center_rate", 0.0, 1.0)
  period = check_period(every, "gj.easgd")
  state_dtype = check_state_dtype(state_dtype, "gj.easgd")
  backend = resolve_backend(backend)
  wide = lambda params: jax.tree.map(lambda x: in_state_dtype(x, state_dtype), params)

  def init_fn(params):
    require_node_axis(params, "gj.easgd")
    if is_abstract(params):
      return EASGDState(count=jnp.zeros([], jnp.int32), center=copy_of(params, state_dtype))
    return EASGDState(count=jnp.zeros([], jnp.int32), center=node_average(backend, wide(params), "gj.easgd"))

  def update_fn(updates, state, params=None, **extra_args):
    grads = updates  # optax's name for the incoming tree; these methods take gradients
    del extra_args
    require_params(params, "gj.easgd")
    require_node_axis(params, "gj.easgd")
    lr = learning_rate_at(learning_rate, state.count)
    sgd = jax.tree.map(lambda g, x: (-lr * g).astype(x.dtype), grads, params)

    def elastic(sgd):
      updates = jax.tree.map(lambda u, x, c: (u - alpha * (x - c)).astype(x.dtype), sgd, params, state.center)
      mean = node_average(backend, wide(params), "gj.easgd")
      center = jax.tree.map(lambda c, m: (c + center_rate * (m - c)).astype(c.dtype), state.center, mean)
      return updates, center

    updates, center = lax.cond(state.count % period == 0, elastic, lambda sgd: (sgd, state.center), sgd)
    return updates, EASGDState(count=next_count(state.count), center=center)

  return float_leaves_only(optax.GradientTransformationExtraArgs(init_fn, update_fn))
