"""Small flax models for the main job."""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax.numpy as jnp

from gossipjax import layers


class MLP(nn.Module):
  """A ReLU multi-layer perceptron on flattened inputs.

  Inputs of shape (batch, ...) are flattened to (batch, features) first.

  Attributes:
    hidden: the widths of the hidden layers.
    num_classes: outputs of the last layer (the logits).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from gossipjax import train
    >>> model = train.MLP(hidden=(8,), num_classes=3)
    >>> params = model.init(jax.random.key(0), jnp.zeros((1, 5)))
    >>> model.apply(params, jnp.zeros((2, 5))).shape
    (2, 3)
  """

  hidden: Sequence[int] = (64,)
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    x = x.reshape(x.shape[:-1] + (-1,)) if x.ndim > 1 else x
    for width in self.hidden:
      x = nn.relu(nn.Dense(width)(x))
    return nn.Dense(self.num_classes)(x)


class CNN(nn.Module):
  """A small convolutional net: two 3x3 convolutions, a 2x2 average pool and a dense head.

  Attributes:
    features: channels of the convolutions.
    num_classes: outputs of the head.
    image_shape: ``(height, width, channels)`` to unflatten inputs given as ``(..., features)``
      (the bundled digits are 64 features, ``(8, 8, 1)``); ``None`` when inputs are images.
    conv_general_dilated: the convolution, ``gj.layers.conv_general_dilated`` (whose per-node weight
      gradient runs as matrix products on a GPU, XLA's convolution elsewhere) unless given.

  Example:
    The bundled digits, given flat:

    >>> import jax, jax.numpy as jnp
    >>> from gossipjax import train
    >>> model = train.CNN(features=(4,), image_shape=(8, 8, 1))
    >>> params = model.init(jax.random.key(0), jnp.zeros((1, 64)))
    >>> model.apply(params, jnp.zeros((2, 64))).shape
    (2, 10)
  """

  features: Sequence[int] = (8, 16)
  num_classes: int = 10
  image_shape: tuple[int, int, int] | None = None
  conv_general_dilated: Any = layers.conv_general_dilated

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    if self.image_shape is not None:
      x = x.reshape(x.shape[:-1] + tuple(self.image_shape))
    for width in self.features:
      x = nn.relu(nn.Conv(width, (3, 3), conv_general_dilated=self.conv_general_dilated)(x))
    x = nn.avg_pool(x, (2, 2), (2, 2))
    x = x.reshape(x.shape[:-3] + (-1,))
    return nn.Dense(self.num_classes)(x)
