"""Hyperparameter plumbing shared by the transforms: schedules and validation.

Validation only looks at Python numbers: under ``optax.inject_hyperparams`` the values
arrive as arrays (possibly traced) and are the caller's responsibility.
"""

from __future__ import annotations

from typing import Any

import jax
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


def check_positive_int(value: Any, name: str) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be a positive integer, got {value!r}")
  return value
