"""rho_per_period against the dense product, and the warning of rho and spectral_gap off doubly stochastic W."""

import time
import warnings

import numpy as np
import pytest
import scipy.sparse as sp

from gossipjax import topology as T
from gossipjax.topology import _spectral


def _dense_rate(topo):
  n = topo.num_nodes
  product = np.eye(n)
  for k in range(topo.period):
    product = topo.matrix(k) @ product
  return np.linalg.norm(product - np.full((n, n), 1 / n), ord=2) ** (1 / topo.period)


TIME_VARYING = [T.one_peer_exponential(16), T.one_peer_exponential(48), T.one_peer_directed_exponential(20),
                T.random_pairs(12, seed=1, period=4), T.random_pairs(31, seed=0, period=8)]


@pytest.mark.parametrize("topo", TIME_VARYING, ids=lambda t: t.name)
def test_rho_per_period_is_the_per_step_rate_of_the_dense_product_on_every_path(topo, monkeypatch):
  want = _dense_rate(topo)
  assert T.rho_per_period(topo) == pytest.approx(want, abs=1e-9)
  monkeypatch.setattr(_spectral, "EXACT_RHO_NODES", 0)  # the sparse paths: FFT of circulants, else Lanczos
  assert T.rho_per_period(topo) == pytest.approx(want, abs=1e-8)


@pytest.mark.parametrize("n", [2, 8, 24, 64, 2048])
def test_one_peer_exponential_mixes_exactly_over_a_period_where_one_step_does_not(n):
  topo = T.one_peer_exponential(n)
  if n & (n - 1):  # not a power of 2: the period does not average exactly
    assert 0 < T.rho_per_period(topo) < T.rho(topo)
    return
  assert T.rho_per_period(topo) == pytest.approx(0.0, abs=1e-7)
  if n > 2:
    assert T.rho(topo) > 0.7  # one step alone pairs each node with one peer
  assert _spectral._translation_kernel(topo.plans()[0]) is not None  # circulant: one FFT per step, any n


def test_rho_per_period_of_a_static_topology_is_rho():
  for topo in (T.ring(10), T.exponential(16), T.torus(3, 4), T.complete(6)):
    assert T.rho_per_period(topo) == T.rho(topo)
  with pytest.raises(TypeError, match="use gj.topology.rho"):
    T.rho_per_period(np.full((3, 3), 1 / 3))


def test_rho_per_period_at_65536_nodes_never_forms_the_product():
  start = time.perf_counter()
  assert T.rho_per_period(T.one_peer_exponential(2**16)) == pytest.approx(0.0, abs=1e-9)
  rate = T.rho_per_period(T.one_peer_exponential(3 * 2**14))  # not a power of 2: a rate above 0
  assert time.perf_counter() - start < 5  # one FFT per step of the period; the product would be 32 GiB
  assert 0.0 < rate < 1.0
  assert all(_spectral._translation_kernel(p) is not None for p in T.one_peer_exponential(3 * 2**14).plans())


def test_rho_and_spectral_gap_warn_for_a_matrix_that_is_not_doubly_stochastic():
  row_only = T.grid(3, 3)  # uniform weights on an irregular graph: rows sum to 1, columns do not
  with pytest.warns(UserWarning, match=r"rho: W is not doubly stochastic \(column \d sums to"):
    T.rho(row_only)
  with pytest.warns(UserWarning, match="spectral_gap: W is not doubly stochastic") as caught:
    T.spectral_gap(row_only)
  assert len(caught) == 1
  with pytest.warns(UserWarning, match=r"rho: W is not doubly stochastic \(row 1 sums to"):
    T.rho(np.array([[0.5, 0.5], [0.2, 0.5]]))
  with pytest.warns(UserWarning, match=r"column \d sums to"):
    T.rho(sp.csr_array(row_only.matrix()))
  with pytest.warns(UserWarning, match="rho_per_period: W at step 0 is not doubly stochastic"):
    T.rho_per_period(T.from_matrix([row_only.matrix(), T.ring(9).matrix()]))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for topo in (T.ring(8), T.grid(3, 3, weights="metropolis"), T.one_peer_exponential(8), T.star(9, "metropolis")):
      T.rho(topo), T.spectral_gap(topo), T.rho_per_period(topo)
