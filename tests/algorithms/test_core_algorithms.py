"""Each core transform held against a plain NumPy recursion of its rule (float64, ~1e-12)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj
from gossipjax import topology as T

N, D, STEPS = 8, 5, 30


def least_squares(seed=0, n=N, d=D, m=12):
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(n, m, d))
  b = rng.normal(size=(n, m)) + np.arange(n)[:, None]  # heterogeneous data
  return a, b


def grad_np(x, a, b):  # f_i(x) = 1/(2m) ||A_i x - b_i||^2
  return np.einsum("nmd,nm->nd", a, np.einsum("nmd,nd->nm", a, x) - b) / a.shape[1]


def grad_jax(x, a, b):
  return jax.vmap(jax.grad(lambda xi, ai, bi: 0.5 * jnp.mean((ai @ xi - bi) ** 2)))(x, a, b)


def run_tx(tx, x0, a, b, steps=STEPS):
  x, state = jnp.asarray(x0), tx.init(jnp.asarray(x0))

  @jax.jit
  def step(x, state):
    updates, state = tx.update(grad_jax(x, a, b), state, x)
    return optax.apply_updates(x, updates), state

  out = []
  for _ in range(steps):
    x, state = step(x, state)
    out.append(np.asarray(x))
  return np.stack(out)


def dmsgd_np(topo, x, a, b, beta, lr, steps=STEPS):
  m, out = np.zeros_like(x), []
  for k in range(steps):
    m = beta * m + grad_np(x, a, b)
    x = topo.matrix(k) @ (x - lr(k) * m)
    out.append(x)
  return np.stack(out)


def decentlam_np(topo, x, a, b, beta, lr, steps=STEPS):
  m, out = np.zeros_like(x), []
  for k in range(steps):
    g = (x - topo.matrix(k) @ (x - lr(k) * grad_np(x, a, b))) / lr(k)
    m = beta * m + g
    x = x - lr(k) * m
    out.append(x)
  return np.stack(out)


TOPOLOGIES = [T.ring(N), T.exponential(N), T.one_peer_exponential(N), T.erdos_renyi(N, 0.5, seed=1), T.torus(2, 4)]


@pytest.mark.parametrize("topo", TOPOLOGIES, ids=lambda t: t.name)
@pytest.mark.parametrize("beta", [0.0, 0.9])
def test_gossip_sgd_is_dmsgd(topo, beta):
  a, b = least_squares()
  x0 = np.random.default_rng(1).normal(size=(N, D))
  got = run_tx(gj.gossip_sgd(topo, beta=beta, learning_rate=0.05), x0, a, b)
  np.testing.assert_allclose(got, dmsgd_np(topo, x0, a, b, beta, lambda k: 0.05), rtol=0, atol=1e-12)


def test_gossip_sgd_with_schedule():
  a, b = least_squares()
  x0 = np.zeros((N, D))
  sched = optax.piecewise_constant_schedule(0.08, {10: 0.25, 20: 0.5})
  got = run_tx(gj.gossip_sgd(T.ring(N), beta=0.5, learning_rate=sched), x0, a, b)
  np.testing.assert_allclose(got, dmsgd_np(T.ring(N), x0, a, b, 0.5, lambda k: float(sched(jnp.asarray(k, jnp.int32)))), atol=1e-12)


SYMMETRIC = [T.ring(N), T.exponential(N, symmetric=True), T.torus(2, 4), T.erdos_renyi(N, 0.5, seed=1)]


@pytest.mark.parametrize("topo", SYMMETRIC, ids=lambda t: t.name)
def test_decentlam_matches_its_rule(topo):
  a, b = least_squares()
  x0 = np.random.default_rng(2).normal(size=(N, D))
  got = run_tx(gj.decentlam(topo, beta=0.8, learning_rate=0.05), x0, a, b)
  np.testing.assert_allclose(got, decentlam_np(topo, x0, a, b, 0.8, lambda k: 0.05), atol=1e-12)


@pytest.mark.parametrize("topo", [T.exponential(16), T.one_peer_exponential(8)], ids=lambda t: t.name)
def test_decentlam_refuses_directed_w_and_says_why(topo):
  with pytest.raises(ValueError, match=r"^gj\.decentlam: needs a symmetric W"):
    gj.decentlam(topo, beta=0.9, learning_rate=0.1)


def test_decentlam_on_directed_exponential_really_diverges():
  """The reason for the check above: with zero gradients the consensus error grows."""
  w = T.exponential(16).matrix()
  x = x_prev = np.random.default_rng(0).normal(size=(16, 1))
  for _ in range(200):
    x, x_prev = w @ x + 0.9 * (x - x_prev), x
  assert np.abs(x - x.mean()).max() > 1e6


def test_decentlam_full_batch_equals_heavy_ball_form():
  """Yuan's lecture (2021), "Decentralized Optimization Algorithms for Large-Scale Deep Neural
  Network Training": x+ = W(x - lr grad) + beta (x - x_prev)."""
  topo, lr, beta = T.ring(N), 0.05, 0.8
  a, b = least_squares()
  x = x_prev = np.random.default_rng(2).normal(size=(N, D))
  got = run_tx(gj.decentlam(topo, beta=beta, learning_rate=lr), x, a, b, steps=10)
  for k in range(10):
    x, x_prev = topo.matrix() @ (x - lr * grad_np(x, a, b)) + beta * (x - x_prev), x
    np.testing.assert_allclose(got[k], x, atol=1e-12)


