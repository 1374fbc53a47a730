"""Compressors (what each keeps, the bits it sends, unbiasedness, contraction) and CHOCO-SGD."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj
from gossipjax import topology as T

C = gj.compress
N = 8
X = jnp.asarray(np.random.default_rng(0).normal(size=20) * np.linspace(0.1, 3, 20))
KEYS = jax.random.split(jax.random.PRNGKey(0), 20000)

ALL = [C.identity(), C.top_k(0.1), C.random_k(0.1), C.sign(), C.qsgd(4), C.threshold_mean()]
IDS = ["identity", "top_k", "random_k", "sign", "qsgd", "threshold_mean"]


def test_top_k_keeps_the_largest_entries_of_each_layer():
  tree = {"a": X, "b": X[:5] * 100}
  out = C.top_k(0.2).compress(tree, jax.random.PRNGKey(0))
  for leaf, got in zip(jax.tree.leaves(tree), jax.tree.leaves(out)):
    k = math.ceil(0.2 * leaf.size)
    keep = np.argsort(-np.abs(np.asarray(leaf)))[:k]
    want = np.zeros(leaf.size)
    want[keep] = np.asarray(leaf)[keep]
    np.testing.assert_array_equal(got, want)
  # k values with a uint8 index each: 4 * (64 + 8) for "a", 1 * (64 + 8) for "b" (float64)
  assert float(C.top_k(0.2).bits(tree)) == 4 * (64 + 8) + 1 * (64 + 8)
  assert float(C.top_k(0.2).bits(jnp.zeros(20, jnp.float32))) == 4 * (32 + 8)


def test_threshold_mean_keeps_entries_at_or_above_each_layers_mean():
  tree = {"small": X * 0.01, "large": X[::-1] * 10}
  out = C.threshold_mean().compress(tree, jax.random.PRNGKey(0))
  for leaf, got in zip(jax.tree.leaves(tree), jax.tree.leaves(out)):
    leaf = np.asarray(leaf)
    keep = np.abs(leaf) >= np.abs(leaf).mean()  # each layer against its own mean
    np.testing.assert_array_equal(got, np.where(keep, leaf, 0))
    assert 0 < keep.sum() < leaf.size
  # how many entries are kept depends on the data, so the fixed-shape message is the dense layer
  assert float(C.threshold_mean().bits(tree)) == float(C.identity().bits(tree)) == 40 * 64
  literal = C.threshold_mean(absolute=False).compress(X, jax.random.PRNGKey(0))
  np.testing.assert_array_equal(literal, np.where(np.asarray(X) >= np.asarray(X).mean(), X, 0))


def test_sign_sends_one_bit_per_entry_and_a_scale():
  got = np.asarray(C.sign().compress(X, jax.random.PRNGKey(0)))
  np.testing.assert_allclose(np.abs(got), np.abs(np.asarray(X)).mean())
  np.testing.assert_array_equal(np.sign(got), np.sign(X))
  assert float(C.sign().bits(X)) == 3 * 8 + 64  # 20 sign bits in 3 bytes, a float64 scale


def test_qsgd_values_lie_on_its_grid():
  s = 4
  got = np.asarray(C.qsgd(s).compress(X, jax.random.PRNGKey(1)))
  levels = np.abs(got) / float(jnp.linalg.norm(X)) * s
  np.testing.assert_allclose(levels, np.round(levels), atol=1e-12)
  assert float(C.qsgd(s).bits(X)) == 20 * 8 + 64  # an int8 level per entry, a float64 norm


def test_float16_quantizers_take_norms_and_scales_in_float32():
  """A float16 sum of squares overflows once ||x|| passes 256, a sum of |x| once it passes 65,504."""
  x = jnp.full((1000,), 100.0, jnp.float16)  # ||x|| = 3162, sum |x| = 1e5, mean |x| = 100
  key = jax.random.PRNGKey(0)
  np.testing.assert_array_equal(C.sign().compress(x, key), x)
  level, norm = C.qsgd(4).encode_leaf(x, key)
  assert norm.dtype == jnp.float32 and float(norm) == pytest.approx(1000**0.5 * 100, rel=1e-6)
  for c in (C.qsgd(4), C.qsgd(4, scaled=False)):
    got = c.compress(x, key)
    assert got.dtype == jnp.float16 and bool(jnp.all(jnp.isfinite(got)))
  got = np.asarray(C.qsgd(4).compress(x, key), np.float64)
  assert set(np.unique(got)) <= {0.0, float(np.float16(float(norm) / 4))} and abs(got.mean() - 100) < 15
  x0 = jnp.full((N, 300), 20.0, jnp.float16) + jnp.arange(N, dtype=jnp.float16)[:, None]  # ||x|| > 256
  xs, _ = run(gj.choco_sgd(T.ring(N), C.qsgd(4), learning_rate=0.0, consensus_step=0.1, seed=0), x0, jnp.zeros_like, 3)
  assert xs.dtype == jnp.float16 and bool(jnp.all(jnp.isfinite(xs)))


@pytest.mark.parametrize("compressor", [C.random_k(0.25), C.qsgd(2)], ids=["random_k", "qsgd"])
def test_unbiased_compressors_are_unbiased(compressor):
  assert compressor.unbiased
  samples = np.asarray(jax.vmap(lambda k: compressor.compress(X, k))(KEYS))
  mean, se = samples.mean(0), samples.std(0) / np.sqrt(len(KEYS))
  assert np.all(np.abs(mean - np.asarray(X)) < 5 * se + 1e-12)
  # the variance bound omega: E||C(x) - x||^2 <= omega ||x||^2
  err = np.mean(np.sum((samples - np.asarray(X)) ** 2, axis=1))
  assert err <= compressor.omega(X.size) * float(jnp.sum(X * X)) * 1.05


@pytest.mark.parametrize("compressor", ALL, ids=IDS)
def test_contraction_versions_contract(compressor):
  """CHOCO's assumption: E||Q(x) - x||^2 <= (1 - delta) ||x||^2 with delta > 0."""
  q = compressor.contraction()
  assert not q.unbiased
  samples = np.asarray(jax.vmap(lambda k: q.compress(X, k))(KEYS[:2000]))
  err = np.mean(np.sum((samples - np.asarray(X)) ** 2, axis=1))
  assert err < 0.999 * float(jnp.sum(X * X))


