"""Per-node layers: operations whose gradients map over nodes at the accelerator's speed.

``jax.vmap`` over nodes compiles some per-node backward passes into slow forms: a convolution's weight gradient
becomes a grouped convolution whose window is the whole image. The layers here keep XLA's forward pass and
choose, per platform when the program is lowered, a formulation of the gradient that maps over nodes as batched
matrix products. Each has the signature of the ``jax.lax`` operation it replaces, so a flax model takes it as one
argument::

  nn.Conv(features, (3, 3), conv_general_dilated=gj.layers.conv_general_dilated)            # linen
  nnx.Conv(c_in, c_out, (3, 3), conv_general_dilated=gj.layers.conv_general_dilated, rngs=rngs)  # NNX
"""

from gossipjax.layers._conv import WEIGHT_GRADS, conv_general_dilated

__all__ = ("WEIGHT_GRADS", "conv_general_dilated")
