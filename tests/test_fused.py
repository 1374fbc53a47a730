"""gj.gossip_sgd_step: the fused in-place DmSGD step equals gj.gossip_sgd + optax.apply_updates."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj
from gossipjax import _native

N = 8


def _params(dtype=jnp.float32):
  k = jax.random.key(0)
  return {"w": jax.random.normal(k, (N, 5, 3), dtype), "b": jax.random.normal(jax.random.fold_in(k, 1), (N, 4), dtype)}


def _grads(x, k):
  return jax.tree.map(lambda v: jnp.sin(v * (k + 1)) + 0.1 * k, x)


def _run_both(topology, steps=5, beta=0.9, learning_rate=0.1, dtype=jnp.float32, **kw):
  """The fused step and the optax transform from the same params, on the same gradients."""
  step = gj.gossip_sgd_step(topology, beta=beta, learning_rate=learning_rate, **kw)
  tx = gj.gossip_sgd(topology, beta=beta, learning_rate=learning_rate)
  x = xr = _params(dtype)
  state, tstate = step.init(x), tx.init(xr)
  f = jax.jit(step, donate_argnums=(0, 1))
  for k in range(steps):
    g = _grads(xr, k)
    updates, tstate = tx.update(g, tstate, xr)
    xr = optax.apply_updates(xr, updates)
    x, state = f(x, state, g)
  return step, x, xr, state


def test_native_kernel_builds_here():
  """This machine has a C++ compiler, so the kernel must build; a failure names its reason."""
  assert shutil.which("c++") or shutil.which("g++")
  status = _native.load()
  assert status.available, status.reason


@pytest.mark.parametrize("topology", [gj.topology.ring(N), gj.topology.exponential(N),
                                      gj.topology.exponential(N, symmetric=True)], ids=lambda t: t.name)
def test_native_step_equals_gossip_sgd(topology):
  step, x, xr, state = _run_both(topology, learning_rate=optax.linear_schedule(0.1, 0.02, 4))
  assert step.native_status().available
  assert int(state.count) == 5
  for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(xr)):
    assert a.dtype == jnp.float32
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert abs(float(jnp.mean(x["w"])) - float(jnp.mean(_params()["w"]))) > 1e-3  # it moved


def test_native_step_is_the_custom_call():
  step = gj.gossip_sgd_step(gj.topology.ring(N))
  x = _params()
  hlo = jax.jit(step, donate_argnums=(0, 1)).lower(x, step.init(x), x).as_text()
  assert hlo.count(_native.TARGET) == 2  # one call per leaf
  hlo_jax = jax.jit(gj.gossip_sgd_step(gj.topology.ring(N), native=False)).lower(x, step.init(x), x).as_text()
  assert _native.TARGET not in hlo_jax


def test_native_step_writes_in_place_when_donated():
  step = gj.gossip_sgd_step(gj.topology.ring(N))
  x = jnp.ones((N, 1 << 12), jnp.float32)
  state = step.init(x)
  px, pm = x.unsafe_buffer_pointer(), state.momentum.unsafe_buffer_pointer()
  x, state = jax.jit(step, donate_argnums=(0, 1))(x, state, jnp.ones_like(x))
  assert x.unsafe_buffer_pointer() == px and state.momentum.unsafe_buffer_pointer() == pm
  np.testing.assert_allclose(x, 0.9)  # W (1 - 0.1 * 1) on a consensus


@pytest.mark.parametrize("topology", [gj.topology.one_peer_exponential(N), gj.topology.one_peer_exponential(12),
                                      gj.topology.one_peer_directed_exponential(N)], ids=lambda t: t.name)
def test_native_step_on_time_varying_circulant_graphs(topology):
  """The step count picks W(k) inside the kernel: over two periods it walks the same W(k) as gj.gossip_sgd."""
  n = topology.num_nodes
  step = gj.gossip_sgd_step(topology, beta=0.9, learning_rate=0.1, native=True)
  tx = gj.gossip_sgd(topology, beta=0.9, learning_rate=0.1)
  x = xr = jax.random.normal(jax.random.key(n), (n, 6), jnp.float32)
  state, tstate = step.init(x), tx.init(xr)
  f = jax.jit(step, donate_argnums=(0, 1))
  for k in range(2 * topology.period + 1):
    g = _grads(xr, k)
    updates, tstate = tx.update(g, tstate, xr)
    xr = optax.apply_updates(xr, updates)
    x, state = f(x, state, g)
    np.testing.assert_allclose(x, xr, rtol=1e-5, atol=1e-6, err_msg=f"step {k}")
  assert f._cache_size() == 1


@pytest.mark.parametrize("topology", [gj.topology.torus(2, 4), gj.topology.random_pairs(N, seed=3)],
                         ids=lambda t: t.name)
def test_other_graphs_run_the_jax_step(topology):
  step, x, xr, _ = _run_both(topology, steps=6)
  assert not step.native_status().available
  for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(xr)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_float64_and_dpsgd_run_the_jax_step():
  _, x, xr, _ = _run_both(gj.topology.ring(N), beta=0.0, dtype=jnp.float64)
  for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(xr)):
    assert a.dtype == jnp.float64
    np.testing.assert_allclose(a, b, rtol=1e-12)


def test_native_true_says_why_it_cannot():
  step = gj.gossip_sgd_step(gj.topology.torus(2, 4), native=True)
  x = _params()
  with pytest.raises(RuntimeError, match="not a circulant graph"):
    step(x, step.init(x), x)


def test_bad_input_is_named():
  step = gj.gossip_sgd_step(gj.topology.ring(N))
  with pytest.raises(ValueError, match=r"\['w'\].*leading node axis of 4.*expects 8"):
    step.init({"w": jnp.ones((4, 3))})
  with pytest.raises(ValueError, match="block"):
    gj.gossip_sgd_step(gj.topology.ring(N), block=0)
  with pytest.raises(ValueError, match="doubly stochastic|column"):
    gj.gossip_sgd_step(np.array([[0.5, 0.5], [0.9, 0.1]]))


def test_a_failed_build_says_why(tmp_path, monkeypatch):
  monkeypatch.setenv("GOSSIPJAX_CACHE_DIR", str(tmp_path))
  assert "failed" in _native.build("false")
  assert "failed" in _native.build(str(tmp_path / "no-such-compiler"))
  assert not list(tmp_path.glob("*.so"))


@pytest.mark.parametrize("block", [1, 4, 7, 1024])
def test_native_blocks_that_do_not_divide_the_columns(block):
  """15 columns per node in blocks of 1, 4, 7 or 1024: the last block is partial or the only one."""
  step, x, xr, _ = _run_both(gj.topology.exponential(N), steps=3, block=block)
  assert step.native_status().available
  for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(xr)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_native_step_on_two_nodes_and_a_vector_leaf():
  step = gj.gossip_sgd_step(gj.topology.ring(4), beta=0.5, learning_rate=0.2)
  x = jnp.arange(4.0, dtype=jnp.float32)  # one float per node: a (4,) leaf
  g = jnp.array([1.0, -1.0, 2.0, 0.0], jnp.float32)
  out, state = jax.jit(step)(x, step.init(x), g)
  y = np.asarray(x) - 0.2 * np.asarray(g)
  w = gj.topology.ring(4).matrix()
  np.testing.assert_allclose(out, w @ y, rtol=1e-6)
  np.testing.assert_allclose(state.momentum, g)


def _stride_ring(n, s, both=True):
  """W(0) = 1/2 I + 0.3 P^s + 0.2 P^-s, or 0.7 I + 0.3 P^s with both=False: rings along the cycles of i -> i + s.

  Such a W is disconnected when s and n share a factor (it is a round of a time-varying graph, as in the
  one-peer exponential graph), so W(1) is the ring, which connects the nodes over the period.
  """
  eye = np.eye(n)
  p, q = np.roll(eye, s, axis=1), np.roll(eye, -s, axis=1)
  w = 0.5 * eye + 0.3 * p + 0.2 * q if both else 0.7 * eye + 0.3 * p
  return gj.topology.Topology(np.stack([w, gj.topology.ring(n).matrix()]),
                              name=f"stride_ring({n}, {s}{'' if both else ', one way'})")


@pytest.mark.parametrize("topology", [
    gj.topology.ring(2), gj.topology.ring(3), gj.topology.ring(5), gj.topology.ring(7), gj.topology.ring(64),
    gj.topology.exponential(5),
    gj.topology.exponential(64), gj.topology.exponential(33, symmetric=True),
    gj.topology.directed_exponential(16), gj.topology.complete(12),
    # rings along cycles of stride s (shifts -s, 0, +s): cycles of 4 rows, of 3, of 2 (s = n/2), of 5
    _stride_ring(12, 3), _stride_ring(12, 4), _stride_ring(12, 6), _stride_ring(10, 4),
    _stride_ring(9, 2, both=False), _stride_ring(64, 32, both=False), _stride_ring(64, -8, both=False),
], ids=lambda t: t.name)
@pytest.mark.parametrize("block", [None, 3])
def test_native_step_on_circulant_graphs_against_numpy(topology, block):
  """Every circulant graph, any shift direction, more shifts than one pass takes (complete(12): 11); W(0)."""
  n = topology.num_nodes
  step = gj.gossip_sgd_step(topology, beta=0.8, learning_rate=0.05, native=True, block=block)
  rng = np.random.default_rng(n)
  x, m, g = (rng.standard_normal((n, 37)).astype(np.float32) for _ in range(3))
  state = step.init(jnp.asarray(x))._replace(momentum=jnp.asarray(m))
  out, state = jax.jit(step, donate_argnums=(0, 1))(jnp.asarray(x), state, jnp.asarray(g))
  m_new = 0.8 * m.astype(np.float64) + g
  np.testing.assert_allclose(state.momentum, m_new, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(out, topology.matrix() @ (x - 0.05 * m_new), rtol=1e-5, atol=1e-5)
