"""Compile time of the 64-node DmSGD step, and compilations over many steps of a time-varying W.

Static ring and time-varying topologies (one-peer exponential, random pairs) are lowered
and compiled from a fresh ``jax.jit`` each; then a time-varying step is run for two
periods and its compilation count read back (1 means the step counter is traced).
"""

from __future__ import annotations

import time

import jax

import gossipjax as gj
from benchmarks import dmsgd_step


def topologies(n: int, period: int = 16) -> dict[str, gj.topology.Topology]:
  topos = {"ring": gj.topology.ring(n), "one_peer_exponential": gj.topology.one_peer_exponential(n)}
  if hasattr(gj.topology, "random_pairs"):
    topos["random_pairs"] = gj.topology.random_pairs(n, period=period)
  return topos


def run(quick: bool = False) -> dict:
  n, batch, sizes, period = (4, 2, (6, 4, 3), 4) if quick else (64, 32, dmsgd_step.SIZES, 16)
  params, (x, y) = dmsgd_step.problem(n, batch, sizes)
  out = {"num_nodes": n, "lower_s": {}, "compile_s": {}, "compilations_over_two_periods": {}}
  for name, topo in topologies(n, period).items():
    tx, step = dmsgd_step.library_step(topo)
    state = tx.init(params)
    t0 = time.perf_counter()
    lowered = step.lower(params, state, x, y)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    out["lower_s"][name], out["compile_s"][name] = t1 - t0, t2 - t1
    if topo.is_time_varying:
      p, s = jax.tree.map(lambda a: a.copy(), params), state
      for _ in range(2 * topo.period):
        p, s = step(p, s, x, y)
      jax.block_until_ready(p)
      out["compilations_over_two_periods"][name] = step._cache_size()
  fused = dmsgd_step.fused_ring_step()
  t0 = time.perf_counter()
  fused.lower(params, jax.tree.map(lambda a: a * 0, params), x, y).compile()
  out["compile_s"]["hand_fused_ring"] = time.perf_counter() - t0
  return out


def table(r: dict) -> list[str]:
  rows = [f"Compile time, {r['num_nodes']}-node DmSGD step"]
  for k, c in r["compile_s"].items():
    low = r["lower_s"].get(k)
    rows.append(f"  {k:22s} compile {c:6.2f} s" + (f"  (trace+lower {low:5.2f} s)" if low is not None else ""))
  for k, c in r["compilations_over_two_periods"].items():
    rows.append(f"  {k:22s} {c} compilation(s) over two periods of steps")
  return rows