def test_random_k_keeps_k_entries_scaled_by_d_over_k():
  got = np.asarray(C.random_k(0.25).compress(X, jax.random.PRNGKey(3)))
  kept = np.flatnonzero(got)
  assert kept.size == 5
  np.testing.assert_allclose(got[kept], np.asarray(X)[kept] * 4)
  np.testing.assert_allclose(np.asarray(C.random_k(0.25, scaled=False).compress(X, jax.random.PRNGKey(3)))[kept],
                             np.asarray(X)[kept])


def test_compressors_are_static_data_and_validate():
  for c in ALL:
    assert not callable(c) and c == type(c)(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)})
    assert hash(c) == hash(type(c)(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)}))
  with pytest.raises(ValueError, match="fraction must be a number in"):
    C.top_k(0.0)
  with pytest.raises(ValueError, match="gj.compress.qsgd: levels must be a positive integer"):
    C.qsgd(0)
  with pytest.raises(TypeError, match="compressor must be a gj.compress"):
    gj.choco_sgd(T.ring(N), "top_k", learning_rate=0.1, consensus_step=0.5)
  with pytest.raises(ValueError, match="consensus_step"):
    gj.choco_sgd(T.ring(N), C.sign(), learning_rate=0.1, consensus_step=0.0)


def test_numpy_scalars_are_accepted_as_every_other_hyperparameter():
  assert C.top_k(np.float32(0.1)) == C.top_k(0.1)  # read as the 0.1 it prints as: 1 entry of 10 kept, not 2
  assert C.random_k(np.float64(0.25), scaled=False) == C.random_k(0.25, scaled=False)
  assert C.qsgd(np.int64(4)) == C.qsgd(4) and type(C.qsgd(np.int32(4)).levels) is int
  assert float(C.top_k(np.float32(0.1)).bits(jnp.zeros(10, jnp.float32))) == 32 + 8
  for bad in (np.True_, np.float32(1.5), np.float64("nan")):
    with pytest.raises(ValueError, match="fraction must be a number in"):
      C.top_k(bad)
  with pytest.raises(ValueError, match="levels must be a positive integer"):
    C.qsgd(np.int64(0))


# ---------------------------------------------------------------- CHOCO-SGD


