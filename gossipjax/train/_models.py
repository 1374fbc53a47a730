"""Small flax models for the main job: an MLP, a CNN and a GPT-style language model."""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
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
    conv_general_dilated: the convolution, ``gj.layers.conv_general_dilated`` (whose per-node gradients run
      as matrix products on a GPU and a CPU) unless given.

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


class GPT(nn.Module):
  """A GPT-style decoder-only language model (flax linen, as the rest of the main job is).

  Token embedding plus a learned position embedding, ``num_layers`` pre-norm blocks
  (LayerNorm, causal multi-head self-attention, residual; LayerNorm, a GELU MLP of 4x the
  width, residual), a final LayerNorm and a head tied to the token embedding
  (``embed.attend``): a byte-level vocabulary is small, so tying saves ``vocab_size x width``
  params and gives the head the embedding's gradient as well as its own.

  Written for node-stacked training: the token lookup is a one-hot matrix product (no more
  work than the tied head already does, and its gradient is a matrix product too, not a
  scatter-add of many repeated tokens), and attention is plain einsums under a causal mask
  (``jnp.tril``), so ``jax.vmap`` over the nodes turns every layer into dot products batched
  over the node axis.

  Attributes:
    vocab_size: tokens range over ``0 .. vocab_size - 1`` (256: bytes).
    context: the longest sequence the position embedding covers; inputs may be shorter.
    num_layers: how many transformer blocks.
    width: the model (residual stream) width; a multiple of ``num_heads``.
    num_heads: attention heads, each of ``width // num_heads`` features.
    dtype: the compute dtype (``jnp.bfloat16`` supported): params stay float32 and the
      logits come back in float32 (or in ``dtype`` where it is wider, float64 say).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from gossipjax import train
    >>> model = train.GPT(context=8, width=16, num_heads=2)
    >>> tokens = jnp.zeros((2, 8), jnp.int32)
    >>> params = model.init(jax.random.key(0), tokens)
    >>> model.apply(params, tokens).shape
    (2, 8, 256)
    >>> model.apply(params, tokens[:, :5]).shape  # shorter than the context
    (2, 5, 256)
  """

  vocab_size: int = 256
  context: int = 64
  num_layers: int = 2
  width: int = 64
  num_heads: int = 4
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, tokens: jnp.ndarray) -> jnp.ndarray:
    length = tokens.shape[-1]
    if length > self.context:
      raise ValueError(f"gj.train.GPT: the input has {length} tokens, more than the model's context of "
                       f"{self.context}")
    if self.width % self.num_heads:
      raise ValueError(f"gj.train.GPT: width {self.width} is not a multiple of num_heads {self.num_heads}")
    init = nn.initializers.normal(0.02)  # GPT-2's: tied logits start near zero, the loss near log(vocab_size)
    embed = nn.Embed(self.vocab_size, self.width, dtype=self.dtype, embedding_init=init)
    position = self.param("position_embedding", init, (self.context, self.width), jnp.float32)
    one_hot = jax.nn.one_hot(tokens, self.vocab_size, dtype=self.dtype)
    x = one_hot @ embed.embedding.astype(self.dtype)
    x = x + position[:length].astype(self.dtype).reshape((1,) * (x.ndim - 2) + (length, self.width))
    for _ in range(self.num_layers):
      x = x + _CausalSelfAttention(self.num_heads, self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))
      h = nn.gelu(nn.Dense(4 * self.width, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x)))
      x = x + nn.Dense(self.width, dtype=self.dtype)(h)
    logits = embed.attend(nn.LayerNorm(dtype=self.dtype)(x))
    return logits.astype(jnp.promote_types(self.dtype, jnp.float32))


class _CausalSelfAttention(nn.Module):
  """Multi-head self-attention in which position t sees positions 0 .. t only."""

  num_heads: int
  dtype: Any

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    length, width = x.shape[-2:]
    head = width // self.num_heads
    qkv = nn.Dense(3 * width, dtype=self.dtype)(x).reshape(x.shape[:-1] + (3, self.num_heads, head))
    q, k, v = qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]
    scores = jnp.einsum("...qhd,...khd->...hqk", q, k) / jnp.sqrt(head).astype(self.dtype)
    # The softmax in float32 at least: in bfloat16 its sum of exponentials loses the small weights.
    scores = scores.astype(jnp.promote_types(self.dtype, jnp.float32))
    causal = jnp.tril(jnp.ones((length, length), bool)).reshape((1,) * (scores.ndim - 2) + (length, length))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
    out = jnp.einsum("...hqk,...khd->...qhd", weights, v).reshape(x.shape)
    return nn.Dense(width, dtype=self.dtype)(out)
