"""Stochastic Gradient Push: push-sum de-biasing on directed, time-varying, not doubly stochastic W."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj
from gossipjax import topology as T

from _steps import scan_steps

N, D = 8, 4


def push_weights(adj):
  """Column-stochastic W for a directed graph (``adj[i, j]``: j sends to i): every sender
  splits its mass equally over itself and its out-neighbours, with no knowledge of who
  else sends to the receiver."""
  adj = np.asarray(adj, bool) | np.eye(adj.shape[0], dtype=bool)
  return adj / adj.sum(axis=0, keepdims=True)


def random_push_topology(n=N, steps=3, seed=0):
  """A time-varying directed graph: a directed ring plus random extra out-edges per step."""
  rng = np.random.default_rng(seed)
  mats = []
  for _ in range(steps):
    adj = np.zeros((n, n), bool)
    adj[(np.arange(n) + 1) % n, np.arange(n)] = True
    adj |= rng.random((n, n)) < 0.3
    mats.append(push_weights(adj))
  return T.from_matrix(np.stack(mats), name="random_push")


PUSH = random_push_topology()


def test_push_topology_is_column_but_not_row_stochastic():
  PUSH.check("column")
  with pytest.raises(ValueError, match="row stochastic"):
    PUSH.check("row")


def test_sgp_is_push_sum_with_local_momentum():
  """Assran et al. 2019, Algorithm 1 with local heavy-ball momentum, in (z, w) form."""
  rng = np.random.default_rng(0)
  c = rng.normal(size=(N, D))
  grad_np = lambda x: x - c  # f_i(x) = ||x - c_i||^2 / 2
  lr, beta, steps = 0.1, 0.5, 12
  x0 = rng.normal(size=(N, D))
  got, state = scan_steps(gj.sgp(PUSH, learning_rate=lr, beta=beta), x0, lambda x: x - c, steps)
  z, w, u = x0.copy(), np.ones(N), np.zeros((N, D))
  for k in range(steps):
    x = z / w[:, None]
    u = beta * u + grad_np(x)
    p = PUSH.matrix(k)
    z, w = p @ (z - lr * u), p @ w
    np.testing.assert_allclose(got[k], z / w[:, None], rtol=0, atol=1e-12)
  np.testing.assert_allclose(state.push_weight, w, atol=1e-13)
  assert np.abs(w - 1).max() > 0.05  # the weights really moved: de-biasing was exercised


@pytest.mark.parametrize("topo, steps", [
    (T.one_peer_directed_exponential(16), 4),  # one period: exact averaging for n = 2^4
    (T.directed_exponential(16), 60),
    (random_push_topology(16, seed=1), 300),
], ids=["one_peer_directed_exponential", "directed_exponential", "random_push"])
def test_sgp_with_zero_gradients_reaches_the_exact_initial_average(topo, steps):
  x0 = np.random.default_rng(2).normal(size=(16, 3)) * np.arange(1, 17)[:, None]
  xs, state = scan_steps(gj.sgp(topo, learning_rate=0.1), x0, jnp.zeros_like, steps)
  np.testing.assert_allclose(xs[-1], np.tile(x0.mean(0), (16, 1)), rtol=0, atol=1e-10)
  if topo.name == "random_push":
    # the numerators z = w x, which is what plain mixing with this W would give, settle at
    # w_i * average, not at the average: the division by w is what makes SGP exact
    z = np.asarray(state.push_weight)[:, None] * xs[-1]
    assert np.abs(z - x0.mean(0)).max() > 0.1


def test_sgp_on_least_squares_reaches_consensus_near_the_minimiser():
  rng = np.random.default_rng(3)
  a = rng.normal(size=(N, 30, D))
  b = rng.normal(size=(N, 30)) + np.arange(N)[:, None]
  x_star = np.linalg.solve(np.einsum("nmd,nme->de", a, a), np.einsum("nmd,nm->d", a, b))
  grad = lambda x: jax.vmap(jax.grad(lambda xi, ai, bi: 0.5 * jnp.mean((ai @ xi - bi) ** 2)))(x, a, b)
  local = np.stack([np.linalg.lstsq(a[i], b[i], rcond=None)[0] for i in range(N)])
  spread = float(gj.consensus_distance(jnp.asarray(local)))  # how far apart the nodes want to be
  lr = optax.polynomial_schedule(0.1, 0.0, power=1, transition_steps=3000)
  for topo in (T.directed_exponential(N), PUSH):
    xs, _ = scan_steps(gj.sgp(topo, learning_rate=lr), np.zeros((N, D)), grad, 3000)
    assert float(gj.consensus_distance(jnp.asarray(xs[-1]))) < 1e-6 * spread
    assert np.abs(xs[-1] - x_star).max() < 0.05


def test_sgp_needs_column_stochastic_w():
  row_only = T.star(6)  # uniform 1/(in-degree + 1) weights: rows sum to 1, columns do not
  with pytest.raises(ValueError, match="column stochastic"):
    gj.sgp(row_only, learning_rate=0.1)
  with pytest.raises(ValueError, match="doubly stochastic"):
    gj.gossip_sgd(PUSH, learning_rate=0.1)
