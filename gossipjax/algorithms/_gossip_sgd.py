"""D-PSGD and DmSGD."""

from __future__ import annotations

from typing import Any

import optax

from gossipjax._validation import check_learning_rate, check_momentum
from gossipjax.mixing import Backend, float_leaves_only, mix



def gossip_sgd(
    topology: Any,
    beta: float = 0.0,
    *,
    learning_rate: optax.ScalarOrSchedule,
    backend: Backend | None = None,
) -> optax.GradientTransformation:
  r"""Decentralized momentum SGD (DmSGD); D-PSGD when ``beta = 0``.

  Per node i, with ``g_i`` its stochastic gradient (Yuan et al. 2021, Algorithm 1; Lian et
  al. 2017 for D-PSGD):

  .. math::
    m_i^{k+1} = \beta m_i^k + g_i^k, \qquad
    x_i^{k+1} = \sum_j w_{ij} (x_j^k - \gamma_k m_j^{k+1}).

  Built as ``chain(trace(beta), scale_by_learning_rate(lr), mix(W))``.

  Args:
    topology: doubly stochastic mixing (``gj.topology.*``, a matrix or a networkx graph).
    beta: momentum coefficient.
    learning_rate: a float or an optax schedule.
    backend: where the nodes live (default: simulate).

  Example:
    >>> import jax, jax.numpy as jnp, optax, gossipjax as gj
    >>> tx = gj.gossip_sgd(gj.topology.ring(8), beta=0.9, learning_rate=0.1)
    >>> x = jnp.ones((8, 3))
    >>> updates, state = tx.update(x, tx.init(x), x)
    >>> optax.apply_updates(x, updates).shape
    (8, 3)
  """
  check_learning_rate(learning_rate, "gj.gossip_sgd")
  check_momentum(beta, "gj.gossip_sgd")
  parts = []
  if not (isinstance(beta, (int, float)) and beta == 0):
    parts.append(optax.trace(decay=beta))
  parts += [optax.scale_by_learning_rate(learning_rate), mix(topology, backend=backend)]
  return float_leaves_only(optax.chain(*parts))
