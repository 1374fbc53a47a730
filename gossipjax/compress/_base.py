"""What a compressor is: static config that compresses one node's pytree and counts its bits."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Compressor:
  """Base of every compressor: maps a rule for one leaf over a node's pytree.

  Compressors are data (frozen dataclasses), not callables, so ``optax.inject_hyperparams``
  does not mistake one for a schedule. Both methods act on **one node's** pytree (no node
  axis); algorithms ``jax.vmap`` them over the stacked nodes. Every leaf (layer) is
  compressed on its own, as in Cui (2019), "Decentralized Deep Learning with Gradient
  Compression" ("every layer has different shape ... the threshold
  should be calculated independently").

  Attributes:
    unbiased: ``E[C(x)] = x`` (then ``omega(d)`` bounds the variance,
      ``E||C(x) - x||^2 <= omega(d) ||x||^2``); otherwise C is a contraction,
      ``||C(x) - x||^2 <= (1 - delta) ||x||^2`` for some ``delta > 0``.

  Example:
    >>> import gossipjax as gj
    >>> [c.unbiased for c in (gj.compress.top_k(0.1), gj.compress.random_k(0.1), gj.compress.qsgd(4))]
    [False, True, True]
    >>> gj.compress.qsgd(4).contraction()  # the biased, contracting form CHOCO-SGD uses
    QSGD(levels=4, scaled=False)
  """

  unbiased: ClassVar[bool] = False

  def compress(self, tree: Any, key: jax.Array) -> Any:
    """``C(x)`` for every leaf of one node's pytree; ``key`` is a PRNG key (used if random)."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, max(1, len(leaves)))
    return jax.tree.unflatten(treedef, [self._leaf(x, k) for x, k in zip(leaves, keys)])

  def bits(self, tree: Any) -> jax.Array:
    """Bits of one node's message that sends ``compress(tree, key)`` (summed over leaves)."""
    total = jnp.zeros([], float)
    for x in jax.tree.leaves(tree):
      total = total + self._leaf_bits(x)
    return total

  def contraction(self) -> "Compressor":
    """The same compressor as a contraction (what CHOCO-SGD's theory needs).

    An unbiased compressor with variance ``omega`` becomes one by scaling its output by
    ``1 / (1 + omega)`` (Koloskova et al. 2019, Sec. 3); a biased one already is.
    """
    return self

  def omega(self, size: int) -> float:
    """Variance bound of an unbiased compressor on a leaf of ``size`` entries."""
    raise NotImplementedError(f"{type(self).__name__} is not unbiased")

  def _leaf(self, x: jax.Array, key: jax.Array) -> jax.Array:
    raise NotImplementedError

  def _leaf_bits(self, x: jax.Array) -> jax.Array:
    raise NotImplementedError


def value_bits(x: jax.Array) -> int:
  """Bits of one entry of ``x`` as stored (32 for float32)."""
  return jnp.dtype(x.dtype).itemsize * 8


def index_bits(size: int) -> int:
  """Bits to address one of ``size`` entries."""
  return max(1, math.ceil(math.log2(size))) if size > 1 else 1


def sparse_bits(kept: Any, x: jax.Array) -> jax.Array:
  """``kept`` values with their indices, or the dense leaf when that is smaller."""
  sparse = jnp.asarray(kept, float) * (value_bits(x) + index_bits(x.size))
  return jnp.minimum(sparse, float(x.size * value_bits(x)))


def check_fraction(fraction: Any, name: str) -> None:
  if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
    raise ValueError(f"{name}: fraction must be a number in (0, 1], got {fraction!r}")


@dataclasses.dataclass(frozen=True)
class Identity(Compressor):
  """No compression: the full-precision message (the baseline to count bits against).

  Example:
    >>> import gossipjax as gj
    >>> gj.compress.Identity() == gj.compress.identity()
    True
  """

  def _leaf(self, x, key):
    del key
    return x

  def _leaf_bits(self, x):
    return jnp.asarray(float(x.size * value_bits(x)))


def identity() -> Identity:
  """No compression; ``bits`` is the dense message (``size * 32`` for float32).

  Returns:
    An `Identity` compressor: ``C(x) = x``.

  Example:
    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> c = gj.compress.identity()
    >>> x = jnp.array([3.0, -1.0, 0.5, -4.0], jnp.float32)
    >>> c.compress(x, jax.random.PRNGKey(0)).tolist(), float(c.bits(x))
    ([3.0, -1.0, 0.5, -4.0], 128.0)
  """
  return Identity()
