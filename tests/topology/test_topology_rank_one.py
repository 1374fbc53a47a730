"""Hubs and exact averaging as rank-one terms: star and complete at any n, equal to their dense W."""

import math
import time
import tracemalloc

import numpy as np
import pytest

from gossipjax import topology as T
from gossipjax.asynchrony._plans import plan_table
from gossipjax.topology import _spectral
from gossipjax.topology._plan import reversed_plan

SMALL = [T.star(9), T.star(9, "metropolis"), T.complete(9), T.star(2), T.complete(2)]


@pytest.mark.parametrize("topo", SMALL, ids=lambda t: f"{t.name}-{t.plans()[0].self_weight[-1]:.3f}")
def test_rank_one_plans_agree_with_their_dense_matrix_in_every_view(topo):
  plan, w = topo.plans()[0], topo.matrix()
  assert plan.rank_one and not plan.rounds  # no exchange round per leaf
  np.testing.assert_allclose(plan.row_sums(), w.sum(axis=1), rtol=0, atol=1e-15)
  np.testing.assert_allclose(plan.column_sums(), w.sum(axis=0), rtol=0, atol=1e-15)
  np.testing.assert_array_equal(topo.sparse().toarray(), w)
  x = np.random.default_rng(0).normal(size=(topo.num_nodes, 3))
  np.testing.assert_allclose(plan.matvec(x), w @ x, rtol=0, atol=1e-14)
  np.testing.assert_array_equal(topo.union_graph().toarray(), (w > 0) & ~np.eye(len(w), dtype=bool))
  assert topo.max_degree() == topo.num_nodes - 1
  assert topo.is_symmetric() == bool(np.allclose(w, w.T, atol=1e-12))
  np.testing.assert_array_equal(reversed_plan(plan).dense(), w.T)
  expanded = plan.expanded()
  assert not expanded.rank_one
  np.testing.assert_allclose(expanded.dense(), w, rtol=0, atol=1e-15)
  table = plan_table(topo)  # the simulators read the edges: the hub's terms become rounds
  dense = np.diag(table.self_weight[0])
  for src, weight in zip(table.src[0], table.weight[0]):
    dense[np.arange(topo.num_nodes), src] += weight
  np.testing.assert_allclose(dense, w, rtol=0, atol=1e-15)


def test_checks_see_through_rank_one_terms():
  n = 6
  hub = np.zeros(n)
  hub[0] = 1.0
  # Leaves 1..5 send to the hub, but the hub sends to nobody: not strongly connected.
  one_way = T.MixingPlan(np.r_[0.0, np.ones(n - 1)], (), (T.RankOne(hub, np.r_[0.0, np.full(n - 1, 0.2)]),))
  with pytest.raises(ValueError, match="not connected"):
    T.Topology.from_plans(one_way, name="one_way").check("row")
  with pytest.raises(ValueError, match=r"rank-one term 0 has v\[5\] = -1"):
    T.Topology.from_plans(T.MixingPlan(np.ones(n), (), (T.RankOne(hub, -hub[::-1]),)))
  assert T.star(n).fingerprint() != T.star(n, "metropolis").fingerprint()
  assert T.complete(n).fingerprint() == T.complete(n).fingerprint() != T.star(n).fingerprint()


@pytest.mark.filterwarnings("ignore:rho. W is not doubly stochastic")  # the norm itself is under test
@pytest.mark.parametrize("make", [T.star, lambda n: T.star(n, "metropolis"), T.complete],
                         ids=["star", "star-metropolis", "complete"])
