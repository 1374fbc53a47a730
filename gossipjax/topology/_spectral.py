"""Spectral facts of a mixing matrix: ``rho = ||W - 11^T/n||_2`` and the spectral gap."""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse as sp
from scipy.sparse import linalg as sla

from gossipjax.topology._plan import MixingPlan
from gossipjax.topology._topology import Topology

# Up to this many nodes rho is the exact dense 2-norm (an SVD, well under a second);
# past it, an FFT for circulant W and a Lanczos eigensolver on the sparse form otherwise.
EXACT_RHO_NODES = 1024


def rho(topology: "Topology | np.ndarray | sp.sparray", step: int = 0) -> float:
  """``||W - 11^T/n||_2``, the rate at which one gossip step contracts disagreement.

  For a time-varying topology this is the value at ``step``; use
  ``rho(product_over_period)`` for the per-period rate.

  Up to ``EXACT_RHO_NODES`` (1,024) nodes this is the exact dense SVD norm. Past it,
  W is never made dense: a circulant W (ring, exponential, one-peer exponential and their
  directed forms) is normal, so its singular values are the magnitudes of the FFT of its
  first row, exact in O(n log n); any other W is handed to ARPACK's Lanczos solver
  (``eigsh``) as an operator, on ``W - 11^T/n`` when W is symmetric and on its Gram matrix
  otherwise (relative tolerance 1e-10). Lanczos needs many iterations where the top of
  the spectrum is clustered, as on large tori and grids (about 30 s at 65,536 nodes).

  Example:
    >>> from gossipjax import topology as T
    >>> round(T.rho(T.exponential(16)), 4), round(T.rho(T.exponential(2**16)), 4)
    (0.6, 0.8824)
  """
  if isinstance(topology, Topology):
    n = topology.num_nodes
    if n <= EXACT_RHO_NODES:
      return _dense_rho(topology.matrix(step))
    plan = topology.plans()[int(step) % topology.period]
    circulant = _circulant_row(plan)
    if circulant is not None:
      return _circulant_rho(circulant)
    return _sparse_rho(topology.sparse(step), symmetric=topology.is_symmetric())
  if sp.issparse(topology):
    w = sp.csr_array(topology, dtype=np.float64)
    if w.shape[0] <= EXACT_RHO_NODES:
      return _dense_rho(w.toarray())
    return _sparse_rho(w, symmetric=abs(w - w.T).max() <= 1e-12)
  w = np.asarray(topology, np.float64)
  if w.shape[0] <= EXACT_RHO_NODES:
    return _dense_rho(w)
  return _sparse_rho(sp.csr_array(w), symmetric=bool(np.allclose(w, w.T, atol=1e-12)))


def spectral_gap(topology: "Topology | np.ndarray | sp.sparray", step: int = 0) -> float:
  """``1 - rho(W)``."""
  return 1.0 - rho(topology, step)


def _dense_rho(w: np.ndarray) -> float:
  n = w.shape[0]
  return float(np.linalg.norm(w - np.full((n, n), 1.0 / n), ord=2))


def _circulant_row(plan: MixingPlan) -> np.ndarray | None:
  """The first row ``c`` (W[i, i + h] = c[h]) when every round is a shift with one weight, else None."""
  n = plan.num_nodes
  s = plan.self_weight
  if not np.all(s == s[0]):
    return None
  row = np.zeros(n)
  row[0] = s[0]
  for r in plan.rounds:
    if r.shift is None or not np.all(r.weight == r.weight[0]):
      return None
    row[r.shift] += r.weight[0]
  return row


def _circulant_rho(row: np.ndarray) -> float:
  # W = sum_h c_h S^h is normal with eigenvalues fft(c); 11^T/n shares the eigenvector 1
  # (eigenvalue 1, where W has sum(c)) and is 0 on the others.
  lam = np.fft.fft(row)
  lam[0] -= 1.0
  return float(np.abs(lam).max())


def _sparse_rho(w: sp.csr_array, symmetric: bool) -> float:
  n = w.shape[0]
  wt = w.T.tocsr()
  a = lambda x: w @ x - x.mean(axis=0)  # (W - 11^T/n) x, never forming 11^T
  at = lambda x: wt @ x - x.mean(axis=0)
  v0 = np.random.default_rng(0).standard_normal(n)  # a fixed start: the same W gives the same value
  if symmetric:
    op = sla.LinearOperator((n, n), matvec=a, matmat=a, dtype=np.float64)
    lam = sla.eigsh(op, k=1, which="LM", tol=1e-10, v0=v0, return_eigenvectors=False)
    return float(abs(lam[0]))
  gram = lambda x: at(a(x))
  op = sla.LinearOperator((n, n), matvec=gram, matmat=gram, dtype=np.float64)
  lam = sla.eigsh(op, k=1, which="LA", tol=1e-10, v0=v0, return_eigenvectors=False)
  return float(np.sqrt(max(lam[0], 0.0)))
