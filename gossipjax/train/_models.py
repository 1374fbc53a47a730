"""Small flax models for the main job."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp


class MLP(nn.Module):
  """A ReLU multi-layer perceptron on flattened inputs."""

  hidden: Sequence[int] = (64,)
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    x = x.reshape(x.shape[:-1] + (-1,)) if x.ndim > 1 else x
    for width in self.hidden:
      x = nn.relu(nn.Dense(width)(x))
    return nn.Dense(self.num_classes)(x)
