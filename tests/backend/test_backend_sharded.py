"""The sharded backend (shard_map + ppermute on 8 CPU devices) equals the simulation, with neighbour-only traffic."""

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import gossipjax as gj
from gossipjax import topology as T

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi"))
import backend_cases as cases  # noqa: E402

K = 8  # conftest gives 8 CPU devices
AUTO = jax.sharding.AxisType.Auto


@pytest.fixture(scope="module")
def backend():
  assert jax.device_count() >= K, "conftest must set --xla_force_host_platform_device_count=8"
  return gj.backend.sharded(jax.make_mesh((K,), ("nodes",), axis_types=(AUTO,)))


def _sharded_trajectory(name, topo, backend, x0, a, b):
  tx = cases.algorithm(name, topo, backend)
  return cases.trajectory(tx, backend.shard(x0), backend.shard(a), backend.shard(b))


@pytest.mark.parametrize("name, topo", cases.cases(16), ids=lambda v: getattr(v, "name", v))
def test_sharded_equals_simulate(backend, name, topo):
  x0, a, b = cases.problem(topo.num_nodes)  # 2 nodes per device
  got = _sharded_trajectory(name, topo, backend, x0, a, b)
  np.testing.assert_allclose(got, cases.reference(name, topo, x0, a, b), rtol=0, atol=1e-12)


def test_64_nodes_on_8_devices_stay_sharded(backend):
  topo = T.exponential(64)
  x0, a, b = cases.problem(64)
  tx = gj.gossip_sgd(topo, beta=0.9, learning_rate=0.05, backend=backend)
  x, state = backend.shard(x0), tx.init(backend.shard(x0))
  step = jax.jit(cases.make_step(tx))
  for _ in range(3):
    x, state = step(x, state, backend.shard(a), backend.shard(b))
  assert x.sharding.is_equivalent_to(backend.sharding, x.ndim)
  assert state[0].trace.sharding.is_equivalent_to(backend.sharding, x.ndim)
  np.testing.assert_allclose(x, cases.reference("gossip_sgd", topo, x0, a, b, steps=3)[-1], rtol=0, atol=1e-12)


def _collectives(hlo: str) -> dict[str, int]:
  ops = re.findall(r"\b(collective-permute|all-gather|all-reduce|all-to-all|reduce-scatter)(?:-start)?\(", hlo)
  return {op: ops.count(op) for op in set(ops)}


