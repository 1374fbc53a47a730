"""Quantizers: send every entry of each layer with a few bits and one scale."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from gossipjax.compress._base import Compressor, gathered, require_floating, row_pieces, wide_dtype


@dataclasses.dataclass(frozen=True)
class Sign(Compressor):
  """The scaled-sign compressor built by `sign`.

  Example:
    >>> import gossipjax as gj
    >>> gj.compress.sign(), gj.compress.Sign().unbiased
    (Sign(), False)
  """

  decode_reads_key: ClassVar[bool] = False  # everything it decodes crosses the wire

  _name: ClassVar[str] = "gj.compress.sign"

  def _encode(self, x, key):
    del key
    # The sum of |x| overflows float16 past 65,504, while the mean never exceeds max |x|.
    scale = jnp.mean(jnp.abs(x), dtype=wide_dtype(x.dtype)).astype(x.dtype)
    rows = row_pieces(x)
    if rows is not None and rows.shape[1] % 8 == 0:  # a node split over devices: each packs its own piece
      return gathered(jnp.packbits(rows >= 0, axis=1).ravel()), scale
    return jnp.packbits(gathered(x).ravel() >= 0), scale  # bit 1: sent as +scale

  def _decode(self, compact, key, shape, dtype):
    del key
    packed, scale = compact
    positive = jnp.unpackbits(packed, count=math.prod(shape)).reshape(shape).astype(bool)
    return jnp.where(positive, scale, -scale).astype(dtype)

  def _check_dtype(self, dtype):
    require_floating(dtype, self._name, "the scale ||x||_1 / d")


def sign() -> Sign:
  """Scaled sign, ``C(x) = (||x||_1 / d) sign(x)`` per layer (Karimireddy et al. 2019).

  An entry that is exactly zero counts as positive (``sign(0) = +1``), so every entry is
  one bit. Biased; a contraction with ``delta = ||x||_1^2 / (d ||x||_2^2) >= 1 / d``.
  Wire form per layer: the sign bits packed eight to a byte (``uint8``, as
  ``np.packbits``), ``ceil(d / 8)`` bytes, and the scale in the layer's dtype. A layer split
  over a node's devices along its first dimension (Explicit mesh) packs each piece where it
  lies and gathers the packed bytes (pieces of a multiple of 8 entries; else the sign bytes),
  and its scale is a sum over the pieces.

  Returns:
    A `Sign` compressor.

  Raises:
    TypeError: a leaf given to ``compress`` or ``encode_leaf`` is not floating point.

  Example:
    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> c = gj.compress.sign()
    >>> x = jnp.array([3.0, -1.0, 0.5, -4.0], jnp.float32)  # ||x||_1 / d = 8.5 / 4
    >>> c.compress(x, jax.random.PRNGKey(0)).tolist()
    [2.125, -2.125, 2.125, -2.125]
    >>> packed, scale = c.encode_leaf(x, jax.random.PRNGKey(0))  # signs + - + -: 0b10100000
    >>> packed.tolist(), float(scale)
    ([160], 2.125)
    >>> float(c.bits(x))  # 4 sign bits padded to a byte, and a 32-bit scale
    40.0

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

  decode_reads_key: ClassVar[bool] = False  # everything it decodes crosses the wire

  levels: int
  scaled: bool = True
  _name: ClassVar[str] = "gj.compress.qsgd"

  def __post_init__(self):
    if (isinstance(self.levels, (bool, np.bool_)) or not isinstance(self.levels, (int, np.integer))
        or not 1 <= self.levels < 2**31):
      raise ValueError(f"{self._name}: levels must be a positive integer below 2**31, got {self.levels!r}")
    object.__setattr__(self, "levels", int(self.levels))  # a NumPy integer too, stored as a Python int

  @property
  def unbiased(self) -> bool:  # type: ignore[override]
    return self.scaled

  def omega(self, size):
    s = self.levels
    return min(size / s**2, math.sqrt(size) / s)

  def _level_dtype(self) -> jnp.dtype:
    """The smallest signed integer dtype that holds the levels ``-s, ..., s``."""
    return next(jnp.dtype(t) for t in (jnp.int8, jnp.int16, jnp.int32) if self.levels <= jnp.iinfo(t).max)

  def _encode(self, x, key):
    s = self.levels
    wide = x.astype(wide_dtype(x.dtype))  # a float16 sum of squares overflows once ||x|| passes 256
    norm = jnp.sqrt(jnp.sum(wide * wide))
    r = jnp.abs(wide) / jnp.where(norm == 0, 1, norm) * s
    lower = jnp.floor(r)
    level = lower + (jax.random.uniform(key, x.shape, r.dtype) < r - lower)
    return gathered(jnp.where(x < 0, -level, level).astype(self._level_dtype())), norm

  def _decode(self, compact, key, shape, dtype):
    del key
    level, norm = compact
    q = (norm / self.levels * level.astype(norm.dtype)).astype(dtype)
    return q if self.scaled else (q / (1.0 + self.omega(math.prod(shape)))).astype(dtype)

  def _check_dtype(self, dtype):
    require_floating(dtype, self._name, "the levels' scale ||x||_2 / s")

  def contraction(self):
    return QSGD(self.levels, scaled=False)


