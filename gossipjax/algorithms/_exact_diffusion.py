"""Exact diffusion (D2): diffusion with a bias-correction step."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax
from jax.typing import DTypeLike

from gossipjax.algorithms._common import primal_dual_method
from gossipjax.mixing import Backend
from gossipjax.algorithms._node_hyperparams import node_hyperparameters



class ExactDiffusionState(NamedTuple):
  """State of `exact_diffusion`.

  Attributes:
    count: int32 scalar, the number of steps taken (the schedule's step).
    psi: the previous adapted iterate ``psi^k = x^{k-1} - lr g^{k-1}`` of every node
      (``psi^0 = x^0``), shaped like the params.
  """

  shared_over_nodes = ("count",)  # the step count every node holds alike (it picks W(k) and the rounds)

  count: jax.Array
  psi: Any  # the previous adapted iterate psi^k = x^{k-1} - lr g^{k-1}  (psi^0 = x^0)


@node_hyperparameters("learning_rate")
def exact_diffusion(
    topology: Any,
    *,
    learning_rate: optax.ScalarOrSchedule,
    backend: Backend | None = None,
    state_dtype: DTypeLike | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Exact diffusion (Yuan, Ying, Zhao and Sayed, IEEE TSP 2019), also D2 (Tang et al. 2018).

  Adapt, correct, combine, with ``\bar W = (I + W) / 2``:

  .. math::
    \psi^{k+1} = x^k - \gamma \nabla f(x^k), \qquad
    \phi^{k+1} = \psi^{k+1} + x^k - \psi^k, \qquad
    x^{k+1} = \bar W \phi^{k+1}, \qquad \psi^0 = x^0.

  Equivalently ``x^{k+1} = \bar W (2 x^k - x^{k-1} - \gamma (\nabla f(x^k) - \nabla f(x^{k-1})))``
  for ``k >= 1`` (D2's form). The correction removes the inconsistency bias of diffusion /
  D-PSGD: with full-batch gradients every node converges to the exact global minimiser.
  ``\bar W`` is applied as ``(phi + W phi) / 2``, one gossip round per step.

  Args:
    topology: a static symmetric doubly stochastic W (``\bar W`` then has eigenvalues in
      (0, 1]). Time-varying W is refused: the correction assumes the same W at every step;
      directed W too: there the correction can diverge (use ``gj.gradient_tracking``).
    learning_rate: a float or an optax schedule.
    backend: where the nodes live (default: simulate).
    state_dtype: the dtype of ``psi``, in which ``phi`` is formed and mixed, e.g.
      ``jnp.float32`` for bfloat16 params; ``None`` keeps the params'. The updates are in the
      params' dtype.

  Returns:
    An optax transform over node-stacked params (its ``update`` needs ``params``) whose
    state is an `ExactDiffusionState`.

  Raises:
    ValueError: the topology is time-varying or directed.

  Example:
    Heterogeneous quadratics ``f_i(x) = (x - b_i)^2 / 2`` on a ring of 4: with full-batch
    gradients every node reaches the exact minimiser of the average, ``mean(b) = 1.5``
    (D-PSGD, ``gj.gossip_sgd``, stops at a biased ``[1.37, 1.23, 1.77, 1.63]``):

    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> tx = gj.exact_diffusion(gj.topology.ring(4), learning_rate=0.5)
    >>> b = jnp.arange(4.0)[:, None]
    >>> x = jnp.zeros((4, 1))
    >>> state, step = tx.init(x), jax.jit(tx.update)
    >>> for _ in range(100):
    ...   u, state = step(x - b, state, x)
    ...   x = x + u
    >>> [round(float(v), 4) for v in x.ravel()]
    [1.5, 1.5, 1.5, 1.5]

  References:
    Yuan, Ying, Zhao, Sayed (2019), Exact Diffusion for Distributed Optimization and
    Learning, Part I: Algorithm Development, IEEE Transactions on Signal Processing 67(3).

    Tang, Lian, Yan, Zhang, Liu (2018), D2: Decentralized Training over Decentralized Data,
    ICML.
  """
  return primal_dual_method("gj.exact_diffusion", "exact diffusion", topology, backend, learning_rate, state_dtype,
                            ExactDiffusionState, _adapt_correct_combine)


def _adapt_correct_combine(mix, params, grads, psi_old, lr):
  """psi = x - lr g, phi = psi + x - psi_old, x+ = (phi + W phi) / 2, in psi's dtype."""
  psi = jax.tree.map(lambda x, g, p: x.astype(p.dtype) - (lr * g).astype(p.dtype), params, grads, psi_old)
  phi = jax.tree.map(lambda p, x, p_old: p + x - p_old, psi, params, psi_old)
  updates = jax.tree.map(lambda wp, p, x: (0.5 * (p + wp)).astype(x.dtype) - x, mix(phi), phi, params)
  return updates, psi
