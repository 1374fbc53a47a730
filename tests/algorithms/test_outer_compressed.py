"""Compressed outer exchanges: DiLoCo and NoLoCo sending compressed pseudo-gradients with error feedback.

Against a NumPy transcription of the recursion: e_i + Delta_i -> C -> mean (or W-mix) of the
decoded messages -> outer step; e_i <- e_i + Delta_i - C(e_i + Delta_i).
"""

import re
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


def reference_scattered(x0, eta, mu, k):
  """NumPy, the reduce-scatter form: each node's vector in N pieces, top-k of each piece (error feedback on
  them), node j averages everyone's piece j and sends the top-k of that mean to all."""
  b = targets()
  phi, m, e = x0.copy(), np.zeros_like(x0), np.zeros_like(x0)
  width = D // N
  for _ in range(ROUNDS):
    theta = phi.copy()
    for _ in range(H):
      theta = theta - LR * (theta - b)
    v = (phi - theta) + e
    q = np.stack([np.concatenate([top_k(p, k) for p in vi.reshape(N, width)]) for vi in v])
    e = v - q
    g = np.concatenate([top_k(p, k) for p in q.reshape(N, N, width).mean(axis=0)])
    m = mu * m + g
    phi = phi - eta * (g + mu * m)
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
  c = gj.compress.top_k(0.1)
  x, state = run(gj.diloco(optax.sgd(LR), inner_steps=H, compressor=c, compressed_mean="all_gather"), x0())
  phi, e = reference(x0(), lambda q, r: np.broadcast_to(q.mean(0), q.shape), 0.7, 0.9, True, 2)
  np.testing.assert_allclose(x, phi, rtol=0, atol=1e-12)
  np.testing.assert_allclose(np.asarray(state.residual), e, rtol=0, atol=1e-12)
  assert np.abs(e).max() > 0.1  # the residual carries something
  # The default, a reduce-scatter: top-1 of each of the 5-entry pieces, twice.
  x, state = run(gj.diloco(optax.sgd(LR), inner_steps=H, compressor=c), x0())
  phi, e = reference_scattered(x0(), 0.7, 0.9, 1)
  np.testing.assert_allclose(x, phi, rtol=0, atol=1e-12)
  np.testing.assert_allclose(np.asarray(state.residual), e, rtol=0, atol=1e-12)


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
  gathered = gj.bytes_per_step(gj.diloco(optax.sgd(0.1), inner_steps=2, compressor=c, compressed_mean="all_gather"),
                              x, steps=2)
  assert gathered.tolist() == [0.0, (N - 1) * 50.0]  # an all-gather of the compact messages
  # A reduce-scatter: N - 1 pieces of 25 entries out (3 kept: 15 bytes), N - 1 compressed means in.
  scattered = gj.bytes_per_step(gj.diloco(optax.sgd(0.1), inner_steps=2, compressor=c), x, steps=2)
  assert scattered.tolist() == [0.0, 2 * (N - 1) * 15.0]
  r = gj.compress.random_k(0.1)  # the receivers redraw the indices from the sender's 8-byte key
  keyed = gj.bytes_per_step(gj.diloco(optax.sgd(0.1), inner_steps=1, compressor=r, compressed_mean="all_gather"), x)
  assert keyed.tolist() == [(N - 1) * (float(r.bits(x[0])) / 8 + 8)]
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


_ITEM_BYTES = {"u8": 1, "s8": 1, "u16": 2, "bf16": 2, "f16": 2, "f32": 4, "u32": 4, "s32": 4, "f64": 8}


def received_bytes(hlo, n):
  """Per device, what the all-gathers and all-to-alls of a compiled step bring from the others (n devices)."""
  found, total = [], 0.0
  for result, op in re.findall(r"= (\(?[a-z0-9]+\[[^\n]*?) (all-gather|all-reduce|collective-permute|all-to-all)\(",
                               hlo):
    found.append(op)
    for t, dims in re.findall(r"([a-z0-9]+)\[([\d,]*)\]", result):
      total += _ITEM_BYTES[t] * np.prod([int(d) for d in dims.split(",") if d]) * (n - 1) / n
  return set(found), total


def test_sharded_diloco_sends_the_compact_messages_it_reports_and_equals_the_simulation():
  """One node a device: the compiled outer step moves the compact messages (bytes read from the HLO)."""
  be = gj.backend.sharded(jax.make_mesh((N,), ("nodes",), devices=jax.devices()[:N]))
  x = jnp.zeros((N, D), jnp.float32)
  cases = [(gj.compress.top_k(0.1), "all_gather"), (gj.compress.qsgd(7), "reduce_scatter"),
           (gj.compress.random_k(0.2), "reduce_scatter")]
  for c, form in cases:
    tx = gj.diloco(optax.sgd(LR), inner_steps=H, compressor=c, backend=be, compressed_mean=form)
    ops, received = received_bytes(jax.jit(tx.update).lower(be.shard(x), tx.init(be.shard(x)), be.shard(x))
                                   .compile().as_text(), N)
    assert ops == ({"all-gather"} if form == "all_gather" else {"all-gather", "all-to-all"}), ops  # no dense sum
    assert received == gj.bytes_per_step(tx, x, steps=H)[-1] < (N - 1) * D * 4, (c, form)
  # random_k's receivers redraw its indices from the senders' keys; two nodes a device exchange blocks of pieces.
  make = lambda backend: gj.diloco(optax.sgd(LR), inner_steps=H, compressor=gj.compress.random_k(0.2),
                                   backend=backend, key=3)
  start = x0() + np.random.default_rng(2).normal(size=(N, D))
  want, _ = run(make(None), start)
  be = gj.backend.sharded(jax.make_mesh((N // 2,), ("nodes",), devices=jax.devices()[:N // 2]))
  got, _ = run(make(be), be.shard(jnp.asarray(start)))
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_sharded_noloco_sends_the_compact_messages_it_reports_and_equals_the_simulation():
  """One node a device: each outer round's permutes carry the compact pseudo-gradient, and nothing else."""
  be = gj.backend.sharded(jax.make_mesh((N,), ("nodes",), devices=jax.devices()[:N]))
  pairs = gj.topology.random_pairs(N, seed=1, period=2)
  branches = be.mixer(pairs).table.branches  # one per matching, each sending one message
  start = x0() + np.random.default_rng(2).normal(size=(N, D))
  for c in (gj.compress.top_k(0.1), gj.compress.random_k(0.2)):  # random_k: keys by global node
    make = lambda backend, c=c: gj.noloco(optax.sgd(LR), pairs, inner_steps=H, compressor=c, backend=backend, key=3)
    tx, x = make(be), be.shard(jnp.zeros((N, D), jnp.float32))
    hlo = jax.jit(tx.update).lower(x, tx.init(x), x).compile().as_text()
    sent = 0
    for dtype, dims in re.findall(r"= (\w+)\[([\d,]*)\]\{[^}]*\} collective-permute(?:-start)?\(", hlo):
      sent += _ITEM_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
    assert not re.search(r"\b(all-gather|all-reduce|all-to-all)(?:-start)?\(", hlo), c
    # Each round a node sends its compact message to its peer (the program holds each matching's branch).
    one = gj.bytes_per_step(make(None), np.zeros((N, D), np.float32), steps=H)[-1]
    assert branches == 2 and 0 < sent == branches * one and one < D * 4, (c, sent, one)
    want, _ = run(make(None), start)
    got, _ = run(make(be), be.shard(jnp.asarray(start)))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12, err_msg=str(c))
