"""DmSGD vs DecentLaM vs PmSGD as the total batch grows, after Kun Yuan, "Decentralized Optimization
Algorithms for Large-Scale Deep Neural Network Training" (lecture, Zhejiang University, 2021).

``n`` nodes train a ResNet-20 (`models.ResNet20`) with momentum SGD three ways:

- PmSGD: ``gj.allreduce_sgd(beta, learning_rate=lr)`` (parallel momentum SGD: gradients all-reduced);
- DmSGD: ``gj.gossip_sgd(W, beta, learning_rate=lr)`` (decentralized momentum SGD);
- DecentLaM: ``gj.decentlam(W, beta, learning_rate=lr)`` (momentum fed the gossip-corrected gradient);

on a symmetric ring W (DecentLaM refuses a directed one). Every batch size gets the same
budget of epochs, so a larger total batch means fewer, larger steps; the learning rate
follows the linear scaling rule (``base_learning_rate * total_batch / base_batch``) with a
linear warm-up and a cosine decay, as large-batch training does. Yuan's claim: at a
small batch all three are alike, and as the batch (hence the learning rate) grows DmSGD's
momentum-amplified inconsistency bias hurts it while DecentLaM keeps up with PmSGD.

Data: scikit-learn's bundled digits (8x8x1 images; the ResNet takes them as they are:
the three stages run at 8x8, 4x4 and 2x2), or CIFAR-10 from a local directory
(``data_dir``). The training loop is the main job's ``gj.train.run``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any

import numpy as np
import optax
from tqdm import tqdm

import gossipjax as gj
from gossipjax import train as gtrain

from large_batch.models import ResNet20


def load_data(config) -> gj.data.Dataset:
  if config.data_dir is None:
    return gj.data.load_digits(flat=False)
  ds = gj.data.load_cifar10(config.data_dir)
  return ds._replace(x_test=ds.x_test[: config.test_examples], y_test=ds.y_test[: config.test_examples])


def make_optimizer(config, method: str, learning_rate: optax.Schedule) -> optax.GradientTransformation:
  if method == "pmsgd":
    return gj.allreduce_sgd(config.beta, learning_rate=learning_rate)
  topo = getattr(gj.topology, config.topology)(config.num_nodes)
  if method == "dmsgd":
    return gj.gossip_sgd(topo, beta=config.beta, learning_rate=learning_rate)
  if method == "decentlam":
    return gj.decentlam(topo, beta=config.beta, learning_rate=learning_rate)
  raise ValueError(f"unknown method {method!r}; choose pmsgd, dmsgd or decentlam")


def schedule(config, total_batch: int, num_train: int) -> tuple[int, int, float, optax.Schedule]:
  """Steps, steps per metric row, peak learning rate and the schedule for one total batch."""
  steps = max(1, math.ceil(config.epochs * num_train / total_batch))
  log_every = max(1, math.ceil(steps / config.chunks))
  steps = log_every * math.ceil(steps / log_every)
  peak = config.base_learning_rate * total_batch / config.base_batch
  warmup = min(steps - 1, max(1, round(config.warmup_epochs * num_train / total_batch)))
  sched = optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(steps, warmup + 1))
  return steps, log_every, peak, sched


def run_one(config, ds, method: str, total_batch: int, seed: int, progress=None) -> dict[str, Any]:
  if total_batch % config.num_nodes:
    raise ValueError(f"total batch {total_batch} is not a multiple of {config.num_nodes} nodes")
  steps, log_every, peak, sched = schedule(config, total_batch, len(ds.y_train))
  cfg = gtrain.RunConfig(algorithm=method, topology=None if method == "pmsgd" else config.topology,
                         num_nodes=config.num_nodes, steps=steps, batch_size=total_batch // config.num_nodes,
                         partition=config.partition, seed=seed, log_every=log_every)
  model = ResNet20(width=config.width, num_classes=ds.num_classes)
  tic, diverged_at = time.perf_counter(), None
  rows: list[dict[str, float]] = []
  try:
    _, rows = gtrain.run(cfg, ds, model, make_optimizer(config, method, sched),
                         progress=progress, on_chunk=lambda state, history: rows.__init__(history))
  except FloatingPointError as e:  # a learning rate too large for the method: a result, not a crash
    diverged_at = str(e)
  row = dict(method=method, total_batch=total_batch, seed=seed, steps=steps, peak_learning_rate=peak,
             epochs=steps * total_batch / len(ds.y_train), seconds=time.perf_counter() - tic,
             diverged=diverged_at, history=list(rows))
  if diverged_at is None:
    row.update({k: v for k, v in rows[-1].items() if k != "step"})
  return row


def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Every (method, total batch, seed); writes results.json, results.md and large_batch.png."""
  os.makedirs(workdir, exist_ok=True)
  ds = load_data(config)
  total_steps = sum(schedule(config, b, len(ds.y_train))[0] for b in config.total_batches)
  runs, t0 = [], time.perf_counter()
  with tqdm(total=total_steps * len(config.methods) * len(config.seeds), desc="steps", unit="step") as bar:
    for seed in config.seeds:
      for total_batch in config.total_batches:
        for method in config.methods:
          r = run_one(config, ds, method, total_batch, seed, bar.update)
          runs.append(r)
          msg = "diverged" if r["diverged"] else f"loss {r['train_loss']:.4f}  acc {r['test_accuracy']:.4f}"
          tqdm.write(f"batch {total_batch:6d}  {method:9s} seed {seed}  lr {r['peak_learning_rate']:.3g}"
                     f"  {r['steps']} steps  {msg}  ({r['seconds']:.1f} s)")
  summary = summarize(config, runs)
  results = dict(config=dataclasses.asdict(config), dataset="digits" if config.data_dir is None else "cifar10",
                 summary=summary, runs=runs, seconds=time.perf_counter() - t0)
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(workdir, "results.md"), "w") as f:
    f.write(result_table(config, summary) + "\n")
  plot(config, summary, runs, os.path.join(workdir, "large_batch.png"))
  return results


