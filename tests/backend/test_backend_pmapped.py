"""The pmapped backend (transforms inside jax.pmap on 8 CPU devices) equals the simulation."""

import re
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import gossipjax as gj
from gossipjax import topology as T

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi"))
import backend_cases as cases  # noqa: E402

K = 8


def blocks(x):
  """(n, ...) -> (K, n / K, ...): device d gets nodes d*B ... d*B + B - 1."""
  return np.asarray(x).reshape((K, -1) + np.shape(x)[1:])


def pmapped_trajectory(name, topo, x0, a, b, steps=cases.STEPS):
  tx = cases.algorithm(name, topo, gj.backend.pmapped("devices"))
  got = cases.trajectory(tx, blocks(x0), blocks(a), blocks(b), steps, wrap=lambda f: jax.pmap(f, axis_name="devices"))
  return got.reshape((steps,) + x0.shape)


CASES = [
    ("gossip_sgd", T.ring(8)),  # one node per device
    ("mix", T.one_peer_exponential(16)),  # time-varying, 2 nodes per device
    ("gossip_sgd", T.one_peer_exponential(16)),
    ("decentlam", T.torus(4, 4)),
    ("gossip_sgd", T.erdos_renyi(16, 0.4, seed=1)),
    ("allreduce_sgd", T.ring(16)),
    ("gradient_tracking", T.one_peer_exponential(16)),
    ("extra", T.torus(4, 4)),
    ("sgp", T.erdos_renyi(16, 0.4, seed=1)),
    ("choco_sgd", T.ring(8)),
    ("choco_sgd_random_k", T.ring(16)),  # 2 nodes per device: keys must follow the global node index
    ("choco_sgd_random_k", T.one_peer_exponential(16)),  # time-varying: the union graph's rounds, mixed at once
    ("easgd", T.ring(16)),
    ("gossip_sgd", T.random_pairs(32, period=256)),  # 4 nodes per device, a long period: the fixed exchanges
]


@pytest.mark.parametrize("name, topo", CASES, ids=lambda v: getattr(v, "name", v))
def test_pmapped_equals_simulate(name, topo):
  assert jax.device_count() >= K
  x0, a, b = cases.problem(topo.num_nodes)
  got = pmapped_trajectory(name, topo, x0, a, b)
  np.testing.assert_allclose(got, cases.reference(name, topo, x0, a, b), rtol=0, atol=1e-12)


def test_pmapped_compiles_to_ppermutes_only():
  topo = T.exponential(32)  # 4 nodes per device; node i reads i - 1, i - 2, i - 4, i - 8, i - 16
  tx = gj.gossip_sgd(topo, beta=0.9, learning_rate=0.1, backend=gj.backend.pmapped("devices"))
  x = blocks(np.ones((32, 3)))
  f = jax.pmap(lambda x, s: tx.update(x, s, x), axis_name="devices")
  hlo = f.lower(x, jax.pmap(tx.init)(x)).compile().as_text()
  ops = re.findall(r"\b(collective-permute|all-gather|all-reduce|all-to-all)(?:-start)?\(", hlo)
  plan = gj.backend.pmapped("devices").mixer(topo).plans[0]
  # Shifts 1, 2 and 4 all read from the previous device (offset 7), 8 from offset 6, 16 from offset 4:
  # one exchange per device offset, each a full cyclic permutation of the 8 devices.
  offsets = sorted({(t - s) % 8 for e in plan.exchanges for s, t in e.pairs})
  assert offsets == [4, 6, 7] and all(len({(t - s) % 8 for s, t in e.pairs}) == 1 for e in plan.exchanges)
  assert set(ops) == {"collective-permute"} and len(ops) == 3


