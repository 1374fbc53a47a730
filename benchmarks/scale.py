"""Millions of simulated nodes: setup, peak memory and step time from n = 64 to 1,048,576.

``python -m benchmarks.scale [--quick]`` writes ``benchmarks/results/results_scale.json``
and a log-log plot, ``benchmarks/results/scale.png``. Two sweeps, each case in a fresh process so its
peak resident memory (``ru_maxrss``) is its own and a case that fails is reported, not fatal:

- a ring with d = 16 floats per node, n = 64 ... 1,048,576;
- every topology family at n = 65,536 with d = 100.

A case is what a user runs: build the topology, ``check("doubly")``, build ``gj.gossip_sgd``,
``init``, and the first compiled step (setup), then the median of 5 more steps. The floor of
memory is the params plus the optimizer state; the rest of the peak is JAX itself (about 0.2
GB), the step's gradients and temporaries. Not part of the default suite.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import resource
import subprocess
import sys
import time

RING_NODES = (64, 1_024, 16_384, 65_536, 262_144, 1_048_576)
FAMILY_NODES = 65_536
FAMILIES = ("ring", "exponential", "symmetric_exponential", "one_peer_exponential", "torus", "grid", "hypercube",
            "erdos_renyi", "random_pairs", "star", "complete")


def build(family: str, n: int):
  from gossipjax import topology as T

  side = 2 ** (int(math.log2(n)) // 2)
  if family == "torus":
    return T.torus(side, n // side)
  if family == "grid":
    return T.grid(side, n // side, weights="metropolis")
  if family == "symmetric_exponential":
    return T.exponential(n, symmetric=True)
  if family == "erdos_renyi":
    return T.erdos_renyi(n, min(1.0, 2 * math.log(n) / n), seed=0)
  if family == "star":
    return T.star(n, weights="metropolis")
  return getattr(T, family)(n)


def measure(family: str, n: int, d: int) -> dict:
  """One case in this process (run it in a fresh one: peak RSS is per process)."""
  import jax
  import jax.numpy as jnp
  import optax

  import gossipjax as gj

  t0 = time.perf_counter()
  topo = build(family, n).check("doubly")
  tx = gj.gossip_sgd(topo, beta=0.9, learning_rate=0.1)
  params = jnp.zeros((n, d), jnp.float32)
  state = tx.init(params)
  grads = jax.random.normal(jax.random.key(0), (n, d), jnp.float32)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1))
  params, state = step(params, state, grads)
  jax.block_until_ready(params)
  setup = time.perf_counter() - t0
  times = []
  for _ in range(5):
    t = time.perf_counter()
    params, state = step(params, state, grads)
    jax.block_until_ready(params)
    times.append(time.perf_counter() - t)
  floor = 2 * n * d * 4  # params + momentum
  return {"family": family, "nodes": n, "floats_per_node": d, "setup_s": setup,
          "step_s": sorted(times)[len(times) // 2], "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
          "params_and_state_bytes": floor}


def run_case(family: str, n: int, d: int, timeout: float) -> dict:
  cmd = [sys.executable, "-m", "benchmarks.scale", "--one", family, str(n), str(d)]
  root = pathlib.Path(__file__).resolve().parent.parent
  try:
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"family": family, "nodes": n, "floats_per_node": d, "error": f"timed out after {timeout:.0f} s"}
  if proc.returncode != 0:
    last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"family": family, "nodes": n, "floats_per_node": d, "error": last[:300]}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def plot(rows: list[dict], path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ok = [r for r in rows if "error" not in r]
  n = [r["nodes"] for r in ok]
  fig, axes = plt.subplots(1, 3, figsize=(14, 4))
  axes[0].loglog(n, [r["setup_s"] for r in ok], "o-")
  axes[0].set(xlabel="nodes", ylabel="setup to the first step (s)")
  axes[1].loglog(n, [r["peak_rss_bytes"] / 2**30 for r in ok], "o-", label="peak RSS")
  axes[1].loglog(n, [r["params_and_state_bytes"] / 2**30 for r in ok], "s--", label="params + state (floor)")
  axes[1].set(xlabel="nodes", ylabel="GiB")
  axes[1].legend(fontsize=8)
  axes[2].loglog(n, [r["step_s"] / r["nodes"] * 1e9 for r in ok], "o-")
  axes[2].set(xlabel="nodes", ylabel="step time per node (ns)")
  for ax in axes:
    ax.grid(alpha=0.3, which="both")
  fig.suptitle(f"gj.gossip_sgd on a ring, d = {ok[0]['floats_per_node'] if ok else '?'} floats per node, simulate backend")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def table(result: dict) -> list[str]:
  lines = ["family               nodes      d   setup s   step ms  ns/node  peak GiB  floor GiB"]
  for r in result["ring"] + result["families"]:
    if "error" in r:
      lines.append(f"{r['family']:<20s} {r['nodes']:>8d} {r['floats_per_node']:>4d}  {r['error']}")
    else:
      lines.append(f"{r['family']:<20s} {r['nodes']:>8d} {r['floats_per_node']:>4d} {r['setup_s']:9.2f} "
                   f"{r['step_s'] * 1e3:9.2f} {r['step_s'] / r['nodes'] * 1e9:8.1f} "
                   f"{r['peak_rss_bytes'] / 2**30:9.2f} {r['params_and_state_bytes'] / 2**30:10.3f}")
  return lines


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes only")
  parser.add_argument("--one", nargs=3, metavar=("FAMILY", "N", "D"), help=argparse.SUPPRESS)
  parser.add_argument("--json", default=str(pathlib.Path(__file__).parent / "results" / "results_scale.json"))
  args = parser.parse_args(argv)
  if args.one:
    family, n, d = args.one
    print(json.dumps(measure(family, int(n), int(d))))
    return {}
  ring_nodes = RING_NODES[:3] if args.quick else RING_NODES
  family_nodes = 1_024 if args.quick else FAMILY_NODES
  result = {"ring": [run_case("ring", n, 16, 600) for n in ring_nodes],
            "families": [run_case(f, family_nodes, 100, 600) for f in FAMILIES]}
  pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
  plot(result["ring"], pathlib.Path(args.json).with_name("scale.png"))
  print("\n".join(table(result)))
  return result


if __name__ == "__main__":
  main()
