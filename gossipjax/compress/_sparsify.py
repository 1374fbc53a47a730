"""Sparsifiers: send a few entries of each layer with their indices."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from gossipjax.compress._base import Compressor, check_fraction, sparse_bits


def _num_kept(fraction: float, size: int) -> int:
  return min(size, max(1, math.ceil(fraction * size - 1e-9)))


def _scatter(x: jax.Array, idx: jax.Array, values: jax.Array) -> jax.Array:
  return jnp.zeros(x.size, x.dtype).at[idx].set(values).reshape(x.shape)


@dataclasses.dataclass(frozen=True)
class TopK(Compressor):
  """The top-k sparsifier built by `top_k`.

  Args:
    fraction: the share of each layer's entries to keep, in (0, 1].

  Example:
    >>> import gossipjax as gj
    >>> gj.compress.top_k(0.25)
    TopK(fraction=0.25)
    >>> gj.compress.top_k(0.25) == gj.compress.TopK(0.25)  # static data: equal configs compare equal
    True
  """

  fraction: float

  def __post_init__(self):
    check_fraction(self.fraction, "gj.compress.top_k")

  def _leaf(self, x, key):
    del key
    flat = x.ravel()
    _, idx = lax.top_k(jnp.abs(flat), _num_kept(self.fraction, x.size))
    return _scatter(x, idx, flat[idx])

  def _leaf_bits(self, x):
    return sparse_bits(_num_kept(self.fraction, x.size), x)


def top_k(fraction: float) -> TopK:
  """Keeps the ``k = ceil(fraction * d)`` largest-magnitude entries of each layer.

  Biased; a contraction with ``delta = k / d`` (Stich et al. 2018). Bits: k values and
  their ``ceil(log2 d)``-bit indices per layer (or the dense layer when smaller).

  ``k`` is rounded up, so every layer keeps at least one entry; the CHOCO-SGD authors'
  code rounds down (``int(fraction * d)``), which keeps one entry fewer whenever
  ``fraction * d`` is not a whole number.

  Args:
    fraction: the share of each layer's entries to keep, in (0, 1].

  Returns:
    A `TopK` compressor.

  Raises:
    ValueError: ``fraction`` is not in (0, 1].

  Example:
    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> c = gj.compress.top_k(0.5)
    >>> c.compress(jnp.array([3.0, -1.0, 0.5, -4.0]), jax.random.PRNGKey(0)).tolist()
    [3.0, 0.0, 0.0, -4.0]
    >>> float(c.bits(jnp.zeros(4, jnp.float32)))  # 2 values of 32 bits, 2 indices of 2 bits
    68.0

  References:
    Stich, Cordonnier, Jaggi (2018), Sparsified SGD with Memory, NeurIPS.

    Koloskova, Stich, Jaggi (2019), Decentralized Stochastic Optimization and Gossip
    Algorithms with Compressed Communication, ICML.
  """
  return TopK(fraction)


@dataclasses.dataclass(frozen=True)
class RandomK(Compressor):
  """The random-k sparsifier built by `random_k`.

  Args:
    fraction: the share of each layer's entries to keep, in (0, 1].
    scaled: multiply the kept entries by ``d / k`` (unbiased) or not (a contraction).

  Example:
    >>> import gossipjax as gj
    >>> c = gj.compress.RandomK(0.25)
    >>> c.unbiased, c.omega(8), c.contraction()  # omega = d / k - 1
    (True, 3.0, RandomK(fraction=0.25, scaled=False))
  """

  fraction: float
  scaled: bool = True

  def __post_init__(self):
    check_fraction(self.fraction, "gj.compress.random_k")

  @property
  def unbiased(self) -> bool:  # type: ignore[override]
    return self.scaled

  def _leaf(self, x, key):
    k = _num_kept(self.fraction, x.size)
    _, idx = lax.top_k(jax.random.uniform(key, (x.size,)), k)  # k distinct uniform indices
    flat = x.ravel()
    values = flat[idx] * (x.size / k) if self.scaled else flat[idx]
    return _scatter(x, idx, values.astype(x.dtype))

  def _leaf_bits(self, x):
    return sparse_bits(_num_kept(self.fraction, x.size), x)

  def omega(self, size):
    if not self.scaled:
      return super().omega(size)
    return size / _num_kept(self.fraction, size) - 1.0

  def contraction(self):
    return RandomK(self.fraction, scaled=False)


def random_k(fraction: float, scaled: bool = True) -> RandomK:
  """Keeps ``k = ceil(fraction * d)`` entries of each layer chosen uniformly at random.

  With ``scaled=True`` the kept entries are multiplied by ``d / k``, so ``E[C(x)] = x``
  (unbiased, ``omega = d / k - 1``); with ``scaled=False`` it is a contraction with
  ``delta = k / d`` in expectation. Bits as ``top_k``.

  Args:
    fraction: the share of each layer's entries to keep, in (0, 1].
    scaled: multiply the kept entries by ``d / k`` (unbiased) or not (a contraction).

  Returns:
    A `RandomK` compressor.

  Raises:
    ValueError: ``fraction`` is not in (0, 1].

  Example:
    Two of the four entries are kept, each multiplied by ``d / k = 2``:

    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> c = gj.compress.random_k(0.5)
    >>> x = jnp.array([3.0, -1.0, 0.5, -4.0], jnp.float32)
    >>> q = c.compress(x, jax.random.PRNGKey(0))
    >>> int((q != 0).sum()), bool(jnp.all((q == 0) | (q == 2 * x)))
    (2, True)
    >>> float(c.bits(x))  # 2 values of 32 bits, 2 indices of 2 bits
    68.0

  References:
    Stich, Cordonnier, Jaggi (2018), Sparsified SGD with Memory, NeurIPS.

    Koloskova, Stich, Jaggi (2019), Decentralized Stochastic Optimization and Gossip
    Algorithms with Compressed Communication, ICML.
  """
  return RandomK(fraction, scaled)


@dataclasses.dataclass(frozen=True)
class ThresholdMean(Compressor):
  """Cui's threshold-at-mean sparsifier built by `threshold_mean`.

  Args:
    absolute: compare magnitudes to the mean magnitude (``True``) or values to the mean.

  Example:
    >>> import gossipjax as gj
    >>> gj.compress.threshold_mean(), gj.compress.ThresholdMean().unbiased
    (ThresholdMean(absolute=True), False)
  """

  absolute: bool = True

  def _mask(self, x):
    if self.absolute:
      return (jnp.abs(x) >= jnp.mean(jnp.abs(x))) & (x != 0)
    return (x >= jnp.mean(x)) & (x != 0)

  def _leaf(self, x, key):
    del key
    return jnp.where(self._mask(x), x, jnp.zeros_like(x))

  def _leaf_bits(self, x):
    return sparse_bits(jnp.sum(self._mask(x)), x)


def threshold_mean(absolute: bool = True) -> ThresholdMean:
  """Cui's sparsifier: keep the entries of each layer that reach the layer's mean (Cui 2019,
  "Decentralized Deep Learning with Gradient Compression").

  With ``absolute=True`` (default) an entry is kept when ``|x_i| >= mean_j |x_j|``: the
  magnitude reading, a contraction (the largest entry is always kept, so
  ``delta >= 1 / d``). ``absolute=False`` is the literal rule of Cui's Algorithm 1,
  ``x_i >= mean_j x_j``, which drops large negative entries and is not a contraction.
  The number of entries kept depends on the data, so ``bits`` is computed from ``x``.

  Args:
    absolute: keep ``|x_i| >= mean |x|`` (``True``) or, literally, ``x_i >= mean x``.

  Returns:
    A `ThresholdMean` compressor.

  Example:
    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> x = jnp.array([3.0, -1.0, 0.5, -4.0], jnp.float32)  # mean |x| = 2.125, mean x = -0.375
    >>> gj.compress.threshold_mean().compress(x, jax.random.PRNGKey(0)).tolist()
    [3.0, 0.0, 0.0, -4.0]
    >>> gj.compress.threshold_mean(absolute=False).compress(x, jax.random.PRNGKey(0)).tolist()
    [3.0, 0.0, 0.5, 0.0]

  References:
    Cui (2019), Decentralized Deep Learning with Gradient Compression, Bulletin of the
    Graduate School of Hosei University, Computer and Information Sciences 14,
    doi:10.15002/00021917.
  """
  return ThresholdMean(absolute)
