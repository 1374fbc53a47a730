"""Periodic global averaging (DSGD-PGA): an all-reduce every H steps."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gossipjax._validation import check_period, require_node_axis, require_params
from gossipjax.mixing import Backend, float_leaves_only, resolve_backend
from gossipjax.mixing._collectives import node_average
from gossipjax.mixing._contract import next_count



class PeriodicAverageState(NamedTuple):
  """State of `periodic_average`.

  Attributes:
    count: int32 scalar, the number of steps taken; the global average is taken when
      ``count % every == every - 1``.
  """

  shared_over_nodes = ("count",)  # the step count every node holds alike (it picks W(k) and the rounds)

  count: jax.Array


def periodic_average(every: int, *, backend: Backend | None = None) -> optax.GradientTransformationExtraArgs:
  r"""Replaces every node's model by the global average every ``every`` steps.

  Chained after any gossip method, this is decentralized SGD with periodic global
  averaging, DSGD-PGA (Chen, Yuan, Zhang, Pan, Xu and Yin, ICML 2021; also in Kun Yuan's
  lecture "Decentralized Optimization Algorithms for Large-Scale Deep Neural Network Training",
  2021): the cheap gossip steps run in between, and one all-reduce every H steps bounds the
  consensus distance independently of the spectral gap of W.

  .. math::
    x^{k+1} = \begin{cases} \frac{1}{n} \mathbf{1}\mathbf{1}^\top (x^k + u^k) & k \bmod H = H - 1 \\
                            x^k + u^k & \text{otherwise.} \end{cases}

  Args:
    every: H, a positive integer, the period of the global average.
    backend: where the nodes live (default: simulate); provides the all-reduce.

  Returns:
    An optax transform of updates, to chain after a gossip method (its ``update`` needs
    ``params``), whose state is a `PeriodicAverageState`.

  Example:
    Every second step ends in the global average (here with zero gradients: one gossip
    round, then the average):

    >>> import jax.numpy as jnp, optax, gossipjax as gj
    >>> tx = gj.chain(gj.gossip_sgd(gj.topology.ring(4), learning_rate=0.1), gj.periodic_average(2))
    >>> x = jnp.arange(4.0)[:, None]
    >>> state = tx.init(x)
    >>> for _ in range(2):
    ...   u, state = tx.update(jnp.zeros_like(x), state, x)
    ...   x = x + u
    ...   print([round(float(v), 4) for v in x.ravel()])
    [1.3333, 1.0, 2.0, 1.6667]
    [1.5, 1.5, 1.5, 1.5]

  References:
    Chen, Yuan, Zhang, Pan, Xu, Yin (2021), Accelerating Gossip SGD with Periodic Global
    Averaging, ICML.
  """
  period = check_period(every, "gj.periodic_average")
  backend = resolve_backend(backend)

  def init_fn(params):
    require_node_axis(params, "gj.periodic_average")
    return PeriodicAverageState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    require_params(params, "gj.periodic_average")
    require_node_axis(params, "gj.periodic_average")
    updates = jax.tree.map(lambda u, x: u.astype(x.dtype), updates, params)

    def average(updates):
      new = node_average(backend, jax.tree.map(lambda x, u: x + u, params, updates), "gj.periodic_average")
      return jax.tree.map(lambda m, x: (m - x).astype(x.dtype), new, params)

    new_updates = lax.cond(state.count % period == period - 1, average, lambda u: u, updates)
    return new_updates, PeriodicAverageState(count=next_count(state.count))

  return float_leaves_only(optax.GradientTransformationExtraArgs(init_fn, update_fn), keep_other_updates=True)