def test_pmapped_local_nodes_and_errors():
  be = gj.backend.pmapped("devices")
  assert be.local_nodes(16) == 2 and be.mixer(T.ring(16)).local_nodes == 2
  with pytest.raises(ValueError, match=r"ring\(12\) has 12 nodes.*multiple of 8"):
    gj.gossip_sgd(T.ring(12), learning_rate=0.1, backend=be)
  tx = gj.mix(T.ring(16), backend=gj.backend.pmapped("devices", axis_size=4))
  x = np.ones((K, 4, 2))  # the pmap runs over 8 devices, the backend was told 4
  with pytest.raises(ValueError, match=r"has 8 devices but the backend was built for 4"):
    jax.pmap(lambda x: tx.update(x, tx.init(x), x), axis_name="devices")(x)
  tx = gj.mix(T.ring(16), backend=be)
  with pytest.raises(ValueError, match="expects 2 nodes"):
    jax.pmap(lambda x: tx.update(x, tx.init(x), x), axis_name="devices")(np.ones((K, 3, 2)))


@pytest.mark.parametrize("topo", [T.star(16, "metropolis"), T.complete(16)], ids=lambda t: t.name)
def test_rank_one_topologies_mix_as_their_dense_matrix(topo):
  x = np.random.default_rng(0).normal(size=(16, 3))
  mixer = gj.backend.pmapped("devices").mixer(topo)
  got = jax.pmap(lambda x: mixer.mix(x), axis_name="devices")(blocks(x))
  np.testing.assert_allclose(np.asarray(got).reshape(x.shape), topo.matrix() @ x, rtol=0, atol=1e-14)


def test_integer_leaves_pass_through_as_in_the_simulation():
  """One rule on every backend: float leaves are mixed, an integer counter is left alone."""
  topo = T.ring(16)
  tree = {"w": np.random.default_rng(0).normal(size=(16, 3)), "count": np.arange(16, dtype=np.int32) * 7}
  mixer = gj.backend.pmapped("devices").mixer(topo)
  got = jax.pmap(lambda t: mixer.mix(t), axis_name="devices")(jax.tree.map(blocks, tree))
  np.testing.assert_array_equal(np.asarray(got["count"]).ravel(), tree["count"])
  np.testing.assert_allclose(np.asarray(got["w"]).reshape(16, 3), topo.matrix() @ tree["w"], rtol=0, atol=1e-14)


def test_the_pmap_axis_is_not_named_nodes_and_gj_chain_gives_the_mean_and_the_mix():
  """The pmap axis runs over devices: the name "nodes" is refused, so no collective over it can mean a subset.

  Inside gj.chain the node axis has no string name; the mean over all nodes is gj.node_mean,
  and the mean and the mix of 8 nodes on 4 devices, 2 a device, equal the dense reference.
  """
  import jax.numpy as jnp
  import optax

  for make in (lambda: gj.backend.pmapped("nodes"), lambda: gj.backend.Pmapped(axis_name="nodes")):
    with pytest.raises(ValueError, match=r"may not be named 'nodes'.*gj\.backend\.pmapped\('devices'\)"):
      make()
  x = np.random.default_rng(0).normal(size=(4, 2, 1)).astype(np.float32)  # (device, node of the block, param)
  flat = x.reshape(8)
  be = gj.backend.pmapped(axis_size=4)
  assert be.axis_name == "devices"
  # A user's transform that moves each node to the mean over all nodes: x + (mean - x).
  mean = optax.GradientTransformation(lambda p: optax.EmptyState(), lambda u, s, p=None: (gj.node_mean(p) - p, s))
  cases = {"mean": (gj.chain(optax.sgd(0.0), gj.periodic_average(1, backend=be), backend=be), np.full(8, flat.mean())),
           "node_mean": (gj.chain(mean, backend=be), np.full(8, flat.mean())),
           "mix": (gj.chain(optax.sgd(0.0), gj.mix(T.ring(8), backend=be), backend=be), T.ring(8).matrix() @ flat)}
  for tx, want in cases.values():
    step = jax.pmap(lambda x, tx=tx: x + tx.update(jnp.zeros_like(x), tx.init(x), x)[0], axis_name="devices",
                    devices=jax.devices()[:4])
    np.testing.assert_allclose(np.asarray(step(x)).reshape(8), want, rtol=1e-6)
