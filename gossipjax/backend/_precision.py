"""The dtype a mixing sum runs in, and the terms an all-reduce mean sums."""

from __future__ import annotations

from typing import Any

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


def mean_terms(x: Any, count: Any) -> Any:
  """``x / count`` in the dtype an all-reduce mean sums in: scaled before the sum, which cannot overflow.

  A mean that sums first overflows where the mean itself is finite (4 nodes at 1e38 in
  float32 sum to inf); each term ``x_i / n`` is at most ``max |x|`` in size, and so is their
  sum. Floats narrower than 32 bits are widened first (`accumulation_dtype`), other floats
  keep their dtype, and integers are averaged in JAX's default float, as ``jnp.mean`` does.
  Every backend's ``mean`` sums these terms over all n nodes.

  Args:
    x: a node-stacked leaf (or a block of it).
    count: n, the number of nodes the mean is over (a number, or a traced integer).

  Returns:
    ``x / count``, to be summed over the node axis.

  >>> x = jnp.full((4,), 1e38, jnp.float32)
  >>> bool(jnp.sum(mean_terms(x, 4)) == x[0]), bool(jnp.isinf(jnp.mean(x)))   # scaled first; summed first
  (True, True)
  >>> mean_terms(jnp.ones(2, jnp.bfloat16), 2).dtype
  dtype('float32')
  """
  if jnp.issubdtype(x.dtype, jnp.inexact):
    dtype = accumulation_dtype(x.dtype)
  else:
    dtype = jnp.result_type(float)
  return x.astype(dtype) / jnp.asarray(count).astype(dtype)