def run(tx, x0, grad_fn, steps):
  def body(carry, _):
    x, state = carry
    updates, state = tx.update(grad_fn(x), state, x)
    x = optax.apply_updates(x, updates)
    return (x, state), x

  (_, state), xs = jax.jit(lambda c: jax.lax.scan(body, c, None, steps))((x0, tx.init(x0)))
  return xs, state


def least_squares(seed=0, d=6):
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(N, 30, d))
  b = rng.normal(size=(N, 30)) + np.arange(N)[:, None]
  grad_np = lambda x: np.einsum("nmd,nm->nd", a, np.einsum("nmd,nd->nm", a, x) - b) / 30
  grad = lambda x: jax.vmap(jax.grad(lambda xi, ai, bi: 0.5 * jnp.mean((ai @ xi - bi) ** 2)))(x, a, b)
  return grad_np, grad


def top_k_np(v, fraction):
  k = math.ceil(fraction * v.shape[-1])
  out = np.zeros_like(v)
  for i, row in enumerate(v):
    keep = np.argsort(-np.abs(row))[:k]
    out[i, keep] = row[keep]
  return out


def test_choco_is_koloskova_algorithm_2():
  topo, lr, eta, fraction, steps = T.exponential(N), 0.05, 0.4, 0.34, 15
  grad_np, grad = least_squares()
  x0 = np.random.default_rng(1).normal(size=(N, 6))
  xs, _ = run(gj.choco_sgd(topo, C.top_k(fraction), learning_rate=lr, consensus_step=eta), jnp.asarray(x0), grad, steps)
  x, x_hat, w = x0.copy(), np.zeros_like(x0), topo.matrix()
  for k in range(steps):
    half = x - lr * grad_np(x)
    x_hat = x_hat + top_k_np(half - x_hat, fraction)
    x = half + eta * (w @ x_hat - x_hat)
    np.testing.assert_allclose(xs[k], x, rtol=0, atol=1e-12)


@pytest.mark.parametrize("topo", [T.exponential(N), T.one_peer_exponential(N)], ids=lambda t: t.name)
def test_choco_without_compression_and_full_step_is_dpsgd(topo):
  _, grad = least_squares()
  x0 = jnp.asarray(np.random.default_rng(2).normal(size=(N, 6)))
  choco, _ = run(gj.choco_sgd(topo, C.identity(), learning_rate=0.05, consensus_step=1.0), x0, grad, 10)
  dpsgd, _ = run(gj.gossip_sgd(topo, learning_rate=0.05), x0, grad, 10)
  np.testing.assert_allclose(choco, dpsgd, rtol=0, atol=1e-12)


@pytest.mark.parametrize("compressor", ALL, ids=IDS)
def test_choco_gossip_reaches_consensus_keeps_the_average_and_counts_bits(compressor):
  x0 = {"w": jax.random.normal(jax.random.key(0), (N, 6, 5)), "b": 3 * jax.random.normal(jax.random.key(1), (N, 5))}
  zeros = lambda x: jax.tree.map(jnp.zeros_like, x)
  xs, state = run(gj.choco_sgd(T.ring(N), compressor, learning_rate=0.0, consensus_step=0.1, seed=3), x0, zeros, 450)
  last = jax.tree.map(lambda x: x[-1], xs)
  assert float(gj.consensus_distance(last)) < 1e-6 * float(gj.consensus_distance(x0))
  for got, start in zip(jax.tree.leaves(last), jax.tree.leaves(x0)):
    np.testing.assert_allclose(got.mean(0), start.mean(0), atol=1e-12)
  # bits of each node's last message, against the uncompressed 64 * (30 + 5)
  bits = np.asarray(state.message_bits)
  dense = float(C.identity().bits(jax.tree.map(lambda x: x[0], x0)))
  assert dense == 64 * 35 and bits.shape == (N,)
  # a fixed message size: the compressor's wire form
  np.testing.assert_array_equal(bits, float(compressor.bits(jax.tree.map(lambda x: x[0], x0))))
  if not isinstance(compressor, (C.Identity, C.ThresholdMean)):
    assert bits.max() < 0.2 * dense


