"""Exact methods, momentum variants and baselines held against their papers' rules (float64).

Two kinds of test: each transform reproduces a plain NumPy recursion written as in its
paper (to ~1e-12), and on full-batch least squares with heterogeneous data each shows the
known answer: exact methods reach the global minimiser, D-PSGD and the momentum variants
keep the inconsistency bias that Kun Yuan describes ("Decentralized Optimization Algorithms for
Large-Scale Deep Neural Network Training", lecture, 2021).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj
from gossipjax import topology as T

from _steps import scan_steps

N, D, M = 8, 5, 40


def least_squares(seed=0, n=N, d=D, m=M):
  """f_i(x) = 1/(2m) ||A_i x - b_i||^2 with node-dependent offsets in b (heterogeneous)."""
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(n, m, d))
  b = rng.normal(size=(n, m)) + 2.0 * np.arange(n)[:, None]
  x_star = np.linalg.solve(np.einsum("nmd,nme->de", a, a), np.einsum("nmd,nm->d", a, b))
  return a, b, x_star


A, B, X_STAR = least_squares()


def grad_np(x):
  return np.einsum("nmd,nm->nd", A, np.einsum("nmd,nd->nm", A, x) - B) / M


def grad_jax(x):
  return jax.vmap(jax.grad(lambda xi, ai, bi: 0.5 * jnp.mean((ai @ xi - bi) ** 2)))(x, A, B)


def trajectory(tx, x0, steps):
  """Iterates x^1..x^steps of ``tx`` on the least-squares problem (one jitted scan)."""
  return scan_steps(tx, x0, grad_jax, steps)[0]


def limit(tx, steps=8000):
  """The point ``tx`` settles at from x^0 = 0 (run long enough to be there at round-off)."""
  return trajectory(tx, np.zeros((N, D)), steps)[-1]


def bias(x):
  """sum_i ||x_i - x*||^2, the quantity of Yuan's bias propositions."""
  return float(np.sum((x - X_STAR) ** 2))


X0 = np.random.default_rng(1).normal(size=(N, D))
STEPS = 25


# ---------------------------------------------------------------- each transform is its paper's rule


def diging_np(topo, lr, steps=STEPS):
  """Nedic et al. 2017, as on Yuan's slide: y^0 = grad(x^0)."""
  x, out = X0.copy(), []
  g = grad_np(x)
  y = g.copy()
  for k in range(steps):
    w = topo.matrix(k)
    x_new = w @ x - lr * y
    g_new = grad_np(x_new)
    y = w @ y + g_new - g
    x, g = x_new, g_new
    out.append(x)
  return np.stack(out)


@pytest.mark.parametrize("topo", [T.ring(N), T.one_peer_exponential(N), T.random_pairs(N, seed=3)],
                         ids=lambda t: t.name)
def test_gradient_tracking_is_diging(topo):
  got = trajectory(gj.gradient_tracking(topo, learning_rate=0.1), X0, STEPS)
  np.testing.assert_allclose(got, diging_np(topo, 0.1), rtol=0, atol=1e-12)


def test_exact_diffusion_is_adapt_correct_combine_and_d2():
  topo, lr = T.ring(N), 0.1
  w_bar = 0.5 * (np.eye(N) + topo.matrix())
  got = trajectory(gj.exact_diffusion(topo, learning_rate=lr), X0, STEPS)
  x, psi_old = X0.copy(), X0.copy()
  for k in range(STEPS):  # Yuan et al. 2019: adapt, correct, combine
    psi = x - lr * grad_np(x)
    x, psi_old = w_bar @ (psi + x - psi_old), psi
    np.testing.assert_allclose(got[k], x, atol=1e-12)
  x_prev, x = X0, got[0]
  for k in range(1, STEPS):  # D2's form (Tang et al. 2018)
    x_next = w_bar @ (2 * x - x_prev - lr * (grad_np(x) - grad_np(x_prev)))
    np.testing.assert_allclose(got[k], x_next, atol=1e-12)
    x_prev, x = x, x_next


def test_extra_is_shi_et_al():
  topo, lr = T.ring(N), 0.1
  w = topo.matrix()
  w_tilde = 0.5 * (np.eye(N) + w)
  got = trajectory(gj.extra(topo, learning_rate=lr), X0, STEPS)
  x_prev, x = X0, w @ X0 - lr * grad_np(X0)  # x^1 = W x^0 - lr g^0 (Yuan 2021)
  np.testing.assert_allclose(got[0], x, atol=1e-12)
  for k in range(1, STEPS):
    x_prev, x = x, (np.eye(N) + w) @ x - w_tilde @ x_prev - lr * (grad_np(x) - grad_np(x_prev))
    np.testing.assert_allclose(got[k], x, atol=1e-12)