def qsgd(levels: int, scaled: bool = True) -> QSGD:
  """QSGD stochastic quantization to ``levels`` levels per layer (Alistarh et al. 2017).

  ``C(x) = ||x||_2 sign(x) xi(x) / s`` where ``xi_i`` rounds ``s |x_i| / ||x||_2`` up or
  down at random so that ``E[C(x)] = x``; variance ``omega = min(d / s^2, sqrt(d) / s)``.
  ``scaled=False`` divides by ``1 + omega``, the contraction CHOCO-SGD uses (Koloskova
  et al. 2019). Wire form per layer: every entry's signed level ``sign(x_i) xi_i`` in
  ``-s, ..., s`` as ``int8`` (``int16`` above 127 levels, ``int32`` above 32,767), and
  the norm, computed and sent in float32 for a 16-bit layer (float16 ends at 65,504) and
  in the layer's dtype otherwise; a layer split over a node's devices (Explicit mesh) sums its
  norm over the pieces and gathers the int8 levels, the message. (A bit-packed code of ``1 + ceil(log2(s + 1))`` bits per
  entry, or the paper's Elias coding, would send fewer.)

  Args:
    levels: s, the number of quantization levels per sign (a positive integer).
    scaled: ``True`` for the unbiased quantizer, ``False`` for the contraction
      ``C(x) / (1 + omega)``.

  Returns:
    A `QSGD` compressor.

  Raises:
    ValueError: ``levels`` is not a positive integer below ``2**31``.
    TypeError: a leaf given to ``compress`` or ``encode_leaf`` is not floating point.

  Example:
    Every entry becomes one of the levels ``k ||x||_2 / s`` with the sign of ``x``:

    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> c = gj.compress.qsgd(4)
    >>> x = jnp.array([3.0, -1.0, 0.5, -4.0], jnp.float32)
    >>> levels = c.compress(x, jax.random.PRNGKey(0)) / (jnp.linalg.norm(x) / 4)
    >>> bool(jnp.allclose(levels, jnp.round(levels), atol=1e-5)), bool(jnp.all(levels * x >= 0))
    (True, True)
    >>> level, norm = c.encode_leaf(x, jax.random.PRNGKey(0))  # what crosses the wire
    >>> level.dtype, norm.dtype
    (dtype('int8'), dtype('float32'))
    >>> float(c.bits(x))  # one byte per entry, and a 32-bit norm
    64.0

  References:
    Alistarh, Grubic, Li, Tomioka, Vojnovic (2017), QSGD: Communication-Efficient SGD via
    Gradient Quantization and Encoding, NeurIPS.

    Koloskova, Stich, Jaggi (2019), Decentralized Stochastic Optimization and Gossip
    Algorithms with Compressed Communication, ICML.
  """
  return QSGD(levels, scaled)
