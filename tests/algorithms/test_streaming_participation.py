"""Streaming DiLoCo with nodes down (``up=``), under ``gj.guard_finite``, and with compressed fragment exchanges.

Against NumPy transcriptions: DiLoCo's participation rules, fragment by fragment. At a
fragment's sync step the pseudo-gradient is averaged over the live nodes that hold the
fragment's last outer result; a live node that missed one of the fragment's outer steps
first takes the participants' outer params and momentum of the fragment. The outer step
lands ``overlap`` steps later on the nodes that took part and are live then; a node down at
the landing keeps its params and is not synced for the fragment. With a compressor each node
sends its fragment pseudo-gradient compressed with error feedback (top-k: of each piece in the
reduce-scatter form, of the whole leaf in the all-gather form).
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj
from test_outer_compressed import received_bytes  # the bytes a compiled step's collectives bring

N, D, H, F, TAU, ALPHA, ROUNDS = 8, 8, 4, 2, 1, 0.3, 4
LR, ETA, MU = 0.1, 0.7, 0.9
STEPS = H * ROUNDS
NAMES = ("a", "b")  # two leaves of equal size: with F = 2, fragment 0 is "a" and fragment 1 is "b"


def problem(n=N, d=D):
  """Per node and leaf, g = s (x - c): a diagonal quadratic of its own."""
  rng = np.random.default_rng(5)
  return rng.uniform(0.5, 2.0, size=(n, 2, d)), rng.normal(size=(n, 2, d)) + np.arange(n)[:, None, None], \
      np.tile(rng.normal(size=(1, 2, d)), (n, 1, 1))


def up_masks():
  up = np.ones((STEPS, N), bool)
  up[0, 1] = False  # an inner step
  up[1, 2] = False  # fragment 0's sync (step 1): node 2 neither sends nor receives, and rejoins at step 5
  up[2, 3] = False  # fragment 0's landing (step 2): node 3 keeps its params, rejoins at step 5
  up[4:8, 4] = False  # node 4 misses round 1: fragment 1's landing at 4, fragment 0's sync and landing, ...
  up[7, 5] = False  # fragment 1's sync in round 1
  up[11, [0, 6]] = False  # two nodes miss fragment 1's sync in round 2
  up[12, 7] = False  # and one its landing
  return up


def reference(up, f=F, tau=TAU, alpha=ALPHA, wrong=False):
  """Streaming DiLoCo with inner Adam (moments and step count per node: a down node keeps them) and nodes down.

  ``wrong`` averages the down nodes' frozen params into each sync, as a method that ignored
  ``up`` in the mean would.
  """
  s, c, x0 = problem()
  theta, phi = x0.copy(), x0.copy()
  mom, pend, m, v = (np.zeros_like(x0) for _ in range(4))
  groups = [[0], [1]] if f == 2 else [[0, 1]]
  sync_at = [(p + 1) * H // f - 1 for p in range(f)]
  synced, joined, outer_steps = np.zeros((f, N), int), -np.ones((f, N), int), np.zeros(f, int)
  out, taken = [], np.zeros(N, int)
  for t in range(STEPS):
    ok = up[t]
    g = s * (theta - c)
    m[ok] = 0.9 * m[ok] + 0.1 * g[ok]
    v[ok] = 0.999 * v[ok] + 0.001 * g[ok] ** 2
    taken[ok] += 1
    k = np.maximum(taken, 1).reshape((N,) + (1,) * (m.ndim - 1))
    step = (m / (1 - 0.9 ** k)) / (np.sqrt(v / (1 - 0.999 ** k)) + 1e-8)
    theta[ok] = theta[ok] - LR * step[ok]
    for p, grp in enumerate(groups):
      if t % H == sync_at[p]:
        current = ok & (synced[p] == outer_steps[p])
        part = current if current.any() else ok
        if part.any():
          for i in np.flatnonzero(ok & ~part):  # rejoin from the participants' outer params and momentum
            phi[i, grp], mom[i, grp] = phi[part][:, grp].mean(0), mom[part][:, grp].mean(0)
          mean = theta[part | ~ok if wrong else part][:, grp].mean(0)
          for i in np.flatnonzero(ok):
            pend[i, grp], joined[p, i] = phi[i, grp] - mean, t // H
          outer_steps[p] += 1
      if t >= sync_at[p] + tau and (t - tau) % H == sync_at[p]:
        for i in np.flatnonzero(ok & (joined[p] == (t - tau) // H)):
          mom[i, grp] = MU * mom[i, grp] + pend[i, grp]
          phi[i, grp] = phi[i, grp] - ETA * (pend[i, grp] + MU * mom[i, grp])
          theta[i, grp] = alpha * theta[i, grp] + (1 - alpha) * phi[i, grp]
          synced[p, i] = outer_steps[p]
    out.append(theta.copy())
  return np.stack(out)


def as_tree(x):
  return {k: x[:, j] for j, k in enumerate(NAMES)}


def run(tx, up=None, backend=None, nan_at=()) -> tuple[np.ndarray, Any]:
  """Params after each step, (STEPS, N, 2, D); at the steps in ``nan_at`` node 2's gradient of "a" is NaN."""
  s, c, x0 = (jnp.asarray(v) for v in problem())
  s, c, x = as_tree(s), as_tree(c), as_tree(x0)
  if backend is not None:
    s, c, x = backend.shard(s), backend.shard(c), backend.shard(x)

  def step(x, state, up, nan):
    g = jax.tree.map(lambda x, s, c: s * (x - c), x, s, c)
    if nan_at:
      g["a"] = g["a"].at[2].set(jnp.where(nan, jnp.nan, g["a"][2]))
    u, state = tx.update(g, state, x) if up is None else tx.update(g, state, x, up=up)
    return optax.apply_updates(x, u), state

  step = jax.jit(step)
  state, out = tx.init(x), []
  for t in range(STEPS):
    x, state = step(x, state, None if up is None else jnp.asarray(up[t]), t in nan_at)
    out.append(np.stack([np.asarray(x[k]) for k in NAMES], axis=1))
  return np.stack(out), state