def test_extra_with_schedule_uses_each_steps_rate():
  topo = T.exponential(N, symmetric=True)
  sched = optax.piecewise_constant_schedule(0.1, {5: 0.5})
  lr = lambda k: float(sched(jnp.asarray(k, jnp.int32)))
  w = topo.matrix()
  got = trajectory(gj.extra(topo, learning_rate=sched), X0, 10)
  x_prev, x = X0, w @ X0 - lr(0) * grad_np(X0)
  for k in range(1, 10):
    x_prev, x = x, (np.eye(N) + w) @ x - 0.5 * (np.eye(N) + w) @ x_prev - (lr(k) * grad_np(x) - lr(k - 1) * grad_np(x_prev))
    np.testing.assert_allclose(got[k], x, atol=1e-12)


def test_qg_dmsgd_is_lin_et_al_algorithm_1():
  topo, lr, beta, mu = T.ring(N), 0.05, 0.9, 0.8
  got = trajectory(gj.qg_dmsgd(topo, beta=beta, learning_rate=lr, mu=mu), X0, STEPS)
  x, m_hat = X0.copy(), np.zeros_like(X0)
  for k in range(STEPS):
    d = grad_np(x) + beta * m_hat
    x_new = topo.matrix() @ (x - lr * d)
    m_hat = mu * m_hat + (1 - mu) * (x - x_new) / lr
    x = x_new
    np.testing.assert_allclose(got[k], x, atol=1e-12)


@pytest.mark.parametrize("every", [1, 3])
def test_easgd_is_zhang_choromanska_lecun(every):
  lr, alpha, beta = 0.05, 0.1, 0.7
  got = trajectory(gj.easgd(learning_rate=lr, alpha=alpha, center_rate=beta, every=every), X0, STEPS)
  x, center = X0.copy(), X0.mean(0)
  for k in range(STEPS):
    g = grad_np(x)
    if k % every == 0:
      x, center = x - lr * g - alpha * (x - center), center + beta * (x.mean(0) - center)
    else:
      x = x - lr * g
    np.testing.assert_allclose(got[k], x, atol=1e-12)


def test_easgd_symmetric_choice_conserves_workers_plus_center():
  alpha = 0.05
  tx = gj.easgd(learning_rate=0.0, alpha=alpha, center_rate=N * alpha)
  x = jnp.asarray(X0)
  state = tx.init(x)
  total = X0.sum(0) + X0.mean(0)
  for _ in range(5):
    u, state = tx.update(jnp.zeros_like(x), state, x)
    x = x + u
    np.testing.assert_allclose(np.asarray(x).sum(0) + np.asarray(state.center)[0], total, atol=1e-12)


def test_periodic_average_after_dpsgd_is_dsgd_pga():
  topo, lr, every = T.ring(N), 0.05, 4
  tx = optax.chain(gj.gossip_sgd(topo, learning_rate=lr), gj.periodic_average(every))
  got = trajectory(tx, X0, STEPS)
  x = X0.copy()
  for k in range(STEPS):
    x = topo.matrix() @ (x - lr * grad_np(x))
    if k % every == every - 1:
      x = np.tile(x.mean(0), (N, 1))
      assert np.ptp(got[k], axis=0).max() < 1e-13
    np.testing.assert_allclose(got[k], x, atol=1e-12)


