"""Compressed outer exchanges: DiLoCo and NoLoCo sending compressed pseudo-gradients with error feedback.

Against a NumPy transcription of the recursion: e_i + Delta_i -> C -> mean (or W-mix) of the
decoded messages -> outer step; e_i <- e_i + Delta_i - C(e_i + Delta_i).
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj

N, D, H, ROUNDS, LR = 4, 20, 2, 3, 0.3


def targets(n=N):
  return np.random.default_rng(0).normal(size=(n, D)) + np.arange(n)[:, None]


def run(tx, x0, steps=H * ROUNDS) -> tuple[np.ndarray, Any]:
  b, x = jnp.asarray(targets()), jnp.asarray(x0)
  state, update = tx.init(x), jax.jit(tx.update)
  for _ in range(steps):
    u, state = update(x - b, state, x)
    x = x + u
  return np.asarray(x), state


def top_k(v, k):
  out = np.zeros_like(v)
  idx = np.argsort(-np.abs(v), kind="stable")[:k]
  out[idx] = v[idx]
  return out


def reference(x0, combine, eta, mu, nesterov, k):
  """NumPy: H inner SGD steps, then top-k with error feedback, the combine, and outer SGD with momentum."""
  b = targets()
  phi, m, e = x0.copy(), np.zeros_like(x0), np.zeros_like(x0)
  for r in range(ROUNDS):
    theta = phi.copy()
    for _ in range(H):
      theta = theta - LR * (theta - b)
    v = (phi - theta) + e
    q = np.stack([top_k(vi, k) for vi in v])
    e = v - q
    g = combine(q, r)
    m = mu * m + g
    phi = phi - eta * ((g + mu * m) if nesterov else m)
  return phi, e


def x0():
  return np.tile(np.random.default_rng(1).normal(size=D), (N, 1))


@pytest.mark.parametrize("identity_like", [gj.compress.top_k(1.0), gj.compress.identity()])
def test_identity_like_compressor_equals_uncompressed_diloco(identity_like):
  plain, _ = run(gj.diloco(optax.sgd(LR), inner_steps=H), x0())
  compressed, state = run(gj.diloco(optax.sgd(LR), inner_steps=H, compressor=identity_like), x0())
  np.testing.assert_allclose(compressed, plain, rtol=0, atol=1e-13)
  assert np.abs(np.asarray(state.residual)).max() < 1e-13


def test_many_level_qsgd_is_close_to_uncompressed_diloco():
  plain, _ = run(gj.diloco(optax.sgd(LR), inner_steps=H), x0())
  compressed, _ = run(gj.diloco(optax.sgd(LR), inner_steps=H, compressor=gj.compress.qsgd(2**20)), x0())
  np.testing.assert_allclose(compressed, plain, rtol=0, atol=1e-4)


def test_identity_compressor_equals_uncompressed_noloco_from_a_common_start():
  W = gj.topology.random_pairs(N, period=ROUNDS)
  # One round from a common start: phi_i - (W theta)_i = (W (phi - theta))_i.
  plain, _ = run(gj.noloco(optax.sgd(LR), W, inner_steps=H), x0(), steps=H)
  compressed, _ = run(gj.noloco(optax.sgd(LR), W, inner_steps=H, compressor=gj.compress.identity()), x0(), steps=H)
  np.testing.assert_allclose(compressed, plain, rtol=0, atol=1e-13)


def test_top_k_with_error_feedback_diloco_equals_numpy():
  x, state = run(gj.diloco(optax.sgd(LR), inner_steps=H, compressor=gj.compress.top_k(0.1)), x0())
  phi, e = reference(x0(), lambda q, r: np.broadcast_to(q.mean(0), q.shape), 0.7, 0.9, True, 2)
  np.testing.assert_allclose(x, phi, rtol=0, atol=1e-12)
  np.testing.assert_allclose(np.asarray(state.residual), e, rtol=0, atol=1e-12)
  assert np.abs(e).max() > 0.1  # the residual carries something


def test_top_k_with_error_feedback_noloco_equals_numpy():
  W = gj.topology.random_pairs(N, period=ROUNDS)
  x, state = run(gj.noloco(optax.sgd(LR), W, inner_steps=H, compressor=gj.compress.top_k(0.1)), x0())
  phi, e = reference(x0(), lambda q, r: W.sparse(r).toarray() @ q, 0.7, 0.5, False, 2)
  np.testing.assert_allclose(x, phi, rtol=0, atol=1e-12)
  np.testing.assert_allclose(np.asarray(state.residual), e, rtol=0, atol=1e-12)


def test_without_error_feedback_the_residual_stays_zero():
  _, state = run(gj.diloco(optax.sgd(LR), inner_steps=H, compressor=gj.compress.top_k(0.1), error_feedback=False),
                 x0())
  assert np.abs(np.asarray(state.residual)).max() == 0.0


def test_bytes_per_step_counts_the_compact_messages():
  x = jnp.zeros((N, 100), jnp.float32)
  c = gj.compress.top_k(0.1)  # 10 float32 values and 10 uint8 indices: 50 bytes per node
  assert float(c.bits(x[0])) / 8 == 50.0
  diloco = gj.bytes_per_step(gj.diloco(optax.sgd(0.1), inner_steps=2, compressor=c), x, steps=2)
  assert diloco.tolist() == [0.0, (N - 1) * 50.0]  # an all-gather of the compact messages
  W = gj.topology.random_pairs(N)
  noloco = gj.bytes_per_step(gj.noloco(optax.sgd(0.1), W, inner_steps=2, compressor=c), x, steps=2)
  assert noloco.tolist() == [0.0, 50.0]  # one compact message to the peer
  q8 = gj.bytes_per_step(gj.noloco(optax.sgd(0.1), W, inner_steps=1, compressor=gj.compress.qsgd(127)), x)
  assert q8.tolist() == [float(gj.compress.qsgd(127).bits(x[0])) / 8]


@pytest.mark.parametrize("method", ["diloco", "noloco"])
def test_compressed_outer_step_inside_chain_equals_the_stacked_call(method):
  W = gj.topology.random_pairs(N, period=ROUNDS)
  make = {
      "diloco": lambda: gj.diloco(optax.sgd(LR), inner_steps=H, compressor=gj.compress.qsgd(7)),
      "noloco": lambda: gj.noloco(optax.sgd(LR), W, inner_steps=H, compressor=gj.compress.qsgd(7)),
  }[method]
  start = x0() + np.random.default_rng(2).normal(size=(N, D))
  stacked, s1 = run(make(), start)
  mapped, s2 = run(gj.chain(make()), start)
  np.testing.assert_allclose(mapped, stacked, rtol=0, atol=1e-12)
  assert np.abs(stacked - start).max() > 0.1


def test_refuses_a_non_compressor():
  with pytest.raises(TypeError, match="gj.diloco: compressor must be a gj.compress compressor"):
    gj.diloco(optax.sgd(0.1), compressor=optax.sgd(0.1))  # type: ignore[arg-type]
