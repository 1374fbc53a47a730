"""Quantizers: send every entry of each layer with a few bits and one scale."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from gossipjax.compress._base import Compressor, value_bits


@dataclasses.dataclass(frozen=True)
class Sign(Compressor):

  def _leaf(self, x, key):
    del key
    return (jnp.sum(jnp.abs(x)) / x.size).astype(x.dtype) * jnp.sign(x)

  def _leaf_bits(self, x):
    return jnp.asarray(float(x.size + value_bits(x)))


def sign() -> Sign:
  """Scaled sign, ``C(x) = (||x||_1 / d) sign(x)`` per layer (Karimireddy et al. 2019).

  Biased; a contraction with ``delta = ||x||_1^2 / (d ||x||_2^2) >= 1 / d``.
  Bits: one per entry plus the scale.
  """
  return Sign()


@dataclasses.dataclass(frozen=True)
class QSGD(Compressor):
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
  """
  return QSGD(levels, scaled)
