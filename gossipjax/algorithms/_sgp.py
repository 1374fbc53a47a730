"""Stochastic Gradient Push: push-sum SGD on directed, time-varying graphs."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import DTypeLike

from gossipjax._validation import check_learning_rate, check_momentum
from gossipjax.algorithms._common import check_state_dtype, in_state_dtype, start_step
from gossipjax.mixing import Backend, float_leaves_only, follow_placement, make_mixer
from gossipjax.mixing._collectives import node_shape
from gossipjax.mixing._contract import next_count
from gossipjax.algorithms._node_hyperparams import node_hyperparameters



class SGPState(NamedTuple):
  """State of `sgp`.

  Attributes:
    count: int32 scalar, the number of steps taken (the schedule's step and P's index).
    push_weight: (nodes,) the push-sum weights ``w_i`` (``w^0 = 1``); the params are
      ``z_i / w_i``.
    momentum: the local momentum ``u_i`` of every node, shaped like the params.
  """

  shared_over_nodes = ("count",)  # the step count every node holds alike (it picks W(k) and the rounds)

  count: jax.Array
  push_weight: jax.Array  # (nodes,) the push-sum weights w_i; params are z_i / w_i
  momentum: Any


@node_hyperparameters("learning_rate", "beta")
def sgp(
    topology: Any,
    beta: float = 0.0,
    *,
    learning_rate: optax.ScalarOrSchedule,
    backend: Backend | None = None,
    state_dtype: DTypeLike | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Stochastic Gradient Push (Assran, Loizou, Ballas and Rabbat, ICML 2019).

  Push-sum gossip on a column-stochastic ``P^{(k)}`` (every node splits what it sends; no
  node needs to know who sends to it), interleaved with local (momentum) SGD. Node i keeps
  a numerator ``z_i`` and a scalar weight ``w_i``; the de-biased ``x_i = z_i / w_i`` is the
  model (the params this transform sees, where gradients are taken):

  .. math::
    u_i^{k+1} &= \beta u_i^k + \nabla F_i(x_i^k), \qquad
    z_i^{k+1/2} = z_i^k - \gamma_k u_i^{k+1}, \\
    z^{k+1} &= P^{(k)} z^{k+1/2}, \qquad w^{k+1} = P^{(k)} w^k, \qquad
    x_i^{k+1} = z_i^{k+1} / w_i^{k+1}, \qquad w^0 = 1.

  Column stochasticity preserves ``sum_i z_i`` and ``sum_i w_i = n``, so with zero gradients
  every ``x_i`` converges to the exact initial average even when P is not doubly
  stochastic (where plain averaging of z would be biased). ``z = w x`` is recomputed from
  the params each step, as the authors' implementation does.

  Args:
    topology: column-stochastic mixing (rows receive: ``P[i, j]`` is the share node j
      pushes to i), possibly directed and time-varying, e.g.
      ``gj.topology.one_peer_directed_exponential(n)``.
    learning_rate: a float or an optax schedule.
    beta: local momentum coefficient in [0, 1); 0, the default in every gossipjax method, is
      plain SGP (the paper uses 0.9).
    backend: where the nodes live (default: simulate).
    state_dtype: the dtype of the momentum and the push-sum weights, in which the
      numerators ``z = w x`` are formed and mixed, e.g. ``jnp.float32`` for bfloat16 params;
      ``None`` keeps the params'. The updates are in the params' dtype.

  Returns:
    An optax transform over node-stacked params (its ``update`` needs ``params``, the
    de-biased ``x_i``) whose state is an `SGPState`.

  Example:
    >>> import jax.numpy as jnp, gossipjax as gj
    >>> tx = gj.sgp(gj.topology.one_peer_directed_exponential(4), learning_rate=0.1)
    >>> x = jnp.arange(4.0)[:, None]
    >>> state = tx.init(x)
    >>> for _ in range(2):  # one period of the one-peer graph: exact averaging
    ...   u, state = tx.update(jnp.zeros_like(x), state, x)
    ...   x = x + u
    >>> x.ravel().tolist()
    [1.5, 1.5, 1.5, 1.5]

  References:
    Assran, Loizou, Ballas, Rabbat (2019), Stochastic Gradient Push for Distributed Deep
    Learning, ICML.

    Kempe, Dobra, Gehrke (2003), Gossip-Based Computation of Aggregate Information, FOCS
    (push-sum).
  """
  check_learning_rate(learning_rate, "gj.sgp")
  check_momentum(beta, "gj.sgp")
  state_dtype = check_state_dtype(state_dtype, "gj.sgp")
  mixer = make_mixer(topology, backend, stochastic="column", name="gj.sgp")

  def init_fn(params):
    leaves = jax.tree.leaves(params)
    if not leaves:
      raise ValueError("gj.sgp: params have no leaves")
    dtype = state_dtype or jnp.result_type(*[x.dtype for x in leaves])
    return SGPState(
        count=jnp.zeros([], jnp.int32),
        push_weight=follow_placement(jnp.ones(node_shape(params), dtype), params),
        momentum=optax.tree.zeros_like(params, state_dtype),
    )

  def update_fn(updates, state, params=None, **extra_args):
    grads = updates  # optax's name for the incoming tree; these methods take gradients
    del extra_args
    lr = start_step("gj.sgp", mixer, params, learning_rate, state.count)
    per_node = lambda w, x: w.astype(x.dtype).reshape((-1,) + (1,) * (x.ndim - 1))
    momentum = jax.tree.map(lambda m, g: (beta * m + g).astype(m.dtype), state.momentum, grads)
    wide = jax.tree.map(lambda x: in_state_dtype(x, state_dtype), params)
    z_half = jax.tree.map(lambda x, u: per_node(state.push_weight, x) * x - (lr * u).astype(x.dtype), wide, momentum)
    z, w = mixer.mix((z_half, state.push_weight), state.count)
    updates = jax.tree.map(lambda zi, x: (zi / per_node(w, zi)).astype(x.dtype) - x, z, params)
    return updates, SGPState(count=next_count(state.count), push_weight=w, momentum=momentum)

  return float_leaves_only(optax.GradientTransformationExtraArgs(init_fn, update_fn))
