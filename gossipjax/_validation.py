"""Argument checks shared by every public transform: one place, one message style.

Every message starts with the public name it concerns (``gj.gossip_sgd: ...``), then says
what was given, what was expected and how to fix it. Checks read only concrete values:
under ``optax.inject_hyperparams`` with ``jit`` hyperparameters arrive traced and are the
caller's responsibility. A hyperparameter given one value per node is checked entry by
entry, inside `checking_node`, and a refusal names the node.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import jax
import jax.core  # jax.core.Tracer: a type checker sees the submodule only where it is imported
import jax.numpy as jnp
import numpy as np

from gossipjax._axis import mapping
from gossipjax._limits import MAX_PERIOD


def check_in_range(value: Any, name: str, arg: str, low: float, high: float, low_open: bool = False,
                   high_open: bool = False) -> None:
  """Raises ``ValueError`` when the number ``arg`` lies outside ``[low, high]``, written as the docstrings write it.

  ``low_open`` / ``high_open`` exclude an end: ``(0, 1]`` for a step size, ``[0, 1)`` for a
  momentum. Python and NumPy numbers are read alike; a traced value is left to the caller.
  """
  v = _concrete_scalar(value, name, arg)
  if v is None:
    return
  if not np.isfinite(v) or v > high or v < low or (low_open and v == low) or (high_open and v == high):
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    raise ValueError(f"{name}: {arg} must be in {interval}, {_got(value)}")


def is_integer(value: Any) -> bool:
  """Whether ``value`` is an integer as a hyperparameter takes one: a Python or NumPy integer, not a bool."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_zero(value: Any) -> bool:
  """Whether ``value`` is a Python or NumPy number equal to 0 (arrays, traced or not, are not: they may change)."""
  return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)) \
      and value == 0


def _shown(value: Any) -> str:
  """A number as a message shows it: ``3``, ``1.5`` (NumPy scalars and concrete 0-d arrays in their own precision)."""
  if isinstance(value, (np.ndarray, jax.Array)) and not isinstance(value, jax.core.Tracer) and np.ndim(value) == 0:
    value = np.asarray(value)[()]
  return str(value) if isinstance(value, np.generic) else repr(value)


# The node whose entry of a per-node hyperparameter is being checked (`checking_node`).
_NODE: contextvars.ContextVar[int | None] = contextvars.ContextVar("gossipjax_checked_node", default=None)


@contextlib.contextmanager
def checking_node(node: int) -> Iterator[None]:
  """Within it the checks read node ``node``'s entry of a per-node hyperparameter, and a refusal names the node."""
  token = _NODE.set(node)
  try:
    yield
  finally:
    _NODE.reset(token)


def _got(value: Any) -> str:
  """``got 1.5``, and ``at node 1`` when the value is one node's entry (`checking_node`)."""
  node = _NODE.get()
  return f"got {_shown(value)}" + ("" if node is None else f" at node {node}")




def check_period(value: Any, name: str, arg: str = "every") -> int | jax.Array:
  """A period (``every``): a positive Python int, or a traced integer scalar given back as it is.

  ``optax.inject_hyperparams`` hands every numeric argument to the transform as an array:
  a concrete one (``init``, an eager ``update``) is read as an int, a traced one (``update``
  under ``jit``) is used as a traced period, so it can change without a recompile. The step
  counter it is compared with is an int32, so a period must stay below ``2**31``.
  """
  if isinstance(value, (jax.Array, np.ndarray)):
    if np.ndim(value) or not jnp.issubdtype(value.dtype, jnp.integer):
      raise TypeError(f"{name}: {arg} must be an integer, got an array of {value.dtype} and shape {np.shape(value)}; "
                      f"under optax.inject_hyperparams pass it as a static argument (static_args=('{arg}',))")
    if isinstance(value, jax.core.Tracer):
      return value
    value = int(value)
  if not is_integer(value) or value < 1:
    raise ValueError(f"{name}: {arg} must be a positive integer, got {_shown(value)}")
  value = int(value)
  if value > MAX_PERIOD:
    raise ValueError(f"{name}: {arg} must be at most 2**31 - 1 = {MAX_PERIOD} (the step counter is an int32), "
                     f"got {value}")
  return value


