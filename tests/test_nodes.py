import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gossipjax as gj


def init(k):
  k1, k2 = jax.random.split(k)
  return {"w": jax.random.normal(k1, (3, 2)), "b": jax.random.normal(k2, (2,))}


def test_init_nodes_same_and_independent():
  same = gj.init_nodes(init, jax.random.key(0), 5)
  assert same["w"].shape == (5, 3, 2) and float(gj.consensus_distance(same)) == 0.0
  indep = gj.init_nodes(init, jax.random.key(0), 5, same_init=False)
  assert float(gj.consensus_distance(indep)) > 0
  assert not np.allclose(indep["w"][0], indep["w"][1])
  with pytest.raises(ValueError, match="positive integer"):
    gj.init_nodes(init, jax.random.key(0), 0)


def test_consensus_distance_and_node_mean_match_numpy():
  p = gj.init_nodes(init, jax.random.key(1), 6, same_init=False)
  flat = np.concatenate([np.asarray(p["b"]).reshape(6, -1), np.asarray(p["w"]).reshape(6, -1)], axis=1)
  want = np.mean(np.sum((flat - flat.mean(0)) ** 2, axis=1))
  np.testing.assert_allclose(gj.consensus_distance(p), want, rtol=1e-12)
  np.testing.assert_allclose(gj.node_mean(p)["w"], np.asarray(p["w"]).mean(0), rtol=1e-12)


def test_check_finite_names_node_and_step():
  p = gj.init_nodes(init, jax.random.key(0), 6)
  gj.check_finite(p, step=3)
  p["w"] = p["w"].at[4, 1, 0].set(jnp.nan)
  p["b"] = p["b"].at[1, 0].set(jnp.inf)
  assert gj.nonfinite_nodes(p).tolist() == [1, 4]
  with pytest.raises(FloatingPointError, match=r"node\(s\) 1, 4 became NaN/inf at step 17"):
    gj.check_finite(p, step=17)


def test_evaluate_nodes_and_mean():
  p = gj.init_nodes(init, jax.random.key(0), 4, same_init=False)
  f = lambda q, x: jnp.sum(x @ q["w"] + q["b"][None])
  x = jnp.ones((7, 3))
  per_node = gj.evaluate_nodes(f, p, x)
  assert per_node.shape == (4,)
  np.testing.assert_allclose(per_node[2], f(jax.tree.map(lambda a: a[2], p), x), rtol=1e-12)
  np.testing.assert_allclose(gj.evaluate_mean(f, p, x), per_node.mean(), rtol=1e-12)  # f is affine in q