def summarize(config, runs) -> list[dict[str, Any]]:
  """One row per (method, total batch): final test accuracy and loss, averaged over seeds."""
  out = []
  for method in config.methods:
    for b in config.total_batches:
      rs = [r for r in runs if r["method"] == method and r["total_batch"] == b]
      ok = [r for r in rs if not r["diverged"]]
      row = dict(method=method, total_batch=b, seeds=len(rs), diverged=len(rs) - len(ok),
                 steps=rs[0]["steps"], peak_learning_rate=rs[0]["peak_learning_rate"])
      for k in ("test_accuracy", "train_loss", "consensus_distance", "node_accuracy_mean"):
        row[k] = float(np.mean([r[k] for r in ok])) if ok else float("nan")
      out.append(row)
  return out


def result_table(config, summary) -> str:
  """Methods as rows, total batch sizes as columns: test accuracy of the average model (%)."""
  head = ["method"] + [f"batch {b} (lr {config.base_learning_rate * b / config.base_batch:g})"
                       for b in config.total_batches]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for method in config.methods:
    cells = []
    for b in config.total_batches:
      r = next(r for r in summary if r["method"] == method and r["total_batch"] == b)
      cells.append("diverged" if r["diverged"] == r["seeds"] else
                   f"{100 * r['test_accuracy']:.2f} (loss {r['train_loss']:.3f})")
    lines.append(f"| {method} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(config, summary, runs, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  for method, marker in zip(config.methods, "o^s"):
    rs = [r for r in summary if r["method"] == method]
    ax1.plot([r["total_batch"] for r in rs], [100 * r["test_accuracy"] for r in rs], marker=marker, label=method)
  ax1.set(xscale="log", xlabel="total batch size (all nodes)", ylabel="test accuracy of the average model (%)",
          title=f"ResNet-20 (width {config.width}), {config.num_nodes} nodes, {config.topology}")
  ax1.set_xticks(list(config.total_batches), [str(b) for b in config.total_batches])
  big = max(config.total_batches)
  for r, ls in zip([r for r in runs if r["total_batch"] == big and r["seed"] == config.seeds[0]], ("-", "--", ":")):
    h = r["history"]
    ax2.plot([x["step"] for x in h], [x["train_loss"] for x in h], ls, label=r["method"])
  ax2.set(yscale="log", xlabel="step", ylabel="training loss (mean over nodes)", title=f"total batch {big}")
  for ax in (ax1, ax2):
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
