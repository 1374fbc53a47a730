"""64 nodes of a ResNet-20 (CIFAR-sized inputs, batch 32 per node) on one GPU, against ``torch.func.vmap``.

One invocation times, interleaved, the ring DmSGD training step of gossipjax at three precisions (float32 at
JAX's default matmul precision, which is TF32 on NVIDIA GPUs; full float32,
``jax.default_matmul_precision("highest")``; bfloat16 compute with float32 params), the same step with XLA's own
weight gradient (``weight_grad="xla"``), the method inside ``gj.chain``, the mixing alone, and, when torch can
be imported, the same ResNet-20 under ``torch.func.vmap(grad(loss))`` at the same three precisions (TF32
convolutions, torch's default; ``cudnn.allow_tf32=False``; ``torch.autocast`` to bfloat16). It writes each
precision's ratio of torch's time to gossipjax's. functorch cannot vmap a BatchNorm that updates running
statistics, so the torch model's BatchNorm uses each batch's statistics only (``track_running_stats=False``);
gossipjax's keeps running statistics per node.

On a GPU both frameworks share the device: JAX takes 75% of its memory when it starts (its default), torch
the rest. Runs where ``jax.devices()[0].platform == "gpu"``, or anywhere with ``force=True``
(``python -m benchmarks --gpu``); elsewhere it records that no GPU was there. ``quick`` is a smoke run at a
tiny size (2 nodes, a ResNet-6 of widths 4 and 8 on 8x8 images).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import gossipjax as gj
from benchmarks import _timing

PRECISIONS = ("float32", "float32_highest", "bfloat16")
BETA, LR = 0.9, 0.05


class _Block(nn.Module):
  features: int
  stride: int
  conv: Any
  dtype: Any

  @nn.compact
  def __call__(self, x, train: bool):
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype, conv_general_dilated=self.conv)
    norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=self.dtype)
    y = conv(self.features, (3, 3), (self.stride, self.stride), padding="SAME")(x)
    y = nn.relu(norm()(y))
    y = conv(self.features, (3, 3), padding="SAME")(y)
    y = norm()(y)
    if self.stride != 1 or x.shape[-1] != self.features:
      x = conv(self.features, (1, 1), (self.stride, self.stride))(x)
      x = norm()(x)
    return nn.relu(x + y)


class ResNetCifar(nn.Module):
  """ResNet-(6k+2) of He et al. 2016 for 32x32 inputs: ``blocks_per_stage=3`` is ResNet-20.

  Its convolutions are ``gj.layers.conv_general_dilated`` (``conv``); ``dtype`` is the compute dtype
  (the params stay float32).
  """

  blocks_per_stage: int = 3
  widths: Sequence[int] = (16, 32, 64)
  num_classes: int = 10
  conv: Any = gj.layers.conv_general_dilated
  dtype: Any = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(self.widths[0], (3, 3), padding="SAME", use_bias=False, dtype=self.dtype,
                conv_general_dilated=self.conv)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=self.dtype)(x))
    for stage, width in enumerate(self.widths):
      for b in range(self.blocks_per_stage):
        x = _Block(width, 2 if stage > 0 and b == 0 else 1, self.conv, self.dtype)(x, train)
    return nn.Dense(self.num_classes, dtype=self.dtype)(jnp.mean(x, axis=(1, 2))).astype(jnp.float32)


def _jax_contender(model, tx, variables, images, labels, precision: str | None) -> Callable[[], None]:
  """A stateful closure running one donated DmSGD step of ``model`` (at ``precision``, if given)."""
  def loss(p, s, x, y):
    logits, new = model.apply({"params": p, "batch_stats": s}, x, train=True, mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new["batch_stats"]

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
  def step(p, s, opt_state, x, y):
    grads, s = jax.vmap(jax.grad(loss, has_aux=True))(p, s, x, y)
    updates, opt_state = tx.update(grads, opt_state, p)
    return optax.apply_updates(p, updates), s, opt_state

  params = jax.tree.map(jnp.copy, variables["params"])
  box = {"p": params, "s": jax.tree.map(jnp.copy, variables["batch_stats"]), "o": tx.init(params)}
  context = (lambda: jax.default_matmul_precision(precision)) if precision else contextlib.nullcontext

  def run():
    with context():
      box["p"], box["s"], box["o"] = step(box["p"], box["s"], box["o"], images, labels)
    jax.block_until_ready(box["p"])

  return run


def _torch_contenders(n: int, blocks: int, widths, images, labels) -> tuple[dict[str, Callable[[], None]], str]:
  """``torch.func.vmap(grad(loss))`` over the same ResNet, one closure per precision; empty if torch is missing."""
  try:
    import torch
  except ImportError as e:
    return {}, f"skipped: torch is not installed ({e}); pip install 'gossipjax[bench]'"
  from torch import nn as tnn
  from torch.func import functional_call, grad, stack_module_state, vmap

  device = "cuda" if torch.cuda.is_available() else "cpu"

  def bn(c):  # per-batch statistics: functorch cannot vmap an in-place running-statistics update
    return tnn.BatchNorm2d(c, track_running_stats=False)

  class Block(tnn.Module):
    def __init__(self, cin, cout, stride):
      super().__init__()
      self.c1, self.b1 = tnn.Conv2d(cin, cout, 3, stride, 1, bias=False), bn(cout)
      self.c2, self.b2 = tnn.Conv2d(cout, cout, 3, 1, 1, bias=False), bn(cout)
      self.short = None
      if stride != 1 or cin != cout:
        self.short = tnn.Sequential(tnn.Conv2d(cin, cout, 1, stride, bias=False), bn(cout))

    def forward(self, x):
      y = self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))
      return torch.relu(y + (x if self.short is None else self.short(x)))

  def build():
    layers: list[tnn.Module] = [tnn.Conv2d(3, widths[0], 3, 1, 1, bias=False), bn(widths[0]), tnn.ReLU()]
    cin = widths[0]
    for stage, width in enumerate(widths):
      for b in range(blocks):
        layers.append(Block(cin, width, 2 if stage > 0 and b == 0 else 1))
        cin = width
    return tnn.Sequential(*layers, tnn.AdaptiveAvgPool2d(1), tnn.Flatten(), tnn.Linear(cin, 10))

  models = [build().to(device) for _ in range(n)]
  params, _ = stack_module_state(models)
  base = build().to("meta")
  x = torch.from_numpy(np.asarray(images)).permute(0, 1, 4, 2, 3).contiguous().to(device)
  y = torch.from_numpy(np.asarray(labels)).long().to(device)

  def loss(p, xb, yb):
    return tnn.functional.cross_entropy(functional_call(base, p, (xb,)), yb)

  grads = vmap(grad(loss))

  def make(precision):
    state = {"p": {k: v.detach().clone() for k, v in params.items()},
             "m": {k: torch.zeros_like(v) for k, v in params.items()}}

    def run():
      torch.backends.cudnn.allow_tf32 = precision != "float32_highest"
      autocast = (torch.autocast(device_type=device, dtype=torch.bfloat16) if precision == "bfloat16"
                  else contextlib.nullcontext())
      with autocast:
        g = grads(state["p"], x, y)
      with torch.no_grad():
        for k, p in state["p"].items():
          m = BETA * state["m"][k] + g[k]
          z = p - LR * m
          state["p"][k] = (z + torch.roll(z, 1, 0) + torch.roll(z, -1, 0)) * (1.0 / 3.0)
          state["m"][k] = m
      if device == "cuda":
        torch.cuda.synchronize()

    return run

  note = f"torch {torch.__version__} on {device}; BatchNorm with per-batch statistics (track_running_stats=False)"
  return {f"torch_{p}": make(p) for p in PRECISIONS}, note


def run(quick: bool = False, force: bool = False, include_torch: bool = True) -> dict:
  platform = jax.devices()[0].platform
  if platform != "gpu" and not force:
    return {"skipped": f"no GPU on this machine (jax platform: {platform}); run on a GPU machine "
                       "or force with `python -m benchmarks --gpu`"}
  n, batch, blocks, size, widths, reps = (2, 2, 1, 8, (4, 8), 1) if quick else (64, 32, 3, 32, (16, 32, 64), 10)
  key = jax.random.key(0)
  images = jax.random.normal(jax.random.fold_in(key, 1), (n, batch, size, size, 3), jnp.float32)
  labels = jax.random.randint(jax.random.fold_in(key, 2), (n, batch), 0, 10)
  topo = gj.topology.ring(n)
  tx = gj.gossip_sgd(topo, beta=BETA, learning_rate=LR)
  model = ResNetCifar(blocks_per_stage=blocks, widths=widths)
  variables = gj.init_nodes(lambda k: model.init(k, images[0, :1]), key, n)

  steps = {
      "float32": _jax_contender(model, tx, variables, images, labels, None),
      "float32_highest": _jax_contender(model, tx, variables, images, labels, "highest"),
      "bfloat16": _jax_contender(model.clone(dtype=jnp.bfloat16), tx, variables, images, labels, None),
      "float32_xla_weight_grad": _jax_contender(
          model.clone(conv=functools.partial(gj.layers.conv_general_dilated, weight_grad="xla")),
          tx, variables, images, labels, None),
      # The same method inside gj.chain: one node's optimizer mapped with the node axis named.
      "named_step": _jax_contender(model, gj.chain(gj.gossip_sgd(topo, beta=BETA, learning_rate=LR)),
                                   variables, images, labels, None),
  }
  mixer = gj.backend.simulate().mixer(topo)
  mix = jax.jit(lambda p: mixer.mix(p, 0), donate_argnums=0)
  box = {"m": jax.tree.map(jnp.copy, variables["params"])}

  def mixing():
    box["m"] = mix(box["m"])
    jax.block_until_ready(box["m"])

  steps["mixing"] = mixing
  torch_steps, torch_note = ({}, "skipped: include_torch=False") if not include_torch else _torch_contenders(
      n, blocks, widths, images, labels)
  times = _timing.interleaved({**steps, **torch_steps}, reps=reps, warmup=2)
  step_s = {p: times[p] for p in PRECISIONS}
  torch_s = {p: times[f"torch_{p}"] for p in PRECISIONS if f"torch_{p}" in times}
  return {"device": _timing.machine()["device"], "num_nodes": n, "batch_per_node": batch, "image_size": size,
          "model": f"ResNet-{2 * len(widths) * blocks + 2}", "params_per_node": _timing.tree_bytes(variables["params"]) // 4 // n,
          "step_s": step_s["float32"], "step_s_by_precision": step_s,
          "xla_weight_grad_step_s": times["float32_xla_weight_grad"],
          "layers_speedup": times["float32_xla_weight_grad"] / step_s["float32"],
          "mixing_s": times["mixing"], "node_steps_per_s": n / step_s["float32"],
          "mixing_fraction": times["mixing"] / step_s["float32"], "named_step_s": times["named_step"],
          "named_to_stacked": times["named_step"] / step_s["float32"],
          "torch": torch_note, "torch_step_s_by_precision": torch_s,
          "torch_over_gossipjax": {p: torch_s[p] / step_s[p] for p in torch_s}}


def table(r: dict) -> list[str]:
  if "skipped" in r:
    return [f"ResNet-20 on GPU: {r['skipped']}"]
  lines = [f"{r['model']} x {r['num_nodes']} nodes on {r['device']}, batch {r['batch_per_node']}/node, "
           f"{r['image_size']}x{r['image_size']} images ({r['params_per_node']} params/node)",
           "| precision | gossipjax | torch.func.vmap (BatchNorm: per-batch statistics) | torch / gossipjax |",
           "|---|---|---|---|"]
  for p in PRECISIONS:
    t = r["torch_step_s_by_precision"].get(p)
    torch_cell, ratio = (f"{t * 1e3:.1f} ms", f"{r['torch_over_gossipjax'][p]:.2f}x") if t else (r["torch"], "")
    lines.append(f"| {p} | {r['step_s_by_precision'][p] * 1e3:.1f} ms | {torch_cell} | {ratio} |")
  lines += [f"  float32 with XLA's weight gradient: {r['xla_weight_grad_step_s'] * 1e3:.1f} ms "
            f"({r['layers_speedup']:.2f}x the gj.layers step)",
            f"  {r['node_steps_per_s']:.0f} node-steps/s; mixing {r['mixing_s'] * 1e3:.2f} ms = "
            f"{100 * r['mixing_fraction']:.1f}% of the step",
            f"  the same method inside gj.chain (named node axis): {r['named_step_s'] * 1e3:.1f} ms = "
            f"{r['named_to_stacked']:.3f}x the stacked call"]
  return lines
