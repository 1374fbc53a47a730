"""What a compressor is: static config that compresses one node's pytree, with its wire form and size."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gossipjax._axis import piece_axes


@dataclasses.dataclass(frozen=True)
class Compressor:
  """Base of every compressor: maps a rule for one leaf over a node's pytree.

  Compressors are data (frozen dataclasses), not callables, so ``optax.inject_hyperparams``
  does not mistake one for a schedule. Every method acts on **one node's** pytree or leaf
  (no node axis); algorithms and backends ``jax.vmap`` them over the stacked nodes. Every
  leaf (layer) is compressed on its own, as in Cui (2019), "Decentralized Deep Learning
  with Gradient Compression" ("every layer has different shape ... the threshold
  should be calculated independently").

  A compressor has two faces. ``compress(tree, key)`` returns ``C(x)`` densely (zeros where
  nothing is sent), which is what a simulation mixes. ``encode_leaf(x, key)`` returns the
  compact arrays that cross a device or process boundary (values and small-integer indices,
  packed signs, integer levels and a scale), whose shapes depend only on the leaf's shape
  and dtype (`wire_spec`), so a backend can allocate its receive buffers ahead of time;
  ``decode_leaf`` rebuilds exactly ``compress``'s leaf from them, bit for bit. ``bits``
  is the size of those arrays. Randomness is shared: the receiver decodes with the
  sender's key (``random_k`` sends no indices, the receiver draws them again).

  Attributes:
    unbiased: ``E[C(x)] = x`` (then ``omega(d)`` bounds the variance,
      ``E||C(x) - x||^2 <= omega(d) ||x||^2``); otherwise C is a contraction,
      ``||C(x) - x||^2 <= (1 - delta) ||x||^2`` for some ``delta > 0``.
    decode_reads_key: whether ``decode_leaf`` reads the sender's key (``random_k`` draws its
      indices again from it), so a receiver needs the key beside the compact arrays; a class
      attribute each compressor declares (``True`` unless it says otherwise, the safe default
      for a compressor of one's own: the key is then sent).

  Example:
    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> [c.unbiased for c in (gj.compress.top_k(0.1), gj.compress.random_k(0.1), gj.compress.qsgd(4))]
    [False, True, True]
    >>> gj.compress.qsgd(4).contraction()  # the biased, contracting form CHOCO-SGD uses
    QSGD(levels=4, scaled=False)

    What crosses the wire for a 1000-entry float32 layer, and the dense leaf it decodes to:

    >>> c, x, key = gj.compress.top_k(0.01), jnp.linspace(-1.0, 1.0, 1000, dtype=jnp.float32), jax.random.key(0)
    >>> [(s.shape, str(s.dtype)) for s in c.wire_spec(x.shape, x.dtype)]  # 10 values, 10 indices
    [((10,), 'float32'), ((10,), 'uint16')]
    >>> wire = c.encode_leaf(x, key)
    >>> bool(jnp.array_equal(c.decode_leaf(wire, key, x.shape, x.dtype), c.compress(x, key)))
    True
    >>> float(c.bits(x))  # 10 * 32 + 10 * 16
    480.0
  """

  unbiased: ClassVar[bool] = False
  decode_reads_key: ClassVar[bool] = True
  # The public name that error messages start with.
  _name: ClassVar[str] = "gj.compress.Compressor"

  def compress(self, tree: Any, key: jax.Array) -> Any:
    """``C(x)`` for every leaf of one node's pytree, dense; ``key`` is a PRNG key (used if random)."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = leaf_keys(key, len(leaves))
    for x in leaves:
      self._check_dtype(jnp.result_type(x))
    return jax.tree.unflatten(treedef, [self._leaf(x, k) for x, k in zip(leaves, keys)])

  def encode(self, tree: Any, key: jax.Array) -> Any:
    """The wire form of one node's pytree: each leaf replaced by its `encode_leaf` tuple.

    Leaf ``i`` is encoded with the same per-leaf key that ``compress(tree, key)`` gives it,
    so ``decode(encode(tree, key), key, tree)`` equals ``compress(tree, key)``.
    """
    leaves, treedef = jax.tree.flatten(tree)
    keys = leaf_keys(key, len(leaves))
    return jax.tree.unflatten(treedef, [self.encode_leaf(x, k) for x, k in zip(leaves, keys)])

  def decode(self, compact: Any, key: jax.Array, like: Any) -> Any:
    """The dense pytree that `encode` sent: ``compact`` as `encode` returned it, ``key`` the
    sender's, ``like`` a pytree of arrays or ``jax.ShapeDtypeStruct`` with the leaves' shapes."""
    leaves, treedef = jax.tree.flatten(like)
    keys = leaf_keys(key, len(leaves))
    parts = treedef.flatten_up_to(compact)
    return jax.tree.unflatten(
        treedef, [self.decode_leaf(c, k, x.shape, x.dtype) for c, x, k in zip(parts, leaves, keys)])

  def encode_leaf(self, x: jax.Array, key: jax.Array) -> tuple[jax.Array, ...]:
    """The compact arrays that send one node's leaf ``x`` (no node axis).

    Their shapes and dtypes depend only on ``x.shape`` and ``x.dtype`` (see `wire_spec`);
    jit- and vmap-able.

    Raises:
      TypeError: the compressor has no compact form for ``x.dtype``.
    """
    x = jnp.asarray(x)
    self._check_dtype(x.dtype)
    return tuple(self._encode(x, key))

  def decode_leaf(self, compact: Sequence[jax.Array], key: jax.Array, shape: Sequence[int],
                  dtype: Any) -> jax.Array:
    """The dense leaf of ``shape`` and ``dtype`` that ``compact = encode_leaf(x, key)`` sent.

    Equal, bit for bit, to the leaf that ``compress`` gives ``x`` with the same ``key``
    (the per-leaf key: `encode` and `decode` split a node's key as ``compress`` does).

    Raises:
      ValueError: ``compact`` does not have the shapes and dtypes of ``wire_spec(shape, dtype)``.
    """
    shape, dtype = tuple(shape), jnp.dtype(dtype)
    compact = tuple(compact)
    want = [(s.shape, s.dtype) for s in self.wire_spec(shape, dtype)]
    got = [(jnp.shape(c), jnp.result_type(c)) for c in compact]
    if got != want:
      raise ValueError(f"{self._name}: decode_leaf got arrays of (shape, dtype) {_pairs(got)}, but a {shape} "
                       f"{dtype} leaf is sent as {_pairs(want)}; pass what encode_leaf returned for such a leaf")
    return self._decode(compact, key, shape, dtype)

  def wire_spec(self, shape: Sequence[int], dtype: Any) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Shapes and dtypes of what `encode_leaf` returns for a leaf of ``shape`` and ``dtype``,
    without encoding anything (what a backend allocates to receive it)."""
    return _wire_spec(self, tuple(shape), jnp.dtype(dtype), bool(jax.config.read("jax_enable_x64")))

  def bits(self, tree: Any) -> jax.Array:
    """Bits that cross the wire to send one node's pytree: the sizes of the `encode_leaf`
    arrays (``size * itemsize * 8``), summed over the arrays and the leaves."""
    total = sum(wire_bits(self.wire_spec(x.shape, x.dtype)) for x in jax.tree.leaves(tree))
    return jnp.asarray(float(total))

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
    """The dense ``C(x)``; by default the decoded wire form."""
    return self._decode(self._encode(x, key), key, x.shape, x.dtype)

  def _encode(self, x: jax.Array, key: jax.Array) -> tuple[jax.Array, ...]:
    raise NotImplementedError

  def _decode(self, compact: tuple[jax.Array, ...], key: jax.Array, shape: tuple[int, ...],
              dtype: jnp.dtype) -> jax.Array:
    raise NotImplementedError

  def _check_dtype(self, dtype: jnp.dtype) -> None:
    require_real(dtype, self._name)


@functools.lru_cache(maxsize=4096)
def _wire_spec(compressor: Compressor, shape: tuple[int, ...], dtype: jnp.dtype,
               x64: bool) -> tuple[jax.ShapeDtypeStruct, ...]:
  del x64  # part of the cache key: it decides which dtypes exist
  return jax.eval_shape(lambda x: compressor.encode_leaf(x, jax.random.key(0)), jax.ShapeDtypeStruct(shape, dtype))


def _pairs(specs) -> str:
  return "[" + ", ".join(f"({tuple(s)}, {jnp.dtype(d).name})" for s, d in specs) + "]"


def leaf_keys(key: jax.Array, count: int) -> jax.Array:
  """The per-leaf keys of a node's pytree of ``count`` leaves (shared by compress, encode, decode)."""
  return jax.random.split(key, max(1, count))


def split_spec(x: Any) -> tuple[Any, ...] | None:
  """One node's leaf layout on an Explicit mesh, one entry per dimension, where a mesh axis splits it; else None.

  Inside a backend's per-node map, a model-sharded node's leaf (laid out ``P("nodes", "model")``)
  is typed ``P("model", None)``: each device holds a piece of the node's layer. On an Auto
  mesh the layout is not part of the type (``None``), and the compiler places the work.
  """
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
  if spec is None or all(s is None for s in spec):
    return None
  return tuple(spec) + (None,) * (jnp.ndim(x) - len(spec))


def gathered(x: jax.Array) -> jax.Array:
  """``x`` whole on every device of its node: an all-gather over the mesh axes that split it (Explicit)."""
  if split_spec(x) is None:
    return x
  return jax.sharding.reshard(x, jax.sharding.PartitionSpec())


def row_pieces(x: jax.Array) -> jax.Array | None:
  """A split leaf's entries as ``(D, size / D)`` rows, row ``p`` the piece device ``p`` of the node holds.

  Only where the pieces are consecutive in the flat (row-major) order: the leaf is split along
  its first dimension alone (``P("nodes", "model")``). ``None`` otherwise.
  """
  spec = split_spec(x)
  if spec is None or spec[0] is None or any(s is not None for s in spec[1:]):
    return None
  names = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
  mesh = jax.typeof(x).sharding.mesh
  pieces = math.prod(mesh.shape[a] for a in names)
  return jnp.reshape(x, (pieces, x.size // pieces), out_sharding=jax.sharding.PartitionSpec(spec[0]))


def map_pieces(x: jax.Array) -> tuple[jax.Array, tuple[str, ...]] | None:
  """Inside a backend's per-node map, ``x`` as ``(D, size / D)`` rows and the mesh axes of the node's D devices.

  There the layout is the compiler's (Auto axes), so it is not read from ``x``: the map names
  the axes a node's leaves may be split over (a model's, not a batch's data axis), and row
  ``p`` is the piece device ``p`` holds when ``x`` is split along its first dimension over
  them. ``None`` outside such a map, or where the first dimension does not divide by D.
  """
  mesh = jax.sharding.get_abstract_mesh()
  axes = tuple(a for a in piece_axes() if a in mesh.auto_axes)
  pieces = math.prod(mesh.shape[a] for a in axes)
  if not axes or jnp.ndim(x) == 0 or x.shape[0] % pieces:
    return None
  return jnp.reshape(x, (pieces, x.size // pieces)), axes


def wire_bits(specs: Sequence[jax.ShapeDtypeStruct]) -> int:
  """Bits of the arrays ``specs`` describe: ``size * itemsize * 8`` summed."""
  return sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize * 8 for s in specs)


def wide_dtype(dtype: Any) -> jnp.dtype:
  """The dtype a compressor computes a leaf's norms and scales in: at least float32."""
  return jnp.promote_types(dtype, jnp.float32)


def require_real(dtype: Any, name: str) -> None:
  """Raises unless ``dtype`` holds real numbers (integer or floating point)."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    raise TypeError(f"{name}: got a complex leaf ({dtype.name}), which has no compact form here; "
                    "store its real and imaginary parts as two real leaves")
  if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
    raise TypeError(f"{name}: got a leaf of dtype {dtype.name}, which has no compact form here; "
                    "cast it to a number type (e.g. x.astype(jnp.float32)) or send it with gj.compress.identity()")


def require_floating(dtype: Any, name: str, why: str) -> None:
  """Raises unless ``dtype`` is a real floating-point dtype; ``why`` says what needs it."""
  require_real(dtype, name)
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{name}: got a leaf of dtype {dtype.name}, but {why} needs floating-point entries; "
                    "cast the leaf (e.g. x.astype(jnp.float32)) or send it with gj.compress.identity()")


def check_fraction(fraction: Any, name: str) -> float:
  """``fraction`` as a Python float (a NumPy scalar too); ``ValueError`` unless it is in (0, 1]."""
  if isinstance(fraction, (bool, np.bool_)) or not isinstance(fraction, (int, float, np.integer, np.floating)) \
      or not 0 < fraction <= 1:
    raise ValueError(f"{name}: fraction must be a number in (0, 1], got {fraction!r}")
  # np.float32(0.1) is read as the 0.1 it prints as, not 0.10000000149..., which would keep an entry more.
  return float(str(fraction)) if isinstance(fraction, np.floating) else float(fraction)


@dataclasses.dataclass(frozen=True)
class Identity(Compressor):
  """No compression: the full-precision message (the baseline to count bits against).

  Example:
    >>> import gossipjax as gj
    >>> gj.compress.Identity() == gj.compress.identity()
    True
  """

  decode_reads_key: ClassVar[bool] = False  # everything it decodes crosses the wire

  _name: ClassVar[str] = "gj.compress.identity"

  def _leaf(self, x, key):
    del key
    return x

  def _encode(self, x, key):
    del key
    return (x,)

  def _decode(self, compact, key, shape, dtype):
    del key, shape, dtype
    return compact[0]

  def _check_dtype(self, dtype):
    del dtype  # any leaf can be sent as it is


def identity() -> Identity:
  """No compression; the wire form is the leaf itself (``size * 32`` bits for float32).

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
