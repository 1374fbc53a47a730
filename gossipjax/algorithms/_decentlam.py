"""DecentLaM: decentralized large-batch momentum SGD."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import DTypeLike

from gossipjax._validation import check_learning_rate, check_momentum
from gossipjax.algorithms._common import check_state_dtype, start_step
from gossipjax.mixing import Backend, float_leaves_only, make_mixer
from gossipjax.mixing._contract import next_count
from gossipjax.algorithms._node_hyperparams import node_hyperparameters



def _check_symmetric(topology, beta) -> None:
  """DecentLaM assumes a symmetric W (assumption A.3 in Kun Yuan, "Decentralized Optimization
  Algorithms for Large-Scale Deep Neural Network Training", lecture, 2021); on a directed graph its
  heavy-ball consensus recursion ``x+ = W x + beta (x - x_prev)`` can be unstable."""
  if topology.is_symmetric():
    return
  detail = ""
  n = topology.num_nodes
  if n <= 256 and isinstance(beta, (int, float, np.integer, np.floating)):
    w = topology.matrix(0)
    companion = np.block([[w + beta * np.eye(n), -beta * np.eye(n)], [np.eye(n), np.zeros((n, n))]])
    radius = float(np.max(np.abs(np.linalg.eigvals(companion))))
    detail = f" (here its spectral radius is {radius:.3f} at beta={beta}{': it diverges' if radius > 1 + 1e-9 else ''})"
  raise ValueError(
      f"gj.decentlam: needs a symmetric W, but {topology.name} is directed: DecentLaM's recursion "
      f"x+ = W x + beta (x - x_prev) is only analysed, and only stable in general, for symmetric W{detail}. "
      "Use an undirected topology (ring, torus, hypercube, exponential(n, symmetric=True), metropolis weights) "
      "or gj.gossip_sgd for directed graphs."
  )


class DecentLaMState(NamedTuple):
  """State of `decentlam`.

  Attributes:
    count: int32 scalar, the number of steps taken (the schedule's step and W's index).
    momentum: the momentum ``m_i`` of every node, fed the gossip-corrected gradient;
      shaped like the params (leading node axis).
  """

  shared_over_nodes = ("count",)  # the step count every node holds alike (it picks W(k) and the rounds)

  count: jax.Array
  momentum: Any


@node_hyperparameters("learning_rate", "beta")
def decentlam(
    topology: Any,
    beta: float = 0.0,
    *,
    learning_rate: optax.ScalarOrSchedule,
    backend: Backend | None = None,
    state_dtype: DTypeLike | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""DecentLaM (Yuan et al., ICCV 2021; Algorithm 2 of Yuan's 2021 lecture).

  The momentum is fed the gossip-corrected gradient, so the momentum-induced part of the
  inconsistency bias vanishes (bias ``O(lr^2 b^2 / (1 - rho)^2)``, as D-PSGD):

  .. math::
    g_i^k &= \frac{1}{\gamma_k}\Big(x_i^k - \sum_j w_{ij}(x_j^k - \gamma_k \nabla F(x_j^k; \xi_j^k))\Big) \\
    m_i^{k+1} &= \beta m_i^k + g_i^k, \qquad x_i^{k+1} = x_i^k - \gamma_k m_i^{k+1}.

  Full-batch, this is ``x^{k+1} = W(x^k - \gamma \nabla f(x^k)) + \beta (x^k - x^{k-1})``.
  A step whose learning rate is exactly 0 leaves the momentum and params unchanged.

  Args:
    topology: doubly stochastic mixing.
    beta: momentum coefficient in [0, 1); 0, the default in every gossipjax method, reduces
      DecentLaM to D-PSGD (the paper uses 0.9).
    learning_rate: a float or an optax schedule.
    backend: where the nodes live (default: simulate).
    state_dtype: the momentum's dtype, e.g. ``jnp.float32`` for bfloat16 params (the gossip
      correction is then divided by the learning rate in it); ``None`` keeps the params'.
      The updates are in the params' dtype.

  Returns:
    An optax transform over node-stacked params (its ``update`` needs ``params``) whose
    state is a `DecentLaMState`.

  Raises:
    ValueError: the topology is directed (DecentLaM needs a symmetric W).

  Example:
    With a zero gradient the first step is one gossip round, ``x^1 = W x^0``, and the
    momentum keeps the gossip correction ``(x - W x) / \gamma``:

    >>> import jax.numpy as jnp, gossipjax as gj
    >>> tx = gj.decentlam(gj.topology.ring(4), beta=0.5, learning_rate=0.1)
    >>> x = jnp.arange(4.0)[:, None]
    >>> u, state = tx.update(jnp.zeros_like(x), tx.init(x), x)
    >>> [round(float(v), 4) for v in (x + u).ravel()]  # each node: mean of itself and its two neighbours
    [1.3333, 1.0, 2.0, 1.6667]
    >>> [round(float(v), 4) for v in state.momentum.ravel()]
    [-13.3333, 0.0, 0.0, 13.3333]

  References:
    Yuan, Chen, Huang, Zhang, Pan, Xu, Yin (2021), DecentLaM: Decentralized Momentum SGD
    for Large-Batch Deep Training, ICCV.

    Yuan (2021), Decentralized Optimization Algorithms for Large-Scale Deep Neural Network
    Training, lecture at Zhejiang University: Algorithm 2 and the inconsistency bias.
  """
  check_learning_rate(learning_rate, "gj.decentlam")
  check_momentum(beta, "gj.decentlam")
  state_dtype = check_state_dtype(state_dtype, "gj.decentlam")
  mixer = make_mixer(topology, backend, name="gj.decentlam")
  _check_symmetric(mixer.topology, beta)

  def init_fn(params):
    return DecentLaMState(count=jnp.zeros([], jnp.int32), momentum=optax.tree.zeros_like(params, state_dtype))

  def update_fn(updates, state, params=None, **extra_args):
    grads = updates  # optax's name for the incoming tree; these methods take gradients
    del extra_args
    lr = start_step("gj.decentlam", mixer, params, learning_rate, state.count)
    half = jax.tree.map(lambda x, g: x - (lr * g).astype(x.dtype), params, grads)
    mixed = mixer.mix(half, state.count)
    safe_lr = jnp.where(lr == 0, 1, lr)

    def momentum(m, x, w):
      corrected = jnp.where(lr == 0, 0, (x.astype(m.dtype) - w.astype(m.dtype)) / safe_lr.astype(m.dtype))
      return (beta * m + corrected).astype(m.dtype)

    mom = jax.tree.map(momentum, state.momentum, params, mixed)
    updates = jax.tree.map(lambda m, x: (-lr * m).astype(x.dtype), mom, params)
    return updates, DecentLaMState(count=next_count(state.count), momentum=mom)

  return float_leaves_only(optax.GradientTransformationExtraArgs(init_fn, update_fn))
