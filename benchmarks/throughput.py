"""Throughput as the number of simulated nodes grows: node-steps per second for n up to 1,024.

A small model (MLP 64-32-10 on digit-sized inputs, batch 32 per node), ring DmSGD with the
library step, params and optimizer state donated. Every size is timed in the same
interleaved rounds.
"""

from __future__ import annotations

import jax

import gossipjax as gj
from benchmarks import _timing, dmsgd_step

SIZES = (64, 32, 10)


def run(quick: bool = False) -> dict:
  nodes, batch, reps = ((4, 16), 8, 3) if quick else ((16, 64, 256, 1024), 32, 7)
  steps = {}
  for n in nodes:
    params, (x, y) = dmsgd_step.problem(n, batch, SIZES)
    tx, step = dmsgd_step.library_step(gj.topology.ring(n))
    box = {"p": params, "s": tx.init(params)}

    def call(box=box, step=step, x=x, y=y):
      box["p"], box["s"] = step(box["p"], box["s"], x, y)
      jax.block_until_ready(box["p"])

    steps[n] = call
  times = _timing.interleaved(steps, reps=reps, warmup=2)
  return {"model": "MLP " + "-".join(map(str, SIZES)), "batch_per_node": batch,
          "seconds_per_step": {str(n): t for n, t in times.items()},
          "node_steps_per_s": {str(n): n / t for n, t in times.items()}}


def table(r: dict) -> list[str]:
  rows = [f"Throughput: {r['model']}, batch {r['batch_per_node']}/node, ring DmSGD"]
  for n, v in r["node_steps_per_s"].items():
    rows.append(f"  n = {n:>5s}  {r['seconds_per_step'][n] * 1e3:8.2f} ms/step  {v:10.0f} node-steps/s")
  return rows
