"""Exact diffusion (D2): diffusion with a bias-correction step."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gossipjax._validation import (check_learning_rate, check_node_axis, require_params, require_static,
                                   require_symmetric)
from gossipjax.algorithms._common import copy_of, learning_rate_at
from gossipjax.mixing import Backend, float_leaves_only, make_mixer



class ExactDiffusionState(NamedTuple):
  """State of `exact_diffusion`.

  Attributes:
    count: int32 scalar, the number of steps taken (the schedule's step).
    psi: the previous adapted iterate ``psi^k = x^{k-1} - lr g^{k-1}`` of every node
      (``psi^0 = x^0``), shaped like the params.
  """

  count: jax.Array
  psi: Any  # the previous adapted iterate psi^k = x^{k-1} - lr g^{k-1}  (psi^0 = x^0)


def exact_diffusion(
    topology: Any,
    *,
    learning_rate: optax.ScalarOrSchedule,
    backend: Backend | None = None,
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
  check_learning_rate(learning_rate, "gj.exact_diffusion")
  mixer = make_mixer(topology, backend)
  require_static(mixer.topology, "gj.exact_diffusion")
  require_symmetric(mixer.topology, "gj.exact_diffusion", "exact diffusion")

  def init_fn(params):
    # A copy, not a view: a jitted step that donates both params and state needs distinct buffers.
    return ExactDiffusionState(count=jnp.zeros([], jnp.int32), psi=copy_of(params))

  def update_fn(grads, state, params=None, **extra_args):
    del extra_args
    require_params(params, "gj.exact_diffusion")
    check_node_axis(params, mixer.local_nodes, "gj.exact_diffusion", mixer.topology.name)
    lr = learning_rate_at(learning_rate, state.count)
    psi = jax.tree.map(lambda x, g: x - (lr * g).astype(x.dtype), params, grads)
    phi = jax.tree.map(lambda p, x, p_old: p + x - p_old, psi, params, state.psi)
    mixed = mixer.mix(phi, state.count)
    updates = jax.tree.map(lambda wp, p, x: (0.5 * (p + wp) - x).astype(x.dtype), mixed, phi, params)
    return updates, ExactDiffusionState(count=optax.safe_increment(state.count), psi=psi)

  return float_leaves_only(optax.GradientTransformationExtraArgs(init_fn, update_fn))
