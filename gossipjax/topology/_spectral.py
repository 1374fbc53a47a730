"""Spectral facts of a mixing matrix: ``rho = ||W - 11^T/n||_2``, its per-period rate and the spectral gap."""

from __future__ import annotations

import warnings
from typing import Any, Callable, cast, overload

import numpy as np
import scipy.sparse as sp
from scipy.sparse import linalg as sla

from gossipjax.topology._plan import MixingPlan, reversed_plan, sparse_shape
from gossipjax.topology._topology import Topology

# Up to this many nodes rho is the exact dense 2-norm (an SVD, well under a second);
# past it, an FFT for circulant W and a Lanczos eigensolver on the sparse form otherwise.
EXACT_RHO_NODES = 1024

# scipy ships no annotations and a type checker infers two wrong ones from its source: eigsh's ``tol`` as an int
# (from its default 0) and ``LinearOperator(shape, matvec=...)`` as the abstract base's ``(dtype, shape)``, though
# ``LinearOperator.__new__`` makes it a custom operator. The same functions, typed loosely:
_arpack_eigsh = cast(Callable[..., Any], sla.eigsh)
_linear_operator = cast(Callable[..., sla.LinearOperator], sla.LinearOperator)


def rho(topology: "Topology | np.ndarray | sp.sparray", step: int = 0) -> float:
  """``||W - 11^T/n||_2``, the rate at which one gossip step contracts disagreement.

  For a time-varying topology this is the value of the one matrix at ``step``, which alone
  may not even connect the nodes (one step of `one_peer_exponential` has rho near 1); its
  rate is `rho_per_period`.

  The number is a rate of consensus only for a doubly stochastic W (rows and columns summing
  to 1: the average is kept and ``11^T/n`` is the limit of ``W^k``). For any other W it is
  still this norm, but not a rate, and a ``UserWarning`` says so.

  Up to ``EXACT_RHO_NODES`` (1,024) nodes this is the exact dense SVD norm. Past it,
  W is never made dense. A W that commutes with the translations of a cyclic group
  ``Z_r x Z_c`` (n = r c, node i at ``(i // c, i % c)``) is a sum of commuting
  permutations, hence normal, and its eigenvalues are the 2-D FFT of its kernel, exact in
  O(n log n): circulant graphs (ring, exponential, one-peer exponential, their directed
  forms and ``complete``, r = 1) and tori with uniform weights (the Kronecker sum of two
  circulants). Any other W goes to ARPACK as an operator (sparse part plus rank-one
  terms, never n x n): a symmetric one by shift-invert Lanczos around 1 and -1 (one
  sparse LU each; plain Lanczos needs thousands of iterations on the clustered spectrum
  of a large grid), a non-symmetric one by Lanczos on the Gram matrix of ``W - 11^T/n``
  with an iteration cap (relative tolerance 1e-10).

  Args:
    topology: a `Topology`, or a mixing matrix (dense or ``scipy.sparse``).
    step: the step of a time-varying topology.

  Returns:
    rho as a float: 0 for exact averaging (`complete`); below 1 for a doubly stochastic W
    of a connected graph with positive self weights.

  Warns:
    UserWarning: W is not doubly stochastic.

  Example:
    >>> from gossipjax import topology as T
    >>> round(T.rho(T.exponential(16)), 4), round(T.rho(T.exponential(2**16)), 4)
    (0.6, 0.8824)

  References:
    Xiao, Boyd (2004), Fast Linear Iterations for Distributed Averaging, Systems & Control
    Letters.
  """
  _warn_unless_doubly_stochastic(topology, "rho", [int(step)] if isinstance(topology, Topology) else None)
  if isinstance(topology, Topology):
    n = topology.num_nodes
    if n <= EXACT_RHO_NODES:
      return _dense_rho(topology.matrix(step))
    plan = topology.plans()[int(step) % topology.period]
    kernel = _translation_kernel(plan)
    if kernel is not None:
      return _circulant_rho(kernel)
    symmetric = Topology.from_plans(plan).is_symmetric()
    if symmetric and not plan.rank_one:
      return _symmetric_rho(plan.sparse())
    return _operator_rho(plan.matvec, reversed_plan(plan).matvec, n, symmetric)
  if sp.issparse(topology):
    w = sp.csr_array(topology, dtype=np.float64)
    if sparse_shape(w)[0] <= EXACT_RHO_NODES:
      return _dense_rho(w.toarray())
    return _sparse_rho(w, symmetric=abs(w - w.T).max() <= 1e-12)
  w = np.asarray(topology, np.float64)
  if w.shape[0] <= EXACT_RHO_NODES:
    return _dense_rho(w)
  return _sparse_rho(sp.csr_array(w), symmetric=bool(np.allclose(w, w.T, atol=1e-12)))


