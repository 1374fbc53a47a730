"""One place to choose the backend: a ``gj.backend.use`` block, a protocol of one's own, and a warning on a mismatch."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj
from gossipjax import topology as T

K = 8


@pytest.fixture(scope="module")
def sharded():
  return gj.backend.sharded(jax.make_mesh((K,), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,)))


def test_transforms_built_in_a_use_block_take_its_backend(sharded):
  with gj.backend.use(sharded):
    tx = gj.chain(optax.clip_by_global_norm(1.0), gj.gossip_sgd(T.ring(16), beta=0.9, learning_rate=0.1))
    assert gj.mixing.resolve_backend(None) is sharded
  assert gj.mixing.resolve_backend(None) == gj.backend.simulate()  # the block is over
  x = sharded.shard(np.random.default_rng(0).normal(size=(16, 3)))
  text = jax.jit(lambda p, s: tx.update(p, s, p)).lower(x, tx.init(x)).compile().as_text()
  assert "collective-permute" in text and "all-reduce" not in text and "all-gather" not in text
  with gj.backend.use(sharded):  # an explicit backend= still wins
    assert gj.mixing.make_mixer(T.ring(4), gj.backend.simulate()).stacked.__class__.__name__ == "SimulateMixer"


@dataclasses.dataclass(frozen=True)
class Halving:
  """A backend of one's own: every node in this process, W applied as the simulation does, means halved."""

  def mixer(self, topology):
    return gj.backend.simulate().mixer(topology)

  def mean(self, tree):
    return gj.backend.simulate().mean(tree)

  def local_nodes(self, num_nodes):
    return num_nodes

  def map(self, fn, in_axes=0, num_nodes=None):
    return jax.vmap(fn, in_axes=in_axes)


def test_a_class_with_the_four_methods_is_a_backend_and_anything_else_is_refused():
  assert isinstance(Halving(), gj.backend.Backend)
  tx = gj.gossip_sgd(T.ring(4), learning_rate=0.1, backend=Halving())
  x = jnp.arange(4.0)[:, None]
  u, _ = tx.update(jnp.zeros_like(x), tx.init(x), x)
  np.testing.assert_allclose(x + u, T.ring(4).matrix() @ np.arange(4.0)[:, None])
  with pytest.raises(TypeError, match=r"^gj: backend=.* is not a backend"):
    gj.gossip_sgd(T.ring(4), learning_rate=0.1, backend="sharded")
  with pytest.raises(TypeError, match=r"^gj.backend.use: .* is not a backend"):
    with gj.backend.use(jax.make_mesh((K,), ("nodes",))):
      pass


BUILT_FOR_THE_SIMULATION = {
    "gossip_sgd": lambda: gj.gossip_sgd(T.ring(16), beta=0.9, learning_rate=0.1),
    "chain_mix": lambda: gj.chain(optax.adam(0.1), gj.mix(T.one_peer_exponential(16))),
    "diloco": lambda: gj.diloco(optax.adam(0.1), inner_steps=2),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("name", sorted(BUILT_FOR_THE_SIMULATION))
def test_a_transform_built_for_the_simulation_gives_its_numbers_on_sharded_params(name, kind, jit):
  """No backend=, params placed by the sharded backend on jax.make_mesh's default (Explicit) or an Auto mesh."""
  axis_type = jax.sharding.AxisType.Explicit if kind == "explicit" else jax.sharding.AxisType.Auto
  be = gj.backend.sharded(jax.make_mesh((K,), ("nodes",), axis_types=(axis_type,)))
  tx = BUILT_FOR_THE_SIMULATION[name]()
  host = np.random.default_rng(0).normal(size=(16, 3))
  target = np.arange(48.0).reshape(16, 3) / 48

  def run(x, update):
    state = tx.init(x)
    for _ in range(4):
      u, state = update(x - target, state, x)
      x = optax.apply_updates(x, u)
    return x

  want = run(jnp.asarray(host), tx.update)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the gossip warns where it sees the placement (next test)
    got = run(be.shard(host), jax.jit(tx.update) if jit else tx.update)
  np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
  assert got.sharding.spec[0] == "nodes"


@pytest.mark.parametrize("kind, jit", [("explicit", True), ("explicit", False), ("auto", False)])
def test_sharded_params_in_a_transform_built_for_the_simulation_warn_with_the_fix(kind, jit):
  axis_type = jax.sharding.AxisType.Explicit if kind == "explicit" else jax.sharding.AxisType.Auto
  be = gj.backend.sharded(jax.make_mesh((K,), ("nodes",), axis_types=(axis_type,)))
  tx = gj.gossip_sgd(T.ring(16), learning_rate=0.1)  # no backend=
  x = be.shard(np.ones((16, 3)))
  with pytest.warns(UserWarning, match=r"sharded over mesh axis 'nodes'.*backend=gj.backend.sharded"):
    (jax.jit(tx.update) if jit else tx.update)(x, tx.init(x), x)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    tx.update(np.ones((16, 3)), tx.init(np.ones((16, 3))), np.ones((16, 3)))  # host arrays: no warning


def test_shard_places_typed_prng_keys_with_the_params(sharded):
  keys = jax.random.split(jax.random.key(0), 16)
  placed = sharded.shard({"w": np.ones((16, 2)), "rngs": keys})
  assert placed["rngs"].sharding.is_equivalent_to(sharded.sharding, 1)
  np.testing.assert_array_equal(jax.random.key_data(placed["rngs"]), jax.random.key_data(keys))


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_follow_placement_places_traced_arrays_on_either_mesh_kind(kind):
  """What an init or update traced next to placed params does (gj.streaming_diloco's averages, called eagerly)."""
  axis_type = jax.sharding.AxisType.Explicit if kind == "explicit" else jax.sharding.AxisType.Auto
  be = gj.backend.sharded(jax.make_mesh((K,), ("nodes",), axis_types=(axis_type,)))
  params = be.shard(np.ones((16, 3)))
  with jax.set_mesh(be.mesh):  # JAX's own rule for a jit on an Explicit mesh that makes new arrays
    placed = jax.jit(lambda y: 2 * gj.mixing.follow_placement(y, params))(jnp.arange(16.0))
  assert placed.sharding.spec[0] == "nodes" and placed.tolist() == list(range(0, 32, 2))
