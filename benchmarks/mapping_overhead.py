"""What the node mapping costs to trace and to call: `gj.chain(adam, mix)` against `optax.chain(adam, mix)`.

Decentralized Adam written two ways over the same node-stacked params of 40 leaves: on
stacked trees with optax's own ``optax.chain(optax.adam(lr), gj.mix(W))`` (Adam is
elementwise, so the two are the same update), and for one node mapped over the nodes with
``gj.chain(optax.adam(lr), gj.mix(W))``. Timed, interleaved: ``jax.jit(update).lower`` from a
fresh transform and jit (tracing and lowering; the transform's ``init`` has run, untimed, as
it must before a step), and an eager ``update`` call (``gj.chain`` compiles one
program per layout and reuses it; optax's chain runs op by op). A third form, lowered only,
is what ``jax.vmap`` itself costs: ``jax.vmap(optax.adam(lr).update)`` followed by the stacked
``gj.mix(W)``, the same update with no mapping around it.
"""

from __future__ import annotations

import gc
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gossipjax as gj


def _problem(n: int, leaves: int, size: int) -> dict:
  rng = np.random.default_rng(0)
  return {f"layer{i:02d}": jnp.asarray(rng.normal(size=(n, size)), jnp.float32) for i in range(leaves)}


def _vmapped_adam_then_mix(W, lr: float) -> optax.GradientTransformation:
  """Adam mapped with a bare ``jax.vmap``, then the stacked gossip: what ``jax.vmap`` alone costs."""
  adam, mix = optax.adam(lr), gj.mix(W)

  def init(params):
    return jax.vmap(adam.init)(params), mix.init(params)

  def update(updates, state, params=None):
    updates, adam_state = jax.vmap(adam.update)(updates, state[0], params)
    updates, mix_state = mix.update(updates, state[1], params)
    return updates, (adam_state, mix_state)

  return optax.GradientTransformation(init, update)


def _timed(fn) -> float:
  """Seconds one call of ``fn`` takes, with the garbage of the calls before it collected first
  and the collector off while it runs (as ``timeit`` does): one form's garbage never lands in
  the next form's time."""
  gc.collect()
  gc.disable()
  try:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
  finally:
    gc.enable()


def run(quick: bool = False) -> dict:
  n, leaves, size, reps = (4, 8, 16, 3) if quick else (16, 40, 256, 15)
  W = gj.topology.ring(n)
  params = _problem(n, leaves, size)
  grads = jax.tree.map(lambda x: x * 0.1, params)
  forms = {"optax.chain": lambda: optax.chain(optax.adam(1e-3), gj.mix(W)),
           "gj.chain": lambda: gj.chain(optax.adam(1e-3), gj.mix(W))}
  floor = lambda: _vmapped_adam_then_mix(W, 1e-3)
  lower = {k: [] for k in (*forms, "jax.vmap")}
  eager = {k: [] for k in forms}
  states = {k: f().init(params) for k, f in forms.items()}
  built = {k: f() for k, f in forms.items()}
  for k, tx in built.items():  # warm: the eager forms' first call compiles
    jax.block_until_ready(tx.update(grads, states[k], params))
  for _ in range(reps):
    for k, make in (*forms.items(), ("jax.vmap", floor)):
      tx = make()
      state = tx.init(params)  # untimed: a step needs the state first, for every form
      lower[k].append(_timed(lambda: jax.jit(tx.update).lower(grads, state, params)))
      if k in built:
        eager[k].append(_timed(lambda: jax.block_until_ready(built[k].update(grads, states[k], params))))
  med = lambda xs: float(np.median(xs))
  out = {"num_nodes": n, "leaves": leaves, "floats_per_leaf": size, "reps": reps,
         "lower_s": {k: med(v) for k, v in lower.items()}, "eager_update_s": {k: med(v) for k, v in eager.items()}}
  out["lower_ratio"] = out["lower_s"]["gj.chain"] / out["lower_s"]["optax.chain"]
  out["vmap_lower_ratio"] = out["lower_s"]["jax.vmap"] / out["lower_s"]["optax.chain"]
  out["eager_ratio"] = out["eager_update_s"]["gj.chain"] / out["eager_update_s"]["optax.chain"]
  return out


def table(r: dict) -> list[str]:
  rows = [f"Mapping overhead, decentralized Adam, {r['num_nodes']} nodes x {r['leaves']} leaves "
          f"(median of {r['reps']})"]
  for k in r["lower_s"]:
    eager = f"   eager update {1e3 * r['eager_update_s'][k]:8.2f} ms" if k in r["eager_update_s"] else ""
    rows.append(f"  {k:12s} trace+lower {1e3 * r['lower_s'][k]:8.1f} ms{eager}")
  rows.append(f"  gj.chain / optax.chain: lower {r['lower_ratio']:.2f}x, eager update {r['eager_ratio']:.2f}x")
  rows.append(f"  jax.vmap(adam) then stacked mix / optax.chain: lower {r['vmap_lower_ratio']:.2f}x")
  return rows
