"""Partial participation in DiLoCo and NoLoCo: the outer step over the nodes that take part.

Against a NumPy transcription: a node that is down (``up=False``) neither computes nor
changes; at an outer step DiLoCo averages the pseudo-gradients of the live nodes that hold
the last result, and a live node that missed an outer step first takes the participants'
outer params and momentum (it rejoins from the result); NoLoCo's pairs average without an
absent peer, whose weight the present node keeps.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj
from gossipjax import topology as T

N, D, H, ROUNDS = 6, 3, 2, 4
LR, OUTER_LR, MU = 0.1, 0.7, 0.5
STEPS = H * ROUNDS


def problem():
  rng = np.random.default_rng(3)
  a = rng.normal(size=(N, 5, D))
  b = rng.normal(size=(N, 5)) + np.arange(N)[:, None]
  return a, b, np.tile(rng.normal(size=D), (N, 1))


def up_masks():
  up = np.ones((STEPS, N), bool)
  up[1, 2] = False  # node 2 misses round 0's outer step: it rejoins at round 1's
  up[2:4, 4] = False  # node 4 is down through round 1 (its outer step too)
  up[5, [0, 3]] = False  # two nodes miss round 2's outer step
  return up


class NumpyAdam:
  """One node's Adam: its moments and its step count t are its own (a node that is down keeps all three)."""

  def __init__(self):
    self.m, self.v, self.t = np.zeros(D), np.zeros(D), 0

  def step(self, x, g):
    self.t += 1
    self.m = 0.9 * self.m + 0.1 * g
    self.v = 0.999 * self.v + 0.001 * g * g
    return x - LR * (self.m / (1 - 0.9 ** self.t)) / (np.sqrt(self.v / (1 - 0.999 ** self.t)) + 1e-8)


def grad(a, b, x, i):
  return a[i].T @ (a[i] @ x - b[i]) / a.shape[1]