def _sparse_rho(w: sp.csr_array, symmetric: bool) -> float:
  if symmetric:
    return _symmetric_rho(w)
  wt = w.T.tocsr()
  return _operator_rho(lambda x: w @ x, lambda x: wt @ x, sparse_shape(w)[0], symmetric=False)


def spectral_gap(topology: "Topology | np.ndarray | sp.sparray", step: int = 0) -> float:
  """``1 - rho(W)``: the larger, the faster gossip reaches consensus.

  Args:
    topology: a `Topology`, or a mixing matrix (dense or ``scipy.sparse``).
    step: the step of a time-varying topology.

  Returns:
    The gap as a float in [0, 1] for a doubly stochastic W.

  Warns:
    UserWarning: W is not doubly stochastic (the gap is then no rate of consensus).

  Example:
    >>> from gossipjax import topology as T
    >>> round(T.spectral_gap(T.ring(8)), 4), T.spectral_gap(T.complete(8))
    (0.1953, 1.0)

  References:
    Xiao, Boyd (2004), Fast Linear Iterations for Distributed Averaging, Systems & Control
    Letters.
  """
  _warn_unless_doubly_stochastic(topology, "spectral_gap", [int(step)] if isinstance(topology, Topology) else None)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # warned once, under this function's name
    return 1.0 - rho(topology, step)


def rho_per_period(topology: Topology) -> float:
  r"""The rate per step of a time-varying topology: rho of the product of one period, to the power 1/p.

  One matrix of a time-varying topology can leave the nodes unconnected (a step of
  `one_peer_exponential` pairs each node with one peer: rho near 1), while the period as a
  whole mixes fast (for n a power of 2, `one_peer_exponential`'s period is exact
  averaging). What decides the rate is the product over one period,

  .. math::
    \rho_{\text{period}} = \big\|W^{(p-1)} \cdots W^{(0)} - \tfrac1n \mathbf 1 \mathbf 1^\top \big\|_2^{1/p},

  the 2-norm of the product on the disagreement subspace (where, W being doubly stochastic,
  ``P - 11^T/n = (W(p-1) - 11^T/n) ... (W(0) - 11^T/n)``), taken per step: every period
  shrinks the disagreement by at least ``rho_per_period ** p``. For a static topology it is
  `rho`. The norm, like `rho`'s, bounds the spectral radius of the product and equals it
  when the product is normal (circulant schedules, symmetric products).

  A schedule of circulant matrices (`one_peer_exponential` and its directed form) multiplies
  their FFTs, exactly, in O(p n log n) at any n. Any other schedule is the exact SVD of the
  product (built by p sparse products) up to ``EXACT_RHO_NODES`` (1,024) nodes, and past it
  Lanczos on the Gram matrix of the product as an operator (p sparse products with W and p
  with W^T per iteration): the product is never formed there.

  Args:
    topology: a `Topology` (a matrix is static: use `rho`).

  Returns:
    The per-step rate as a float: 0 when a period averages exactly.

  Warns:
    UserWarning: some W(k) is not doubly stochastic (the number is then no rate of consensus).

  Example:
    >>> from gossipjax import topology as T
    >>> g = T.one_peer_exponential(64)
    >>> round(T.rho(g), 3), T.rho_per_period(g)   # one step alone, and per step over the period of 6
    (0.999, 0.0)
    >>> round(T.rho_per_period(T.one_peer_exponential(48)), 4), round(T.rho_per_period(T.ring(8)), 4)
    (0.7691, 0.8047)

  References:
    Ying, Yuan, Chen, Hu, Pan, Yin (2021), Exponential Graph is Provably Efficient for
    Decentralized Deep Training, NeurIPS (the per-period product of the one-peer graph).
  """
  if not isinstance(topology, Topology):
    raise TypeError(f"rho_per_period: expected a gossipjax Topology, got {type(topology).__name__}; "
                    "a single matrix is static, use gj.topology.rho")
  if topology.period == 1:
    return rho(topology)
  _warn_unless_doubly_stochastic(topology, "rho_per_period", range(topology.period))
  plans, n, p = topology.plans(), topology.num_nodes, topology.period
  kernels = [_translation_kernel(plan) for plan in plans]
  circulant = [k for k in kernels if k is not None]
  if len(circulant) == len(kernels) and len({k.shape for k in circulant}) == 1:
    lam = np.prod([np.fft.fft2(k) for k in circulant], axis=0)  # commuting normal matrices: eigenvalues multiply
    lam[0, 0] -= 1.0
    return float(np.abs(lam).max()) ** (1.0 / p)
  if n <= EXACT_RHO_NODES:
    product = np.eye(n)
    for plan in plans:
      product = plan.matvec(product)
    return _dense_rho(product) ** (1.0 / p)
  backward = [reversed_plan(plan) for plan in reversed(plans)]

  def matvec(x):
    for plan in plans:
      x = plan.matvec(x)
    return x

  def rmatvec(x):
    for plan in backward:
      x = plan.matvec(x)
    return x

  return _operator_rho(matvec, rmatvec, n, symmetric=False) ** (1.0 / p)


