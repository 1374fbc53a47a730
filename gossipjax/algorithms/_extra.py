"""EXTRA: the first exact first-order decentralized method."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax
from jax.typing import DTypeLike

from gossipjax.algorithms._common import primal_dual_method
from gossipjax.mixing import Backend
from gossipjax.algorithms._node_hyperparams import node_hyperparameters



class ExtraState(NamedTuple):
  """State of `extra`.

  Attributes:
    count: int32 scalar, the number of steps taken (the schedule's step).
    correction: ``c^k = W_tilde x^{k-1} - lr g^{k-1}`` of every node (``c^0 = x^0``),
      shaped like the params.
  """

  shared_over_nodes = ("count",)  # the step count every node holds alike (it picks W(k) and the rounds)

  count: jax.Array
  correction: Any  # \tilde W x^{k-1} - lr g^{k-1}  (x^0 before the first step)


@node_hyperparameters("learning_rate")
def extra(
    topology: Any,
    *,
    learning_rate: optax.ScalarOrSchedule,
    backend: Backend | None = None,
    state_dtype: DTypeLike | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""EXTRA (Shi, Ling, Wu and Yin, SIAM J. Optim. 2015), with ``\tilde W = (I + W) / 2``.

  .. math::
    x^1 &= W x^0 - \gamma \nabla f(x^0), \\
    x^{k+1} &= (I + W) x^k - \tilde W x^{k-1} - \gamma \big(\nabla f(x^k) - \nabla f(x^{k-1})\big).

  Summing the recursion, ``x^{k+1} = W x^k - \gamma \nabla f(x^k) + \sum_{t<k} (W - \tilde W) x^t``:
  the running sum is a dual correction that removes the inconsistency bias, so with
  full-batch gradients every node converges to the exact global minimiser. The state
  carries ``c^k = \tilde W x^{k-1} - \gamma \nabla f(x^{k-1})`` (``c^0 = x^0``) so that each
  step is one gossip round: ``x^{k+1} = x^k + W x^k - \gamma \nabla f(x^k) - c^k``.

  Kun Yuan ("Decentralized Optimization Algorithms for Large-Scale Deep Neural Network Training",
  lecture, 2021) writes EXTRA as ``x^{k+1} = W(2x^k - x^{k-1}) - \gamma(\ldots)``, i.e.
  ``\tilde W = W`` and ``2W - I`` in place of ``I + W``; that form diverges when W has an
  eigenvalue below ``-1/3`` (a ring of even size with weights 1/3 sits on that edge), while
  Shi et al.'s ``\tilde W = (I + W) / 2`` is stable for every symmetric doubly stochastic W.

  Args:
    topology: a static symmetric doubly stochastic W. Time-varying and directed W are
      refused (use ``gj.gradient_tracking``): on a directed W the correction can diverge.
    learning_rate: a float or an optax schedule.
    backend: where the nodes live (default: simulate).
    state_dtype: the correction's dtype, e.g. ``jnp.float32`` for bfloat16 params (W x is
      then combined with it in that dtype); ``None`` keeps the params'. The updates are in
      the params' dtype.

  Returns:
    An optax transform over node-stacked params (its ``update`` needs ``params``) whose
    state is an `ExtraState`.

  Raises:
    ValueError: the topology is time-varying or directed.

  Example:
    Heterogeneous quadratics ``f_i(x) = (x - b_i)^2 / 2`` on a ring of 4, from ``x^0 = b``:
    the first step is D-PSGD's, ``x^1 = W b`` (every gradient is zero there), after which the
    correction takes every node to the exact minimiser of the average, ``mean(b) = 1.5``:

    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> tx = gj.extra(gj.topology.ring(4), learning_rate=0.5)
    >>> x = b = jnp.arange(4.0)[:, None]
    >>> state, step = tx.init(x), jax.jit(tx.update)
    >>> trajectory = []
    >>> for _ in range(100):
    ...   u, state = step(x - b, state, x)
    ...   x = x + u
    ...   trajectory.append([round(float(v), 4) for v in x.ravel()])
    >>> trajectory[0], trajectory[-1]
    ([1.3333, 1.0, 2.0, 1.6667], [1.5, 1.5, 1.5, 1.5])

  References:
    Shi, Ling, Wu, Yin (2015), EXTRA: An Exact First-Order Algorithm for Decentralized
    Consensus Optimization, SIAM Journal on Optimization 25(2).

    Yuan (2021), Decentralized Optimization Algorithms for Large-Scale Deep Neural Network
    Training, lecture at Zhejiang University: the primal-dual methods.
  """
  return primal_dual_method("gj.extra", "EXTRA", topology, backend, learning_rate, state_dtype, ExtraState,
                            _corrected_step)


def _corrected_step(mix, params, grads, correction, lr):
  """x+ = x + W x - lr g - c, c+ = (x + W x) / 2 - lr g, in c's dtype."""
  mixed = mix(params)
  step = jax.tree.map(lambda wx, g, c: wx.astype(c.dtype) - (lr * g).astype(c.dtype), mixed, grads, correction)
  updates = jax.tree.map(lambda s, c, x: (s - c).astype(x.dtype), step, correction, params)
  correction = jax.tree.map(lambda x, wx, g, c: 0.5 * (x.astype(c.dtype) + wx.astype(c.dtype)) - (lr * g).astype(c.dtype),
                            params, mixed, grads, correction)
  return updates, correction
