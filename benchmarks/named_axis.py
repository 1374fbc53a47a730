"""The named node axis costs nothing: a method called on stacked trees against the same method inside ``gj.chain``.

Inside ``gj.chain`` (``gj.nodes``) each transform runs for one node under
``jax.vmap(axis_name="nodes")`` and its gossip round is a collective whose batching rule calls
the stacked mixer. Four updates of 64 nodes x 65,536 floats on a ring, jitted and donated,
timed in the same interleaved rounds:

- ``stacked``: ``gj.gossip_sgd(W, beta=0.9)`` called on the stacked trees;
- ``chain(method)``: the same method inside ``gj.chain``;
- ``chain(trace, lr, mix)``: DmSGD composed from optax's pieces and ``gj.mix`` in ``gj.chain``;
- ``rolls``: the update written by hand with ``jnp.roll`` (the floor).

Also the time to trace and compile each form at 64 and 4,096 nodes (of 16 floats): the named
form traces the one-node optimizer a few times to learn which state leaves differ between
nodes, so its compile time is reported beside the stacked one's.

Run: ``python -m benchmarks --only named_axis`` (``--quick`` for tiny sizes).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax

import gossipjax as gj
from benchmarks import _timing

BETA, LR = 0.9, 0.05


def _forms(topology: gj.topology.Topology) -> dict[str, optax.GradientTransformation]:
  return {
      "stacked": gj.gossip_sgd(topology, beta=BETA, learning_rate=LR),
      "chain(method)": gj.chain(gj.gossip_sgd(topology, beta=BETA, learning_rate=LR)),
      "chain(trace, lr, mix)": gj.chain(optax.trace(BETA), optax.scale_by_learning_rate(LR), gj.mix(topology)),
  }


def _rolls():
  def update(g, m, x):
    m = BETA * m + g
    half = x - LR * m
    return (half + jnp.roll(half, 1, 0) + jnp.roll(half, -1, 0)) / 3 - x, m

  return update


def _stepper(update, state, params, grads):
  step = jax.jit(update, donate_argnums=(1,))
  box = {"state": state}

  def call():
    u, box["state"] = step(grads, box["state"], params)
    jax.block_until_ready(u)

  return call


def _compile_seconds(tx, n: int, d: int) -> float:
  params = jnp.zeros((n, d))
  start = time.perf_counter()
  jax.jit(tx.update).lower(params, tx.init(params), params).compile()
  return time.perf_counter() - start


def run(quick: bool = False) -> dict:
  n, d, reps = (8, 256, 3) if quick else (64, 65536, 15)
  topology = gj.topology.ring(n)
  key = jax.random.key(0)
  params = jax.random.normal(key, (n, d))
  grads = jax.random.normal(jax.random.fold_in(key, 1), (n, d))
  steps = {name: _stepper(tx.update, tx.init(params), params, grads) for name, tx in _forms(topology).items()}
  steps["rolls"] = _stepper(_rolls(), jnp.zeros_like(params), params, grads)
  seconds = _timing.interleaved(steps, reps=reps)
  ms = {name: 1e3 * t for name, t in seconds.items()}
  compile_n = (8, 64) if quick else (64, 4096)
  compile_s = {f"{name} n={m}": _compile_seconds(tx, m, 16)
               for m in compile_n for name, tx in _forms(gj.topology.ring(m)).items()}
  return {"nodes": n, "floats": d, "update_ms": ms, "compile_s": compile_s,
          "ratio_to_stacked": {name: v / ms["stacked"] for name, v in ms.items()}}


def table(r: dict) -> list[str]:
  rows = [f"Named node axis: {r['nodes']} nodes x {r['floats']} floats, ring, one optimizer update "
          "(median ms, interleaved)"]
  for name, v in r["update_ms"].items():
    rows.append(f"  {name:24s} {v:8.3f} ms   {r['ratio_to_stacked'][name]:.2f}x stacked")
  rows.append("  trace + compile (s), 16 floats per node:")
  for name, v in r["compile_s"].items():
    rows.append(f"  {name:32s} {v:6.2f}")
  return rows


if __name__ == "__main__":
  print("\n".join(table(run())))