def _warn_unless_doubly_stochastic(w, what: str, steps) -> None:
  """A ``UserWarning`` naming the first row or column of W that does not sum to 1 (O(n * degree))."""
  if isinstance(w, Topology):
    sums = ((k, kind, (plan.row_sums() if kind == "row" else plan.column_sums()))
            for k in sorted({s % w.period for s in steps}) for plan in [w.plans()[k]] for kind in ("row", "column"))
  else:
    m = sp.csr_array(w, dtype=np.float64) if sp.issparse(w) else np.asarray(w, np.float64)
    sums = ((0, "row", np.asarray(m.sum(axis=1)).ravel()), (0, "column", np.asarray(m.sum(axis=0)).ravel()))
  for k, kind, s in sums:
    off = np.abs(s - 1.0)
    if off.max(initial=0.0) > 1e-6:
      i = int(np.argmax(off))
      at = f" at step {k}" if isinstance(w, Topology) and w.is_time_varying else ""
      warnings.warn(f"{what}: W{at} is not doubly stochastic ({kind} {i} sums to {s[i]:.6g}), so "
                    "||W - 11^T/n||_2 is no rate of consensus; for a row or column stochastic W the rate is set by "
                    "the second largest |eigenvalue| of W, not by this norm", UserWarning, stacklevel=3)
      return


def _dense_rho(w: np.ndarray) -> float:
  n = w.shape[0]
  return float(np.linalg.norm(w - np.full((n, n), 1.0 / n), ord=2))


