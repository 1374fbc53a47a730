"""The all-reduce baseline: every node applies the global average gradient (PmSGD)."""

from __future__ import annotations

from typing import Any, NamedTuple

import optax
from jax.typing import DTypeLike

from gossipjax._validation import check_learning_rate, check_momentum, is_zero, require_node_axis
from gossipjax.algorithms._common import check_state_dtype, in_dtypes_of_updates
from gossipjax.mixing import Backend, float_leaves_only, resolve_backend
from gossipjax.mixing._collectives import node_average
from gossipjax.algorithms._node_hyperparams import node_hyperparameters



class AllReduceState(NamedTuple):
  """State of the all-reduce mean: none; the class says that it exchanges (see ``gj.chain``'s per-node gates)."""

  shared_over_nodes = ()  # nothing held per node or shared: a gossipjax transform that communicates


def all_reduce(backend: Backend | None = None) -> optax.GradientTransformationExtraArgs:
  """Replaces every node's update by the average over all nodes (an all-reduce)."""
  backend = resolve_backend(backend)

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    return node_average(backend, updates, "gj.allreduce_sgd"), state

  return float_leaves_only(optax.GradientTransformationExtraArgs(lambda params: AllReduceState(), update_fn),
                           keep_other_updates=True)


@node_hyperparameters("learning_rate", "beta")
def allreduce_sgd(
    beta: float = 0.0,
    *,
    learning_rate: optax.ScalarOrSchedule,
    backend: Backend | None = None,
    state_dtype: DTypeLike | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Parallel momentum SGD (PmSGD / AllReduce-SGD), the centralized baseline.

  .. math::
    \bar g^k = \frac{1}{n}\sum_i g_i^k, \quad m^{k+1} = \beta m^k + \bar g^k, \quad
    x_i^{k+1} = x_i^k - \gamma_k m^{k+1}.

  Nodes that start equal stay equal (exactly, up to round-off), so this is one model
  trained on the global batch.

  Args:
    beta: momentum coefficient in [0, 1); 0, the default in every gossipjax method, is plain
      SGD on the averaged gradient.
    learning_rate: a float or an optax schedule.
    backend: where the nodes live (default: simulate); provides the all-reduce mean.
    state_dtype: the momentum's dtype (optax's ``accumulator_dtype``), e.g. ``jnp.float32``
      for bfloat16 params; ``None`` keeps the gradients'. Updates keep the gradients' dtype.

  Returns:
    An optax transform over node-stacked params; its update is ``-lr`` times the momentum
    of the node-averaged gradient, the same on every node.

  Example:
    >>> import jax.numpy as jnp, gossipjax as gj
    >>> tx = gj.allreduce_sgd(learning_rate=0.5)
    >>> x = jnp.zeros((4, 1))
    >>> g = jnp.arange(4.0)[:, None]  # node i's gradient is i: their average is 1.5
    >>> u, _ = tx.update(g, tx.init(x), x)
    >>> u.ravel().tolist()  # every node steps along -0.5 * 1.5
    [-0.75, -0.75, -0.75, -0.75]

  References:
    Goyal, Dollár, Girshick, Noordhuis, Wesolowski, Kyrola, Tulloch, Jia, He (2017),
    Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour, arXiv:1706.02677.

    Zhang, Lian, Zhang, Liu, Decentralized Distributed Deep Learning (IBM T.J. Watson
    Research Center, University of Rochester, ETH Zurich): the AllReduce baseline of its
    Table 1.

    Yuan (2021), Decentralized Optimization Algorithms for Large-Scale Deep Neural Network
    Training, lecture at Zhejiang University: parallel momentum SGD (PmSGD).
  """
  check_learning_rate(learning_rate, "gj.allreduce_sgd")
  check_momentum(beta, "gj.allreduce_sgd")
  state_dtype = check_state_dtype(state_dtype, "gj.allreduce_sgd")
  parts: list[Any] = [all_reduce(backend)]
  if not is_zero(beta):  # no momentum, no state (Python or NumPy 0; a traced beta keeps its momentum)
    parts.append(optax.trace(decay=beta, accumulator_dtype=state_dtype))
  parts.append(optax.scale_by_learning_rate(learning_rate))
  chained = optax.chain(*parts)
  if state_dtype is not None:
    chained = in_dtypes_of_updates(chained)
  return _node_axis_checked(float_leaves_only(chained), "gj.allreduce_sgd")



def _node_axis_checked(tx: optax.GradientTransformationExtraArgs, name: str) -> optax.GradientTransformationExtraArgs:
  """``tx`` (its state unchanged), which first checks that every float leaf has a node axis to average over."""

  def init_fn(params):
    require_node_axis(params, name)
    return tx.init(params)

  def update_fn(updates, state, params=None, **extra_args):
    require_node_axis(updates, name, "updates")
    return tx.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
