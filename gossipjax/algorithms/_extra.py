"""EXTRA: the first exact first-order decentralized method."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gossipjax._validation import (check_learning_rate, check_node_axis, require_params, require_static,
                                   require_symmetric)
from gossipjax.algorithms._common import copy_of, learning_rate_at
from gossipjax.mixing import Backend, float_leaves_only, make_mixer



class ExtraState(NamedTuple):
  """State of `extra`.

  Attributes:
    count: int32 scalar, the number of steps taken (the schedule's step).
    correction: ``c^k = W_tilde x^{k-1} - lr g^{k-1}`` of every node (``c^0 = x^0``),
      shaped like the params.
  """

  count: jax.Array
  correction: Any  # \tilde W x^{k-1} - lr g^{k-1}  (x^0 before the first step)


def extra(
    topology: Any,
    *,
    learning_rate: optax.ScalarOrSchedule,
    backend: Backend | None = None,
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

  Returns:
    An optax transform over node-stacked params (its ``update`` needs ``params``) whose
    state is an `ExtraState`.

  Raises:
    ValueError: the topology is time-varying or directed.

  Example:
    Heterogeneous quadratics ``f_i(x) = (x - b_i)^2 / 2`` on a ring of 4: with full-batch
    gradients every node reaches the exact minimiser of the average, ``mean(b) = 1.5``
    (D-PSGD, ``gj.gossip_sgd``, stops at a biased ``[1.37, 1.23, 1.77, 1.63]``):

    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> tx = gj.extra(gj.topology.ring(4), learning_rate=0.5)
    >>> b = jnp.arange(4.0)[:, None]
    >>> x = jnp.zeros((4, 1))
    >>> state, step = tx.init(x), jax.jit(tx.update)
    >>> for _ in range(100):
    ...   u, state = step(x - b, state, x)
    ...   x = x + u
    >>> [round(float(v), 4) for v in x.ravel()]
    [1.5, 1.5, 1.5, 1.5]

  References:
    Shi, Ling, Wu, Yin (2015), EXTRA: An Exact First-Order Algorithm for Decentralized
    Consensus Optimization, SIAM Journal on Optimization 25(2).

    Yuan (2021), Decentralized Optimization Algorithms for Large-Scale Deep Neural Network
    Training, lecture at Zhejiang University: the primal-dual methods.
  """
  check_learning_rate(learning_rate, "gj.extra")
  mixer = make_mixer(topology, backend)
  require_static(mixer.topology, "gj.extra")
  require_symmetric(mixer.topology, "gj.extra", "EXTRA")

  def init_fn(params):
    # A copy, not a view: a jitted step that donates both params and state needs distinct buffers.
    return ExtraState(count=jnp.zeros([], jnp.int32), correction=copy_of(params))

  def update_fn(grads, state, params=None, **extra_args):
    del extra_args
    require_params(params, "gj.extra")
    check_node_axis(params, mixer.local_nodes, "gj.extra", mixer.topology.name)
    lr = learning_rate_at(learning_rate, state.count)
    mixed = mixer.mix(params, state.count)
    step = jax.tree.map(lambda wx, g: wx - (lr * g).astype(wx.dtype), mixed, grads)
    updates = jax.tree.map(lambda s, c: (s - c).astype(c.dtype), step, state.correction)
    correction = jax.tree.map(lambda x, wx, g: 0.5 * (x + wx) - (lr * g).astype(x.dtype), params, mixed, grads)
    return updates, ExtraState(count=optax.safe_increment(state.count), correction=correction)

  return float_leaves_only(optax.GradientTransformationExtraArgs(init_fn, update_fn))
