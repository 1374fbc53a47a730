"""The benchmark models as plain functions of a params dict (so JAX and PyTorch match)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def mlp_init(key: jax.Array, sizes: tuple[int, ...]) -> dict[str, jax.Array]:
  """He-initialised dense layers ``w{i}`` (in, out) and ``b{i}``."""
  params = {}
  for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
    key, sub = jax.random.split(key)
    params[f"w{i}"] = jax.random.normal(sub, (a, b), jnp.float32) * float(np.sqrt(2.0 / a))
    params[f"b{i}"] = jnp.zeros((b,), jnp.float32)
  return params


def mlp_apply(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  layers = len(params) // 2
  for i in range(layers):
    x = x @ params[f"w{i}"] + params[f"b{i}"][None, :]
    if i < layers - 1:
      x = jax.nn.relu(x)
  return x


def cross_entropy(params: dict[str, jax.Array], x: jax.Array, labels: jax.Array) -> jax.Array:
  logits = mlp_apply(params, x)
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def synthetic_batch(key: jax.Array, num_nodes: int, batch: int, features: int, classes: int):
  """One batch per node: inputs (n, batch, features), integer labels (n, batch)."""
  kx, ky = jax.random.split(key)
  x = jax.random.normal(kx, (num_nodes, batch, features), jnp.float32)
  y = jax.random.randint(ky, (num_nodes, batch), 0, classes)
  return x, y