def test_allreduce_sgd_is_centralized_momentum_sgd():
  a, b = least_squares()
  x0 = np.tile(np.random.default_rng(3).normal(size=(1, D)), (N, 1))
  got = run_tx(gj.allreduce_sgd(learning_rate=0.05, beta=0.9), x0, a, b)
  x, m = x0[0], np.zeros(D)
  for k in range(STEPS):
    m = 0.9 * m + grad_np(np.tile(x, (N, 1)), a, b).mean(0)
    x = x - 0.05 * m
    np.testing.assert_allclose(got[k], np.tile(x, (N, 1)), atol=1e-12)


def test_mix_composes_with_adam_into_decentralized_adam():
  topo = T.exponential(N)
  a, b = least_squares()
  x0 = np.zeros((N, D))
  got = run_tx(optax.chain(optax.adam(1e-2), gj.mix(topo)), x0, a, b, steps=5)
  adam = optax.adam(1e-2)
  x, s = jnp.asarray(x0), adam.init(jnp.asarray(x0))
  for k in range(5):
    u, s = adam.update(grad_jax(x, a, b), s, x)
    x = jnp.asarray(topo.matrix() @ np.asarray(x + u))
    np.testing.assert_allclose(got[k], x, atol=1e-12)


def test_mix_preserves_average_and_contracts_disagreement():
  topo = T.ring(16)
  x = jax.random.normal(jax.random.key(0), (16, 4))
  tx = gj.mix(topo)
  u, _ = tx.update(jnp.zeros_like(x), tx.init(x), x)
  y = x + u
  np.testing.assert_allclose(y.mean(0), x.mean(0), atol=1e-14)
  assert gj.consensus_distance(y) <= T.rho(topo) ** 2 * gj.consensus_distance(x) + 1e-12


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("make", [
    lambda t: gj.gossip_sgd(t, beta=0.9, learning_rate=0.1),
    lambda t: gj.gossip_sgd(t, learning_rate=optax.linear_schedule(0.1, 0.0, 10)),
    lambda t: gj.decentlam(T.ring(8), beta=0.9, learning_rate=0.1),
    lambda t: optax.chain(optax.adam(1e-3), gj.mix(t)),
    lambda t: gj.allreduce_sgd(beta=0.9, learning_rate=0.1),
], ids=["dmsgd", "dpsgd-schedule", "decentlam", "adam+mix", "allreduce"])
def test_jit_keeps_dtype_and_state_structure(make, dtype):
  topo = T.one_peer_exponential(8)
  tx = make(topo)
  params = {"w": jnp.ones((8, 3, 2), dtype), "b": jnp.zeros((8, 2), dtype)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  for _ in range(3):
    updates, new_state = step(params, state, params)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    state = new_state
    params = optax.apply_updates(params, updates)
  assert all(x.dtype == dtype for x in jax.tree.leaves(params))
  assert all(u.dtype == dtype for u in jax.tree.leaves(updates))


def test_inject_hyperparams_changes_learning_rate_without_rebuilding():
  tx = optax.inject_hyperparams(gj.gossip_sgd)(T.ring(4), beta=0.9, learning_rate=0.1)
  x = jnp.ones((4, 2))
  state = tx.init(x)
  state.hyperparams["learning_rate"] = jnp.asarray(0.0)
  u, _ = jax.jit(tx.update)(x, state, x)
  np.testing.assert_allclose(u, 0.0, atol=1e-15)


def test_time_varying_step_is_traced_no_recompile():
  topo = T.one_peer_exponential(8)
  tx = gj.gossip_sgd(topo, learning_rate=0.1)
  x = jax.random.normal(jax.random.key(1), (8, 3))
  step = jax.jit(lambda x, s: tx.update(x, s, x))
  s = tx.init(x)
  for _ in range(topo.period + 2):
    _, s = step(x, s)
  assert step._cache_size() == 1


def test_wrong_node_axis_names_both_sizes():
  tx = gj.gossip_sgd(T.ring(8), learning_rate=0.1)
  x = {"layer": {"w": jnp.ones((6, 3))}}
  with pytest.raises(ValueError, match=r"\['layer'\]\['w'\] has a leading node axis of 6, but ring\(8\) expects 8"):
    tx.update(x, tx.init(x), x)
  with pytest.raises(ValueError, match="needs the current params"):
    tx.update(x, tx.init(x))


def test_flax_linen_tree_and_nnx_optimizer():
  from flax import nnx

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))

  model, n = MLP(), 4
  x = jnp.ones((n, 2, 5))
  params = gj.init_nodes(lambda k: model.init(k, x[0]), jax.random.key(0), n, same_init=False)
  assert gj.consensus_distance(params) > 0
  tx = gj.gossip_sgd(T.ring(n), beta=0.9, learning_rate=0.1)
  loss = lambda p, xb: jnp.mean(model.apply(p, xb) ** 2)
  grads = jax.vmap(jax.grad(loss))(params, x)
  updates, _ = tx.update(grads, tx.init(params), params)
  linen_new = optax.apply_updates(params, updates)
  assert jax.tree.structure(linen_new) == jax.tree.structure(params)
  assert gj.consensus_distance(linen_new) < gj.consensus_distance(params)  # one gossip step on a linen tree

  class NnxMLP(nnx.Module):
    def __init__(self, rngs):
      self.l1, self.l2 = nnx.Linear(5, 8, rngs=rngs), nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
      return self.l2(nnx.relu(self.l1(x)))

  @nnx.vmap(in_axes=0, out_axes=0)
  def make(key):
    return NnxMLP(nnx.Rngs(key))

  stacked = make(jax.random.split(jax.random.key(0), n))
  opt = nnx.Optimizer(stacked, gj.gossip_sgd(T.ring(n), beta=0.9, learning_rate=0.1), wrt=nnx.Param)
  before = jax.tree.map(np.asarray, nnx.state(stacked, nnx.Param))

  @nnx.vmap(in_axes=(0, 0))
  def node_grads(m, xb):
    return nnx.grad(lambda m: jnp.mean(m(xb) ** 2))(m)

  g = node_grads(stacked, x)
  opt.update(stacked, g)
  after = nnx.state(stacked, nnx.Param)
  ref = jax.tree.map(lambda p, gi: np.asarray(T.ring(n).matrix() @ (p - 0.1 * gi).reshape(n, -1)).reshape(p.shape),
                     before, jax.tree.map(np.asarray, g))
  for got, want in zip(jax.tree.leaves(after), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)