def _translation_kernel(plan: MixingPlan) -> np.ndarray | None:
  """The kernel ``K`` (r, c) with ``W[i, i + g] = K[g]`` on some group Z_r x Z_c, else None.

  Tries r = 1 (a circulant: every round a shift with one weight, read off the rounds) and
  then every factorisation n = r c of the node count. Constant rank-one terms (multiples of
  11^T) add to every entry of the kernel; other rank-one terms are not translation invariant.
  """
  n = plan.num_nodes
  s = plan.self_weight
  if not np.all(s == s[0]) or not all(t.is_constant for t in plan.rank_one):
    return None
  everywhere = sum((float(t.u[0] * t.v[0]) for t in plan.rank_one), 0.0)
  if all(r.shift is not None and np.all(r.weight == r.weight[0]) for r in plan.rounds):
    row = np.full(n, everywhere)
    row[0] += s[0]
    for r in plan.rounds:
      row[r.shift] += r.weight[0]
    return row[None]
  dst, src, w = plan.round_edges()
  if not len(dst) or len(dst) > _MAX_KERNEL_EDGES_PER_NODE * n:
    return None
  most = int(np.bincount(dst, minlength=n).max())
  for r in (d for d in range(2, n) if n % d == 0):
    c = n // r
    key = ((src // c - dst // c) % r) * c + (src % c - dst % c) % c
    keys, index = np.unique(key, return_inverse=True)
    if len(keys) > most:  # every node has the same offsets in a translation-invariant W
      continue
    per_node = sp.coo_array((w, (dst, index)), shape=(n, len(keys))).tocsc()
    per_node.sum_duplicates()
    if per_node.nnz != n * len(keys):
      continue
    columns = per_node.toarray()
    if not np.all(columns == columns[0]):
      continue
    kernel = np.full(n, everywhere)
    kernel[0] += s[0]
    kernel[keys] += columns[0]
    return kernel.reshape(r, c)
  return None


# A translation-invariant W is looked for only among graphs this sparse (a torus has 4 edges per node).
_MAX_KERNEL_EDGES_PER_NODE = 64


def _circulant_rho(kernel: np.ndarray) -> float:
  # W = sum_g K_g T_g (T_g the translations of the group) is normal with eigenvalues fft2(K);
  # 11^T/n shares the eigenvector 1 (eigenvalue 1, where W has sum(K)) and is 0 on the others.
  lam = np.fft.fft2(kernel)
  lam[0, 0] -= 1.0
  return float(np.abs(lam).max())


def _symmetric_rho(w: sp.csr_array) -> float:
  """``max |lambda|`` of a symmetric stochastic sparse W off the consensus direction, by shift-invert Lanczos.

  The eigenvalue below 1 and the lowest one decide rho. Factorising ``W - sigma I`` once
  (one sparse LU; sigma just above 1, where W is non-singular) makes the top ones the
  best-separated for Lanczos, where plain Lanczos on a large grid's clustered spectrum needs
  thousands of iterations. The lowest eigenvalue is bounded below by Gershgorin's
  ``min_i (2 W_ii - 1)``; only when that bound could beat the second eigenvalue is it
  computed too, by shift-invert at the bound.
  """
  n = sparse_shape(w)[0]
  if np.abs(w.sum(axis=1) - 1.0).max() > 1e-9:  # not stochastic: 1 is not an eigenvector
    return _operator_rho(lambda x: w @ x, lambda x: w @ x, n, symmetric=True)
  # Plain Lanczos first, on a short leash: it is fast on expanders (random graphs, hypercubes),
  # where an LU would fill in; grids and other graphs with a clustered top go on to the LU.
  quick = _operator_rho(lambda x: w @ x, lambda x: w @ x, n, symmetric=True, maxiter=_QUICK_ITER)
  if quick is not None:
    return quick
  v0 = np.random.default_rng(0).standard_normal(n)  # a fixed start: the same W gives the same value
  ones = np.full(n, 1.0 / np.sqrt(n))
  lam, vecs = _arpack_eigsh(w.tocsc(), k=2, sigma=1.0 + _SHIFT, which="LM", tol=1e-10, v0=v0, maxiter=_MAX_ITER)
  consensus = int(np.argmax(np.abs(ones @ vecs)))  # W 1 = 1: drop the consensus direction's eigenvalue
  second = float(abs(lam[1 - consensus]))
  lowest_bound = float(np.min(2.0 * w.diagonal() - 1.0))
  if -lowest_bound <= second:
    return second
  bottom = _arpack_eigsh(w.tocsc(), k=1, sigma=lowest_bound - _SHIFT, which="LM", tol=1e-10, v0=v0,
                        maxiter=_MAX_ITER, return_eigenvectors=False)
  return max(second, float(abs(bottom[0])))


_SHIFT = 1e-6
# ARPACK restarts (of _NCV Lanczos vectors each): the quick try, and the cap of any solve.
_QUICK_ITER = 20
_MAX_ITER = 300
_NCV = 32


@overload
def _operator_rho(matvec, rmatvec, n: int, symmetric: bool, maxiter: None = None) -> float: ...
@overload
def _operator_rho(matvec, rmatvec, n: int, symmetric: bool, maxiter: int) -> float | None: ...
def _operator_rho(matvec, rmatvec, n: int, symmetric: bool, maxiter: int | None = None) -> float | None:
  """``||W - 11^T/n||_2`` by Lanczos on an operator.

  With ``maxiter`` given, returns None when Lanczos has not converged by then; without it,
  stops after ``_MAX_ITER`` restarts (a few thousand products with W) and raises
  ``ArpackNoConvergence`` there, so no call runs unbounded.
  """
  a = lambda x: matvec(x) - x.mean(axis=0)  # (W - 11^T/n) x, never forming 11^T
  at = lambda x: rmatvec(x) - x.mean(axis=0)
  v0 = np.random.default_rng(0).standard_normal(n)  # a fixed start: the same W gives the same value
  if symmetric:
    op = _linear_operator((n, n), matvec=a, matmat=a, dtype=np.float64)
    lam = _eigsh(op, "LM", v0, maxiter)
    return None if lam is None else float(abs(lam))
  gram = lambda x: at(a(x))
  op = _linear_operator((n, n), matvec=gram, matmat=gram, dtype=np.float64)
  lam = _eigsh(op, "LA", v0, maxiter)
  return None if lam is None else float(np.sqrt(max(lam, 0.0)))


@overload
def _eigsh(op: sla.LinearOperator, which: str, v0: np.ndarray, maxiter: None) -> float: ...
@overload
def _eigsh(op: sla.LinearOperator, which: str, v0: np.ndarray, maxiter: int) -> float | None: ...
def _eigsh(op: sla.LinearOperator, which: str, v0: np.ndarray, maxiter: int | None) -> float | None:
  n = op.shape[0]
  try:
    return float(_arpack_eigsh(op, k=1, which=which, tol=1e-10, v0=v0, ncv=min(_NCV, n - 1) if n > 2 else None,
                               maxiter=maxiter or _MAX_ITER, return_eigenvectors=False)[0])
  except sla.ArpackNoConvergence as e:
    if maxiter is not None:
      return None
    raise sla.ArpackNoConvergence(
        f"rho: Lanczos did not converge within {_MAX_ITER} restarts of {_NCV} products with W (the top of "
        "the spectrum is clustered, as for a large grid with non-symmetric weights); use a symmetric W "
        "(weights='metropolis') or compute rho at a smaller size", e.eigenvalues, e.eigenvectors) from e
  except sla.ArpackError:
    # ARPACK breaks down on an operator that is exactly 0 (W = 11^T/n); the norm is then 0.
    probe = op.matvec(v0)
    if np.linalg.norm(probe) <= 1e-12 * np.linalg.norm(v0):
      return 0.0
    raise
