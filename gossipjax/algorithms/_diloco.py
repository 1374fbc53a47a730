"""DiLoCo: H local steps per node, then an all-reduce of the pseudo-gradients and an outer Nesterov step."""

from __future__ import annotations

import jax
import optax
from jax.typing import DTypeLike

from gossipjax.algorithms._outer_optimizer import _outer_optimizer, check_outer_rates, check_transform
from gossipjax.compress import Compressor
from gossipjax.mixing import Backend
from gossipjax.algorithms._node_hyperparams import node_hyperparameters


@node_hyperparameters("outer_learning_rate", "outer_momentum")
def diloco(
    inner: optax.GradientTransformation,
    *,
    inner_steps: int = 500,
    outer_learning_rate: float = 0.7,
    outer_momentum: float = 0.9,
    nesterov: bool = True,
    backend: Backend | None = None,
    state_dtype: DTypeLike | None = None,
    compressor: Compressor | None = None,
    error_feedback: bool = True,
    key: jax.Array | int = 0,
    compressed_mean: str = "reduce_scatter",
) -> optax.GradientTransformationExtraArgs:
  r"""DiLoCo: H local steps of ``inner`` per node, then an all-reduce and an outer Nesterov step.

  Douillard et al. (2023), Algorithm 1. Every node starts a round at the shared outer params
  :math:`\phi`, takes H steps of ``inner`` (AdamW in the paper) on its own data, and the
  pseudo-gradients are averaged (the round's only communication, one all-reduce) and
  applied by Nesterov-momentum SGD:

  .. math::
    \Delta = \frac1n \sum_j (\phi - \theta_j), \qquad
    m \leftarrow \mu m + \Delta, \qquad
    \phi \leftarrow \phi - \eta (\Delta + \mu m), \qquad \theta_j \leftarrow \phi.

  (PyTorch's and optax's Nesterov convention; ``nesterov=False`` gives heavy-ball
  :math:`\phi \leftarrow \phi - \eta m`.) The inner optimizer's state persists across
  rounds. Built as `outer_optimizer` with ``optax.sgd(eta, momentum=mu, nesterov=True)`` and
  no topology. Outer SGD with :math:`\eta = 1` and no momentum is periodic averaging of the
  inner optimizer; with H = 1 and inner SGD it is AllReduce-SGD.

  Args:
    inner: the local optimizer, e.g. ``optax.adamw(4e-4, weight_decay=0.1)`` (the paper's).
    inner_steps: H, a positive integer, the local steps per round; the paper uses 500 for language models.
    outer_learning_rate: :math:`\eta` (0.7 in the paper), or an optax schedule, called with
      the outer round.
    outer_momentum: :math:`\mu` in [0, 1) (0.9 in the paper).
    nesterov: Nesterov momentum (the paper's) or heavy-ball.
    backend: where the nodes live (default: simulate); provides the all-reduce. ``update``
      takes ``up`` (a bool per node): the outer step averages the live nodes that hold the
      last result, and a node back from missing a round rejoins from it (see
      `outer_optimizer`).
    state_dtype: the dtype of :math:`\phi` and :math:`m`, e.g. ``jnp.float32`` for bfloat16
      params (as in `outer_optimizer`); ``None`` keeps the params'.
    compressor: ``None``, or a ``gj.compress`` compressor for each node's pseudo-gradient
      (e.g. ``gj.compress.qsgd(7)``, 4 bits), averaged as decoded values (see
      `outer_optimizer`).
    error_feedback: with a ``compressor``, carry what it did not send into the next round.
    key: the PRNG key or int seed of a random ``compressor``.
    compressed_mean: with a ``compressor``, ``"reduce_scatter"`` (a quantized all-reduce:
      compressed pieces, ``2 (n - 1) / n`` of a compact message a node) or ``"all_gather"``
      (the exact mean of the decoded messages, ``n - 1`` compact messages a node); see
      `outer_optimizer`.

  Returns:
    An optax transform over node-stacked params (its ``update`` needs ``params``) whose
    state is an `OuterState`.

  Raises:
    TypeError: ``inner`` is not an optax transform, or its state cannot be stacked per node.
    ValueError: ``inner_steps`` is not a positive integer, a rate is out of range, or
      ``compressed_mean`` is neither form.

  Example:
    Two nodes pull towards 1 and 3; one round of two local steps, then the outer step from
    the shared start 0 along the averaged pseudo-gradient:

    >>> import jax.numpy as jnp, optax, gossipjax as gj
    >>> tx = gj.diloco(optax.sgd(0.5), inner_steps=2)
    >>> x = jnp.zeros((2, 1))
    >>> state = tx.init(x)
    >>> for _ in range(2):
    ...   u, state = tx.update(x - jnp.array([[1.0], [3.0]]), state, x)
    ...   x = x + u
    >>> [round(float(v), 4) for v in x.ravel()]  # 0 + 0.7 * (1 + 0.9) * 1.5, on both nodes
    [1.995, 1.995]

    Partial participation (see `outer_optimizer`): node 2 is down for the first round, which
    averages nodes 0 and 1 only; in the next it rejoins from that result and takes part:

    >>> tx = gj.diloco(optax.sgd(0.5), inner_steps=1, outer_learning_rate=1.0, outer_momentum=0.0)
    >>> x, target = jnp.zeros((3, 1)), jnp.array([[1.0], [3.0], [8.0]])
    >>> state = tx.init(x)
    >>> for up in ([True, True, False], [True, True, True]):
    ...   u, state = tx.update(x - target, state, x, up=jnp.array(up))
    ...   x = x + u
    ...   print(x.ravel().tolist())
    [1.0, 1.0, 0.0]
    [1.5, 1.5, 1.5]

  References:
    Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen (2023), DiLoCo:
    Distributed Low-Communication Training of Language Models, arXiv:2311.08105.
  """
  check_outer_rates(outer_learning_rate, outer_momentum, "gj.diloco")
  check_transform(inner, "gj.diloco", "inner", "optax.adamw(4e-4)")
  outer = optax.sgd(outer_learning_rate, momentum=outer_momentum, nesterov=nesterov)
  return _outer_optimizer(inner, outer, inner_steps, None, backend, "gj.diloco", state_dtype, compressor,
                          error_feedback, key, compressed_mean)
