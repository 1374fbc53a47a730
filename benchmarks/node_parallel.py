"""Node-parallel scaling: a CNN training step sharded over 1, 2, 4 and 8 devices.

The step is what a user writes: each node's gradient through ``backend.map``, a
``gj.per_node`` gradient clip, ``gj.gossip_sgd`` on a ring, ``optax.apply_updates``, under
``jax.jit`` with the params and state donated. Two sweeps, timed in the same interleaved
rounds:

- weak scaling: a fixed number of nodes per device (n grows with the devices); the ideal
  is a constant step time, reported as efficiency = t(1 device) / t(K devices);
- strong scaling: a fixed n split over more devices; the ideal is K times faster,
  reported as speedup = t(1 device) / t(K devices).

Each device's FLOPs come from the compiled program's cost analysis. On a CPU host the
devices are XLA's simulated CPU devices (``--xla_force_host_platform_device_count``); they
share the host's cores, so past the number of cores the speedup is bounded by the cores,
not by the library.

Run: ``python -m benchmarks --only node_parallel`` (it starts a process with 8 devices).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

DEVICES = (1, 2, 4, 8)


def run(quick: bool = False) -> dict:
  """Runs the sweep in a process of its own, where XLA has 8 devices."""
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / "node_parallel.json"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
      flags = f"{flags} --xla_force_host_platform_device_count={max(DEVICES)}".strip()
    cmd = [sys.executable, "-m", "benchmarks.node_parallel", "--json", str(out)] + (["--quick"] if quick else [])
    root = pathlib.Path(__file__).resolve().parent.parent
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=dict(os.environ, XLA_FLAGS=flags))
    if proc.returncode != 0 or not out.exists():
      raise RuntimeError(f"node_parallel failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _measure(quick: bool) -> dict:
  import jax
  import jax.numpy as jnp
  import optax

  import gossipjax as gj
  from benchmarks import _timing
  from gossipjax.train import CNN

  devices = [k for k in DEVICES if k <= jax.device_count()]
  per_device, total, batch, reps = (2, 8, 8, 3) if quick else (4, 32, 32, 7)
  features = (4,) if quick else (16, 32)
  model = CNN(features=features, num_classes=10)

  def loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

  def build(k: int, n: int, plain_vmap: bool = False):
    mesh = jax.make_mesh((k,), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:k])
    be = gj.backend.sharded(mesh)
    kx, ky = jax.random.split(jax.random.key(n))
    x = jax.random.normal(kx, (n, batch, 8, 8, 1), jnp.float32)
    y = jax.random.randint(ky, (n, batch), 0, 10)
    params = gj.init_nodes(lambda key: model.init(key, x[0]), jax.random.key(0), n)
    tx = optax.chain(gj.per_node(optax.clip_by_global_norm(1.0), backend=be),
                     gj.gossip_sgd(gj.topology.ring(n), beta=0.9, learning_rate=0.05, backend=be))
    params, x, y = be.shard((params, x, y))
    grads = jax.vmap(jax.grad(loss)) if plain_vmap else be.map(jax.grad(loss))

    def step(params, state, x, y):
      updates, state = tx.update(grads(params, x, y), state, params)
      return optax.apply_updates(params, updates), state

    state = tx.init(params)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, x, y).compile()
    box = {"p": params, "s": state}

    def call():
      box["p"], box["s"] = compiled(box["p"], box["s"], x, y)
      jax.block_until_ready(box["p"])

    return call, float(compiled.cost_analysis()["flops"])

  steps, flops, sizes, built = {}, {}, {}, {}
  for k in devices:
    for sweep, n in (("weak", per_device * k), ("strong", total)):
      name = f"{sweep}_{k}"
      if (k, n) not in built:  # where the two sweeps meet (n = per_device * k = total) they share one program
        built[k, n] = build(k, n)
      steps[name], flops[name] = built[k, n]
      sizes[name] = n
  # The same strong-scaling step on all devices with the gradient left to the compiler's own
  # partitioning of a plain vmap (which all-gathers the batch): what backend.map saves.
  k = devices[-1]
  steps["plain_vmap"], flops["plain_vmap"] = build(k, total, plain_vmap=True)
  times = _timing.interleaved(steps, reps=reps, warmup=2)
  rows = {}
  for sweep in ("weak", "strong"):
    base = times[f"{sweep}_1"]
    for k in devices:
      name = f"{sweep}_{k}"
      rows[name] = {"devices": k, "nodes": sizes[name], "seconds_per_step": times[name],
                    "ratio_to_1_device": base / times[name], "flops_per_device": flops[name],
                    "flops_per_device_ratio_to_1_device": flops[name] / flops[f"{sweep}_1"]}
  rows["plain_vmap"] = {"devices": k, "nodes": total, "seconds_per_step": times["plain_vmap"],
                        "ratio_to_1_device": times["strong_1"] / times["plain_vmap"], "flops_per_device": flops["plain_vmap"],
                        "flops_per_device_ratio_to_1_device": flops["plain_vmap"] / flops["strong_1"]}
  return {"model": f"CNN conv{'-'.join(map(str, features))}, 8x8x1 inputs, batch {batch}/node",
          "algorithm": "per_node(clip_by_global_norm) + gossip_sgd(ring, beta=0.9), grads through backend.map",
          "nodes_per_device_weak": per_device, "nodes_strong": total, "platform": jax.default_backend(),
          "host_cores": os.cpu_count(), "rows": rows}


def table(r: dict) -> list[str]:
  lines = [f"Node-parallel scaling: {r['model']}; {r['algorithm']} ({r['platform']}, {r['host_cores']} host cores)",
           "  sweep   devices  nodes  ms/step  t(1)/t(K)  FLOPs/device  FLOPs/device vs 1 device",
           "  (vmap: the strong step on all devices with a plain jax.vmap gradient instead of backend.map)"]
  for name, row in r["rows"].items():
    sweep = "vmap" if name == "plain_vmap" else name.split("_")[0]
    lines.append(f"  {sweep:<7s} {row['devices']:>7d} {row['nodes']:>6d} {row['seconds_per_step'] * 1e3:8.2f} "
                 f"{row['ratio_to_1_device']:10.2f} {row['flops_per_device']:13.3g} "
                 f"{row['flops_per_device_ratio_to_1_device']:10.3f}")
  return lines


if __name__ == "__main__":
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--json", required=True)
  args = parser.parse_args()
  import gossipjax as gj

  gj.backend.reserve_cpu_threads()  # before JAX's first computation: threads for collectives over 8 CPU devices
  result = _measure(args.quick)
  pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
