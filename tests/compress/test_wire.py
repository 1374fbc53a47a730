"""The compact wire form: encode -> decode rebuilds compress bit for bit, its sizes, and bad dtypes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import gossipjax as gj

C = gj.compress
N = 8

# Every compressor, with the variants whose wire form differs: top_k's dense fallback, unscaled
# random_k, QSGD's contraction and its int16 levels, both threshold rules.
EVERY = {
    "identity": C.identity(),
    "top_k": C.top_k(0.1),
    "top_k_dense": C.top_k(0.9),
    "random_k": C.random_k(0.1),
    "random_k_unscaled": C.random_k(0.5, scaled=False),
    "sign": C.sign(),
    "qsgd": C.qsgd(4),
    "qsgd_int16_contraction": C.qsgd(300).contraction(),
    "threshold_mean": C.threshold_mean(),
    "threshold_mean_literal": C.threshold_mean(absolute=False),
}

# Leaves of several shapes and the three float widths in one node's tree (one compile per compressor);
# 300 entries need uint16 indices, 15 uint8 ones.
SHAPES = {"scalar": ((), jnp.float64), "matrix": ((3, 5), jnp.bfloat16), "wide": ((300,), jnp.float32)}


def _nodes(seed=0):
  """A node-stacked tree; one entry per leaf is exactly zero (sign's and QSGD's edge case)."""
  tree = {}
  for i, (name, (shape, dtype)) in enumerate(SHAPES.items()):
    x = 3 * jax.random.normal(jax.random.key(seed + i), (N, *shape))
    tree[name] = x.at[(slice(None),) + (0,) * len(shape)].set(0.0).astype(dtype) if shape else x.astype(dtype)
  return tree


def _bits_of(a) -> np.ndarray:
  """The array's raw bytes, so that -0.0 and 0.0 (or two NaNs) must match exactly."""
  a = np.asarray(a)
  return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _assert_bitwise_equal(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(_bits_of(g), _bits_of(w))


@pytest.mark.parametrize("compressor", EVERY.values(), ids=EVERY.keys())
def test_decode_of_encode_is_compress_bit_for_bit_under_jit_and_vmap(compressor):
  x = _nodes()
  keys = jax.random.split(jax.random.key(7), N)
  one = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape[1:], v.dtype), x)

  @jax.jit
  def both(x, keys):
    sent = jax.vmap(compressor.encode)(x, keys)
    return jax.vmap(lambda c, k: compressor.decode(c, k, one))(sent, keys), jax.vmap(compressor.compress)(x, keys), sent

  got, want, sent = both(x, keys)
  _assert_bitwise_equal(got, want)
  # what crossed has the shapes wire_spec promises, and bits counts exactly those arrays
  for name, leaf in one.items():
    spec = compressor.wire_spec(leaf.shape, leaf.dtype)
    assert [(a.shape[1:], a.dtype) for a in sent[name]] == [(s.shape, s.dtype) for s in spec]
  assert float(compressor.bits(one)) == sum(a[0].nbytes * 8 for a in jax.tree.leaves(sent))


def test_encode_and_decode_run_inside_shard_map():
  """The backends' use: every device encodes its node and ships the compact arrays to its ring
  neighbour. The neighbour decodes exactly what the sender decodes from its own message (what
  CHOCO needs: both sides update the same public copy), which is compress's leaf up to the
  round-off of a reduction (a scale, a norm) compiled in another program."""
  mesh = jax.make_mesh((N,), ("nodes",))
  on_mesh = jax.sharding.NamedSharding(mesh, P("nodes"))
  x = jax.device_put(3 * jax.random.normal(jax.random.key(0), (N, 100)), on_mesh)
  keys = jax.device_put(jax.random.split(jax.random.PRNGKey(1), N), on_mesh)  # raw keys work as typed ones
  shift = [(i, (i + 1) % N) for i in range(N)]
  for compressor in (C.top_k(0.1), C.random_k(0.1), C.sign()):

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P("nodes"), P("nodes")), out_specs=P("nodes"))
    def exchange(x, keys):
      sent = compressor.encode(x[0], keys[0])
      got = jax.tree.map(lambda a: jax.lax.ppermute(a, "nodes", shift), sent)
      got_key = jax.lax.ppermute(keys, "nodes", shift)[0]
      return compressor.decode(sent, keys[0], x[0])[None], compressor.decode(got, got_key, x[0])[None]

    own, received = exchange(x, keys)
    _assert_bitwise_equal(received, np.roll(np.asarray(own), 1, axis=0))
    np.testing.assert_allclose(own, jax.vmap(compressor.compress)(x, keys), rtol=1e-14, atol=0)


