"""Quantizers: send every entry of each layer with a few bits and one scale."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from gossipjax.compress._base import Compressor, value_bits


@dataclasses.dataclass(frozen=True)
class Sign(Compressor):
  """The scaled-sign compressor built by `sign`.

  Example:
    >>> import gossipjax as gj
    >>> gj.compress.sign(), gj.compress.Sign().unbiased
    (Sign(), False)
  """

  def _leaf(self, x, key):
    del key
    return (jnp.sum(jnp.abs(x)) / x.size).astype(x.dtype) * jnp.sign(x)

  def _leaf_bits(self, x):
    return jnp.asarray(float(x.size + value_bits(x)))


def sign() -> Sign:
  """Scaled sign, ``C(x) = (||x||_1 / d) sign(x)`` per layer (Karimireddy et al. 2019).

  Biased; a contraction with ``delta = ||x||_1^2 / (d ||x||_2^2) >= 1 / d``.
  Bits: one per entry plus the scale.

  Returns:
    A `Sign` compressor.

  Example:
    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> c = gj.compress.sign()
    >>> x = jnp.array([3.0, -1.0, 0.5, -4.0], jnp.float32)  # ||x||_1 / d = 8.5 / 4
    >>> c.compress(x, jax.random.PRNGKey(0)).tolist()
    [2.125, -2.125, 2.125, -2.125]
    >>> float(c.bits(x))  # 4 sign bits and a 32-bit scale
    36.0

  References:
    Karimireddy, Rebjock, Stich, Jaggi (2019), Error Feedback Fixes SignSGD and other
    Gradient Compression Schemes, ICML.

    Bernstein, Wang, Azizzadenesheli, Anandkumar (2018), signSGD: Compressed Optimisation
    for Non-Convex Problems, ICML.
  """
  return Sign()


@dataclasses.dataclass(frozen=True)
class QSGD(Compressor):
  """The QSGD quantizer built by `qsgd`.

  Args:
    levels: s, the number of quantization levels per sign.
    scaled: ``True`` for the unbiased quantizer, ``False`` for its contraction
      (divided by ``1 + omega``).

  Example:
    >>> import gossipjax as gj
    >>> c = gj.compress.QSGD(levels=4)
    >>> c.unbiased, c.omega(16), c.contraction().unbiased  # omega = min(d / s^2, sqrt(d) / s)
    (True, 1.0, False)
  """

  levels: int
  scaled: bool = True

  def __post_init__(self):
    if isinstance(self.levels, bool) or not isinstance(self.levels, int) or self.levels < 1:
      raise ValueError(f"qsgd: levels must be a positive integer, got {self.levels!r}")

  @property
  def unbiased(self) -> bool:  # type: ignore[override]
    return self.scaled

  def omega(self, size):
    s = self.levels
    return min(size / s**2, math.sqrt(size) / s)

  def _leaf(self, x, key):
    s = self.levels
    norm = jnp.sqrt(jnp.sum(x * x))
    r = jnp.abs(x) / jnp.where(norm == 0, 1, norm) * s
    lower = jnp.floor(r)
    level = lower + (jax.random.uniform(key, x.shape, r.dtype) < r - lower)
    q = (norm / s * jnp.sign(x) * level).astype(x.dtype)
    return q if self.scaled else (q / (1.0 + self.omega(x.size))).astype(x.dtype)

  def _leaf_bits(self, x):
    return jnp.asarray(float(x.size * (1 + max(1, math.ceil(math.log2(self.levels + 1)))) + value_bits(x)))

  def contraction(self):
    return QSGD(self.levels, scaled=False)


def qsgd(levels: int, scaled: bool = True) -> QSGD:
  """QSGD stochastic quantization to ``levels`` levels per layer (Alistarh et al. 2017).

  ``C(x) = ||x||_2 sign(x) xi(x) / s`` where ``xi_i`` rounds ``s |x_i| / ||x||_2`` up or
  down at random so that ``E[C(x)] = x``; variance ``omega = min(d / s^2, sqrt(d) / s)``.
  ``scaled=False`` divides by ``1 + omega``, the contraction CHOCO-SGD uses (Koloskova
  et al. 2019). Bits: a fixed-length code of one sign bit and ``ceil(log2(s + 1))`` level
  bits per entry, plus the norm (Elias coding, as in the paper, would send fewer).

  Args:
    levels: s, the number of quantization levels per sign (a positive integer).
    scaled: ``True`` for the unbiased quantizer, ``False`` for the contraction
      ``C(x) / (1 + omega)``.

  Returns:
    A `QSGD` compressor.

  Raises:
    ValueError: ``levels`` is not a positive integer.

  Example:
    Every entry becomes one of the levels ``k ||x||_2 / s`` with the sign of ``x``:

    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> c = gj.compress.qsgd(4)
    >>> x = jnp.array([3.0, -1.0, 0.5, -4.0], jnp.float32)
    >>> levels = c.compress(x, jax.random.PRNGKey(0)) / (jnp.linalg.norm(x) / 4)
    >>> bool(jnp.allclose(levels, jnp.round(levels), atol=1e-5)), bool(jnp.all(levels * x >= 0))
    (True, True)
    >>> float(c.bits(x))  # 1 sign and 3 level bits per entry, and a 32-bit norm
    48.0

  References:
    Alistarh, Grubic, Li, Tomioka, Vojnovic (2017), QSGD: Communication-Efficient SGD via
    Gradient Quantization and Encoding, NeurIPS.

    Koloskova, Stich, Jaggi (2019), Decentralized Stochastic Optimization and Gossip
    Algorithms with Compressed Communication, ICML.
  """
  return QSGD(levels, scaled)
