"""One slow learner among 16, for AD-PSGD, D-PSGD and AllReduce: Table 2 of Zhang, Lian, Zhang and Liu,
"Decentralized Distributed Deep Learning".

Real training (a flax MLP on scikit-learn's digits, split iid over 16 learners) in simulated
time (`gj.asynchrony`): a learner's gradient takes ``base_time * slowdown`` simulated
seconds (times a small log-normal jitter). An epoch is one pass of the cluster as a whole
over the training set (gradient samples processed / training-set size). Speedup is the
simulated time per epoch of one normal learner doing all the work alone (``N / batch``
gradients, no communication) over the method's simulated time per epoch.
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

import gossipjax as gj
from gossipjax import asynchrony as ga


class MLP(nn.Module):
  hidden: int = 64
  num_classes: int = 10

  @nn.compact
  def __call__(self, x):
    return nn.Dense(self.num_classes)(nn.relu(nn.Dense(self.hidden)(x)))


def make_problem(config):
  ds = gj.data.load_digits(seed=config.seed)
  parts = gj.data.partition_iid(ds.y_train, config.num_nodes, seed=config.seed)
  data = gj.data.node_data(ds.x_train, ds.y_train, parts)
  model = MLP(config.hidden, ds.num_classes)

  def loss_fn(params, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

  def accuracy(params, batch):
    x, y = batch
    return (model.apply(params, x).argmax(-1) == y).mean()

  params = gj.init_nodes(lambda k: model.init(k, jnp.zeros((1, ds.x_train.shape[1]))),
                         jax.random.key(config.seed), config.num_nodes)
  return ds, data, loss_fn, accuracy, params


def _model_bytes(params) -> float:
  return float(sum(x[0].size * x.dtype.itemsize for x in jax.tree.leaves(params)))


def _cluster(config, slowdown, params):
  # bandwidth chosen so that one model crosses a link in `transfer` seconds.
  return ga.straggler_cluster(config.num_nodes, slowdown, base_time=config.base_time, jitter=config.jitter,
                              latency=config.latency, bandwidth=_model_bytes(params) / config.transfer)


def _metrics(ds, loss_fn, accuracy, params) -> dict[str, float]:
  return dict(final_loss=float(gj.evaluate_mean(loss_fn, params, (ds.x_train, ds.y_train))),
              final_accuracy=float(gj.evaluate_mean(accuracy, params, (ds.x_test, ds.y_test))),
              consensus_distance=float(gj.consensus_distance(params)))


def run_adpsgd(config, slowdown, problem, key) -> tuple[dict[str, Any], Any]:
  ds, data, loss_fn, accuracy, params = problem
  sim = ga.adpsgd(loss_fn, data, _cluster(config, slowdown, params), learning_rate=config.learning_rate,
                  batch_size=config.batch_size, model_bytes=_model_bytes(params))
  total = int(math.ceil(config.epochs * len(ds.y_train) / config.batch_size))
  state = sim.init(params, key)
  chunk = min(config.events_per_chunk, total)
  jax.block_until_ready(sim.run(state, chunk))  # compile outside the timing
  tic, done = time.perf_counter(), 0
  while done < total:
    state = sim.run(state, chunk)
    done += chunk
  jax.block_until_ready(state.params)
  wall = time.perf_counter() - tic
  epochs = float(state.samples) / len(ds.y_train)
  row = dict(time_per_epoch=float(state.clock) / epochs, epochs=epochs, events=int(state.events),
             events_per_second=int(state.events) / wall, straggler_gradients=int(state.counts[0]),
             wall_seconds=wall, **_metrics(ds, loss_fn, accuracy, state.params))
  return row, (sim, state)


def run_synchronous(config, method, slowdown, problem, key) -> dict[str, Any]:
  ds, data, loss_fn, accuracy, params = problem
  c = _cluster(config, slowdown, params)
  nbytes = _model_bytes(params)
  if method == "allreduce":
    tx = gj.allreduce_sgd(learning_rate=config.learning_rate)
    comm = float(ga.allreduce_time(c, nbytes))
  else:
    topo = getattr(gj.topology, config.dpsgd_topology)(config.num_nodes)
    tx = gj.gossip_sgd(topo, learning_rate=config.learning_rate)
    # neighbours exchange in parallel, one message per round of the sparse plan
    comm = len(topo.plans()[0].rounds) * float(ga.transfer_time(c, nbytes))
  sim = ga.synchronous(loss_fn, data, c, tx, config.batch_size, comm_time=comm)
  rounds = int(math.ceil(config.epochs * len(ds.y_train) / (config.batch_size * config.num_nodes)))
  tic = time.perf_counter()
  state = sim.run(sim.init(params, key), rounds)
  jax.block_until_ready(state.params)
  wall = time.perf_counter() - tic
  epochs = float(state.samples) / len(ds.y_train)
  return dict(time_per_epoch=float(state.clock) / epochs, epochs=epochs, rounds=rounds, wall_seconds=wall,
              **_metrics(ds, loss_fn, accuracy, state.params))


def stale_probe(config, problem, sim, state, slow_node: int = 0) -> dict[str, Any]:
  """Runs AD-PSGD on until the straggler's first gradient lands; the loss just before and after."""
  ds, _, loss_fn, accuracy, _ = problem
  train = (ds.x_train, ds.y_train)
  tic = time.perf_counter()
  while int(state.counts[slow_node]) == 0:
    before = state
    state = sim.run(state, config.events_per_chunk)
  state = before
  while int(state.counts[slow_node]) == 0:  # step to the exact event
    prev, state = state, sim.run(state, 1)
  loss = lambda s: float(gj.evaluate_mean(loss_fn, s.params, train))
  node_loss = lambda s: float(loss_fn(jax.tree.map(lambda x: x[slow_node], s.params), train))
  return dict(
      slowdown=config.stale_probe_slowdown,
      arrival_time=float(state.clock),
      updates_while_computing=int(prev.events),  # it read the initial model: every update since is staleness
      epochs_while_computing=float(prev.samples) / len(ds.y_train),
      mean_loss_before=loss(prev), mean_loss_after=loss(state),
      straggler_loss_before=node_loss(prev), straggler_loss_after=node_loss(state),
      accuracy_after=float(gj.evaluate_mean(accuracy, state.params, (ds.x_test, ds.y_test))),
      wall_seconds=time.perf_counter() - tic)