def _spec(compressor, shape, dtype=jnp.float32):
  return [(s.shape, s.dtype) for s in compressor.wire_spec(shape, dtype)]


def test_top_k_sends_values_and_the_smallest_index_dtype():
  assert _spec(C.top_k(0.01), (1000,)) == [((10,), jnp.float32), ((10,), jnp.uint16)]
  assert float(C.top_k(0.01).bits(jnp.zeros(1000, jnp.float32))) == 10 * 32 + 10 * 16
  for size, index in ((256, jnp.uint8), (257, jnp.uint16), (65536, jnp.uint16), (65537, jnp.uint32)):
    assert _spec(C.top_k(0.01), (size,))[1] == ((math.ceil(size / 100),), index)
  assert _spec(C.top_k(0.1), (4, 5), jnp.bfloat16) == [((2,), jnp.bfloat16), ((2,), jnp.uint8)]
  # when values and indices would not be smaller than the layer, the layer is sent dense
  assert _spec(C.top_k(0.9), (10,)) == [((10,), jnp.float32)]
  assert _spec(C.top_k(0.5), ()) == [((), jnp.float32)]
  assert _spec(C.top_k(0.7), (10,), jnp.bfloat16) == [((10,), jnp.bfloat16)]  # 7 * (2 + 1) bytes >= 10 * 2
  assert _spec(C.top_k(0.6), (10,), jnp.bfloat16) == [((6,), jnp.bfloat16), ((6,), jnp.uint8)]  # 18 < 20


def test_random_k_sends_its_values_only():
  assert _spec(C.random_k(0.01), (1000,)) == [((10,), jnp.float32)]
  assert _spec(C.random_k(0.25, scaled=False), (3, 4), jnp.float64) == [((3,), jnp.float64)]
  assert float(C.random_k(0.01).bits(jnp.zeros(1000, jnp.float32))) == 10 * 32


def test_quantizers_send_integer_levels_or_packed_signs_and_a_scale():
  assert _spec(C.qsgd(4), (1000,)) == [((1000,), jnp.int8), ((), jnp.float32)]
  assert _spec(C.qsgd(127), (2, 3), jnp.bfloat16) == [((2, 3), jnp.int8), ((), jnp.float32)]  # 16-bit: a float32 norm
  assert _spec(C.qsgd(128), (5,))[0] == ((5,), jnp.int16)
  assert _spec(C.qsgd(40000), (5,))[0] == ((5,), jnp.int32)
  assert float(C.qsgd(4).bits(jnp.zeros(1000, jnp.float32))) == 1000 * 8 + 32
  for d in (1, 8, 9, 1000):
    assert _spec(C.sign(), (d,)) == [((math.ceil(d / 8),), jnp.uint8), ((), jnp.float32)]
  assert float(C.sign().bits(jnp.zeros((10, 100), jnp.float32))) == 125 * 8 + 32


def test_dense_wire_forms_and_the_message_of_every_compressor_on_1000_floats():
  x = jnp.zeros(1000, jnp.float32)
  bits = {name: float(c.bits(x)) for name, c in EVERY.items()}
  assert bits["identity"] == bits["threshold_mean"] == bits["top_k_dense"] == 32000  # dense
  assert bits["top_k"] == 100 * (32 + 16) and bits["random_k"] == 100 * 32
  assert bits["sign"] == 1000 + 32 and bits["qsgd"] == 8000 + 32 and bits["qsgd_int16_contraction"] == 16000 + 32


