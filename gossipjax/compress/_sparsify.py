"""Sparsifiers: send a few entries of each layer with their indices."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from gossipjax.compress._base import (Compressor, check_fraction, gathered, map_pieces, require_floating, row_pieces,
                                      split_spec)


def _num_kept(fraction: float, size: int) -> int:
  return min(size, max(1, math.ceil(fraction * size - 1e-9)))


def _scatter(shape: tuple[int, ...], dtype, idx: jax.Array, values: jax.Array) -> jax.Array:
  return jnp.zeros(math.prod(shape), dtype).at[idx].set(values).reshape(shape)


def index_dtype(size: int, name: str) -> jnp.dtype:
  """The smallest unsigned integer dtype that addresses ``size`` entries."""
  for dtype in (jnp.uint8, jnp.uint16, jnp.uint32):
    if size <= 2 ** (8 * jnp.dtype(dtype).itemsize):
      return jnp.dtype(dtype)
  raise ValueError(f"{name}: a leaf of {size} entries cannot be addressed with 32-bit indices; split it into "
                   "smaller leaves")


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

  decode_reads_key: ClassVar[bool] = False  # everything it decodes crosses the wire

  fraction: float
  _name: ClassVar[str] = "gj.compress.top_k"

  def __post_init__(self):
    object.__setattr__(self, "fraction", check_fraction(self.fraction, self._name))

  def _top(self, x):
    flat = x.ravel()
    _, idx = lax.top_k(jnp.abs(flat), _num_kept(self.fraction, x.size))
    return idx, flat[idx]

  def _sparse_is_smaller(self, size, dtype):
    k = _num_kept(self.fraction, size)
    return k * (jnp.dtype(dtype).itemsize + index_dtype(size, self._name).itemsize) < size * jnp.dtype(dtype).itemsize

  def _leaf(self, x, key):
    del key
    idx, values = self._top(x)
    return _scatter(x.shape, x.dtype, idx, values)

  def _encode(self, x, key):
    if not self._sparse_is_smaller(x.size, x.dtype):
      return (self._leaf(gathered(x), key),)
    rows = row_pieces(x)
    if rows is not None:  # the split is in the leaf's type: the node's devices gather their pieces' candidates
      return self._top_of_rows(rows, 0, x.size, gathered)
    pieces = map_pieces(x)
    if pieces is not None:  # inside a backend's map, where the compiler would gather the layer to select from
      rows, axes = pieces
      gather = lambda v: lax.all_gather(v, axes, tiled=True, to="invarying")
      return jax.shard_map(lambda r: self._top_of_rows(r, lax.axis_index(axes), x.size, gather),
                           in_specs=P(axes), out_specs=P(), axis_names=frozenset(axes))(rows)
    idx, values = self._top(gathered(x))
    return values, idx.astype(index_dtype(x.size, self._name))

  def _top_of_rows(self, rows, first_row, size, gather):
    """A layer's top k (values, flat indices) from rows of its pieces, ``rows[0]`` the layer's row ``first_row``:
    the top k of each row, then of the D * k candidates that ``gather`` brings together."""
    k = _num_kept(self.fraction, size)
    _, local = lax.top_k(jnp.abs(rows), min(k, rows.shape[1]))
    values = gather(jnp.take_along_axis(rows, local, axis=1).ravel())
    flat = local + rows.shape[1] * (first_row + jnp.arange(rows.shape[0])[:, None])
    candidates = gather(flat.ravel().astype(index_dtype(size, self._name)))
    _, best = lax.top_k(jnp.abs(values), k)  # ties keep the lower index first, as one top_k over x does
    return values[best], candidates[best]

  def _decode(self, compact, key, shape, dtype):
    del key
    if not self._sparse_is_smaller(math.prod(shape), dtype):
      return compact[0]
    values, idx = compact
    return _scatter(shape, dtype, idx.astype(jnp.int32), values)


def top_k(fraction: float) -> TopK:
  """Keeps the ``k = ceil(fraction * d)`` largest-magnitude entries of each layer.

  Biased; a contraction with ``delta = k / d`` (Stich et al. 2018). Wire form per layer:
  the k values (in the layer's dtype) and their indices in the smallest unsigned integer
  that addresses the layer (``uint8`` up to 256 entries, ``uint16`` up to 65,536, else
  ``uint32``), or the dense layer when that is not larger.

  A layer split over a node's D devices is selected piece by piece: each device takes the
  top k of its piece, and the D * k candidates (values and indices), gathered, hold the
  layer's top k (ties to the lower index, as one top k over the layer). On an Explicit mesh
  the split is read from the layer's type (``P("model")``, along its first dimension).
  Inside the sharded backend's ``backend.map`` (``gj.choco_sgd``), on Explicit and Auto
  meshes alike, the pieces are those of the node's model axes (the mesh axes besides the
  node axis and ``data_axis``) for every layer whose first dimension divides by D: a layer
  split along another dimension is moved into them (an all-to-all), and one held whole by
  each device is sliced. Other layers are gathered whole.

  ``k`` is rounded up, so every layer keeps at least one entry; the CHOCO-SGD authors' code
  rounds down (``int(fraction * d)``), which keeps one entry fewer whenever
  ``fraction * d`` is not a whole number.

  Args:
    fraction: the share of each layer's entries to keep, in (0, 1].

  Returns:
    A `TopK` compressor.

  Raises:
    ValueError: ``fraction`` is not in (0, 1].
    TypeError: a leaf given to ``compress`` or ``encode_leaf`` is complex or boolean.

  Example:
    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> c = gj.compress.top_k(0.5)
    >>> c.compress(jnp.array([3.0, -1.0, 0.5, -4.0]), jax.random.PRNGKey(0)).tolist()
    [3.0, 0.0, 0.0, -4.0]
    >>> values, indices = c.encode_leaf(jnp.array([3.0, -1.0, 0.5, -4.0], jnp.float32), jax.random.PRNGKey(0))
    >>> values.tolist(), indices.tolist(), indices.dtype
    ([-4.0, 3.0], [3, 0], dtype('uint8'))
    >>> float(c.bits(jnp.zeros(4, jnp.float32)))  # 2 values of 32 bits, 2 indices of 8 bits
    80.0

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

  decode_reads_key: ClassVar[bool] = True  # its indices are drawn again from the sender's key

  fraction: float
  scaled: bool = True
  _name: ClassVar[str] = "gj.compress.random_k"

  def __post_init__(self):
    object.__setattr__(self, "fraction", check_fraction(self.fraction, self._name))

  @property
  def unbiased(self) -> bool:  # type: ignore[override]
    return self.scaled

  def _indices(self, size, key):
    _, idx = lax.top_k(jax.random.uniform(key, (size,)), _num_kept(self.fraction, size))
    return idx  # k distinct uniform indices: the receiver draws the same ones from the key

  def _encode(self, x, key):
    idx = self._indices(x.size, key)
    flat = x.ravel()
    values = flat[idx] if split_spec(x) is None else flat.at[idx].get(out_sharding=jax.sharding.PartitionSpec())
    if self.scaled:
      values = values * (x.size / idx.size)
    return (values.astype(x.dtype),)

  def _decode(self, compact, key, shape, dtype):
    return _scatter(shape, dtype, self._indices(math.prod(shape), key), compact[0])

  def _check_dtype(self, dtype):
    if self.scaled:
      require_floating(dtype, self._name, "scaling the kept entries by d / k (scaled=True)")
    super()._check_dtype(dtype)

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
  ``delta = k / d`` in expectation. Wire form per layer: the k values only. Sender and
  receiver share the key, so the receiver draws the same indices instead of receiving them.
  A layer split over a node's devices (Explicit mesh) gathers only its k values.

  Args:
    fraction: the share of each layer's entries to keep, in (0, 1].
    scaled: multiply the kept entries by ``d / k`` (unbiased) or not (a contraction).

  Returns:
    A `RandomK` compressor.

  Raises:
    ValueError: ``fraction`` is not in (0, 1].
    TypeError: a leaf given to ``compress`` or ``encode_leaf`` is complex or boolean, or
      not floating point while ``scaled=True``.

  Example:
    Two of the four entries are kept, each multiplied by ``d / k = 2``:

    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> c = gj.compress.random_k(0.5)
    >>> x = jnp.array([3.0, -1.0, 0.5, -4.0], jnp.float32)
    >>> q = c.compress(x, jax.random.PRNGKey(0))
    >>> int((q != 0).sum()), bool(jnp.all((q == 0) | (q == 2 * x)))
    (2, True)
    >>> float(c.bits(x))  # 2 values of 32 bits; the indices come from the shared key
    64.0

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

  decode_reads_key: ClassVar[bool] = False  # everything it decodes crosses the wire

  absolute: bool = True
  _name: ClassVar[str] = "gj.compress.threshold_mean"

  def _mask(self, x):
    if self.absolute:
      return (jnp.abs(x) >= jnp.mean(jnp.abs(x))) & (x != 0)
    return (x >= jnp.mean(x)) & (x != 0)

  def _encode(self, x, key):
    del key
    return (jnp.where(self._mask(x), x, jnp.zeros_like(x)),)

  def _decode(self, compact, key, shape, dtype):
    del key, shape, dtype
    return compact[0]