@pytest.mark.parametrize(
    "topo, permutes",
    [(T.ring(16), 2), (T.exponential(64), 3), (T.one_peer_exponential(16), 4), (T.torus(4, 4), None)],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_only_neighbour_exchange_in_compiled_program(backend, topo, permutes):
  """The optimizer step compiles to collective-permutes only: no all-gather, no all-reduce."""
  tx = gj.gossip_sgd(topo, beta=0.9, learning_rate=0.1, backend=backend)
  x = backend.shard(np.ones((topo.num_nodes, 4)))
  hlo = jax.jit(lambda x, s: tx.update(x, s, x)).lower(x, tx.init(x)).compile().as_text()
  ops = _collectives(hlo)
  assert set(ops) == {"collective-permute"}, ops
  # One ppermute per device offset of each plan: a ring of 2 nodes per device needs 2, exponential(64)
  # over 8 devices 3 (offsets 1, 2, 4), one-peer exponential 1 per step of its period (4 switch branches).
  expected = permutes if permutes is not None else sum(len(p.exchanges) for p in backend.mixer(topo).plans)
  assert ops["collective-permute"] == expected


def test_a_cyclic_shift_needs_at_most_two_ppermutes_of_only_the_needed_rows():
  from gossipjax.backend._block_plan import compile_plan

  for h in range(1, 16):
    w = np.eye(16) * 0.5
    w[np.arange(16), (np.arange(16) + h) % 16] += 0.5
    (plan,) = T.from_matrix(w).plans()
    bp = compile_plan(plan, 4)  # 4 nodes per device
    assert len(bp.exchanges) <= 2
    # Exactly the rows read across devices travel (h per device for h < 4, the whole block for 4 <= h <= 12).
    crossing = int(np.sum(np.arange(16) // 4 != ((np.arange(16) + h) % 16) // 4))
    assert sum(int(e.count.sum()) for e in bp.exchanges) == crossing == 4 * min(h, 4, 16 - h)


def test_mean_is_a_psum_and_equals_the_average(backend):
  x = np.random.default_rng(0).normal(size=(16, 3))
  got = jax.jit(backend.mean)(backend.shard(x))
  np.testing.assert_allclose(got, np.broadcast_to(x.mean(0), x.shape), rtol=0, atol=1e-14)
  assert "all-gather" not in jax.jit(backend.mean).lower(backend.shard(x)).compile().as_text()


def test_explicit_mesh_under_set_mesh():
  mesh = jax.make_mesh((K,), ("nodes",))  # jax 0.10's default: explicit axes, which need jax.set_mesh
  be = gj.backend.sharded(mesh)
  topo = T.torus(4, 4)
  x0, a, b = cases.problem(16)
  with jax.set_mesh(mesh):
    got = cases.trajectory(cases.algorithm("gossip_sgd", topo, be), be.shard(x0), be.shard(a), be.shard(b), steps=3)
  np.testing.assert_allclose(got, cases.reference("gossip_sgd", topo, x0, a, b, steps=3), rtol=0, atol=1e-12)


def test_two_axis_mesh_mixes_over_the_named_axis():
  mesh = jax.make_mesh((4, 2), ("nodes", "model"), axis_types=(AUTO, AUTO))
  be = gj.backend.sharded(mesh, axis="nodes")
  topo = T.erdos_renyi(12, 0.4, seed=3)
  x = np.random.default_rng(0).normal(size=(12, 2))
  got = jax.jit(lambda x: be.mixer(topo).mix(x))(be.shard(x))
  np.testing.assert_allclose(got, topo.matrix() @ x, rtol=0, atol=1e-13)


def test_inject_hyperparams_treats_the_backend_as_data(backend):
  topo = T.ring(16)
  tx = optax.inject_hyperparams(gj.gossip_sgd)(topology=topo, beta=0.9, learning_rate=0.05, backend=backend)
  x0, a, b = cases.problem(16)
  got = cases.trajectory(tx, backend.shard(x0), backend.shard(a), backend.shard(b), steps=3)
  np.testing.assert_allclose(got, cases.reference("gossip_sgd", topo, x0, a, b, steps=3), rtol=0, atol=1e-12)


def test_nodes_not_divisible_by_devices(backend):
  with pytest.raises(ValueError, match=r"^gj.backend.sharded: ring\(12\) has 12 nodes.*multiple of 8"):
    gj.gossip_sgd(T.ring(12), learning_rate=0.1, backend=backend)


def test_mesh_without_the_axis():
  mesh = jax.make_mesh((K,), ("data",))
  with pytest.raises(ValueError, match=r"no axis named 'nodes'"):
    gj.backend.sharded(mesh)
  with pytest.raises(TypeError, match="Mesh"):
    gj.backend.sharded(jax.devices())


def test_wrong_global_node_axis_names_both_sizes(backend):
  tx = gj.gossip_sgd(T.ring(16), learning_rate=0.1, backend=backend)
  x = backend.shard(jnp.ones((8, 2)))
  with pytest.raises(ValueError, match="expects 16 nodes"):
    tx.update(x, tx.init(x), x)


def test_shard_rejects_an_uneven_leaf(backend):
  with pytest.raises(ValueError, match="multiple"):
    backend.shard(np.ones((12, 2)))
  assert backend.shard(np.ones((16, 2))).sharding.spec == P("nodes")


def _run_example(name, timeout=120):
  """An example's stdout, run as a user runs it: on the devices it asks for, with no setting of ours."""
  import os
  import subprocess

  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
  res = subprocess.run([sys.executable, str(cases.EXAMPLES / name)], env=env, capture_output=True, text=True,
                       timeout=timeout)
  assert res.returncode == 0, res.stderr[-3000:]
  return res.stdout


@pytest.mark.slow
def test_examples_simulate_sharded_pmapped_print_the_same_numbers():
  (want,) = cases.example_numbers(_run_example("simulate.py"))
  for name in ("sharded.py", "pmapped.py"):
    out = _run_example(name)
    assert re.search(rf"\b(on|over) {K} devices", out), out  # the script's own CPU devices, not one
    (got,) = cases.example_numbers(out)
    np.testing.assert_allclose(got, want, rtol=1e-5)


RANK_ONE = [T.star(16), T.star(16, "metropolis"), T.complete(16), T.complete(8)]


@pytest.mark.parametrize("topo", RANK_ONE, ids=lambda t: f"{t.name}-{t.plans()[0].self_weight[-1]:.3f}")
def test_rank_one_topologies_mix_as_their_dense_matrix(backend, topo):
  """Star and complete are rank-one terms: one psum each step, the same numbers as W @ x."""
  x = np.random.default_rng(0).normal(size=(topo.num_nodes, 3))
  mixer = backend.mixer(topo)
  got = jax.jit(lambda x: mixer.mix(x))(backend.shard(x))
  np.testing.assert_allclose(got, topo.matrix() @ x, rtol=0, atol=1e-14)
  sim = gj.backend.simulate().mixer(topo).mix(jnp.asarray(x))
  np.testing.assert_allclose(sim, topo.matrix() @ x, rtol=0, atol=1e-14)
  ops = _collectives(jax.jit(lambda x: mixer.mix(x)).lower(backend.shard(x)).compile().as_text())
  assert ops == {"all-reduce": 1}, ops  # no exchange round per leaf: one all-reduce for all terms
  if np.allclose(topo.matrix().sum(axis=0), 1):  # gossip_sgd needs a doubly stochastic W (not a uniform star)
    x0, a, b = cases.problem(topo.num_nodes)
    got = _sharded_trajectory("gossip_sgd", topo, backend, x0, a, b)
    np.testing.assert_allclose(got, cases.reference("gossip_sgd", topo, x0, a, b), rtol=0, atol=1e-12)


@pytest.mark.parametrize("topo", [T.ring(16), T.complete(16)], ids=lambda t: t.name)
def test_integer_leaves_pass_through_as_in_the_simulation(backend, topo):
  """One rule on every backend: float leaves are mixed, an integer counter is left alone."""
  tree = {"w": np.random.default_rng(0).normal(size=(16, 3)), "count": np.arange(16, dtype=np.int32) * 7}
  mixer = backend.mixer(topo)
  got = jax.jit(lambda t: mixer.mix(t))(backend.shard(tree))
  sim = gj.backend.simulate().mixer(topo).mix(jax.tree.map(jnp.asarray, tree))
  np.testing.assert_array_equal(got["count"], tree["count"])
  np.testing.assert_array_equal(sim["count"], tree["count"])
  np.testing.assert_allclose(got["w"], topo.matrix() @ tree["w"], rtol=0, atol=1e-14)
