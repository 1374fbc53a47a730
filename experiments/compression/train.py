"""Accuracy vs bits sent: CHOCO-SGD with compressed gossip against uncompressed D-PSGD.

16 nodes on a ring train a flax MLP on scikit-learn's digits (real data, no network).
CHOCO-SGD (`gj.choco_sgd`, Koloskova et al. 2019) gossips ``C(x_i - \\hat x_i)`` with
each compressor of `gj.compress` (top-k, random-k, sign, QSGD and the
threshold-at-mean rule of Cui (2019), "Decentralized Deep Learning with Gradient Compression");
D-PSGD (`gj.gossip_sgd` with ``beta=0``) sends the dense model.

Bits: every step node i sends its message to each of its out-neighbours; the size of
the message is the size of the compressor's compact wire form, the arrays that
``Compressor.encode_leaf`` builds for each layer (``state.message_bits``, from
``Compressor.bits``); for D-PSGD the dense model (``gj.compress.identity().bits``, 32 bits
per float). The figure's x axis is the cumulative bits sent over the whole network.

What is measured is each node's own model (``train_loss``: the nodes' mean training
loss on the full training set; ``test_accuracy``: the nodes' mean test accuracy), since
a decentralized run ends with n models; the average model is reported too, but the
average is preserved by every method here and says little about the quality of gossip.
The data are split over the nodes with a Dirichlet label skew, so a node that does not
reach consensus has a visibly worse model than the average.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import gossipjax as gj


class MLP(nn.Module):
  hidden: int = 64
  num_classes: int = 10

  @nn.compact
  def __call__(self, x):
    return nn.Dense(self.num_classes)(nn.relu(nn.Dense(self.hidden)(x)))


def make_compressor(spec: str) -> gj.compress.Compressor:
  """``"top_k:0.1"`` -> ``gj.compress.top_k(0.1)``; ``"sign"`` -> ``gj.compress.sign()``."""
  name, _, arg = spec.partition(":")
  factory = getattr(gj.compress, name)
  if not arg:
    return factory()
  return factory(int(arg) if arg.isdigit() else float(arg))


def _out_degree(topology) -> np.ndarray:
  w = topology.matrix(0)
  return ((w != 0) & ~np.eye(len(w), dtype=bool)).sum(axis=0)  # column j: who receives from j


def run_method(config, dataset, data, model, tx, bits_fn) -> dict[str, Any]:
  """Trains ``config.num_nodes`` models with ``tx``; logs accuracy and cumulative bits every chunk.

  ``bits_fn(opt_state) -> float`` is the network-wide bits sent in the step that produced it.
  """
  n = config.num_nodes
  x_test, y_test = jnp.asarray(dataset.x_test), jnp.asarray(dataset.y_test)
  x_train, y_train = jnp.asarray(dataset.x_train), jnp.asarray(dataset.y_train)
  params = gj.init_nodes(lambda k: model.init(k, x_test[:1]), jax.random.key(config.seed), n)
  opt_state = tx.init(params)
  batch_key = jax.random.fold_in(jax.random.key(config.seed), 1)
  ce = lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()

  def one_step(carry, k):
    params, opt_state, bits = carry
    xb, yb = gj.data.sample_batches(data, jax.random.fold_in(batch_key, k), config.batch_size)
    grads = jax.vmap(jax.grad(ce))(params, xb, yb)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state, bits + bits_fn(opt_state)), None

  @jax.jit
  def chunk(params, opt_state, bits, start):
    (params, opt_state, bits), _ = lax.scan(one_step, (params, opt_state, bits),
                                            start + jnp.arange(config.log_every))
    mean = gj.node_mean(params)
    acc = lambda p: jnp.mean(jnp.argmax(model.apply(p, x_test), -1) == y_test)
    node_acc = jax.vmap(acc)(params)
    return params, opt_state, bits, dict(
        train_loss=jnp.mean(jax.vmap(ce, in_axes=(0, None, None))(params, x_train, y_train)),
        mean_model_train_loss=ce(mean, x_train, y_train), mean_model_accuracy=acc(mean),
        test_accuracy=jnp.mean(node_acc), node_accuracy_min=jnp.min(node_acc),
        consensus_distance=gj.consensus_distance(params))

  history, bits, tic = [], jnp.zeros([], jnp.float64 if jax.config.jax_enable_x64 else jnp.float32), time.perf_counter()
  diverged_at = None
  for step in range(0, config.steps, config.log_every):
    params, opt_state, bits, m = chunk(params, opt_state, bits, jnp.asarray(step, jnp.int32))
    try:
      gj.check_finite(params, step + config.log_every)
    except FloatingPointError:  # a consensus step too large for the compressor: a result, not a crash
      diverged_at = step + config.log_every
      break
    history.append(dict(step=step + config.log_every, bits=float(bits), **{k: float(v) for k, v in m.items()}))
  last = history[-1] if history else {}
  return dict(history=history, seconds=time.perf_counter() - tic, diverged_at_step=diverged_at, **last)


def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Runs D-PSGD and CHOCO-SGD x compressors x consensus steps; writes results.json, results.md, the figure."""
  os.makedirs(workdir, exist_ok=True)
  ds = gj.data.load_digits(seed=config.seed)
  if config.partition == "iid":
    parts = gj.data.partition_iid(ds.y_train, config.num_nodes, config.seed)
  else:
    parts = gj.data.partition_dirichlet(ds.y_train, config.num_nodes, config.alpha, config.seed)
  data = gj.data.node_data(ds.x_train, ds.y_train, parts)
  model = MLP(config.hidden, ds.num_classes)
  topo = getattr(gj.topology, config.topology)(config.num_nodes)
  degree = jnp.asarray(_out_degree(topo), jnp.float32)
  one_node = model.init(jax.random.key(0), jnp.asarray(ds.x_test[:1]))
  dense_bits = float(gj.compress.identity().bits(one_node))

  runs = []
  t0 = time.perf_counter()
  tx = gj.gossip_sgd(topo, beta=0.0, learning_rate=config.learning_rate)
  r = run_method(config, ds, data, model, tx, lambda s: dense_bits * jnp.sum(degree))
  runs.append(dict(method="d-psgd", compressor="none", consensus_step=1.0, **r))
  _print(runs[-1])
  for spec in config.compressors:
    for eta in config.consensus_steps:
      tx = gj.choco_sgd(topo, make_compressor(spec), learning_rate=config.learning_rate, consensus_step=eta,
                        seed=config.seed)
      r = run_method(config, ds, data, model, tx, lambda s: jnp.sum(s.message_bits * degree))
      runs.append(dict(method="choco", compressor=spec, consensus_step=eta, **r))
      _print(runs[-1])

  best = {}
  for r in runs:
    key = r["compressor"]
    if r["diverged_at_step"] is not None or not np.isfinite(r["train_loss"]) or r["train_loss"] > 1e3:
      continue
    if key not in best or r["train_loss"] < best[key]["train_loss"]:
      best[key] = r
  results = dict(config=dataclasses.asdict(config), dense_bits_per_message=dense_bits,
                 best=[best[k]["compressor"] + f"@{best[k]['consensus_step']:g}" for k in best],
                 runs=runs, seconds=time.perf_counter() - t0)
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(workdir, "results.md"), "w") as f:
    f.write(result_table(list(best.values()), runs[0]["bits"]) + "\n\n" + grid_table(runs) + "\n")
  plot(list(best.values()), os.path.join(workdir, "compression.png"), config)
  return results


