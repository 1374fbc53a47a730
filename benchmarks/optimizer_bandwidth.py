"""The DmSGD optimizer step alone against the machine's copy bandwidth, measured in the same run.

64 nodes x 2^20 float32 (one leaf), params and momentum donated. A DmSGD step must at
least read x, m, g and write x, m: five passes over n x d floats. Its bandwidth is those
bytes over its time, and the target is 80% of the bandwidth of an in-place copy-like pass
(``x * c``, two passes) timed alongside. ``gossipjax_*`` is ``gj.gossip_sgd`` then
``optax.apply_updates`` (on the one-peer exponential graph each call takes the next W(k) of
the period, so the median is over its rounds). A dense ``W @ X`` mixing is timed as the foil,
and the same update with no mixing at all (W = I, purely elementwise, in place) as the floor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gossipjax as gj
from benchmarks import _timing

BETA, LR = 0.9, 0.05
PASSES = 5  # read x, m, g; write x, m


def library_update(topology):
  """``(x, opt_state, g) -> (x, opt_state)``: ``gj.gossip_sgd`` then ``optax.apply_updates``."""
  tx = gj.gossip_sgd(topology, beta=BETA, learning_rate=LR)

  def step(x, state, g):
    updates, state = tx.update(g, state, x)
    return optax.apply_updates(x, updates), state

  return tx, jax.jit(step, donate_argnums=(0, 1))


def fused_ring_update():
  def step(x, m, g):
    m = BETA * m + g
    y = x - LR * m
    return (y + jnp.roll(y, 1, axis=0) + jnp.roll(y, -1, axis=0)) * (1.0 / 3.0), m

  return jax.jit(step, donate_argnums=(0, 1))


def no_mixing_update():
  """DmSGD with W = I: the purely elementwise floor that any mixing can only add to."""

  def step(x, m, g):
    m = BETA * m + g
    return x - LR * m, m

  return jax.jit(step, donate_argnums=(0, 1))


def dense_update(w: np.ndarray):
  wj = jnp.asarray(w, jnp.float32)

  def step(x, m, g):
    m = BETA * m + g
    return wj @ (x - LR * m), m

  return jax.jit(step, donate_argnums=(0, 1))


def run(quick: bool = False) -> dict:
  n, d, reps = (8, 1 << 14, 3) if quick else (64, 1 << 20, 15)
  key = jax.random.key(0)
  g = jax.random.normal(key, (n, d), jnp.float32)
  x0 = jax.random.normal(jax.random.fold_in(key, 1), (n, d), jnp.float32)
  steps = {}
  copy, copy_bytes = _timing.copy_step((n, d))
  steps["copy"] = copy

  def stateful(name, f, state):
    box = {"x": x0.copy(), "s": state}

    def call():
      box["x"], box["s"] = f(box["x"], box["s"], g)
      jax.block_until_ready(box["x"])

    steps[name] = call

  for topo in (gj.topology.ring(n), gj.topology.exponential(n), gj.topology.one_peer_exponential(n)):
    tx, f = library_update(topo)
    stateful(f"gossipjax_{topo.name}", f, tx.init(x0))
  stateful("hand_fused_ring", fused_ring_update(), jnp.zeros_like(x0))
  stateful("no_mixing_floor", no_mixing_update(), jnp.zeros_like(x0))
  stateful("dense_matmul_ring", dense_update(gj.topology.ring(n).matrix()), jnp.zeros_like(x0))
  times = _timing.interleaved(steps, reps=reps, warmup=2)
  copy_bw = copy_bytes / times["copy"]
  step_bytes = PASSES * n * d * 4
  out = {"num_nodes": n, "floats_per_node": d, "copy_GBps": copy_bw / 1e9, "seconds": times, "GBps": {},
         "fraction_of_copy_bandwidth": {}}
  for k, t in times.items():
    if k == "copy":
      continue
    out["GBps"][k] = step_bytes / t / 1e9
    out["fraction_of_copy_bandwidth"][k] = (step_bytes / t) / copy_bw
  return out


def table(r: dict) -> list[str]:
  rows = [f"Optimizer step alone, {r['num_nodes']} nodes x {r['floats_per_node']} floats; "
          f"in-place copy {r['copy_GBps']:.1f} GB/s ({r['seconds']['copy'] * 1e3:.1f} ms)"]
  for k, f in r["fraction_of_copy_bandwidth"].items():
    rows.append(f"  {k:28s} {r['seconds'][k] * 1e3:8.1f} ms  {r['GBps'][k]:6.1f} GB/s  {f:5.2f} of copy bandwidth")
  return rows
