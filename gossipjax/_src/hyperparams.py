"""Hyperparameter plumbing shared by the transforms: schedules and validation.

Validation only looks at Python numbers: under ``optax.inject_hyperparams`` the values
arrive as arrays (possibly traced) and are the caller's responsibility.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


def learning_rate_at(learning_rate: optax.ScalarOrSchedule, count: jax.Array) -> Any:
  """The learning rate of step ``count``: a schedule is called, a number returned."""
  return learning_rate(count) if callable(learning_rate) else learning_rate


def check_in_range(value: Any, name: str, low: float, high: float, low_open: bool = False) -> None:
  """Raises ``ValueError`` when a Python number lies outside ``[low, high]`` (``(low, high]``)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return
  if value > high or value < low or (low_open and value == low):
    bracket = "(" if low_open else "["
    raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value!r}")


def check_period(value: Any, name: str) -> int | jax.Array:
  """A period (``every``): a positive Python int, or a traced integer scalar given back as it is.

  ``optax.inject_hyperparams`` hands every numeric argument to the transform as an array:
  a concrete one (``init``, an eager ``update``) is read as an int, a traced one (``update``
  under ``jit``) is used as a traced period, so it can change without a recompile.
  """
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    if np.ndim(value) or not jnp.issubdtype(value.dtype, jnp.integer):
      raise TypeError(f"{name} must be an integer, got an array of {value.dtype} and shape {np.shape(value)}; "
                      "under optax.inject_hyperparams pass it as a static argument (static_args=('every',))")
    if isinstance(value, jax.core.Tracer):
      return value
    value = int(value)
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be a positive integer, got {value!r}")
  return value
