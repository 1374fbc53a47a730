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


def test_init_nodes_stacks_the_whole_tree_in_one_program_that_later_calls_reuse():
  """The same leaves (values, dtypes, weak types, PRNG keys) as broadcasting ``init_fn(key)`` by hand, copied by one
  compiled program for the tree, not one per leaf, and none at all for a later call on the same shapes."""
  tree = {"w": jnp.arange(21.0, dtype=jnp.float32).reshape(3, 7), "b": jnp.arange(11), "s": 1.5,
          "h": jnp.ones((2, 5), jnp.bfloat16), "key": jax.random.key(3)}
  compiles = []
  listener = lambda event, duration, **kw: compiles.append(event) if event.endswith("backend_compile_duration") else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    p = gj.init_nodes(lambda k: tree, jax.random.key(0), 13)
    first = len(compiles)
    again = gj.init_nodes(lambda k: dict(tree), jax.random.key(1), 13)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert first == 1 and len(compiles) == first
  for stacked in (p, again):
    for name, leaf in tree.items():
      want = jnp.broadcast_to(leaf, (13,) + jnp.shape(leaf))
      assert stacked[name].shape == want.shape and stacked[name].dtype == want.dtype, name
      if name == "key":
        np.testing.assert_array_equal(jax.random.key_data(stacked[name]), jax.random.key_data(want))
      else:
        assert stacked[name].weak_type == want.weak_type, name  # a Python float stays weakly typed
        np.testing.assert_array_equal(np.asarray(stacked[name]), np.asarray(want))


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


def _state_with_rng_and_counters(n=4):
  """What a full ``nnx.state`` of n stacked models holds: params, PRNG keys and integer counters."""
  p = gj.init_nodes(init, jax.random.key(2), n, same_init=False)
  return {"params": p, "rngs": {"key": jax.random.split(jax.random.key(5), n), "count": jnp.arange(n, dtype=jnp.uint32)},
          "step": jnp.full((n,), 7, jnp.int32), "frozen": jnp.ones((n,), bool)}


def test_node_helpers_skip_rng_keys_and_counters_as_mix_does():
  tree = _state_with_rng_and_counters()
  params = tree["params"]
  for f in (gj.consensus_distance, jax.jit(gj.consensus_distance)):
    np.testing.assert_allclose(f(tree), gj.consensus_distance(params), rtol=1e-15)
  mean = gj.node_mean(tree)
  np.testing.assert_allclose(mean["params"]["w"], np.asarray(params["w"]).mean(0), rtol=1e-12)
  assert mean["rngs"]["count"].dtype == jnp.uint32 and int(mean["rngs"]["count"]) == 0  # node 0's counter
  np.testing.assert_array_equal(jax.random.key_data(mean["rngs"]["key"]), jax.random.key_data(tree["rngs"]["key"][0]))
  assert int(mean["step"]) == 7 and bool(mean["frozen"])
  assert gj.nonfinite_nodes(tree).tolist() == []
  tree["params"]["b"] = tree["params"]["b"].at[2, 0].set(jnp.nan)
  assert gj.nonfinite_nodes(tree).tolist() == [2]


def test_node_helpers_name_a_leaf_they_cannot_handle():
  good = {"w": jnp.ones((4, 2))}
  for f in (gj.consensus_distance, gj.node_mean, gj.nonfinite_nodes):
    name = f.__name__
    with pytest.raises(ValueError, match=rf"gj.{name}: leaf \['z'\]\['c'\] has 3 nodes on its leading axis, "
                                         r"leaf \['w'\] has 4"):
      f({**good, "z": {"c": jnp.ones((3, 2))}})
    with pytest.raises(TypeError, match=rf"gj.{name}: leaf \['lr'\] is a float, not an array with a leading node"):
      f({**good, "lr": 0.1})
    with pytest.raises(ValueError, match=rf"gj.{name}: leaf \['t'\] is a scalar of dtype int32"):
      f({**good, "t": jnp.int32(3)})
    with pytest.raises(TypeError, match=rf"gj.{name}: leaf \['s'\] has dtype <U1, which is neither a number nor"):
      f({**good, "s": np.array(["a", "b", "c", "d"])})


def test_consensus_distance_of_16_bit_params_sums_in_float32():
  x = jax.random.normal(jax.random.key(0), (8, 4096), jnp.float32).astype(jnp.bfloat16)
  got = gj.consensus_distance({"w": x})
  assert got.dtype == jnp.float32
  want = np.asarray(x, np.float64)
  np.testing.assert_allclose(got, np.sum((want - want.mean(0)) ** 2) / 8, rtol=1e-5)
  assert gj.node_mean({"w": x})["w"].dtype == jnp.bfloat16


MESH_KINDS = {"explicit": jax.sharding.AxisType.Explicit, "auto": jax.sharding.AxisType.Auto}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("kind", sorted(MESH_KINDS))
def test_node_helpers_on_params_placed_by_the_sharded_backend(kind, jit):
  """jax.make_mesh's default (Explicit axes) and Auto axes: the numbers of the host arrays, the layouts kept."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((4, 2), ("nodes", "model"), axis_types=(MESH_KINDS[kind],) * 2)
  be = gj.backend.sharded(mesh)
  host = _state_with_rng_and_counters(8)
  tree = be.shard(host)
  split = NamedSharding(mesh, P("nodes", None, "model"))  # each node's kernel split over 2 devices
  tree["params"]["w"] = jax.device_put(host["params"]["w"], split)
  wrap = jax.jit if jit else (lambda f: f)
  flat = np.concatenate([np.asarray(host["params"][k]).reshape(8, -1) for k in ("b", "w")], axis=1)
  np.testing.assert_allclose(wrap(gj.consensus_distance)(tree), np.mean(np.sum((flat - flat.mean(0)) ** 2, 1)),
                             rtol=1e-12)
  mean = wrap(gj.node_mean)(tree)
  np.testing.assert_allclose(mean["params"]["w"], np.asarray(host["params"]["w"]).mean(0), rtol=1e-12)
  assert mean["params"]["w"].sharding.spec[:2] == (None, "model")  # node 0's layout on the model axis
  assert int(mean["step"]) == 7 and int(mean["rngs"]["count"]) == 0
  np.testing.assert_array_equal(jax.random.key_data(mean["rngs"]["key"]), jax.random.key_data(host["rngs"]["key"][0]))
  # Nodes that agree: node 0's value exactly, at distance 0 exactly.
  agree = be.shard(jax.tree.map(lambda x: jnp.broadcast_to(x[5], x.shape), host["params"]))
  agree["w"] = jax.device_put(agree["w"], split)
  for name, x in wrap(gj.node_mean)(agree).items():
    np.testing.assert_array_equal(x, host["params"][name][5])
  assert float(wrap(gj.consensus_distance)(agree)) == 0.0
  f = lambda q, x: jnp.sum(x @ q["w"] + q["b"][None])
  x = jnp.ones((7, 3))
  per_node = gj.evaluate_nodes(f, tree["params"], x)
  np.testing.assert_allclose(per_node, gj.evaluate_nodes(f, host["params"], x), rtol=1e-12)
  np.testing.assert_allclose(gj.evaluate_mean(f, tree["params"], x), per_node.mean(), rtol=1e-12)
  assert gj.nonfinite_nodes(tree).tolist() == []
  host["params"]["b"] = host["params"]["b"].at[6, 1].set(jnp.inf)
  with pytest.raises(FloatingPointError, match=r"node\(s\) 6 became NaN/inf at step 3"):
    gj.check_finite(be.shard(host), step=3)
