"""What the algorithms share: hyperparameter plumbing, state copies and dtypes, and the frame of
the primal-dual methods (EXTRA, exact diffusion)."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from gossipjax._validation import (check_learning_rate, check_node_axis, require_params, require_static,
                                   require_symmetric)
from gossipjax.mixing import Backend, Mixer, float_leaves_only, make_mixer
from gossipjax.mixing._contract import next_count


def learning_rate_at(learning_rate: optax.ScalarOrSchedule, count: jax.Array) -> Any:
  """The learning rate of step ``count``: a schedule is called, a number returned."""
  return learning_rate(count) if callable(learning_rate) else learning_rate


def start_step(name: str, mixer: Mixer, params: Any, learning_rate: optax.ScalarOrSchedule, count: jax.Array) -> Any:
  """What a mixing method's ``update`` starts with: the params are there, with the mixer's node
  axis (errors name ``name``); returns the step's learning rate."""
  require_params(params, name)
  check_node_axis(params, mixer.local_nodes, name, mixer.topology.name)
  return learning_rate_at(learning_rate, count)


def copy_of(params: Any, dtype: Any = None) -> Any:
  """A state's own copy of the params (a jitted step that donates both needs distinct buffers).

  Abstract params (``jax.ShapeDtypeStruct``, as ``tx.init`` gets when a checkpoint template or
  a shape is all that is wanted) give zeros of their shape and dtype, as ``zeros_like`` does.
  ``dtype`` (a method's ``state_dtype``) stores the copy in that dtype; ``None`` keeps each leaf's.
  """
  def copy(x):
    if isinstance(x, jax.ShapeDtypeStruct):  # placed as the struct says (a sharded node axis stays sharded)
      return jnp.zeros(x.shape, dtype or x.dtype, device=x.sharding)
    return jnp.array(x, dtype=dtype, copy=True)

  return jax.tree.map(copy, params)


def is_abstract(params: Any) -> bool:
  """Whether any leaf is a ``jax.ShapeDtypeStruct`` (shapes without values)."""
  return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))


def check_state_dtype(state_dtype: Any, name: str) -> Any:
  """``state_dtype`` as a NumPy dtype (``None`` stays ``None``); it must be a floating-point dtype.

  Raises:
    ValueError: it is not a floating-point dtype.
  """
  if state_dtype is None:
    return None
  try:
    dtype = jnp.dtype(state_dtype)
  except TypeError as e:
    raise ValueError(f"{name}: state_dtype must be a floating-point dtype such as jnp.float32, got {state_dtype!r}") from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{name}: state_dtype must be a floating-point dtype such as jnp.float32, got {dtype}")
  return dtype


def in_state_dtype(x: jax.Array, state_dtype: Any) -> jax.Array:
  """``x`` cast to ``state_dtype`` (``None``: left in its own dtype), to compute a state in it."""
  return x if state_dtype is None else x.astype(state_dtype)


def in_dtypes_of_updates(tx: optax.GradientTransformationExtraArgs) -> optax.GradientTransformationExtraArgs:
  """``tx`` with its updates cast back to the incoming updates' dtypes (those of the gradients).

  For a chain whose state is wider than the params (``state_dtype``): optax's
  ``trace(accumulator_dtype=...)`` returns updates in the wider dtype.
  """

  def update_fn(updates, state, params=None, **extra_args):
    new, state = tx.update(updates, state, params, **extra_args)
    return jax.tree.map(lambda u, g: u.astype(g.dtype), new, updates), state

  return optax.GradientTransformationExtraArgs(tx.init, update_fn)


# step(mix, params, grads, carried, lr) -> (updates, carried): one step of a primal-dual method,
# with ``mix(tree)`` the step's gossip round and ``carried`` its params-shaped state.
PrimalDualStep = Callable[[Callable[[Any], Any], Any, Any, Any, Any], tuple[Any, Any]]


def primal_dual_method(name: str, method: str, topology: Any, backend: Backend | None,
                       learning_rate: optax.ScalarOrSchedule, state_dtype: Any, state_class: type,
                       step: PrimalDualStep) -> optax.GradientTransformationExtraArgs:
  """The frame EXTRA and exact diffusion share; ``step`` is the method.

  Both need a static symmetric W (their correction assumes the same W at every step and is only
  stable for symmetric W), carry one params-shaped quantity from step to step (``x^0`` before the
  first; in ``state_dtype`` when given) in a ``state_class(count, carried)``, and take one gossip
  round per step. ``step`` computes in the carried quantity's dtype and returns the updates in
  the params'.
  """
  check_learning_rate(learning_rate, name)
  state_dtype = check_state_dtype(state_dtype, name)
  mixer = make_mixer(topology, backend, name=name)
  require_static(mixer.topology, name)
  require_symmetric(mixer.topology, name, method)

  def init_fn(params):
    return state_class(jnp.zeros([], jnp.int32), copy_of(params, state_dtype))

  def update_fn(updates, state, params=None, **extra_args):
    grads = updates  # optax's name for the incoming tree; these methods take gradients
    del extra_args
    lr = start_step(name, mixer, params, learning_rate, state.count)
    updates, carried = step(lambda tree: mixer.mix(tree, state.count), params, grads, state[1], lr)
    return updates, state_class(next_count(state.count), carried)

  return float_leaves_only(optax.GradientTransformationExtraArgs(init_fn, update_fn))
