"""AllReduce, D-PSGD and AD-PSGD reach the same loss per epoch: Figure 1 / Table 1 of Zhang, Lian,
Zhang and Liu, "Decentralized Distributed Deep Learning".

16 learners train a flax MLP on scikit-learn's digits (real data, no network), each with
its own share of the training set. The three methods use the same learning rate and the
same per-learner batch:

- AllReduce-SGD: ``gj.allreduce_sgd`` (every round, the learners average their gradients);
- D-PSGD: ``gj.gossip_sgd(ring, beta=0)`` (every round, each learner averages its model
  with its ring neighbours);
- AD-PSGD: ``gj.asynchrony.adpsgd``, the event-driven simulator: each learner, on its own
  clock, computes a gradient on the model it read, averages with one random ring
  neighbour and applies its (possibly stale) gradient; no barrier.

The synchronous methods run through ``gj.asynchrony.synchronous`` so that all three draw
minibatches the same way. An epoch is one pass of the cluster over the training set
(gradient samples processed / training-set size): about 10.5 synchronous rounds of 16
gradients, or 168 AD-PSGD events, at batch 8. After every epoch the study records the
training loss (mean over the learners of each learner's loss on the whole training set,
the quantity of Zhang et al.'s Figure 1), the loss of the average model, and test accuracies.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import gossipjax as gj
from gossipjax import asynchrony as ga


class MLP(nn.Module):
  hidden: int = 64
  num_classes: int = 10

  @nn.compact
  def __call__(self, x):
    return nn.Dense(self.num_classes)(nn.relu(nn.Dense(self.hidden)(x)))


def make_problem(config, seed: int):
  ds = gj.data.load_digits(seed=0)
  if config.partition == "iid":
    parts = gj.data.partition_iid(ds.y_train, config.num_nodes, seed)
  else:
    parts = gj.data.partition_dirichlet(ds.y_train, config.num_nodes, config.alpha, seed)
  data = gj.data.node_data(ds.x_train, ds.y_train, parts)
  model = MLP(config.hidden, ds.num_classes)

  def loss_fn(params, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

  def accuracy(params, batch):
    x, y = batch
    return (model.apply(params, x).argmax(-1) == y).mean()

  params = gj.init_nodes(lambda k: model.init(k, jnp.zeros((1, ds.x_train.shape[1]))),
                         jax.random.key(seed), config.num_nodes)
  return ds, data, loss_fn, accuracy, params


def make_simulator(config, method: str, problem):
  _, data, loss_fn, _, _ = problem
  cluster = ga.cluster(config.num_nodes, jitter=config.jitter)
  topo = getattr(gj.topology, config.topology)(config.num_nodes)
  if method == "ad-psgd":
    return ga.adpsgd(loss_fn, data, cluster, topo, learning_rate=config.learning_rate, batch_size=config.batch_size)
  if method == "allreduce":
    tx = gj.allreduce_sgd(learning_rate=config.learning_rate)
  elif method == "d-psgd":
    tx = gj.gossip_sgd(topo, beta=0.0, learning_rate=config.learning_rate)
  else:
    raise ValueError(f"unknown method {method!r}")
  return ga.synchronous(loss_fn, data, cluster, tx, config.batch_size)


def evaluate(problem, params) -> dict[str, float]:
  ds, _, loss_fn, accuracy, _ = problem
  train, test = (ds.x_train, ds.y_train), (ds.x_test, ds.y_test)
  return dict(
      train_loss=float(jnp.mean(gj.evaluate_nodes(loss_fn, params, train))),
      mean_model_train_loss=float(gj.evaluate_mean(loss_fn, params, train)),
      test_accuracy=float(jnp.mean(gj.evaluate_nodes(accuracy, params, test))),
      mean_model_accuracy=float(gj.evaluate_mean(accuracy, params, test)),
      consensus_distance=float(gj.consensus_distance(params)))


def run_method(config, method: str, seed: int, progress=None) -> dict[str, Any]:
  """Trains with ``method`` for ``config.epochs`` epochs; one metrics row per epoch (epoch 0 first)."""
  problem = make_problem(config, seed)
  ds, _, _, _, params = problem
  sim = make_simulator(config, method, problem)
  per_step = config.batch_size * (1 if method == "ad-psgd" else config.num_nodes)
  state = sim.init(params, jax.random.key(seed + 1))
  history = [dict(epoch=0.0, **evaluate(problem, state.params))]
  tic, done = time.perf_counter(), 0
  for epoch in range(1, config.epochs + 1):
    target = math.ceil(epoch * len(ds.y_train) / per_step)  # rounds or events to the end of this epoch
    state = sim.run(state, target - done)
    done = target
    history.append(dict(epoch=float(state.samples) / len(ds.y_train), **evaluate(problem, state.params)))
    if progress is not None:
      progress(1)
  return dict(method=method, seed=seed, steps=done, history=history, seconds=time.perf_counter() - tic,
              **history[-1])


def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Runs every method for every seed; writes results.json, results.md and allreduce_vs_gossip.png."""
  os.makedirs(workdir, exist_ok=True)
  runs, t0 = [], time.perf_counter()
  with tqdm(total=len(config.methods) * len(config.seeds) * config.epochs, desc="epochs", unit="ep") as bar:
    for seed in config.seeds:
      for method in config.methods:
        r = run_method(config, method, seed, bar.update)
        runs.append(r)
        tqdm.write(f"{method:9s} seed {seed}  loss {r['train_loss']:.4f}  acc {r['test_accuracy']:.4f}"
                   f"  mean-model acc {r['mean_model_accuracy']:.4f}  ({r['seconds']:.1f} s)")
  summary = summarize(config, runs)
  results = dict(config=dataclasses.asdict(config), summary=summary, runs=runs, seconds=time.perf_counter() - t0)
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(workdir, "results.md"), "w") as f:
    f.write(result_table(summary) + "\n")
  plot(config, runs, os.path.join(workdir, "allreduce_vs_gossip.png"))
  return results