def threshold_mean(absolute: bool = True) -> ThresholdMean:
  """Cui's sparsifier: keep the entries of each layer that reach the layer's mean (Cui 2019,
  "Decentralized Deep Learning with Gradient Compression").

  With ``absolute=True`` (default) an entry is kept when ``|x_i| >= mean_j |x_j|``: the
  magnitude reading, a contraction (the largest entry is always kept, so
  ``delta >= 1 / d``). ``absolute=False`` is the literal rule of Cui's Algorithm 1,
  ``x_i >= mean_j x_j``, which drops large negative entries and is not a contraction.

  The number of entries kept depends on the data and can be all of them (a layer whose
  entries have equal magnitudes), so a message of fixed shape, which a backend's
  preallocated buffers need, is the dense layer with zeros: its wire form and ``bits``
  are the dense layer's. The saving this rule promises needs a variable-length message
  (the kept values and their indices), which `encode_leaf` does not build.

  Args:
    absolute: keep ``|x_i| >= mean |x|`` (``True``) or, literally, ``x_i >= mean x``.

  Returns:
    A `ThresholdMean` compressor.

  Raises:
    TypeError: a leaf given to ``compress`` or ``encode_leaf`` is complex or boolean.

  Example:
    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> x = jnp.array([3.0, -1.0, 0.5, -4.0], jnp.float32)  # mean |x| = 2.125, mean x = -0.375
    >>> gj.compress.threshold_mean().compress(x, jax.random.PRNGKey(0)).tolist()
    [3.0, 0.0, 0.0, -4.0]
    >>> gj.compress.threshold_mean(absolute=False).compress(x, jax.random.PRNGKey(0)).tolist()
    [3.0, 0.0, 0.5, 0.0]
    >>> float(gj.compress.threshold_mean().bits(x))  # fixed shape: the dense layer, 4 x 32 bits
    128.0

  References:
    Cui (2019), Decentralized Deep Learning with Gradient Compression, Bulletin of the
    Graduate School of Hosei University, Computer and Information Sciences 14,
    doi:10.15002/00021917.
  """
  return ThresholdMean(absolute)