def _print(r):
  if r["diverged_at_step"] is not None:
    print(f"{r['method']:6s} {r['compressor']:14s} eta {r['consensus_step']:<5g} diverged at step "
          f"{r['diverged_at_step']}", flush=True)
    return
  print(f"{r['method']:6s} {r['compressor']:14s} eta {r['consensus_step']:<5g} loss {r['train_loss']:.4f}"
        f"  acc {r['test_accuracy']:.4f}  bits {r['bits']:.3e}  ({r['seconds']:.1f} s)", flush=True)


def result_table(rows, dense_total: float) -> str:
  head = ["method", "compressor", "eta", "train loss (nodes)", "test acc (nodes)", "min node acc",
          "test acc (mean model)", "consensus dist", "total bits sent", "bits vs D-PSGD"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    lines.append(f"| {r['method']} | {r['compressor']} | {r['consensus_step']:g} | {r['train_loss']:.4f} | "
                 f"{r['test_accuracy']:.4f} | {r['node_accuracy_min']:.4f} | {r['mean_model_accuracy']:.4f} | "
                 f"{r['consensus_distance']:.2e} | "
                 f"{r['bits']:.3e} | {r['bits'] / dense_total:.4f} |")
  return "\n".join(lines)


def grid_table(runs) -> str:
  """Every (compressor, consensus step) run: the grid the first table picks from."""
  lines = ["| compressor | eta | train loss (nodes) | test acc (nodes) | consensus dist |", "|---|---|---|---|---|"]
  for r in runs:
    if r["diverged_at_step"] is not None:
      lines.append(f"| {r['compressor']} | {r['consensus_step']:g} | diverged (step {r['diverged_at_step']}) | | |")
    else:
      lines.append(f"| {r['compressor']} | {r['consensus_step']:g} | {r['train_loss']:.4f} | "
                   f"{r['test_accuracy']:.4f} | {r['consensus_distance']:.2e} |")
  return "\n".join(lines)


def plot(rows, path: str, config) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  for r in rows:
    label = "D-PSGD (uncompressed)" if r["method"] == "d-psgd" else f"CHOCO {r['compressor']} (eta {r['consensus_step']:g})"
    style = dict(color="k", lw=2) if r["method"] == "d-psgd" else {}
    ax1.plot([h["bits"] for h in r["history"]], [h["test_accuracy"] for h in r["history"]], label=label, **style)
    ax2.plot([h["step"] for h in r["history"]], [h["test_accuracy"] for h in r["history"]], label=label, **style)
  ax1.set(xscale="log", xlabel="cumulative bits sent (whole network)", ylabel="test accuracy (mean over the nodes' models)",
          title=f"{config.num_nodes} nodes, {config.topology}, digits MLP")
  ax2.set(xlabel="step", ylabel="test accuracy (mean over the nodes' models)", title="same runs per step")
  for ax in (ax1, ax2):
    ax.grid(alpha=0.3)
  ax2.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
