"""Cost of the simulated-time tools as the number of nodes grows.

``python -m benchmarks.simulators [--quick] [--only NAME ...] [--json PATH]`` (not part of the
default suite) times:

- ``adpsgd``: one AD-PSGD event (``gj.asynchrony.adpsgd``), d = 100, at n = 256, 4,096 and
  65,536, with uniform peers (``topology=None``) and on a ring. An event touches one node and
  one peer, so its cost should not grow with n.
- ``sgp``: one step of SGP with bounded staleness (tau = 1) on the one-peer directed
  exponential graph, d = 100, at n = 1,024 and 16,384 (per step, so per node it should be flat).
- ``faults``: one synchronous D-PSGD round with ``faulty_mix`` on a ring under node outages
  and message losses, d = 100, at n = 1,024 and 16,384.
- ``dirichlet``: ``gj.data.partition_dirichlet`` of 60,000 labels (10 classes, alpha = 0.1)
  over 16,384 and 60,000 nodes, where many nodes start with no sample.

A size that fails (e.g. out of memory) is reported with its error instead of a time.
``benchmarks/results/results_simulators.json`` holds a run, next to the same measurements of the
dense implementations they replaced (``before``).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gossipjax as gj
from gossipjax import asynchrony as ga

D = 100


def _problem(n: int, samples_per_node: int = 4, seed: int = 0):
  """Least squares with ``samples_per_node`` samples of dimension D on each node."""
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(n * samples_per_node, D)).astype(np.float32)
  b = (a @ rng.normal(size=D)).astype(np.float32)
  parts = np.arange(n * samples_per_node).reshape(n, samples_per_node)
  data = gj.data.node_data(a, b, list(parts))

  def loss_fn(x, batch):
    ai, bi = batch
    return 0.5 * jnp.mean((ai @ x["w"] - bi) ** 2)

  return data, loss_fn, {"w": jnp.zeros((n, D), jnp.float32)}


def _per_call(run, state, count: int, reps: int):
  """Median seconds of ``run(state, count)`` (compiled first), and the state it ends in."""
  state = run(state, count)
  jax.block_until_ready(state)
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    state = run(state, count)
    jax.block_until_ready(state)
    times.append(time.perf_counter() - t0)
  return float(np.median(times)), state


def _guard(fn, *args):
  try:
    return fn(*args)
  except Exception as e:  # a size the old dense code cannot hold is a result, not a crash
    return {"error": f"{type(e).__name__}: {str(e)[:200]}"}


def adpsgd_event(n: int, topology: str, events: int, reps: int) -> dict:
  data, loss_fn, params = _problem(n)
  topo = None if topology == "uniform" else gj.topology.ring(n)
  t0 = time.perf_counter()
  sim = ga.adpsgd(loss_fn, data, ga.cluster(n, jitter=0.3, latency=0.01), topo, learning_rate=0.01, batch_size=4)
  state = sim.init(params, jax.random.key(0))
  setup = time.perf_counter() - t0
  seconds, _ = _per_call(sim.run, state, events, reps)
  return {"us_per_event": seconds / events * 1e6, "setup_s": setup}


def sgp_step(n: int, steps: int, reps: int) -> dict:
  data, loss_fn, params = _problem(n)
  topo = gj.topology.one_peer_directed_exponential(n)
  t0 = time.perf_counter()
  sim = ga.sgp_bounded_staleness(loss_fn, data, ga.cluster(n, jitter=0.3, latency=0.5), topo, learning_rate=0.01,
                                 batch_size=4, tau=1)
  state = sim.init(params, jax.random.key(0))
  setup = time.perf_counter() - t0
  seconds, _ = _per_call(sim.run, state, steps, reps)
  return {"ms_per_step": seconds / steps * 1e3, "ns_per_node_step": seconds / steps / n * 1e9, "setup_s": setup}


def fault_round(n: int, rounds: int, reps: int) -> dict:
  data, loss_fn, params = _problem(n)
  f = ga.faults(down=[(1, 0.0, 1e9), (n // 2, 0.0, 1e9)], loss_prob=0.1)
  t0 = time.perf_counter()
  tx = optax.chain(optax.scale_by_learning_rate(0.01), ga.faulty_mix(gj.topology.ring(n)))
  sim = ga.synchronous(loss_fn, data, ga.cluster(n, jitter=0.3), tx, 4, faults=f)
  state = sim.init(params, jax.random.key(0))
  setup = time.perf_counter() - t0
  seconds, _ = _per_call(sim.run, state, rounds, reps)
  return {"ms_per_round": seconds / rounds * 1e3, "ns_per_node_round": seconds / rounds / n * 1e9,
          "setup_s": setup}


def dirichlet(n: int, samples: int = 60_000) -> dict:
  labels = np.random.default_rng(0).integers(0, 10, samples)
  t0 = time.perf_counter()
  parts = gj.data.partition_dirichlet(labels, n, 0.1, seed=0)
  seconds = time.perf_counter() - t0
  return {"seconds": seconds, "samples": samples, "min_part": int(min(len(p) for p in parts))}


def run(quick: bool = False, only: tuple[str, ...] = ()) -> dict:
  out = {"machine": _machine(), "d": D}
  want = lambda name: not only or name in only
  if want("adpsgd"):
    sizes = (16, 64) if quick else (256, 4096, 65536)
    # 20,000 events per call: a call also copies the (n, d) params once (O(n d)), which
    # this many events make small next to the events themselves at 65,536 nodes.
    out["adpsgd"] = {f"{topo}/{n}": _guard(adpsgd_event, n, topo, 50 if quick else 20000, 2 if quick else 5)
                     for topo in ("uniform", "ring") for n in sizes}
  if want("sgp"):
    sizes = (16, 64) if quick else (1024, 16384)
    out["sgp"] = {str(n): _guard(sgp_step, n, 3 if quick else 20, 2 if quick else 5) for n in sizes}
  if want("faults"):
    sizes = (16, 64) if quick else (1024, 16384)
    out["faults"] = {str(n): _guard(fault_round, n, 3 if quick else 20, 2 if quick else 5) for n in sizes}
  if want("dirichlet"):
    sizes = (64, 1024) if quick else (16384, 60000)
    out["dirichlet"] = {str(n): _guard(dirichlet, n, 2000 if quick else 60_000) for n in sizes}
  return out


def _machine() -> dict:
  from benchmarks import _timing

  return _timing.machine()


def table(r: dict) -> list[str]:
  rows = [f"Simulators, d = {r['d']}"]
  show = lambda v, key, unit: v["error"][:60] if "error" in v else f"{v[key]:10.2f} {unit}"
  for name, v in r.get("adpsgd", {}).items():
    rows.append(f"  adpsgd    {name:>14s}  {show(v, 'us_per_event', 'us/event')}")
  for name, v in r.get("sgp", {}).items():
    rows.append(f"  sgp       n = {name:>8s}  {show(v, 'ms_per_step', 'ms/step')}")
  for name, v in r.get("faults", {}).items():
    rows.append(f"  faults    n = {name:>8s}  {show(v, 'ms_per_round', 'ms/round')}")
  for name, v in r.get("dirichlet", {}).items():
    rows.append(f"  dirichlet n = {name:>8s}  {show(v, 'seconds', 's')}")
  return rows


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.simulators", description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that every part runs")
  parser.add_argument("--only", nargs="*", default=(), choices=("adpsgd", "sgp", "faults", "dirichlet"))
  parser.add_argument("--json", default=None, help="also write the figures to this path")
  args = parser.parse_args(argv)
  r = run(args.quick, tuple(args.only))
  print("\n".join(table(r)), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(r, f, indent=1)
  return r


if __name__ == "__main__":
  main()