def check_finite_nonnegative(value: Any, name: str, arg: str) -> None:
  """Raises ``ValueError`` unless the number ``arg`` is finite and >= 0 (a time, a size)."""
  v = _concrete_scalar(value, name, arg)
  if v is not None and not (np.isfinite(v) and v >= 0):
    raise ValueError(f"{name}: {arg} must be a finite number >= 0, {_got(value)}")


def check_positive_int(value: Any, name: str, arg: str) -> int:
  """``value`` as an int; ``ValueError`` unless it is a positive integer (Python or NumPy)."""
  if not is_integer(value) or value < 1:
    raise ValueError(f"{name}: {arg} must be a positive integer, got {_shown(value)}")
  return int(value)


def check_node_axis(tree: Any, expected: int, name: str, topology_name: str, what: str = "params") -> None:
  """Raises ``ValueError`` naming both sizes when a leaf's leading axis is not ``expected``.

  Shapes are static under ``jit``, so this costs nothing at run time. For one node (inside
  ``gj.nodes``) there is no node axis to check.
  """
  if mapping() is not None:
    return
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    shape = getattr(leaf, "shape", ())
    if len(shape) == 0 or shape[0] != expected:
      got = "no node axis (a scalar)" if len(shape) == 0 else f"a leading node axis of {shape[0]}"
      raise ValueError(
          f"{name}: {what}{jax.tree_util.keystr(path)} has {got}, but {topology_name} expects {expected} "
          "nodes on the leading axis (stack every node's params, e.g. with gj.init_nodes)"
      )


def require_node_axis(tree: Any, name: str, what: str = "params") -> None:
  """Raises ``ValueError`` naming the first floating-point leaf without a leading node axis (a scalar).

  For the transforms that average over the node axis with no topology to fix n (all-reduce,
  periodic averaging, EASGD's center): a scalar leaf has no node axis to average over. For one
  node (inside ``gj.nodes``) the average is a collective over the named axis.
  """
  if mapping() is not None:
    return
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    dtype = getattr(leaf, "dtype", None)
    if np.ndim(leaf) == 0 and (dtype is None or jnp.issubdtype(dtype, jnp.inexact)):
      raise ValueError(f"{name}: {what}{jax.tree_util.keystr(path)} is a scalar, with no node axis to average "
                       "over; every leaf needs the leading node axis (stack every node's params, e.g. with "
                       "gj.init_nodes)")


def check_node_mask(mask: Any, shape: tuple[int, ...], name: str) -> None:
  """Raises unless the participation mask ``up`` is a bool array of ``shape``: (n,) on stacked trees, () for one node.

  A stacked transform and `gj.chain` around it check the same mask alike, in the same words.
  """
  if mask.dtype != jnp.bool_ or tuple(mask.shape) != tuple(shape):
    raise ValueError(f"{name}: up must be a bool array with one entry per node, of shape {tuple(shape)}, got "
                     f"{mask.dtype} of shape {tuple(mask.shape)}")


def require_static(topology: Any, name: str) -> None:
  """Raises for a time-varying W where a method's correction assumes the same W at every step."""
  if topology.is_time_varying:
    raise ValueError(f"{name}: needs a static W, got {topology!r}; "
                     "gj.gradient_tracking converges exactly on time-varying graphs")


def require_symmetric(topology: Any, name: str, method: str) -> None:
  """Raises for a directed W where a primal-dual correction is only stable for symmetric W.

  EXTRA and exact diffusion accumulate ``(W - W~) x`` as a dual correction, ``W~ = (I + W) / 2``;
  their analysis needs W symmetric (real eigenvalues in (-1, 1], so that ``W~`` is positive
  definite), and on a directed doubly stochastic W, such as the static exponential graph, the
  correction can grow without bound.
  """
  if topology.is_symmetric():
    return
  raise ValueError(
      f"{name}: needs a symmetric W, but {topology.name} is directed: {method}'s correction is only analysed, "
      "and only stable in general, for symmetric W (on a directed W such as the static exponential graph it "
      "diverges). Use an undirected topology (ring, torus, hypercube, exponential(n, symmetric=True), "
      "metropolis weights), or gj.gradient_tracking, which converges exactly on directed and time-varying graphs")