def reference(a, b, x0, up, topo=None):
  """DiLoCo (Nesterov outer step) without ``topo``, NoLoCo (heavy ball over ``topo``'s pairs) with it."""
  theta, phi, mom = x0.copy(), x0.copy(), np.zeros((N, D))
  adam = [NumpyAdam() for _ in range(N)]
  synced, outer_steps, out = np.zeros(N, int), 0, []
  for k in range(STEPS):
    for i in np.flatnonzero(up[k]):
      theta[i] = adam[i].step(theta[i], grad(a, b, theta[i], i))
    if k % H == H - 1:
      ok = up[k]
      if topo is None:
        current = ok & (synced == outer_steps)
        part = current if current.any() else ok
        rejoin = ok & ~part
        phi[rejoin], mom[rejoin] = phi[part].mean(axis=0), mom[part].mean(axis=0)
        combined = np.tile(theta[part].mean(axis=0), (N, 1))
      else:
        part = ok
        w = topo.matrix(k // H) * part[None, :]
        combined = w @ theta + (1 - w.sum(axis=1, keepdims=True)) * theta
      for i in np.flatnonzero(ok):
        g = phi[i] - combined[i]
        mom[i] = MU * mom[i] + g
        phi[i] = phi[i] - OUTER_LR * ((g + MU * mom[i]) if topo is None else mom[i])
        theta[i] = phi[i]
        synced[i] = outer_steps + 1
      outer_steps += 1
    out.append(theta.copy())
  return np.stack(out)


def run(tx, a, b, x0, up):
  grads = jax.vmap(jax.grad(lambda x, ai, bi: 0.5 * jnp.mean((ai @ x - bi) ** 2)))
  step = jax.jit(lambda x, s, up: (lambda u, s: (x + u, s))(*tx.update(grads(x, a, b), s, x, up=up)))
  x = jnp.asarray(x0)
  state, out = tx.init(x), []
  for k in range(STEPS):
    x, state = step(x, state, jnp.asarray(up[k]))
    out.append(np.asarray(x))
  return np.stack(out), state


def diloco(**kw):
  return gj.diloco(optax.adam(LR), inner_steps=H, outer_learning_rate=OUTER_LR, outer_momentum=MU, **kw)


def noloco(**kw):
  return gj.noloco(optax.adam(LR), T.random_pairs(N, seed=4, period=ROUNDS), inner_steps=H,
                   outer_learning_rate=OUTER_LR, outer_momentum=MU, **kw)


def test_diloco_averages_the_participants_and_a_node_that_missed_a_round_rejoins():
  a, b, x0 = problem()
  up = up_masks()
  want = reference(a, b, x0, up)
  got, state = run(diloco(), a, b, x0, up)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
  np.testing.assert_array_equal(got[1:4, 4], np.tile(got[1, 4], (3, 1)))  # down: frozen
  live = [0, 1, 2, 3, 5]
  assert np.ptp(got[2 * H - 1, live], axis=0).max() < 1e-12  # node 2 rejoined at round 1: one model again
  assert np.ptp(got[-1], axis=0).max() < 1e-12  # and every node after round 3
  assert int(state.outer_steps) == ROUNDS and state.synced.tolist() == [ROUNDS] * N
  # The mean is over the participants: averaging the frozen node 2 in gives another model.
  assert np.abs(got[1] - reference(a, b, x0, np.ones_like(up))[1]).max() > 1e-3
  # An identity compressor sends the same pseudo-gradients: the compressed form averages the same nodes.
  same, _ = run(diloco(compressor=gj.compress.top_k(1.0)), a, b, x0, up)
  np.testing.assert_allclose(same, want, rtol=0, atol=1e-12)


def test_noloco_pairs_without_an_absent_peer():
  a, b, x0 = problem()
  up = up_masks()
  topo = T.random_pairs(N, seed=4, period=ROUNDS)
  want = reference(a, b, x0, up, topo)
  got, _ = run(noloco(), a, b, x0, up)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
  same, _ = run(noloco(compressor=gj.compress.top_k(1.0)), a, b, x0, up)
  # The compressed form sends pseudo-gradients only: equal where the pair's outer params agree (round 0).
  np.testing.assert_allclose(same[:H], want[:H], rtol=0, atol=1e-12)


@pytest.mark.parametrize("make", [diloco, noloco], ids=["diloco", "noloco"])
def test_named_axis_and_sharded_nodes_equal_the_stacked_call(make):
  a, b, x0 = problem()
  up = up_masks()
  want, _ = run(make(), a, b, x0, up)
  chained, _ = run(gj.chain(make()), a, b, x0, up)
  np.testing.assert_allclose(chained, want, rtol=0, atol=1e-12)
  be = gj.backend.sharded(jax.make_mesh((2,), ("nodes",), devices=jax.devices()[:2]))
  sharded, _ = run(make(backend=be), be.shard(jnp.asarray(a)), be.shard(jnp.asarray(b)), be.shard(jnp.asarray(x0)),
                   up)
  np.testing.assert_allclose(sharded, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("method", ["diloco", "noloco"])
@pytest.mark.parametrize("form", ["stacked", "gj.chain"])
def test_guard_finite_skipped_node_is_not_averaged_in(method, form):
  a, b, x0 = problem()
  up = np.ones((STEPS, N), bool)
  up[H - 1, 2] = False  # node 2's NaN at round 0's last step: it skips that step and the outer one
  tx = gj.guard_finite(diloco() if method == "diloco" else noloco())
  tx = gj.chain(tx) if form == "gj.chain" else tx
  topo = T.random_pairs(N, seed=4, period=ROUNDS) if method == "noloco" else None
  grads = jax.vmap(jax.grad(lambda x, ai, bi: 0.5 * jnp.mean((ai @ x - bi) ** 2)))
  update, x = jax.jit(tx.update), jnp.asarray(x0)
  state, got = tx.init(x), []
  for k in range(STEPS):
    g = grads(x, a, b)
    u, state = update(g.at[2].set(jnp.nan) if k == H - 1 else g, state, x)
    x = x + u
    got.append(np.asarray(x))
  # The per-node reference: node 2 keeps its whole Adam state (its step count too) through the NaN step.
  np.testing.assert_allclose(np.stack(got), reference(a, b, x0, up, topo), rtol=0, atol=1e-12)
  assert gj.nonfinite_counts(state).tolist() == [0, 0, 1, 0, 0, 0]


def test_fault_simulator_drops_a_node_from_the_average_until_it_rejoins():
  x = np.linspace(-1.0, 1.0, 24)
  data = gj.data.node_data(x, 2 * x + np.repeat(np.arange(4.0), 6), [np.arange(6 * i, 6 * i + 6) for i in range(4)])
  loss = lambda w, batch: jnp.mean((w[0] * batch[0] + w[1] - batch[1]) ** 2)
  cluster = gj.asynchrony.cluster(4)  # every round takes one second
  faults = gj.asynchrony.faults(down=[(1, 2.5, 6.5)])  # node 1 misses rounds 3-6 (the outer steps of 3 and 5)
  sim = gj.asynchrony.synchronous(loss, data, cluster, diloco(), batch_size=6, faults=faults)
  state = sim.init(jnp.zeros((4, 2)), jax.random.key(0))
  rows = []
  for _ in range(10):
    state = sim.run(state, 1)
    rows.append(np.asarray(state.params))
  rows = np.stack(rows)
  np.testing.assert_array_equal(rows[2:7, 1], np.tile(rows[2, 1], (5, 1)))  # down: frozen, not averaged
  assert np.ptp(rows[3][[0, 2, 3]], axis=0).max() < 1e-12 and np.abs(rows[3, 1] - rows[3, 0]).max() > 1e-3
  assert np.ptp(rows[7], axis=0).max() < 1e-12  # back for round 7, whose outer step it rejoins from


def test_up_must_be_one_bool_per_node():
  x = jnp.zeros((N, D))
  tx = diloco()
  with pytest.raises(ValueError, match=r"^gj\.diloco: up must be a bool array with one entry per node, of shape \(6,\)"):
    tx.update(x, tx.init(x), x, up=jnp.ones(N - 1, bool))
