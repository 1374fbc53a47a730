"""Per-node layers: operations whose gradients map over nodes at the accelerator's speed.

``jax.vmap`` over nodes compiles some per-node passes into slow forms: a convolution's weight gradient becomes a
grouped convolution whose window is the whole image, and XLA:CPU runs every grouped convolution slowly. The layers
here choose, per platform when the program is lowered, a formulation that maps over nodes as batched matrix
products, and keep only what XLA's own form keeps for the backward pass. Each has the signature of the ``jax.lax`` operation it replaces, so a flax model takes it as one
argument.

Example:
  flax linen and NNX, 4 nodes of a convolution's gradient:

  >>> import jax, jax.numpy as jnp, flax.linen as nn
  >>> from flax import nnx
  >>> import gossipjax as gj
  >>> conv = nn.Conv(8, (3, 3), conv_general_dilated=gj.layers.conv_general_dilated)
  >>> x = jnp.ones((4, 2, 16, 16, 3))  # 4 nodes, a batch of 2 images each
  >>> params = gj.init_nodes(lambda k: conv.init(k, x[0]), jax.random.key(0), 4)
  >>> grads = jax.vmap(jax.grad(lambda p, x: conv.apply(p, x).sum()))(params, x)
  >>> grads["params"]["kernel"].shape
  (4, 3, 3, 3, 8)
  >>> layer = nnx.Conv(3, 8, (3, 3), conv_general_dilated=gj.layers.conv_general_dilated, rngs=nnx.Rngs(0))
  >>> layer(x[0]).shape
  (2, 16, 16, 8)
"""

from gossipjax.layers._conv import WEIGHT_GRADS, conv_general_dilated

__all__ = ("WEIGHT_GRADS", "conv_general_dilated")
