"""Node-stacked Equinox modules train through gj.chain, as docs/guides/equinox.md shows."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj

N, LR = 4, 0.1


def loss(model, x, y):
  return jnp.mean((jax.vmap(model)(x) - y) ** 2)


@pytest.fixture(scope="module")
def problem():
  models = eqx.filter_vmap(lambda k: eqx.nn.MLP(3, 2, width_size=5, depth=1, key=k))(
      jax.random.split(jax.random.key(0), N))
  x = jax.random.normal(jax.random.key(1), (N, 6, 3))
  y = jax.random.normal(jax.random.key(2), (N, 6, 2))
  return models, x, y


def _expected(models, grads, w):
  """x+ = W (x - lr g), leaf by leaf, with the dense W."""
  params = eqx.filter(models, eqx.is_inexact_array)
  return jax.tree.map(lambda p, g: np.einsum("ij,j...->i...", w, np.asarray(p) - LR * np.asarray(g)), params, grads)


def test_a_gossip_step_on_stacked_modules_is_w_times_the_local_step(problem):
  models, x, y = problem
  topology = gj.topology.ring(N)
  tx = gj.chain(optax.sgd(LR), gj.mix(topology))
  params = eqx.filter(models, eqx.is_inexact_array)
  grads = eqx.filter_vmap(eqx.filter_grad(loss))(models, x, y)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  stepped = eqx.apply_updates(models, updates)
  assert stepped.activation is models.activation  # what is not an array is left alone
  got = eqx.filter(stepped, eqx.is_inexact_array)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14), got,
               _expected(models, grads, topology.matrix(0)))


@pytest.mark.parametrize("kind", ["simulate", "sharded"])
def test_the_partitioned_form_through_backend_map_gives_the_same_step(problem, kind):
  models, x, y = problem
  topology = gj.topology.ring(N)
  mesh = jax.make_mesh((N,), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:N])
  backend = gj.backend.simulate() if kind == "simulate" else gj.backend.sharded(mesh)
  params, static = eqx.partition(models, eqx.is_inexact_array)
  batch = (x, y)
  if kind == "sharded":
    params, batch = backend.shard((params, batch))
  tx = gj.chain(optax.sgd(LR), gj.mix(topology, backend=backend), backend=backend)
  grad_fn = backend.map(jax.grad(lambda p, x, y: loss(eqx.combine(p, static), x, y)))

  @jax.jit
  def step(params, state, x, y):
    updates, state = tx.update(grad_fn(params, x, y), state, params)
    return optax.apply_updates(params, updates)

  got = step(params, tx.init(params), *batch)
  grads = eqx.filter_vmap(eqx.filter_grad(loss))(models, x, y)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14), got,
               _expected(models, grads, topology.matrix(0)))