def test_choco_limit_is_dpsgd_with_damped_mixing():
  """At a fixed point q = 0 and x_hat = x - lr g, so x = W_eta (x - lr g) with W_eta = I + eta (W - I):
  CHOCO's full-batch limit is D-PSGD's on W_eta, whatever the compressor."""
  topo, lr, eta = T.ring(N), 0.05, 0.3
  _, grad = least_squares()
  x0 = jnp.zeros((N, 6))
  choco, _ = run(gj.choco_sgd(topo, C.top_k(0.34), learning_rate=lr, consensus_step=eta), x0, grad, 3000)
  damped = T.from_matrix(np.eye(N) + eta * (topo.matrix() - np.eye(N)))
  dpsgd, _ = run(gj.gossip_sgd(damped, learning_rate=lr), x0, grad, 3000)
  np.testing.assert_allclose(choco[-1], dpsgd[-1], rtol=0, atol=1e-9)


def test_choco_orders_its_steps_as_the_paper_not_as_the_authors_code():
  """The authors' code takes the consensus step with the old public copies, then compresses:
  x+ = x - lr g + eta (W - I) x_hat, x_hat += C(x+ - x_hat). gj.choco_sgd follows Algorithm 2
  (compress, update x_hat, then the consensus step with the new x_hat). The trajectories differ,
  and so do the full-batch limits: adapt-then-combine x = W_eta (x - lr g) here, combine-then-adapt
  x = W_eta x - lr g for the code's order."""
  topo, lr, eta, fraction = T.ring(N), 0.05, 0.3, 0.34
  grad_np, grad = least_squares()
  x0 = np.zeros((N, 6))
  ours, _ = run(gj.choco_sgd(topo, C.top_k(fraction), learning_rate=lr, consensus_step=eta), jnp.asarray(x0), grad, 3000)
  w_eta = np.eye(N) + eta * (topo.matrix() - np.eye(N))
  x, x_hat = x0.copy(), np.zeros_like(x0)
  code_order = []
  for _ in range(3000):
    x = x - lr * grad_np(x) + eta * (topo.matrix() @ x_hat - x_hat)
    x_hat = x_hat + top_k_np(x - x_hat, fraction)
    code_order.append(x)
  assert np.abs(np.asarray(ours[2]) - code_order[2]).max() > 1e-3  # they part at once
  atc, cta = x0.copy(), x0.copy()
  for _ in range(3000):
    atc, cta = w_eta @ (atc - lr * grad_np(atc)), w_eta @ cta - lr * grad_np(cta)
  np.testing.assert_allclose(np.asarray(ours[-1]), atc, rtol=0, atol=1e-9)
  np.testing.assert_allclose(code_order[-1], cta, rtol=0, atol=1e-9)
  assert np.abs(atc - cta).max() > 1e-4  # two different limits


def test_choco_takes_a_typed_key_a_raw_key_or_an_int():
  x = jnp.ones((N, 6))
  runs = []
  for key in (3, jax.random.key(3), jax.random.PRNGKey(3)):
    tx = gj.choco_sgd(T.ring(N), gj.compress.random_k(0.5), learning_rate=0.1, consensus_step=0.5, key=key)
    runs.append(tx.update(0.1 * x, tx.init(x), x)[0])
  tx = gj.choco_sgd(T.ring(N), gj.compress.random_k(0.5), learning_rate=0.1, consensus_step=0.5, seed=3)
  runs.append(tx.update(0.1 * x, tx.init(x), x)[0])
  for u in runs[1:]:
    np.testing.assert_array_equal(u, runs[0])
  with pytest.raises(ValueError, match="^gj.choco_sgd: give key or seed, not both"):
    gj.choco_sgd(T.ring(N), gj.compress.random_k(0.5), learning_rate=0.1, consensus_step=0.5, key=1, seed=3)
  with pytest.raises(TypeError, match="^gj.choco_sgd: key must be"):
    gj.choco_sgd(T.ring(N), gj.compress.random_k(0.5), learning_rate=0.1, consensus_step=0.5, key="a")


@pytest.mark.parametrize("c", [gj.compress.identity(), gj.compress.sign(), gj.compress.qsgd(4), gj.compress.top_k(0.3),
                               gj.compress.random_k(0.3), gj.compress.threshold_mean()], ids=lambda c: type(c).__name__)
def test_a_compressor_declares_whether_its_decoding_reads_the_key(c):
  x = jax.random.normal(jax.random.key(0), (40,))
  k1, k2 = jax.random.split(jax.random.key(1))
  wire = c.encode_leaf(x, k1)
  same = bool(jnp.array_equal(c.decode_leaf(wire, k1, x.shape, x.dtype), c.decode_leaf(wire, k2, x.shape, x.dtype)))
  assert c.decode_reads_key == (not same)
