"""``mixer.mix_rounds`` takes a static W's rounds apart, the same on every backend, from one set of exchanges."""

import re

import jax
import numpy as np
import pytest

import gossipjax as gj
from gossipjax import topology as T
from gossipjax.mixing import make_mixer
from gossipjax.mixing._node_mixer import NodeMixer

AUTO = jax.sharding.AxisType.Auto


def _tree(n):
  rng = np.random.default_rng(0)
  return {"w": rng.normal(size=(n, 3, 2)), "b": rng.normal(size=(n, 4)), "count": np.arange(n)}


@pytest.mark.parametrize("topo", [T.exponential(16), T.torus(4, 4)], ids=lambda t: t.name)
def test_the_rounds_sum_to_w_and_every_backend_gives_the_same_rounds(topo):
  x = _tree(16)
  sim = make_mixer(topo)
  rounds = sim.mix_rounds(x)
  plan = topo.plans()[0]
  assert len(rounds) == len(plan.rounds) > 1
  whole = sim.mix(x, 0)
  for k in ("w", "b"):
    total = plan.self_weight.reshape((-1,) + (1,) * (x[k].ndim - 1)) * x[k] + sum(r[k] for r in rounds)
    np.testing.assert_allclose(total, whole[k], rtol=0, atol=1e-14)
  assert all(np.array_equal(r["count"], x["count"]) for r in rounds)  # an integer leaf passes through

  be = gj.backend.sharded(jax.make_mesh((8,), ("nodes",), axis_types=(AUTO,)))  # 2 nodes per device
  mixer = make_mixer(topo, be)
  got = jax.jit(mixer.mix_rounds)(be.shard(x))
  hlo = jax.jit(mixer.mix_rounds).lower(be.shard(x)).compile().as_text()
  # One permute per exchange of the whole plan (and bucket): the rounds share them.
  exchanges = len(be.mixer(topo).plans[0].exchanges)
  assert len(re.findall(r"collective-permute\(", hlo)) == exchanges
  for r, want in zip(got, rounds):
    for k in x:
      np.testing.assert_allclose(r[k], want[k], rtol=0, atol=1e-14)

  pm = make_mixer(topo, gj.backend.pmapped("devices", axis_size=8))
  blocks = jax.tree.map(lambda v: v.reshape((8, 2) + v.shape[1:]), x)
  got = jax.pmap(pm.mix_rounds, axis_name="devices")(blocks)
  for r, want in zip(got, rounds):
    for k in x:
      np.testing.assert_allclose(np.asarray(r[k]).reshape(want[k].shape), want[k], rtol=0, atol=1e-14)


def test_a_backend_mixer_without_mix_rounds_mixes_each_round_alone():
  topo = T.exponential(8)

  class Plain:  # a user's mixer: mix only
    def __init__(self, inner):
      self.inner, self.topology, self.local_nodes = inner, inner.topology, inner.local_nodes

    def mix(self, tree, step=0, wire=None):
      return self.inner.mix(tree, step, wire)

    def first_node(self):
      return 0

  be = gj.backend.simulate()
  plain = NodeMixer(Plain(be.mixer(topo)), be, "test")
  x = _tree(8)
  for a, b in zip(plain.mix_rounds(x), make_mixer(topo).mix_rounds(x)):
    np.testing.assert_allclose(a["w"], b["w"], rtol=0, atol=0)


def test_a_time_varying_or_rank_one_w_is_refused():
  with pytest.raises(ValueError, match="mix_rounds .*time-varying"):
    make_mixer(T.one_peer_exponential(8)).mix_rounds(_tree(8))
  with pytest.raises(ValueError, match="mix_rounds .*rank-one"):
    make_mixer(T.complete(8)).mix_rounds(_tree(8))