def test_qsgd_levels_and_sign_bits_on_the_wire():
  x = jnp.array([3.0, -1.0, 0.0, -4.0, 0.5, 2.0, -0.0, 1.0, -2.0], jnp.float32)
  level, norm = C.qsgd(4).encode_leaf(x, jax.random.key(0))
  assert norm == jnp.linalg.norm(x) and bool(jnp.all(jnp.abs(level) <= 4)) and level[2] == 0
  assert bool(jnp.all(level.astype(jnp.float32) * x >= 0))
  packed, scale = C.sign().encode_leaf(x, jax.random.key(0))
  np.testing.assert_array_equal(packed, np.packbits(np.asarray(x) >= 0))  # a zero is sent as +
  np.testing.assert_array_equal(C.sign().compress(x, jax.random.key(0)), np.where(np.asarray(x) >= 0, scale, -scale))


def test_integer_leaves_go_through_the_sparsifiers():
  x = jnp.arange(-10, 10, dtype=jnp.int32)
  for c in (C.identity(), C.top_k(0.1), C.random_k(0.2, scaled=False), C.threshold_mean()):
    key = jax.random.key(0)
    _assert_bitwise_equal(c.decode(c.encode(x, key), key, x), c.compress(x, key))
  assert _spec(C.top_k(0.1), (20,), jnp.int32) == [((2,), jnp.int32), ((2,), jnp.uint8)]


@pytest.mark.parametrize(("compressor", "dtype", "error", "match"), [
    (C.qsgd(4), jnp.int32, TypeError, r"gj.compress.qsgd: got a leaf of dtype int32, .* needs floating-point"),
    (C.qsgd(4), jnp.bool_, TypeError, r"gj.compress.qsgd: got a leaf of dtype bool"),
    (C.sign(), jnp.int8, TypeError, r"gj.compress.sign: .* cast the leaf"),
    (C.sign(), jnp.complex64, TypeError, r"gj.compress.sign: got a complex leaf .* two real leaves"),
    (C.top_k(0.1), jnp.complex128, TypeError, r"gj.compress.top_k: got a complex leaf"),
    (C.top_k(0.1), jnp.bool_, TypeError, r"gj.compress.top_k: got a leaf of dtype bool"),
    (C.random_k(0.1), jnp.int32, TypeError, r"gj.compress.random_k: .*\(scaled=True\) needs floating-point"),
    (C.threshold_mean(), jnp.complex64, TypeError, r"gj.compress.threshold_mean: got a complex leaf"),
], ids=["qsgd-int", "qsgd-bool", "sign-int", "sign-complex", "top_k-complex", "top_k-bool", "random_k-int",
        "threshold-complex"])
def test_leaves_without_a_compact_form_raise(compressor, dtype, error, match):
  x = jnp.zeros(6, dtype)
  with pytest.raises(error, match=match):
    compressor.encode_leaf(x, jax.random.key(0))
  with pytest.raises(error, match=match):
    compressor.wire_spec(x.shape, x.dtype)
  with pytest.raises(error, match=match):
    compressor.compress({"w": x}, jax.random.key(0))
  assert C.identity().wire_spec(x.shape, x.dtype)[0].dtype == x.dtype  # identity sends anything


def test_decode_rejects_arrays_that_are_not_the_wire_form():
  c, x = C.top_k(0.1), jnp.ones(300, jnp.float32)
  values, indices = c.encode_leaf(x, jax.random.key(0))
  with pytest.raises(ValueError, match=r"gj.compress.top_k: decode_leaf got .* \(\(30,\), uint16\)"):
    c.decode_leaf((values, indices.astype(jnp.int32)), jax.random.key(0), x.shape, x.dtype)
  with pytest.raises(ValueError, match="gj.compress.top_k: decode_leaf got"):
    c.decode_leaf((values,), jax.random.key(0), x.shape, x.dtype)
  with pytest.raises(ValueError, match="gj.compress.top_k: .* cannot be addressed with 32-bit indices"):
    c.wire_spec((2**32 + 1,), jnp.float32)