def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Runs every (method, slowdown) pair and writes ``workdir/results.json`` and a figure."""
  os.makedirs(workdir, exist_ok=True)
  problem = make_problem(config)
  ds = problem[0]
  single_tpe = len(ds.y_train) / config.batch_size * config.base_time
  rows, probe = [], None
  for method in config.methods:
    for slowdown in config.slowdowns:
      key = jax.random.key(config.seed + 1)
      if method == "ad-psgd":
        row, (sim, state) = run_adpsgd(config, slowdown, problem, key)
        if config.stale_probe_slowdown is not None and slowdown == config.stale_probe_slowdown:
          probe = stale_probe(config, problem, sim, state)
      else:
        row = run_synchronous(config, method, slowdown, problem, key)
      row = dict(method=method, slowdown=slowdown, speedup=single_tpe / row["time_per_epoch"], **row)
      rows.append(row)
      print(f"{method:9s} {slowdown:>6g}x  time/epoch {row['time_per_epoch']:10.2f}  speedup {row['speedup']:7.4f}"
            f"  loss {row['final_loss']:.4f}  acc {row['final_accuracy']:.4f}", flush=True)
  results = dict(rows=rows, single_learner_time_per_epoch=single_tpe, stale_probe=probe,
                 config=dataclasses.asdict(config))
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  plot(results, os.path.join(workdir, "stragglers.png"))
  return results


def plot(results, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
  n = results["config"]["num_nodes"]
  for method, marker in (("ad-psgd", "o"), ("d-psgd", "s"), ("allreduce", "^")):
    rs = [r for r in results["rows"] if r["method"] == method]
    if rs:
      ax1.plot([r["slowdown"] for r in rs], [r["speedup"] for r in rs], marker=marker, label=method)
      ax2.plot([r["slowdown"] for r in rs], [100 * r["final_accuracy"] for r in rs], marker=marker, label=method)
  s = np.array(sorted({r["slowdown"] for r in results["rows"]}), float)
  ax1.plot(s, n / s, "k:", label=f"{n} / slowdown")
  ax1.set(xscale="log", yscale="log", xlabel="slowdown of one learner", ylabel="speedup (simulated time)",
          title=f"{n} learners, one straggler")
  ax2.set(xscale="log", ylim=(80, 100), xlabel="slowdown of one learner", ylabel="test accuracy of the mean model (%)",
          title=f"after {results['config']['epochs']:g} epochs")
  ax1.legend()
  ax2.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
