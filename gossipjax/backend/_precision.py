"""The dtype a mixing sum runs in."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def accumulation_dtype(dtype: np.dtype) -> np.dtype:
  """float32 for floats narrower than 32 bits (bfloat16, float16, float8), else ``dtype`` itself.

  In bfloat16 the weights of W are rounded too (a ring's 1/3 becomes 0.33398, so a row
  sums to 1.002) and so is every partial sum of ``W x``: the node average then drifts
  by percents in a few hundred steps. Mixers exchange the leaf in its own dtype, sum in
  this one and round the result once.

  >>> accumulation_dtype(jnp.bfloat16), accumulation_dtype(jnp.float64), accumulation_dtype(jnp.int32)
  (dtype('float32'), dtype('float64'), dtype('int32'))
  """
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
    return jnp.dtype(jnp.float32)
  return dtype
