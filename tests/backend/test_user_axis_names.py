"""A user's own jax.vmap around a gossip step (an ensemble), whatever its axis name: the simulation's numbers or a refusal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gossipjax as gj

N, D = 8, 3
W = gj.topology.ring(N)


def _ensemble(members):
  rng = np.random.default_rng(0)
  return jnp.asarray(rng.normal(size=(members, N, D))), jnp.asarray(rng.normal(size=(members, N, D)))


def _simulated(params, grads):
  tx = gj.gossip_sgd(W, learning_rate=0.1)
  return jax.vmap(lambda p, g: tx.update(g, tx.init(p), p)[0])(params, grads)


@pytest.mark.parametrize("members", [4, 3])  # the device count, and another size
def test_an_ensemble_around_the_sharded_backend(members):
  mesh = jax.make_mesh((4,), ("nodes",))
  be = gj.backend.sharded(mesh)
  tx = gj.gossip_sgd(W, learning_rate=0.1, backend=be)
  want = _simulated(*_ensemble(members))
  on_mesh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "nodes"))  # every member's nodes
  params, grads = jax.device_put(_ensemble(members), on_mesh)
  step = lambda p, g: tx.update(g, tx.init(p), p)[0]
  with pytest.raises(ValueError, match=r"runs inside a mapping over an axis named 'nodes' .* name your axis "
                                       r"otherwise, e\.g\. jax\.vmap\(\.\.\., axis_name='ensemble'\)"):
    jax.vmap(step, axis_name="nodes")(params, grads)
  for call in (jax.vmap(step, axis_name="ensemble"), jax.jit(jax.vmap(step, axis_name="ensemble"))):
    np.testing.assert_allclose(call(params, grads), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("members", [4, 2])  # the device count, and this device's block of nodes
def test_an_ensemble_inside_the_pmapped_backend(members):
  devices = 4
  tx = gj.gossip_sgd(W, learning_rate=0.1, backend=gj.backend.pmapped(axis_size=devices))
  params, grads = _ensemble(members)
  # (devices, members, N / devices, D): each device's block of every member's nodes.
  blocks = lambda x: jnp.moveaxis(x.reshape(members, devices, N // devices, D), 1, 0)
  step = lambda p, g: tx.update(g, tx.init(p), p)[0]
  with pytest.raises(ValueError, match=r"runs inside a jax\.vmap whose axis is named 'devices'.* name your vmap's "
                                       r"axis otherwise"):
    jax.pmap(jax.vmap(step, axis_name="devices"), axis_name="devices", devices=jax.devices()[:devices])(
        blocks(params), blocks(grads))
  got = jax.pmap(jax.vmap(step, axis_name="ensemble"), axis_name="devices", devices=jax.devices()[:devices])(
      blocks(params), blocks(grads))
  got = jnp.moveaxis(got, 0, 1).reshape(members, N, D)
  np.testing.assert_allclose(got, _simulated(params, grads), rtol=0, atol=1e-12)
