"""Shared plumbing for algorithms: topology + backend -> mixer, and node-axis checks."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gossipjax.backend import Backend, Mixer, simulate
from gossipjax.topology import Topology, as_topology
from gossipjax.topology._topology import Stochasticity


def make_mixer(topology: Any, backend: Backend | None = None, stochastic: Stochasticity = "doubly") -> Mixer:
  """Validates the topology for what the algorithm needs and builds the backend's mixer."""
  topo = as_topology(topology).check(stochastic=stochastic)
  return (backend or simulate()).mixer(topo)


def check_node_axis(tree: Any, expected: int, topology_name: str, what: str = "params") -> None:
  """Raises ``ValueError`` naming both sizes when a leaf's leading axis is not ``expected``.

  Shapes are static under ``jit``, so this costs nothing at run time.
  """
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    shape = getattr(leaf, "shape", ())
    if len(shape) == 0 or shape[0] != expected:
      got = "no node axis (a scalar)" if len(shape) == 0 else f"a leading node axis of {shape[0]}"
      raise ValueError(
          f"{what}{jax.tree_util.keystr(path)} has {got}, but {topology_name} expects {expected} "
          "nodes on the leading axis (stack every node's params, e.g. with gj.init_nodes)"
      )


def require_static(mixer: Mixer, name: str) -> None:
  """Raises for a time-varying W where a method's correction assumes the same W at every step."""
  if mixer.topology.is_time_varying:
    raise ValueError(f"{name} needs a static W, got {mixer.topology!r}; "
                     "gj.gradient_tracking converges exactly on time-varying graphs")


def require_params(params: Any, name: str) -> None:
  if params is None:
    raise ValueError(f"{name} needs the current params: call tx.update(updates, state, params)")


def _concrete_scalar(value: Any, name: str, what: str) -> float | None:
  """``value`` as a float; ``None`` when it is traced (``inject_hyperparams`` under ``jit``)."""
  if isinstance(value, jax.core.Tracer):
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating, np.ndarray, jax.Array)):
    raise TypeError(f"{name}: {what} must be a float, got {type(value).__name__} {value!r}")
  if np.ndim(value) != 0 or not np.issubdtype(np.asarray(value).dtype, np.number):
    raise TypeError(f"{name}: {what} must be a scalar number, got {np.asarray(value).dtype} of shape {np.shape(value)}")
  return float(np.asarray(value))


def check_learning_rate(learning_rate: Any, name: str) -> None:
  """Raises unless ``learning_rate`` is a finite, non-negative number or a schedule (a callable).

  A schedule's values are not checked here (that would call it); a traced value (a
  hyperparameter injected under ``jit``) is accepted as it is.
  """
  if callable(learning_rate):
    return
  if isinstance(learning_rate, bool) or not isinstance(
      learning_rate, (int, float, np.integer, np.floating, np.ndarray, jax.Array, jax.core.Tracer)):
    raise TypeError(f"{name}: learning_rate must be a float or an optax schedule (a callable step -> rate), "
                    f"got {type(learning_rate).__name__} {learning_rate!r}")
  lr = _concrete_scalar(learning_rate, name, "learning_rate")
  if lr is not None and not np.isfinite(lr):
    raise ValueError(f"{name}: learning_rate must be finite, got {lr}")
  if lr is not None and lr < 0:
    raise ValueError(f"{name}: learning_rate must be non-negative, got {lr} (a negative rate ascends the loss)")


def check_momentum(beta: Any, name: str) -> None:
  """Raises unless ``beta`` is a finite number in [0, 1) (a traced value is accepted as it is)."""
  b = _concrete_scalar(beta, name, "beta (the momentum)")
  if b is not None and not (np.isfinite(b) and 0 <= b < 1):
    raise ValueError(f"{name}: beta (the momentum) must be in [0, 1), got {b}")


def _is_float(leaf: Any) -> bool:
  dtype = getattr(leaf, "dtype", None)
  return dtype is None or jnp.issubdtype(dtype, jnp.inexact)


def float_leaves_only(tx: optax.GradientTransformation, keep_other_updates: bool = False
                      ) -> optax.GradientTransformationExtraArgs:
  """``tx`` on the floating-point leaves of the params; integer, bool and PRNG-key leaves are left alone.

  Such a leaf (a step counter, a flax RNG count) is not a quantity to average: gossip
  would mix node i's counter with its neighbours', and a method that divides by the
  learning rate turns it into garbage. It is neither mixed nor kept in ``tx``'s state.
  Its update is zero, or with ``keep_other_updates`` the incoming update passed on
  unchanged (for transforms of updates, such as ``mix``, that sit inside a chain, as
  optax's own transforms leave it to the chain). Params with only floating-point
  leaves go to ``tx`` as they are, so its state is unchanged.
  """
  tx = optax.with_extra_args_support(tx)

  def all_float(tree):
    return all(_is_float(x) for x in jax.tree.leaves(tree))

  def mask(tree, like):
    return jax.tree.map(lambda p, x: x if _is_float(p) else optax.MaskedNode(), like, tree)

  def init_fn(params):
    return tx.init(params if all_float(params) else mask(params, params))

  def update_fn(updates, state, params=None, **extra_args):
    like = updates if params is None else params
    if all_float(like):
      return tx.update(updates, state, params, **extra_args)
    new, state = tx.update(mask(updates, like), state, None if params is None else mask(params, like), **extra_args)

    def fill(p, new, old):
      if _is_float(p):
        return new
      return old if keep_other_updates else jnp.zeros_like(p)

    return jax.tree.map(fill, like, new, updates), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
