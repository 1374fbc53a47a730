"""D-PSGD and DmSGD."""

from __future__ import annotations

from typing import Any

import optax
from jax.typing import DTypeLike

from gossipjax._validation import check_learning_rate, check_momentum, is_zero
from gossipjax.algorithms._common import check_state_dtype
from gossipjax.mixing import Backend, float_leaves_only
from gossipjax.mixing._mix import mix_named
from gossipjax.algorithms._node_hyperparams import node_hyperparameters



@node_hyperparameters("learning_rate", "beta")
def gossip_sgd(
    topology: Any,
    beta: float = 0.0,
    *,
    learning_rate: optax.ScalarOrSchedule,
    backend: Backend | None = None,
    state_dtype: DTypeLike | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Decentralized momentum SGD (DmSGD); D-PSGD when ``beta = 0``.

  Per node i, with ``g_i`` its stochastic gradient (Yuan et al. 2021, Algorithm 1; Lian et
  al. 2017 for D-PSGD):

  .. math::
    m_i^{k+1} = \beta m_i^k + g_i^k, \qquad
    x_i^{k+1} = \sum_j w_{ij} (x_j^k - \gamma_k m_j^{k+1}).

  Built as ``chain(trace(beta), scale_by_learning_rate(lr), mix(W))``.

  Args:
    topology: doubly stochastic mixing (``gj.topology.*``, a matrix or a networkx graph).
    beta: momentum coefficient in [0, 1); 0, the default in every gossipjax method, is
      D-PSGD (the DmSGD papers use 0.9).
    learning_rate: a float or an optax schedule; or one value per node, an array of shape
      (n,) (so is ``beta``): each node then steps with its own, as inside `gj.chain`.
    backend: where the nodes live (default: simulate).
    state_dtype: the momentum's dtype (optax's ``accumulator_dtype``), e.g. ``jnp.float32``
      for bfloat16 params; ``None`` keeps the params'. The local step ``x - lr m`` is then
      formed and mixed in that dtype (JAX's promotion); the updates are in the params' dtype.

  Returns:
    An optax transform over node-stacked params (its ``update`` needs ``params``), the
    chain above.

  Example:
    One step on a ring of 4 from ``x = 0`` with node i's gradient equal to i: each node
    takes its local step ``-0.5 i``, then averages with its two neighbours; the node
    average moves by ``-0.5`` times the average gradient, as in centralized SGD:

    >>> import jax.numpy as jnp, gossipjax as gj
    >>> tx = gj.gossip_sgd(gj.topology.ring(4), beta=0.9, learning_rate=0.5)
    >>> x = jnp.zeros((4, 1))
    >>> g = jnp.arange(4.0)[:, None]
    >>> u, state = tx.update(g, tx.init(x), x)
    >>> [round(float(v), 4) for v in (x + u).ravel()]
    [-0.6667, -0.5, -1.0, -0.8333]
    >>> round(float((x + u).mean()), 4)
    -0.75

  References:
    Lian, Zhang, Zhang, Hsieh, Zhang, Liu (2017), Can Decentralized Algorithms Outperform
    Centralized Algorithms? A Case Study for Decentralized Parallel Stochastic Gradient
    Descent, NeurIPS.

    Yuan, Chen, Huang, Zhang, Pan, Xu, Yin (2021), DecentLaM: Decentralized Momentum SGD
    for Large-Batch Deep Training, ICCV (DmSGD, its Algorithm 1).
  """
  check_learning_rate(learning_rate, "gj.gossip_sgd")
  check_momentum(beta, "gj.gossip_sgd")
  state_dtype = check_state_dtype(state_dtype, "gj.gossip_sgd")
  parts = []
  if not is_zero(beta):  # no momentum, no state (Python or NumPy 0; a traced beta keeps its momentum)
    parts.append(optax.trace(decay=beta, accumulator_dtype=state_dtype))
  parts += [optax.scale_by_learning_rate(learning_rate), mix_named("gj.gossip_sgd", topology, backend=backend)]
  return float_leaves_only(optax.chain(*parts))
