"""`gj.gradient_tracker`: the tracking step alone, held to its recursion, its invariant and its limit (float64)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj
from gossipjax import topology as T

from test_algorithms_exact import D, N, X0, X_STAR, grad_np, trajectory

STEPS = 25


@pytest.mark.parametrize("topo", [T.ring(N), T.random_pairs(N, seed=3, period=5)], ids=lambda t: t.name)
def test_tracker_then_sgd_then_mix_is_the_two_round_recursion(topo):
  """y^k = W(k-1) y^(k-1) + g^k - g^(k-1), y^0 = g^0, and x^(k+1) = W(k)(x^k - lr y^k), as NumPy writes it."""
  lr = 0.1
  got = trajectory(gj.chain(gj.gradient_tracker(topo), optax.sgd(lr), gj.mix(topo)), X0, STEPS)
  x, g_old, y = X0.copy(), None, None
  for k in range(STEPS):
    g = grad_np(x)
    y = g if k == 0 else topo.matrix(k - 1) @ y + g - g_old
    x, g_old = topo.matrix(k) @ (x - lr * y), g
    np.testing.assert_allclose(got[k], x, rtol=0, atol=1e-12)


def test_the_trackers_sum_to_the_gradients_and_the_rest_pass_through():
  tracker = gj.gradient_tracker(T.one_peer_exponential(N))
  rng = np.random.default_rng(0)
  tree = {"w": jnp.zeros((N, 3)), "step": jnp.zeros((N,), jnp.int32)}
  state = tracker.init(tree)
  for k in range(6):
    g = {"w": jnp.asarray(rng.normal(size=(N, 3))), "step": jnp.full((N,), k, jnp.int32)}
    y, state = tracker.update(g, state)
    np.testing.assert_allclose(np.asarray(y["w"]).sum(0), np.asarray(g["w"]).sum(0), rtol=0, atol=1e-12)
    assert y["step"].tolist() == [k] * N  # integer leaves are not tracked
  assert int(state.count) == 6


def test_tracked_adam_reaches_the_minimiser_where_decentralized_adam_stops_short():
  """GTAdam's fixed point: every tracker holds the average gradient, which is then zero."""
  W, lr = T.ring(N), 0.02
  x = lambda tx: np.asarray(trajectory(tx, np.zeros((N, D)), 3000)[-1])
  error = lambda x: float(np.max(np.abs(x - X_STAR)))
  assert error(x(gj.chain(gj.gradient_tracker(W), optax.adam(lr), gj.mix(W)))) < 1e-7
  assert error(x(gj.chain(optax.adam(lr), gj.mix(W)))) > 1e-2


def test_state_dtype_forms_the_tracker_in_float32_and_returns_the_gradients_dtype():
  tracker = gj.gradient_tracker(T.ring(N), state_dtype=jnp.float32)
  g = jnp.full((N, 2), 1 / 3, jnp.bfloat16)
  state = tracker.init(g)
  assert state.correction.dtype == jnp.float32
  y, state = tracker.update(g, state)
  assert y.dtype == jnp.bfloat16 and state.correction.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(state.correction, np.float64), 0.0, atol=1e-7)  # W y - g, y = g


def test_sharded_tracker_equals_the_simulation():
  backend = gj.backend.sharded(jax.make_mesh((8,), ("nodes",), axis_types=(jax.sharding.AxisType.Explicit,)))
  topo = T.random_pairs(16, seed=0, period=4)
  rng = np.random.default_rng(0)
  a, b, x0 = rng.normal(size=(16, 6, 3)), rng.normal(size=(16, 6)) + np.arange(16)[:, None], rng.normal(size=(16, 3))
  grad = jax.vmap(jax.grad(lambda xi, ai, bi: 0.5 * jnp.mean((ai @ xi - bi) ** 2)))

  def run(backend, x, a, b):
    tx = gj.chain(gj.gradient_tracker(topo, backend=backend), optax.adam(0.05), gj.mix(topo, backend=backend),
                  backend=backend)
    step = jax.jit(lambda x, s: (lambda u, s: (optax.apply_updates(x, u), s))(*tx.update(grad(x, a, b), s, x)))
    state = tx.init(x)
    for _ in range(5):
      x, state = step(x, state)
    return np.asarray(x)

  want = run(None, *map(jnp.asarray, (x0, a, b)))
  np.testing.assert_allclose(run(backend, *map(backend.shard, (x0, a, b))), want, rtol=0, atol=1e-12)


def test_refusals_name_the_transform():
  directed = np.zeros((6, 6), bool)
  directed[np.arange(6), (np.arange(6) + 1) % 6] = True  # a directed ring with a chord: no doubly stochastic rule
  directed[0, 3] = True
  with pytest.raises(ValueError, match=r"^gj\.gradient_tracker: graph\(6\): W must be doubly stochastic.*gj\.sgp"):
    gj.gradient_tracker(T.from_adjacency(directed))
  with pytest.raises(ValueError, match=r"gj.gradient_tracker: gradients\['w'\] has a leading node axis of 6"):
    tracker = gj.gradient_tracker(T.ring(N))
    g = {"w": jnp.ones((N - 2, 3))}
    tracker.update(g, tracker.init(g))
  with pytest.raises(ValueError, match="gj.gradient_tracker: state_dtype"):
    gj.gradient_tracker(T.ring(N), state_dtype=jnp.int32)

