"""Per-node work runs where the nodes live: ``backend.map``, ``gj.per_node``, and what crosses devices.

A full training step (a CNN's gradients through ``backend.map``, a ``per_node`` clip, the
algorithm's update) compiled for 8 sharded CPU devices holds only the mixing's
collective-permutes, and each device does about 1/8 of the simulated step's FLOPs.
"""

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj
from gossipjax.train import CNN
from gossipjax import topology as T

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi"))
import backend_cases as cases  # noqa: E402

K = 8  # conftest gives 8 CPU devices
N = 16


@pytest.fixture(scope="module")
def sharded():
  mesh = jax.make_mesh((K,), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,))
  return gj.backend.sharded(mesh)


def _loss(w, x, y):
  return jnp.mean((x @ w - y) ** 2)


def _problem(n=N, d=3, m=5, seed=0):
  rng = np.random.default_rng(seed)
  return rng.normal(size=(n, d)), rng.normal(size=(n, m, d)), rng.normal(size=(n, m))


# ---------------------------------------------------------------------------------------------
# backend.map


def test_map_equals_vmap_on_every_in_process_backend(sharded):
  w, x, y = _problem()
  want = jax.vmap(jax.grad(_loss))(w, x, y)
  for be in (gj.backend.simulate(), sharded):
    got = be.map(jax.grad(_loss))(w, x, y)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
  got = jax.jit(sharded.map(jax.grad(_loss)))(*sharded.shard((w, x, y)))
  assert got.sharding.spec[0] == "nodes"
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_map_broadcasts_in_axes_none(sharded):
  w, x, y = _problem()
  shared_x, shared_y = x[0], y[0]
  want = jax.vmap(jax.grad(_loss), in_axes=(0, None, None))(w, shared_x, shared_y)
  for be in (gj.backend.simulate(), sharded):
    got = be.map(jax.grad(_loss), in_axes=(0, None, None))(w, shared_x, shared_y)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_map_takes_pytree_prefixes_of_in_axes(sharded):
  w, x, y = _problem()
  fn = lambda p, b: _loss(p["w"], b["x"], b["y"])
  want = jax.vmap(fn, in_axes=(0, {"x": 0, "y": None}))({"w": w}, {"x": x, "y": y[0]})
  got = sharded.map(fn, in_axes=(0, {"x": 0, "y": None}))({"w": w}, {"x": x, "y": y[0]})
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_pmapped_map_runs_inside_the_pmap():
  w, x, y = _problem()
  be = gj.backend.pmapped("devices", axis_size=K)
  blocks = lambda a: a.reshape((K, N // K) + a.shape[1:])
  got = jax.pmap(be.map(jax.grad(_loss), num_nodes=N), axis_name="devices")(blocks(w), blocks(x), blocks(y))
  np.testing.assert_allclose(got.reshape(w.shape), jax.vmap(jax.grad(_loss))(w, x, y), rtol=0, atol=1e-12)


def test_map_names_the_leaf_its_shape_and_the_expected_size(sharded):
  w, x, y = _problem()
  f = sharded.map(lambda p, b: _loss(p["w"], b[0], b[1]))
  with pytest.raises(ValueError, match=r"argument 1\[1\] has shape \(8, 5\) but its leading node axis must be 16"):
    f({"w": w}, (x, y[:8]))
  with pytest.raises(ValueError, match=r"argument 0\['w'\] has shape \(12, 3\).*8 devices of mesh axis 'nodes'"):
    f({"w": w[:12]}, (x[:12], y[:12]))
  with pytest.raises(ValueError, match=r"argument 0 has shape \(16, 3\) but its leading node axis must be 32"):
    gj.backend.simulate().map(jax.grad(_loss), num_nodes=32)(w, x, y)
  with pytest.raises(ValueError, match="is a scalar"):
    gj.backend.simulate().map(lambda a, b: a * b)(w, 2.0)
  with pytest.raises(ValueError, match="in_axes has 2 entries but the function got 3"):
    gj.backend.simulate().map(jax.grad(_loss), in_axes=(0, 0))(w, x, y)
  with pytest.raises(ValueError, match="must be 0 .* or None"):
    gj.backend.simulate().map(jax.grad(_loss), in_axes=1)(w, x, y)


# ---------------------------------------------------------------------------------------------
# gj.per_node


def test_per_node_clips_each_node_by_its_own_norm(sharded):
  g = np.ones((N, 4)) * 0.1
  g[3] = 50.0  # one node with a norm of 100
  tx = optax.chain(gj.per_node(optax.clip_by_global_norm(1.0)), gj.gossip_sgd(T.ring(N), beta=0.0, learning_rate=1.0))
  x = np.zeros((N, 4))
  u, _ = tx.update(g, tx.init(x), x)
  # Mixing moves the clipped gradients: compare the gradients the mixing received instead.
  clip = gj.per_node(optax.clip_by_global_norm(1.0))
  clipped, _ = clip.update(g, clip.init(g))
  np.testing.assert_allclose(np.delete(clipped, 3, axis=0), 0.1, rtol=0, atol=1e-15)
  np.testing.assert_allclose(np.linalg.norm(clipped[3]), 1.0, rtol=1e-12)
  bare = optax.clip_by_global_norm(1.0)
  shrunk, _ = bare.update(g, bare.init(g))
  assert np.all(np.delete(shrunk, 3, axis=0) < 0.002)  # bare: one norm over all nodes shrinks every node
  np.testing.assert_allclose(u, -gj.backend.simulate().mixer(T.ring(N)).mix(jnp.asarray(clipped)), atol=1e-12)
  # Sharded: the same numbers, node by node on the device that holds the node.
  clip_sh = gj.per_node(optax.clip_by_global_norm(1.0), backend=sharded)
  gs = sharded.shard(g)
  np.testing.assert_allclose(jax.jit(clip_sh.update)(gs, clip_sh.init(gs))[0], clipped, rtol=0, atol=1e-15)


def test_per_node_keeps_state_per_node():
  """``apply_if_finite`` bare skips every node when one is NaN; per node, only that node."""
  g = np.ones((4, 2))
  g[1, 0] = np.nan
  bare = optax.apply_if_finite(optax.sgd(1.0), max_consecutive_errors=5)
  u, s = bare.update(g, bare.init(g))
  assert np.all(np.asarray(u) == 0) and int(s.total_notfinite) == 1
  tx = gj.per_node(optax.apply_if_finite(optax.sgd(1.0), max_consecutive_errors=5))
  u, s = tx.update(g, tx.init(g))
  np.testing.assert_array_equal(np.asarray(s.total_notfinite), [0, 1, 0, 0])
  np.testing.assert_array_equal(np.asarray(u)[[0, 2, 3]], -1.0)
  assert np.all(np.asarray(u)[1] == 0)


def test_per_node_elementwise_transforms_are_unchanged():
  g = np.random.default_rng(1).normal(size=(4, 3))
  for inner in (optax.adam(0.1), optax.sgd(0.1, momentum=0.9)):
    a, b = gj.per_node(inner), inner
    sa, sb = a.init(g), b.init(g)
    for _ in range(3):
      ua, sa = a.update(g, sa, g)
      ub, sb = b.update(g, sb, g)
    np.testing.assert_allclose(ua, ub, rtol=1e-12, atol=1e-15)


def test_per_node_says_when_a_state_cannot_be_stacked():
  odd = optax.GradientTransformation(lambda p: ("not an array",), lambda u, s, p=None: (u, s))
  with pytest.raises(TypeError, match="gj.per_node: the state of this transform cannot be stacked over nodes"):
    gj.per_node(odd).init(np.zeros((4, 2)))


# ---------------------------------------------------------------------------------------------
# Only the gossip crosses devices

_COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|all-to-all|reduce-scatter|collective-permute)(?:-start)?\(")

# What each algorithm needs beyond its neighbours: allreduce_sgd all-reduces every step by
# definition; periodic_average all-reduces the params every H steps (inside a conditional, so
# the compiled program holds it); easgd all-reduces the nodes to move the centre variable.
GLOBAL_BY_DEFINITION = {"allreduce_sgd": "all-reduce", "periodic_average": "all-reduce", "easgd": "all-reduce"}


def _cnn_step(name, topo, be, grads_with_map=True, conv=gj.layers.conv_general_dilated):
  model = CNN(features=(4,), num_classes=10, conv_general_dilated=conv)
  batch = 4
  x = jnp.zeros((N, batch, 8, 8, 1), jnp.float32)
  y = jnp.zeros((N, batch), jnp.int32)
  params = gj.init_nodes(lambda k: model.init(k, x[0]), jax.random.key(0), N)
  if hasattr(be, "shard"):
    params, x, y = be.shard((params, x, y))
  tx = optax.chain(gj.per_node(optax.clip_by_global_norm(1.0), backend=be), cases.ALGORITHMS[name](topo, be))
  state = tx.init(params)
  loss = lambda p, xb, yb: optax.softmax_cross_entropy_with_integer_labels(model.apply(p, xb), yb).mean()
  grad_fn = be.map(jax.grad(loss)) if grads_with_map else jax.vmap(jax.grad(loss))

  def step(params, state, x, y):
    updates, state = tx.update(grad_fn(params, x, y), state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step).lower(params, state, x, y).compile()


def _collectives(compiled):
  return sorted({m.group(1) for m in _COLLECTIVE.finditer(compiled.as_text())})


def _hlo_cases():
  return [(name, topo) for topo in (T.ring(N), T.one_peer_exponential(N)) for name in cases.ALGORITHMS
          if cases.applies(name, topo)]


@pytest.mark.slow
@pytest.mark.parametrize("name, topo", _hlo_cases(), ids=lambda v: getattr(v, "name", v))
def test_sharded_training_step_only_gossips(sharded, name, topo):
  got = _collectives(_cnn_step(name, topo, sharded))
  if name in GLOBAL_BY_DEFINITION:
    assert got == sorted({GLOBAL_BY_DEFINITION[name]} | ({"collective-permute"} & set(got))), got
  else:
    assert got == ["collective-permute"], f"{name} on {topo.name}: {got}"


@pytest.mark.slow
def test_a_plain_vmap_of_the_cnn_gradient_all_gathers(sharded):
  """Why ``backend.map`` exists: the compiler's own partitioning of the vmapped gradient gathers the batch.

  With XLA's convolution; ``gj.layers``' patches form (its CPU default) is matrix products that it partitions
  without a gather.
  """
  step = _cnn_step("gossip_sgd", T.ring(N), sharded, grads_with_map=False, conv=jax.lax.conv_general_dilated)
  assert "all-gather" in _collectives(step)


@pytest.mark.slow
@pytest.mark.parametrize("name, topo", [("gossip_sgd", T.ring(N)), ("gossip_sgd", T.one_peer_exponential(N)),
                                        ("choco_sgd", T.ring(N))], ids=lambda v: getattr(v, "name", v))
def test_each_device_does_an_eighth_of_the_flops(sharded, name, topo):
  per_device = _cnn_step(name, topo, sharded).cost_analysis()["flops"]
  simulated = _cnn_step(name, topo, gj.backend.simulate()).cost_analysis()["flops"]
  # 1/8 of the model's flops, plus the mixing: a time-varying graph's step-indexed weights
  # are applied outside its exchange branches, which counts a little more than a switch does.
  assert 0.115 < per_device / simulated < 0.16, per_device / simulated