def summarize(config, runs) -> list[dict[str, Any]]:
  """Per method: mean and standard deviation over seeds of the final metrics."""
  keys = ("train_loss", "mean_model_train_loss", "test_accuracy", "mean_model_accuracy", "consensus_distance")
  rows = []
  for method in config.methods:
    rs = [r for r in runs if r["method"] == method]
    row = dict(method=method, seeds=len(rs), epochs=float(np.mean([r["epoch"] for r in rs])))
    for k in keys:
      row[k], row[k + "_std"] = float(np.mean([r[k] for r in rs])), float(np.std([r[k] for r in rs]))
    rows.append(row)
  return rows


def result_table(summary) -> str:
  head = ["method", "epochs", "train loss (learners)", "train loss (avg model)", "test acc (learners)",
          "test acc (avg model)", "consensus dist"]
  pm = lambda r, k, f: f"{r[k]:{f}}" + (f" ± {r[k + '_std']:{f}}" if r["seeds"] > 1 else "")
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in summary:
    lines.append(f"| {r['method']} | {r['epochs']:.1f} | {pm(r, 'train_loss', '.4f')} | "
                 f"{pm(r, 'mean_model_train_loss', '.4f')} | {pm(r, 'test_accuracy', '.4f')} | "
                 f"{pm(r, 'mean_model_accuracy', '.4f')} | {r['consensus_distance']:.2e} |")
  return "\n".join(lines)


def plot(config, runs, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  for method, color in zip(config.methods, ("C0", "C1", "C2")):
    rs = [r for r in runs if r["method"] == method]
    epochs = np.array([[h["epoch"] for h in r["history"]] for r in rs]).mean(0)
    loss = np.array([[h["train_loss"] for h in r["history"]] for r in rs]).mean(0)
    acc = np.array([[h["test_accuracy"] for h in r["history"]] for r in rs]).mean(0)
    ax1.plot(epochs, loss, color=color, label=method)
    ax2.plot(epochs, 100 * acc, color=color, label=method)
  ax1.set(yscale="log", xlabel="epoch", ylabel="training loss (mean over learners)",
          title=f"{config.num_nodes} learners, digits MLP" + (f", {len(config.seeds)} seeds" if len(config.seeds) > 1 else ""))
  ax2.set(xlabel="epoch", ylabel="test accuracy (%, mean over learners)", ylim=(50, 100))
  for ax in (ax1, ax2):
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
