"""Quasi-global momentum: decentralized momentum SGD for heterogeneous data."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import DTypeLike

from gossipjax._validation import check_in_range, check_learning_rate, check_momentum
from gossipjax.algorithms._common import check_state_dtype, start_step
from gossipjax.mixing import Backend, float_leaves_only, make_mixer
from gossipjax.mixing._contract import next_count
from gossipjax.algorithms._node_hyperparams import node_hyperparameters



class QGMomentumState(NamedTuple):
  """State of `qg_dmsgd`.

  Attributes:
    count: int32 scalar, the number of steps taken (the schedule's step and W's index).
    momentum: the quasi-global momentum ``m_hat_i`` of every node, shaped like the params.
  """

  shared_over_nodes = ("count",)  # the step count every node holds alike (it picks W(k) and the rounds)

  count: jax.Array
  momentum: Any  # the quasi-global momentum m_hat_i


@node_hyperparameters("learning_rate", "beta")
def qg_dmsgd(
    topology: Any,
    beta: float = 0.0,
    *,
    learning_rate: optax.ScalarOrSchedule,
    mu: float | None = None,
    backend: Backend | None = None,
    state_dtype: DTypeLike | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Quasi-global momentum DSGD, QG-DSGDm (Lin, Karimireddy, Stich and Jaggi, ICML 2021).

  The local heavy-ball step uses a momentum built from the model's actual displacement
  after gossip, a cheap estimate of the global update direction, rather than from the
  node's own gradients (Algorithm 1 of the paper):

  .. math::
    d_i^k &= \nabla F_i(x_i^k) + \beta \hat m_i^k, \qquad
    x_i^{k+1} = \sum_j w_{ij} (x_j^k - \gamma_k d_j^k), \\
    \hat m_i^{k+1} &= \mu \hat m_i^k + (1 - \mu) \frac{x_i^k - x_i^{k+1}}{\gamma_k},
    \qquad \hat m^0 = 0.

  At a fixed point the displacement and hence ``\hat m`` vanish, so the full-batch bias is
  D-PSGD's ``O(\gamma^2 b^2 / (1 - \rho)^2)``, not DmSGD's, which grows as ``(1 - \beta)^{-2}``.
  A step whose learning rate is exactly 0 leaves the momentum unchanged.

  Args:
    topology: doubly stochastic mixing.
    beta: heavy-ball coefficient in [0, 1); 0, the default in every gossipjax method, reduces
      the method to D-PSGD (the paper uses 0.9).
    learning_rate: a float or an optax schedule.
    mu: averaging rate of the quasi-global momentum, in [0, 1]. The default, ``beta``, is the
      paper's Algorithm 1; the authors' code uses ``mu = 0.1`` whatever ``beta`` is, so the two
      agree only at ``beta = 0.9``: pass ``mu=0.1`` to match that code.
    backend: where the nodes live (default: simulate).
    state_dtype: the quasi-global momentum's dtype, e.g. ``jnp.float32`` for bfloat16 params
      (the displacement is then read in it, before the update is rounded); ``None`` keeps
      the params'. The updates are in the params' dtype.

  Returns:
    An optax transform over node-stacked params (its ``update`` needs ``params``) whose
    state is a `QGMomentumState`.

  Example:
    With a zero gradient the first step is one gossip round, and the momentum becomes
    ``(1 - mu)`` times the displacement per unit learning rate, ``(x^0 - x^1) / \gamma``:

    >>> import jax.numpy as jnp, gossipjax as gj
    >>> tx = gj.qg_dmsgd(gj.topology.ring(4), beta=0.9, learning_rate=0.1)
    >>> x = jnp.arange(4.0)[:, None]
    >>> u, state = tx.update(jnp.zeros_like(x), tx.init(x), x)
    >>> [round(float(v), 4) for v in (x + u).ravel()]
    [1.3333, 1.0, 2.0, 1.6667]
    >>> [round(float(v), 4) for v in state.momentum.ravel()]
    [-1.3333, 0.0, 0.0, 1.3333]

  References:
    Lin, Karimireddy, Stich, Jaggi (2021), Quasi-Global Momentum: Accelerating Decentralized
    Deep Learning on Heterogeneous Data, ICML.
  """
  check_learning_rate(learning_rate, "gj.qg_dmsgd")
  check_momentum(beta, "gj.qg_dmsgd")
  state_dtype = check_state_dtype(state_dtype, "gj.qg_dmsgd")
  mixer = make_mixer(topology, backend, name="gj.qg_dmsgd")
  mu = beta if mu is None else mu
  check_in_range(mu, "gj.qg_dmsgd", "mu", 0.0, 1.0)

  def init_fn(params):
    return QGMomentumState(count=jnp.zeros([], jnp.int32), momentum=optax.tree.zeros_like(params, state_dtype))

  def update_fn(updates, state, params=None, **extra_args):
    grads = updates  # optax's name for the incoming tree; these methods take gradients
    del extra_args
    lr = start_step("gj.qg_dmsgd", mixer, params, learning_rate, state.count)
    half = jax.tree.map(lambda x, g, m: x - (lr * (g + beta * m)).astype(x.dtype), params, grads, state.momentum)
    mixed = mixer.mix(half, state.count)
    updates = jax.tree.map(lambda w, x: (w - x).astype(x.dtype), mixed, params)
    safe_lr = jnp.where(lr == 0, 1, lr)

    def momentum(m, w, x):
      displacement = jnp.where(lr == 0, m, (x.astype(m.dtype) - w.astype(m.dtype)) / safe_lr.astype(m.dtype))
      return (mu * m + (1 - mu) * displacement).astype(m.dtype)

    return updates, QGMomentumState(count=next_count(state.count),
                                    momentum=jax.tree.map(momentum, state.momentum, mixed, params))

  return float_leaves_only(optax.GradientTransformationExtraArgs(init_fn, update_fn))