def test_star_and_complete_at_65536_nodes_build_check_and_mix_in_linear_memory(make):
  n = 65_536
  tracemalloc.start()
  start = time.perf_counter()
  topo = make(n).check("row")
  rho = T.rho(topo)
  symmetric = topo.is_symmetric()
  x = np.random.default_rng(1).normal(size=(n, 4))
  mixed = topo.plans()[0].matvec(x)
  seconds = time.perf_counter() - start
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  assert seconds < 20 and peak < 200 * 2**20  # about 1 s; one dense W would be 32 GiB
  assert topo.max_degree() == n - 1
  if topo.name.startswith("complete"):
    assert rho == 0.0 and symmetric
    np.testing.assert_allclose(mixed, np.broadcast_to(x.mean(axis=0), x.shape), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="entry lists are built only up to"):
      topo.union_graph()
  else:
    w = topo.plans()[0]
    leaf_weight = w.rank_one[1].u[1]
    want = w.self_weight[:, None] * x
    want[0] += x[1:].sum(axis=0) * w.rank_one[0].v[1]
    want[1:] += leaf_weight * x[0]
    np.testing.assert_allclose(mixed, want, rtol=0, atol=1e-12)
    if symmetric:  # Metropolis: leaf-only vectors that sum to 0 keep their self weight 1 - 1/n
      assert rho == pytest.approx(1 - 1 / n, abs=1e-12)
    else:  # uniform: the hub's column (1/2 from every leaf) dominates
      assert rho == pytest.approx(math.sqrt(n - 1) / 2, rel=1e-3)
    assert topo.union_graph().nnz == 2 * (n - 1)


def test_the_async_simulators_refuse_a_complete_graph_past_the_dense_cap_by_name():
  with pytest.raises(ValueError, match=r"complete\(65536\).*one message per edge.*ring, torus"):
    plan_table(T.complete(65_536))


@pytest.mark.filterwarnings("ignore:rho. W is not doubly stochastic")  # the norm itself is under test
@pytest.mark.parametrize("topo", [T.torus(4, 6), T.torus(3, 5), T.torus(8, 8, "metropolis"), T.torus(2, 7),
                                  T.complete(40), T.grid(6, 7, "metropolis"), T.grid(5, 8),
                                  T.erdos_renyi(40, 0.2, seed=2), T.star(30, "metropolis"), T.star(30)],
                         ids=lambda t: t.name)
def test_rho_past_the_exact_size_equals_the_dense_svd(topo, monkeypatch):
  exact = T.rho(topo)
  monkeypatch.setattr(_spectral, "EXACT_RHO_NODES", 0)
  assert T.rho(topo) == pytest.approx(exact, abs=1e-9)
  if topo.name.startswith("torus"):
    assert _spectral._translation_kernel(topo.plans()[0]) is not None  # the exact FFT path, no eigensolver
  monkeypatch.setattr(_spectral, "_QUICK_ITER", 1)  # symmetric W without rank-one terms: by shift-invert
  assert T.rho(topo) == pytest.approx(exact, abs=1e-9)


def test_rho_of_large_tori_is_an_fft_and_of_large_grids_a_shift_invert():
  big = T.torus(256, 256)
  assert _spectral._translation_kernel(big.plans()[0]) is not None  # the exact FFT path, no eigensolver
  torus = T.rho(big)
  grid = T.rho(T.grid(256, 256, "metropolis"))
  # Uniform torus weights 1/5: lambda = (1 + 2 cos(2 pi a / r) + 2 cos(2 pi b / c)) / 5, largest off (0, 0).
  assert torus == pytest.approx((1 + 2 * math.cos(2 * math.pi / 256) + 2) / 5, abs=1e-12)
  assert 1 - 1e-4 < grid < 1


def test_exact_averaging_of_large_values_does_not_overflow():
  """complete(n) scales each row before summing, as a ring does: n rows near float32's max stay finite."""
  import jax
  import jax.numpy as jnp

  import gossipjax as gj

  x = jnp.full((8, 2), 3e38, jnp.float32)
  mixed = gj.backend.simulate().mixer(T.complete(8)).mix(x, 0)
  one_device = jax.pmap(lambda b: gj.backend.pmapped(axis_size=1).mixer(T.complete(8)).mix(b, 0), axis_name="devices",
                        devices=jax.devices()[:1])(x[None])[0]
  for out in (mixed, one_device):
    assert bool(jnp.isfinite(out).all())
    np.testing.assert_allclose(out, x, rtol=1e-6)
