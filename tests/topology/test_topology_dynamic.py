"""Push-form directed exponential graphs and random pairwise averaging."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gossipjax as gj
from gossipjax import topology as T


@pytest.mark.parametrize("n", [2, 8, 12, 16])
def test_directed_exponential_pushes_to_powers_of_two(n):
  topo = T.directed_exponential(n)
  w = topo.matrix()
  np.testing.assert_allclose(w, T.exponential(n).matrix().T, atol=1e-15)  # the same graph, edges reversed
  np.testing.assert_allclose(w.sum(axis=0), 1, atol=1e-15)  # column stochastic: push
  topo.check("column")
  np.testing.assert_allclose(topo.plans()[0].dense(), w, atol=1e-15)
  if n == 8:  # node 3 pushes to 4, 5, 7 and keeps a quarter
    assert set(np.flatnonzero(w[:, 3]).tolist()) == {3, 4, 5, 7}


@pytest.mark.parametrize("n", [4, 16])
def test_one_peer_directed_exponential_sends_one_message_and_averages_in_a_period(n):
  topo = T.one_peer_directed_exponential(n)
  assert topo.period == int(np.log2(n))
  prod = np.eye(n)
  for k in range(topo.period):
    w = topo.matrix(k)
    np.testing.assert_allclose(w, T.one_peer_exponential(n).matrix(k).T, atol=1e-15)
    assert ((w > 0).sum(axis=0) == 2).all()  # each node pushes to itself and one peer
    prod = w @ prod
  np.testing.assert_allclose(prod, np.full((n, n), 1 / n), atol=1e-14)


@pytest.mark.parametrize("n", [8, 7])
def test_random_pairs_are_random_matchings(n):
  topo = T.random_pairs(n, seed=5, period=20)
  assert topo.period == 20 and topo.num_nodes == n
  topo.check("doubly")
  for k in range(topo.period):
    w = topo.matrix(k)
    np.testing.assert_array_equal(w, w.T)
    off = w - np.diag(np.diag(w))
    peers = (off > 0).sum(axis=1)
    assert peers.max() == 1 and (peers == 0).sum() == n % 2  # one idle node when n is odd
    np.testing.assert_allclose(off[off > 0], 0.5)
    assert len(topo.plans()[k].rounds) == 1  # a matching is one exchange round
  # the matchings differ from step to step
  assert len({topo.matrix(k).tobytes() for k in range(topo.period)}) > topo.period // 2


def test_random_pairs_are_reproducible_and_keyed_by_seed():
  a, b, c = T.random_pairs(16, seed=1), T.random_pairs(16, seed=1), T.random_pairs(16, seed=2)
  np.testing.assert_array_equal(a.matrices, b.matrices)
  assert not np.array_equal(a.matrices, c.matrices)
  assert not hasattr(gj, "random_pairs")  # one public name: gj.topology.random_pairs


def test_random_pairs_refuses_a_period_that_cannot_connect():
  with pytest.raises(ValueError, match="do not connect"):
    T.random_pairs(8, period=1)
  with pytest.raises(ValueError, match="period must be a positive integer"):
    T.random_pairs(8, period=0)


def test_long_period_mixes_by_table_lookup_with_one_compilation():
  """A period longer than lax.switch is kept for (here 64) is mixed by gathering from a table."""
  topo = T.random_pairs(8, seed=0, period=64)
  mixer = gj.backend.simulate().mixer(topo)
  x = {"a": jax.random.normal(jax.random.key(0), (8, 3)), "b": jnp.arange(8.0)}
  mix = jax.jit(mixer.mix)
  for k in (0, 1, 17, 63, 64, 130):
    got = mix(x, jnp.asarray(k))
    w = topo.matrix(k)
    np.testing.assert_allclose(got["a"], w @ np.asarray(x["a"]), atol=1e-14)
    np.testing.assert_allclose(got["b"], w @ np.asarray(x["b"]), atol=1e-14)
  assert mix._cache_size() == 1


def test_random_pairs_gossip_reaches_consensus_and_keeps_the_average():
  topo = T.random_pairs(16, seed=0)
  tx = gj.mix(topo)
  x = jax.random.normal(jax.random.key(1), (16, 4))
  state = tx.init(x)
  step = jax.jit(lambda x, s: tx.update(jnp.zeros_like(x), s, x))
  start = gj.consensus_distance(x)
  y = x
  for _ in range(60):
    u, state = step(y, state)
    y = y + u
  np.testing.assert_allclose(y.mean(0), x.mean(0), atol=1e-13)
  assert gj.consensus_distance(y) < 1e-8 * start
