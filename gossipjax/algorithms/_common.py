"""Hyperparameter plumbing shared by the algorithms."""

from __future__ import annotations

from typing import Any

import jax
import optax


def learning_rate_at(learning_rate: optax.ScalarOrSchedule, count: jax.Array) -> Any:
  """The learning rate of step ``count``: a schedule is called, a number returned."""
  return learning_rate(count) if callable(learning_rate) else learning_rate
