"""Hyperparameter plumbing shared by the algorithms."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax


def learning_rate_at(learning_rate: optax.ScalarOrSchedule, count: jax.Array) -> Any:
  """The learning rate of step ``count``: a schedule is called, a number returned."""
  return learning_rate(count) if callable(learning_rate) else learning_rate


def copy_of(params: Any) -> Any:
  """A state's own copy of the params (a jitted step that donates both needs distinct buffers).

  Abstract params (``jax.ShapeDtypeStruct``, as ``tx.init`` gets when a checkpoint template or
  a shape is all that is wanted) give zeros of their shape and dtype, as ``zeros_like`` does.
  """
  def copy(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      return jnp.zeros(x.shape, x.dtype)
    return jnp.array(x, copy=True)

  return jax.tree.map(copy, params)


def is_abstract(params: Any) -> bool:
  """Whether any leaf is a ``jax.ShapeDtypeStruct`` (shapes without values)."""
  return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
