"""What each topology costs and how fast it mixes: messages per step, rho, measured gossip decay.

Pure gossip ``x^{k+1} = W(k) x^k`` contracts the disagreement ``x - mean`` by ``rho = ||W - 11^T/n||_2``
per step at worst, so ``||x^k - mean|| <= rho^k ||x^0 - mean||`` for a static doubly stochastic W.
For a time-varying W the per-step bound is the product of the per-step rhos, and the rate
over one period is ``rho(W(tau-1) ... W(0))``.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import gossipjax as gj

T = gj.topology


def _side(n: int) -> int:
  side = math.isqrt(n)
  if side * side != n:
    raise ValueError(f"the grid and the torus are built square here; n = {n} is not a square")
  return side


# name -> (n, seed) -> Topology. Star and grid are irregular: Metropolis weights make W doubly stochastic.
TOPOLOGIES: dict[str, Callable[[int, int], gj.topology.Topology]] = {
    "ring": lambda n, seed: T.ring(n),
    "star": lambda n, seed: T.star(n, weights="metropolis"),
    "grid": lambda n, seed: T.grid(_side(n), _side(n), weights="metropolis"),
    "torus": lambda n, seed: T.torus(_side(n), _side(n)),
    "half_random": lambda n, seed: T.erdos_renyi(n, 0.5, seed=seed),  # Metropolis weights
    "static_exponential": lambda n, seed: T.exponential(n),  # directed, BlueFog's default
    "one_peer_exponential": lambda n, seed: T.one_peer_exponential(n),
}


def rho(w: np.ndarray) -> float:
  """``||W - 11^T/n||_2`` as the root of the top eigenvalue of ``M^T M``, ``M = W - 11^T/n``.

  The same number as ``gj.topology.rho`` (an SVD), several times faster at n = 1024; the
  eigenvalue's absolute error is ``eps * rho^2``, so the root is accurate even for rho ~ 0.
  """
  m = np.asarray(w, np.float64) - 1.0 / w.shape[0]
  return float(np.sqrt(max(np.linalg.eigvalsh(m.T @ m)[-1], 0.0)))


def messages_per_node(topology: gj.topology.Topology) -> dict[str, float]:
  """Messages a node receives per step (the most any node gets in any step, and the average), and what the
  plan executes: exchange rounds, and rank-one terms (a reduction over the nodes, as a star's hub does)."""
  n = topology.num_nodes
  received = ((topology.matrices * (1 - np.eye(n))) > 0).sum(axis=2)  # (period, n)
  return dict(messages_max=int(received.max()), messages_mean=float(received.mean()),
              plan_rounds=max(len(p.rounds) for p in topology.plans()),
              plan_rank_one=max(len(p.rank_one) for p in topology.plans()))


def spectral_facts(topology: gj.topology.Topology) -> dict[str, Any]:
  """rho per step, and over one period of a time-varying W (with its per-step equivalent)."""
  per_step = [rho(topology.matrix(k)) for k in range(topology.period)]
  product = np.eye(topology.num_nodes)
  for k in range(topology.period):
    product = topology.matrix(k) @ product
  rho_period = rho(product)
  return dict(period=topology.period, rho=max(per_step), rho_per_step=per_step, rho_period=rho_period,
              rate_per_step=rho_period ** (1.0 / topology.period))


def consensus_decay(topology: gj.topology.Topology, steps: int, dim: int, seed: int) -> np.ndarray:
  """``||x^k - mean|| / ||x^0 - mean||`` for k = 0..steps of pure gossip from a random x^0.

  The gossip step is ``gj.mix`` (the topology's sparse plan: rolls and gathers, no n x n
  matmul) applied to a zero local update, in one jitted scan; float64 (call under
  ``jax.enable_x64``) so the decay can be followed to ~1e-15.
  """
  tx = gj.mix(topology)
  x0 = jax.random.normal(jax.random.key(seed), (topology.num_nodes, dim), jnp.float64)

  def body(carry, _):
    x, state = carry
    u, state = tx.update(jnp.zeros_like(x), state, x)
    x = x + u
    return (x, state), gj.consensus_distance(x)

  _, dist = jax.jit(lambda c: jax.lax.scan(body, c, None, steps))((x0, tx.init(x0)))
  dist = np.concatenate([[float(gj.consensus_distance(x0))], np.asarray(dist)])
  return np.sqrt(np.maximum(dist, 0.0) / dist[0])


def measured_rate(decay: np.ndarray, period: int = 1, floor: float = 1e-12) -> float | None:
  """Per-step contraction over the second half of the steps where the error is above round-off.

  None when that stretch is shorter than two periods (one-peer exponential is exact after one).
  """
  valid = np.flatnonzero(decay > floor)
  last = int(valid[-1]) if valid.size else 0
  first = last // 2
  if last - first < max(5, 2 * period):
    return None
  return float((decay[last] / decay[first]) ** (1.0 / (last - first)))


def first_below(decay: np.ndarray, target: float) -> int | None:
  hit = np.flatnonzero(decay <= target)
  return int(hit[0]) if hit.size else None


def steps_from_rho(row: dict[str, Any], target: float) -> int | None:
  """Steps the rho bound needs to shrink the disagreement by ``target`` (None when rho >= 1).

  ``ceil(ln target / ln rho)`` for a static W; whole periods, at the per-period rate, for a time-varying one.
  """
  r, tau = row["rho_period"], row["period"]
  if r >= 1 - 1e-12:
    return None
  return tau * (1 if r <= target else math.ceil(math.log(target) / math.log(r)))


def analyse(name: str, n: int, config) -> tuple[dict[str, Any], np.ndarray]:
  """One (topology, n) row of the table and its decay curve."""
  tic = time.perf_counter()
  topology = TOPOLOGIES[name](n, config.seed)
  row = dict(topology=name, n=n, **messages_per_node(topology))
  build = time.perf_counter() - tic
  tic = time.perf_counter()
  row.update(spectral_facts(topology))
  row["rho_seconds"] = time.perf_counter() - tic
  tic = time.perf_counter()
  with jax.enable_x64(True):
    decay = consensus_decay(topology, config.decay_steps, config.decay_dim, config.seed)
  row["decay_seconds"] = time.perf_counter() - tic
  row.update(build_seconds=build, measured_rate=measured_rate(decay, row["period"]),
             steps_to_target=first_below(decay, config.decay_target),
             steps_to_target_from_rho=steps_from_rho(row, config.decay_target),
             bound_violation=float(np.max(decay - per_step_bound(row, len(decay)))))
  return row, decay


def per_step_bound(row: dict[str, Any], length: int) -> np.ndarray:
  """``prod_{t<k} rho(W(t))``: the guaranteed decay after k steps (rho^k when W is static)."""
  factors = np.array([row["rho_per_step"][k % row["period"]] for k in range(length - 1)])
  return np.concatenate([[1.0], np.cumprod(factors)])
