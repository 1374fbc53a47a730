"""64 nodes of a ResNet-20 (CIFAR-sized inputs, batch 32 per node) on one GPU.

Reports node-steps per second of the ring DmSGD training step and the fraction of the
step spent in mixing (the mixing of the params alone, timed in the same interleaved
rounds, over the full step). Runs where ``jax.devices()[0].platform == "gpu"``, or
anywhere with ``force=True`` (``python -m benchmarks --gpu``); elsewhere it records that
no GPU was there.
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import gossipjax as gj
from benchmarks import _timing


class _Block(nn.Module):
  features: int
  stride: int

  @nn.compact
  def __call__(self, x, train: bool):
    norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9)
    y = nn.Conv(self.features, (3, 3), (self.stride, self.stride), padding="SAME", use_bias=False)(x)
    y = nn.relu(norm()(y))
    y = nn.Conv(self.features, (3, 3), padding="SAME", use_bias=False)(y)
    y = norm()(y)
    if self.stride != 1 or x.shape[-1] != self.features:
      x = nn.Conv(self.features, (1, 1), (self.stride, self.stride), use_bias=False)(x)
      x = norm()(x)
    return nn.relu(x + y)


class ResNetCifar(nn.Module):
  """ResNet-(6k+2) of He et al. 2016 for 32x32 inputs: ``blocks_per_stage=3`` is ResNet-20."""

  blocks_per_stage: int = 3
  widths: Sequence[int] = (16, 32, 64)
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(self.widths[0], (3, 3), padding="SAME", use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    for stage, width in enumerate(self.widths):
      for b in range(self.blocks_per_stage):
        x = _Block(width, 2 if stage > 0 and b == 0 else 1)(x, train)
    return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


def run(quick: bool = False, force: bool = False) -> dict:
  platform = jax.devices()[0].platform
  if platform != "gpu" and not force:
    return {"skipped": f"no GPU on this machine (jax platform: {platform}); run on a GPU machine "
                       "or force with `python -m benchmarks --gpu`"}
  n, batch, blocks, reps = (2, 4, 1, 2) if quick else (64, 32, 3, 10)
  model = ResNetCifar(blocks_per_stage=blocks)
  key = jax.random.key(0)
  sample = jnp.zeros((1, 32, 32, 3), jnp.float32)
  variables = gj.init_nodes(lambda k: model.init(k, sample), key, n)
  params, stats = variables["params"], variables["batch_stats"]
  images = jax.random.normal(jax.random.fold_in(key, 1), (n, batch, 32, 32, 3), jnp.float32)
  labels = jax.random.randint(jax.random.fold_in(key, 2), (n, batch), 0, 10)
  topo = gj.topology.ring(n)
  tx = gj.gossip_sgd(topo, beta=0.9, learning_rate=0.05)

  def loss(p, s, x, y):
    logits, new = model.apply({"params": p, "batch_stats": s}, x, train=True, mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new["batch_stats"]

  def make_step(tx):
    def step(p, s, opt_state, x, y):
      grads, s = jax.vmap(jax.grad(loss, has_aux=True))(p, s, x, y)
      updates, opt_state = tx.update(grads, opt_state, p)
      return optax.apply_updates(p, updates), s, opt_state

    return jax.jit(step, donate_argnums=(0, 1, 2))

  # The same method inside gj.chain: one node's optimizer mapped with the node axis named.
  named = gj.chain(gj.gossip_sgd(topo, beta=0.9, learning_rate=0.05))
  step, named_step = make_step(tx), make_step(named)
  mixer = gj.backend.simulate().mixer(topo)
  mix = jax.jit(lambda p: mixer.mix(p, 0), donate_argnums=0)
  box = {"p": params, "s": stats, "o": tx.init(params), "m": jax.tree.map(jnp.copy, params)}
  named_box = {"p": jax.tree.map(jnp.copy, params), "s": jax.tree.map(jnp.copy, stats), "o": named.init(params)}

  def train():
    box["p"], box["s"], box["o"] = step(box["p"], box["s"], box["o"], images, labels)
    jax.block_until_ready(box["p"])

  def train_named():
    b = named_box
    b["p"], b["s"], b["o"] = named_step(b["p"], b["s"], b["o"], images, labels)
    jax.block_until_ready(b["p"])

  def mixing():
    box["m"] = mix(box["m"])
    jax.block_until_ready(box["m"])

  times = _timing.interleaved({"step": train, "named_step": train_named, "mixing": mixing}, reps=reps, warmup=2)
  return {"device": _timing.machine()["device"], "num_nodes": n, "batch_per_node": batch,
          "model": f"ResNet-{6 * blocks + 2}", "params_per_node": _timing.tree_bytes(params) // 4 // n,
          "step_s": times["step"], "mixing_s": times["mixing"], "node_steps_per_s": n / times["step"],
          "mixing_fraction": times["mixing"] / times["step"], "named_step_s": times["named_step"],
          "named_to_stacked": times["named_step"] / times["step"]}


def table(r: dict) -> list[str]:
  if "skipped" in r:
    return [f"ResNet-20 on GPU: {r['skipped']}"]
  return [f"{r['model']} x {r['num_nodes']} nodes on {r['device']}, batch {r['batch_per_node']}/node "
          f"({r['params_per_node']} params/node)",
          f"  step {r['step_s'] * 1e3:.1f} ms  {r['node_steps_per_s']:.0f} node-steps/s  "
          f"mixing {r['mixing_s'] * 1e3:.2f} ms = {100 * r['mixing_fraction']:.1f}% of the step",
          f"  the same method inside gj.chain (named node axis): {r['named_step_s'] * 1e3:.1f} ms = "
          f"{r['named_to_stacked']:.3f}x the stacked call"]