@pytest.mark.parametrize("topo", [T.ring(N), T.one_peer_exponential(N)], ids=lambda t: t.name)
def test_mix_every_h_is_local_sgd_with_gossip_rounds(topo):
  """gj.mix(W, every=H): H - 1 local steps, then a gossip with W(round); W advances per round."""
  lr, every = 0.05, 3
  got = trajectory(optax.chain(optax.sgd(lr), gj.mix(topo, every=every)), X0, STEPS)
  x = X0.copy()
  for k in range(STEPS):
    x = x - lr * grad_np(x)
    if k % every == every - 1:
      x = topo.matrix(k // every) @ x
    np.testing.assert_allclose(got[k], x, atol=1e-12)


# ---------------------------------------------------------------- known answers on least squares


@pytest.mark.parametrize("make", [
    lambda: gj.gradient_tracking(T.ring(N), learning_rate=0.1),
    lambda: gj.gradient_tracking(T.one_peer_exponential(N), learning_rate=0.2),
    lambda: gj.gradient_tracking(T.random_pairs(N, seed=0), learning_rate=0.2),
    lambda: gj.exact_diffusion(T.ring(N), learning_rate=0.2),
    lambda: gj.extra(T.ring(N), learning_rate=0.2),
], ids=["gradient_tracking-ring", "gradient_tracking-one_peer_exp", "gradient_tracking-random_pairs",
        "exact_diffusion-ring", "extra-ring"])
def test_exact_methods_reach_the_global_minimiser(make):
  x = trajectory(make(), np.zeros((N, D)), 600)[-1]
  np.testing.assert_allclose(x, np.tile(X_STAR, (N, 1)), rtol=0, atol=1e-10)


def test_dpsgd_bias_scales_as_lr_squared():
  """Yuan (2021): full-batch D-SGD's limiting bias is O(lr^2 b^2 / (1 - rho)^2)."""
  topo = T.ring(N)
  b = {lr: bias(limit(gj.gossip_sgd(topo, learning_rate=lr))) for lr in (0.02, 0.01, 0.005)}
  assert b[0.005] > 1e-3  # a real bias, not round-off
  coarse, fine = b[0.02] / b[0.01], b[0.01] / b[0.005]
  assert 3.5 < coarse < 4.5 and 3.5 < fine < 4.5
  assert abs(fine - 4) < abs(coarse - 4)  # and tends to 4 as lr -> 0


def test_momentum_bias_dmsgd_larger_decentlam_and_qg_equal_to_dpsgd():
  """Yuan's bias table: DmSGD amplifies the bias by ~1/(1-beta)^2; DecentLaM and
  QG-DmSGD keep D-PSGD's (their full-batch fixed point is D-PSGD's: x = W(x - lr grad))."""
  topo, lr, beta = T.ring(N), 0.02, 0.9
  dpsgd = bias(limit(gj.gossip_sgd(topo, learning_rate=lr)))
  dmsgd = bias(limit(gj.gossip_sgd(topo, beta=beta, learning_rate=lr)))
  decentlam = bias(limit(gj.decentlam(topo, beta=beta, learning_rate=lr)))
  qg = bias(limit(gj.qg_dmsgd(topo, beta=beta, learning_rate=lr)))
  assert dmsgd > 10 * dpsgd
  # DmSGD's fixed point is D-PSGD's with the effective rate lr / (1 - beta).
  np.testing.assert_allclose(dmsgd, bias(limit(gj.gossip_sgd(topo, learning_rate=lr / (1 - beta)))), rtol=1e-9)
  np.testing.assert_allclose(decentlam, dpsgd, rtol=1e-9)
  np.testing.assert_allclose(qg, dpsgd, rtol=1e-9)


def test_periodic_averaging_and_allreduce_have_no_consensus_error_at_averaging_steps():
  topo = T.ring(N)
  x = trajectory(optax.chain(gj.gossip_sgd(topo, learning_rate=0.02), gj.periodic_average(5)), np.zeros((N, D)), 4000)[-1]
  assert float(gj.consensus_distance(jnp.asarray(x))) < 1e-25
  dpsgd = limit(gj.gossip_sgd(topo, learning_rate=0.02))
  assert bias(x) < 0.5 * bias(dpsgd)  # periodic averaging shrinks the bias on a slow ring


def test_exact_diffusion_and_extra_refuse_time_varying_w():
  for make in (gj.exact_diffusion, gj.extra):
    with pytest.raises(ValueError, match="static W.*gradient_tracking"):
      make(T.one_peer_exponential(N), learning_rate=0.1)


def test_errors_name_the_bad_hyperparameter():
  with pytest.raises(ValueError, match="learning_rate must be non-negative"):
    gj.gradient_tracking(T.ring(N), learning_rate=-0.1)
  with pytest.raises(ValueError, match=r"every must be a positive integer"):
    gj.periodic_average(0)
  with pytest.raises(ValueError, match="alpha"):
    gj.easgd(learning_rate=0.1, alpha=1.5)
  with pytest.raises(ValueError, match="beta"):
    gj.qg_dmsgd(T.ring(N), beta=1.0, learning_rate=0.1)
  with pytest.raises(ValueError, match="needs the current params"):
    tx = gj.extra(T.ring(N), learning_rate=0.1)
    tx.update(jnp.zeros((N, D)), tx.init(jnp.zeros((N, D))))
