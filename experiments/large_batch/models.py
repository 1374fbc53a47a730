"""ResNet-20 of He et al. (2016, Sec. 4.2) in flax, for CIFAR-10 (32x32x3) or the digits (8x8x1).

Three stages of three basic blocks at 16/32/64 channels (times ``width / 16``), strides
1/2/2, global average pooling and one dense layer: 6*3 + 2 = 20 weight layers. The
shortcut that changes shape is a 1x1 strided convolution (option B of the paper).

Normalisation is GroupNorm, not BatchNorm: BatchNorm's running statistics are a second,
non-gradient state per node that gossip methods would also have to average, and the
model would no longer be a pure function of its params (what ``gj.train.run`` and the
optimizers expect). Any input size works: an 8x8 digit goes through the stages at 8x8,
4x4 and 2x2.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax.numpy as jnp

import gossipjax as gj

# Per-node convolutions: their gradients run as matrix products on a GPU and on a CPU (gj.layers).
Conv = functools.partial(nn.Conv, conv_general_dilated=gj.layers.conv_general_dilated)


def _norm(features: int) -> nn.Module:
  return nn.GroupNorm(num_groups=min(8, features // 2) or 1)


class BasicBlock(nn.Module):
  """Two 3x3 convolutions with a residual connection."""

  features: int
  stride: int = 1

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    s = (self.stride, self.stride)
    y = Conv(self.features, (3, 3), s, padding="SAME", use_bias=False)(x)
    y = nn.relu(_norm(self.features)(y))
    y = Conv(self.features, (3, 3), padding="SAME", use_bias=False)(y)
    y = _norm(self.features)(y)
    if self.stride != 1 or x.shape[-1] != self.features:
      x = _norm(self.features)(Conv(self.features, (1, 1), s, use_bias=False)(x))
    return nn.relu(x + y)


class ResNet20(nn.Module):
  """ResNet-(6 * blocks_per_stage + 2); the defaults give ResNet-20 (about 0.27M params).

  Attributes:
    width: channels of the first stage (16 in the paper; the stages have width, 2x, 4x).
    blocks_per_stage: 3 for ResNet-20.
    num_classes: outputs.
  """

  width: int = 16
  blocks_per_stage: int = 3
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    x = Conv(self.width, (3, 3), padding="SAME", use_bias=False)(x)
    x = nn.relu(_norm(self.width)(x))
    for stage in range(3):
      for b in range(self.blocks_per_stage):
        x = BasicBlock(self.width * 2**stage, 2 if stage > 0 and b == 0 else 1)(x)
    return nn.Dense(self.num_classes)(jnp.mean(x, axis=(-3, -2)))
