"""The all-reduce mean scales before it sums: nodes at 1e38 (a finite mean) stay finite on every backend."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj

# The largest values of each dtype (near its max), and the rounding a sum of n terms of it may add.
BIG = {"f32": (jnp.float32, 1e38, 1e-6), "bf16": (jnp.bfloat16, 3e38, 1e-2), "f16": (jnp.float16, 6e4, 1e-3)}


def _backends():
  k = len(jax.devices())
  return {
      "simulate": gj.backend.simulate(),
      "sharded": gj.backend.sharded(jax.make_mesh((k,), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,))),
      "hierarchical": gj.backend.hierarchical(2),
  }


def _big_tree(n):
  return {name: jnp.full((n, 3), value, dtype) for name, (dtype, value, _) in BIG.items()}


def _check_mean(got, tree):
  for name, (_, _, rtol) in BIG.items():
    assert got[name].dtype == tree[name].dtype
    np.testing.assert_allclose(np.asarray(got[name], np.float32), np.asarray(tree[name], np.float32), rtol=rtol,
                               err_msg=name)


def _place(be, tree):
  return be.shard(tree) if hasattr(be, "shard") else tree


@pytest.mark.parametrize("name", ["simulate", "sharded", "hierarchical"])
def test_mean_of_nodes_at_the_largest_values_is_finite(name):
  be = _backends()[name]
  tree = _big_tree(16)
  _check_mean(jax.jit(be.mean)(_place(be, tree)), tree)


def test_pmapped_mean_of_nodes_at_the_largest_values_is_finite():
  k = len(jax.devices())
  be = gj.backend.pmapped("devices")
  tree = jax.tree.map(lambda x: x.reshape((k, 2) + x.shape[1:]), _big_tree(2 * k))
  _check_mean(jax.pmap(be.mean, axis_name="devices")(tree), tree)


def test_the_mean_is_still_the_mean():
  x = jnp.arange(24.0, dtype=jnp.float32).reshape(8, 3)
  for name, be in _backends().items():
    np.testing.assert_allclose(be.mean(_place(be, x)), np.broadcast_to(x.mean(0), x.shape), rtol=1e-6, err_msg=name)


METHODS = {
    "diloco": lambda be: gj.diloco(optax.sgd(0.1), inner_steps=2, backend=be),
    "periodic_average": lambda be: gj.periodic_average(2, backend=be),
    "easgd": lambda be: gj.easgd(learning_rate=0.1, every=1, backend=be),
}


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("name", ["simulate", "sharded"])
def test_methods_that_average_keep_nodes_at_1e38_finite(method, name):
  """Zero gradients on nodes that agree at 1e38: every step leaves them where they are."""
  be = _backends()[name]
  tx = METHODS[method](be)
  x = _place(be, jnp.full((8, 3), 1e38, jnp.float32))
  state = tx.init(x)
  step = jax.jit(tx.update)
  for _ in range(4):
    updates, state = step(jnp.zeros_like(x), state, x)
    x = jnp.asarray(optax.apply_updates(x, updates))
  assert bool(jnp.isfinite(x).all()), (method, name, x)
  np.testing.assert_allclose(np.asarray(x), np.float32(1e38), rtol=1e-6)