def streaming(**kw):
  kw = {"num_fragments": F, "overlap": TAU, "mixing": ALPHA, **kw}
  return gj.streaming_diloco(optax.adam(LR), inner_steps=H, outer_learning_rate=ETA, outer_momentum=MU, **kw)


def test_nodes_down_match_numpy_stacked_in_chain_and_sharded_two_nodes_a_device():
  up = up_masks()
  want = reference(up)
  got, state = run(streaming(), up)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
  np.testing.assert_array_equal(got[3:8, 4], np.tile(got[3, 4], (5, 1, 1)))  # down through round 1: frozen
  assert np.abs(got[2, 2, 0] - got[2, 0, 0]).max() > 1e-3  # node 2 missed fragment 0's sync: its own "a"
  assert np.ptp(got[5][[0, 1, 2, 3, 5, 6, 7], 0], axis=0).max() > 1e-3  # alpha keeps the local params apart
  assert [int(s) for s in state.outer_steps] == [ROUNDS, ROUNDS]
  # Fragment 1's last sync lands next round: the nodes that missed round 2's (0, 6) or its landing (7) are behind.
  assert np.asarray(state.synced[1]).tolist() == [2, 3, 3, 3, 3, 3, 2, 2]
  # Averaging the down nodes in ends measurably elsewhere: the mean is over the participants.
  assert np.abs(got - reference(up, wrong=True)).max() > 1e-3
  chained, _ = run(gj.chain(streaming()), up)
  np.testing.assert_allclose(chained, want, rtol=0, atol=1e-12)
  be = gj.backend.sharded(jax.make_mesh((N // 2,), ("nodes",), devices=jax.devices()[:N // 2]))
  sharded, _ = run(streaming(backend=be), up, backend=be)
  np.testing.assert_allclose(sharded, want, rtol=0, atol=1e-12)


def test_guard_finite_holds_a_nan_node_out_of_its_fragment():
  nan_at = (1, 2, 6)  # fragment 0's sync, its landing, and the next landing
  up = np.ones((STEPS, N), bool)
  up[list(nan_at), 2] = False
  got, state = run(gj.guard_finite(streaming()), nan_at=nan_at)
  np.testing.assert_allclose(got, reference(up), rtol=0, atol=1e-12)
  assert gj.nonfinite_counts(state).tolist() == [0, 0, 3, 0, 0, 0, 0, 0]
  assert np.abs(got - reference(np.ones_like(up))).max() > 1e-3


def test_one_fragment_without_overlap_or_mixing_is_diloco_with_up_and_a_compressor():
  up = up_masks()
  one = dict(num_fragments=1, overlap=0, mixing=0.0)
  diloco = lambda **kw: gj.diloco(optax.adam(LR), inner_steps=H, outer_learning_rate=ETA, outer_momentum=MU, **kw)
  want, _ = run(diloco(), up)
  np.testing.assert_allclose(want, reference(up, f=1, tau=0, alpha=0.0), rtol=0, atol=1e-12)
  got, _ = run(streaming(**one), up)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
  for c, form in [(gj.compress.qsgd(7), "reduce_scatter"), (gj.compress.top_k(0.5), "all_gather")]:
    want, _ = run(diloco(compressor=c, compressed_mean=form, key=3), up)
    got, state = run(streaming(compressor=c, compressed_mean=form, key=3, **one), up)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    assert np.abs(np.asarray(state.residual["a"])).max() > 1e-3  # the compressor dropped something, the
    # residual kept it (qsgd: pieces of 2 of the 16 entries)


CN, CD = 4, 8  # the compressed runs: 4 nodes, leaves of 8 (pieces of 2 in the reduce-scatter form)


def top_k(v, k):
  out = np.zeros_like(v)
  idx = np.argsort(-np.abs(v), kind="stable")[:k]
  out[idx] = v[idx]
  return out


def compressed_reference(form):
  """Inner SGD; each fragment's (one leaf's) pseudo-gradient plus residual, top-k, and its mean."""
  s, c, x0 = problem(CN, CD)
  theta, phi = x0.copy(), x0.copy()
  mom, pend, e = np.zeros_like(x0), np.zeros_like(x0), np.zeros_like(x0)
  width = CD // CN
  for t in range(STEPS):
    theta = theta - LR * s * (theta - c)
    for p in range(2):
      sync = (p + 1) * H // 2 - 1
      if t % H == sync:
        v = phi[:, p] - theta[:, p] + e[:, p]
        if form == "reduce_scatter":  # top-1 of each piece; node j averages the pieces j, top-1 of that
          q = np.stack([np.concatenate([top_k(piece, 1) for piece in vi.reshape(CN, width)]) for vi in v])
          g = np.concatenate([top_k(piece, 1) for piece in q.reshape(CN, CN, width).mean(axis=0)])
        else:  # top-4 of the whole leaf; every node decodes all and averages
          q = np.stack([top_k(vi, CD // 2) for vi in v])
          g = q.mean(axis=0)
        e[:, p], pend[:, p] = v - q, g
      if t >= sync + TAU and (t - TAU) % H == sync:
        mom[:, p] = MU * mom[:, p] + pend[:, p]
        phi[:, p] = phi[:, p] - ETA * (pend[:, p] + MU * mom[:, p])
        theta[:, p] = ALPHA * theta[:, p] + (1 - ALPHA) * phi[:, p]
  return theta, e


def compressed_run(tx, backend=None) -> tuple[np.ndarray, Any]:
  s, c, x0 = (as_tree(jnp.asarray(v)) for v in problem(CN, CD))
  if backend is not None:
    s, c, x0 = backend.shard(s), backend.shard(c), backend.shard(x0)
  step = jax.jit(lambda x, st: (lambda u, st: (optax.apply_updates(x, u), st))(
      *tx.update(jax.tree.map(lambda x, s, c: s * (x - c), x, s, c), st, x)))
  x, state = x0, tx.init(x0)
  for _ in range(STEPS):
    x, state = step(x, state)
  return np.stack([np.asarray(x[k]) for k in NAMES], axis=1), state


def compressed(**kw):
  return gj.streaming_diloco(optax.sgd(LR), num_fragments=2, inner_steps=H, overlap=TAU, mixing=ALPHA,
                             outer_learning_rate=ETA, outer_momentum=MU, compressor=gj.compress.top_k(0.5), **kw)


@pytest.mark.parametrize("form", ["reduce_scatter", "all_gather"])
def test_top_k_with_error_feedback_matches_numpy(form):
  got, state = compressed_run(compressed(compressed_mean=form))
  want, e = compressed_reference(form)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
  residual = np.stack([np.asarray(state.residual[k]) for k in NAMES], axis=1)
  np.testing.assert_allclose(residual, e, rtol=0, atol=1e-12)
  assert np.abs(e).max() > 0.1  # the residual carries something


def test_sharded_sends_the_compact_fragments_it_reports_and_equals_the_simulation():
  """One node a device on an Explicit mesh: the compiled syncs move the compact messages (bytes read from the HLO)."""
  mesh = jax.make_mesh((CN,), ("nodes",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:CN])
  be = gj.backend.sharded(mesh)
  x = as_tree(jnp.zeros((CN, 2, CD), jnp.float32))
  for c, form in [(gj.compress.qsgd(7), "reduce_scatter"), (gj.compress.top_k(0.25), "all_gather")]:
    tx = gj.streaming_diloco(optax.sgd(LR), num_fragments=2, inner_steps=H, overlap=TAU, compressor=c,
                             compressed_mean=form, backend=be)
    xs = be.shard(x)
    ops, received = received_bytes(jax.jit(tx.update).lower(xs, tx.init(xs), xs).compile().as_text(), CN)
    assert ops == ({"all-gather"} if form == "all_gather" else {"all-gather", "all-to-all"}), ops  # no dense sum
    sent = gj.bytes_per_step(tx, x, steps=H)
    assert np.count_nonzero(sent) == 2 and received == sent.sum() < 2 * (CN - 1) * CD * 4, (c, form, sent)
  got, _ = compressed_run(compressed(backend=be))  # the reduce-scatter's pieces, one node a device
  np.testing.assert_allclose(got, compressed_reference("reduce_scatter")[0], rtol=0, atol=1e-12)


def test_up_must_be_one_bool_per_node():
  x = as_tree(jnp.zeros((N, 2, D)))
  tx = streaming()
  with pytest.raises(ValueError, match=r"^gj\.streaming_diloco: up must be a bool array with one entry per node, "
                                       r"of shape \(8,\)"):
    tx.update(x, tx.init(x), x, up=jnp.ones(N - 1, bool))
  with pytest.raises(ValueError, match=r"^gj\.streaming_diloco: compressed_mean must be 'reduce_scatter' or"):
    streaming(compressor=gj.compress.qsgd(7), compressed_mean="ring")
  with pytest.raises(TypeError, match=r"^gj\.streaming_diloco: compressor must be a gj\.compress compressor"):
    streaming(compressor=optax.sgd(0.1))  # type: ignore[arg-type]