def require_params(params: Any, name: str) -> None:
  """Raises when a transform that reads the params is called without them."""
  if params is None:
    raise ValueError(f"{name}: needs the current params: call tx.update(updates, state, params)")


def _concrete_scalar(value: Any, name: str, what: str) -> float | None:
  """``value`` as a float; ``None`` when it is traced (``inject_hyperparams`` under ``jit``)."""
  if isinstance(value, jax.core.Tracer):
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating, np.ndarray, jax.Array)):
    raise TypeError(f"{name}: {what} must be a float, got {type(value).__name__} {value!r}")
  if np.ndim(value) != 0 or not np.issubdtype(np.asarray(value).dtype, np.number):
    raise TypeError(f"{name}: {what} must be a scalar number, got {np.asarray(value).dtype} of shape {np.shape(value)}")
  return float(np.asarray(value))


FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_learning_rate(learning_rate: Any, name: str, arg: str = "learning_rate",
                        high: float = np.inf) -> None:
  """Raises unless ``learning_rate`` is a finite number in [0, ``high``] or a schedule (a callable).

  A schedule is traced once on an abstract step count (``jax.eval_shape``, nothing runs):
  one that returns an array of shape (3,) or (n, 1) would broadcast into a per-coordinate or
  per-node rate, so it is refused. Its values are not checked; a traced value (a
  hyperparameter injected under ``jit``) is accepted when it is a scalar. ``arg`` names the
  argument in messages (``"outer_learning_rate"``).
  """
  if callable(learning_rate):
    _check_schedule_shape(learning_rate, name, arg)
    return
  if isinstance(learning_rate, jax.core.Tracer):
    if np.ndim(learning_rate):
      raise TypeError(f"{name}: {arg} must be a scalar, got a traced array of shape {np.shape(learning_rate)}")
    return
  if isinstance(learning_rate, bool) or not isinstance(
      learning_rate, (int, float, np.integer, np.floating, np.ndarray, jax.Array, jax.core.Tracer)):
    raise TypeError(f"{name}: {arg} must be a float or an optax schedule (a callable step -> rate), "
                    f"got {type(learning_rate).__name__} {learning_rate!r}")
  lr = _concrete_scalar(learning_rate, name, arg)
  if lr is not None and not np.isfinite(lr):
    raise ValueError(f"{name}: {arg} must be finite, {_got(learning_rate)}")
  if lr is not None and lr < 0:
    raise ValueError(f"{name}: {arg} must be non-negative, {_got(learning_rate)} (a negative rate ascends the loss)")
  if lr is not None and lr > high:
    raise ValueError(f"{name}: {arg} must be at most {high:.4g}, {_got(learning_rate)}")


def _check_schedule_shape(schedule: Any, name: str, arg: str = "learning_rate") -> None:
  try:
    out = jax.eval_shape(schedule, jax.ShapeDtypeStruct((), jnp.int32))
  except Exception:  # a schedule that cannot be traced on its own fails where it is used, with its own error
    return
  shapes = [np.shape(x) for x in jax.tree.leaves(out)]
  if shapes != [()]:
    got = f"an array of shape {shapes[0]}" if len(shapes) == 1 else f"{len(shapes)} values"
    raise ValueError(f"{name}: {arg} is a schedule that returns {got}; it must return one number per step "
                     "(an array would be broadcast into a per-coordinate or per-node rate)")


def check_momentum(beta: Any, name: str) -> None:
  """Raises unless ``beta`` is a finite number in [0, 1) (a traced value is accepted as it is)."""
  b = _concrete_scalar(beta, name, "beta (the momentum)")
  if b is not None and not (np.isfinite(b) and 0 <= b < 1):
    raise ValueError(f"{name}: beta (the momentum) must be in [0, 1), {_got(beta)}")
