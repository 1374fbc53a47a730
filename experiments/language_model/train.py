"""Data parallel, decentralized and low-communication training of a byte-level GPT on the Python standard library.

The nodes train the main job's GPT (`gossipjax.train.GPT`) on the standard library's own source
(`gossipjax.data.load_python_stdlib`: next-byte windows, train and test split by file), split iid or by
source (`gossipjax.data.partition_by_source`: each node reads whole packages of its own). A step takes the
same global batch at every node count. Every method runs the same AdamW on every node; they differ in what
crosses the network:

- ``allreduce_adamw``: every step, an all-reduce of the gradients, then AdamW (data parallel; ``gj.train``);
- ``d_adamw``: AdamW, then one gossip round on the one-peer exponential graph (``gj.train``);
- ``diloco``: H AdamW steps per node, then an all-reduce and the outer Nesterov step (`gj.diloco`);
- ``streaming_diloco``: the same outer step on one of F byte-balanced fragments every H / F steps,
  overlapping tau inner steps and merged with weight alpha (`gj.streaming_diloco`);
- ``noloco``: H AdamW steps per node, then one exchange with a random peer and NoLoCo's outer step
  (`gj.noloco` over ``gj.topology.random_pairs``).

Every run of one method at one node count shares one compiled program: the data and the PRNG key are its
arguments, and every partition's index table is padded to the whole training set's length.

Bytes are what `gj.bytes_per_step` counts per node. Simulated time is what `gj.time_per_step` gives for
one period (H steps) of each method's exchanges on each network preset, with ``config.step_time`` of compute
a step, repeated over the run: the exchanges a method runs do not depend on the gradients' values.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import gossipjax as gj
from gossipjax.train import GPT, cross_entropy, make_algorithm, make_topology

LABELS = {"allreduce_adamw": "AllReduce-AdamW", "d_adamw": "D-PSGD + AdamW", "diloco": "DiLoCo",
          "streaming_diloco": "Streaming DiLoCo", "noloco": "NoLoCo"}
COLORS = {name: f"C{i}" for i, name in enumerate(LABELS)}


def enable_compilation_cache(directory: str) -> None:
  """JAX's persistent compilation cache in ``directory``, for every program (a later run of the study reuses them)."""
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def make_model(config) -> Any:
  return GPT(context=config.context, num_layers=config.layers, width=config.width,
                      num_heads=config.heads, dtype=jnp.dtype(config.compute_dtype))


def make_method(name: str, config, n: int) -> optax.GradientTransformation:
  """The optax transform of method ``name`` over ``n`` stacked nodes."""
  h = config.inner_steps
  if name in ("allreduce_adamw", "d_adamw"):
    topo = make_topology(config.gossip_topology, n) if name == "d_adamw" else None
    return make_algorithm(name, topo, config.learning_rate, config.beta)
  adamw = optax.adamw(config.learning_rate, b1=config.beta)
  if name == "diloco":
    lr, mu = config.diloco_outer
    return gj.diloco(adamw, inner_steps=h, outer_learning_rate=lr, outer_momentum=mu)
  if name == "streaming_diloco":
    lr, mu = config.diloco_outer
    return gj.streaming_diloco(adamw, num_fragments=config.fragments, fragment_split=config.fragment_split,
                               inner_steps=h, overlap=config.overlap, mixing=config.mixing,
                               outer_learning_rate=lr, outer_momentum=mu)
  if name == "noloco":
    lr, mu = config.noloco_outer
    # A fresh random matching in every round of the run, the same for every seed (one compiled program).
    pairs = gj.topology.random_pairs(n, seed=0, period=max(16, config.steps // h))
    return gj.noloco(adamw, pairs, inner_steps=h, outer_learning_rate=lr, outer_momentum=mu)
  raise ValueError(f"unknown method {name!r}; choose from {', '.join(LABELS)}")


def communication(tx: optax.GradientTransformation, params, config) -> dict[str, np.ndarray]:
  """Per node, the bytes sent and, per network preset, the simulated seconds after 0, 1, ..., ``steps`` steps.

  Counted over one period of H steps (every method's pattern of exchanges repeats with it) and repeated.
  """
  h, reps = config.inner_steps, -(-config.steps // config.inner_steps)
  cum = lambda per_step: np.concatenate([[0.0], np.cumsum(np.tile(per_step, reps)[:config.steps])])
  out = {"bytes": cum(gj.bytes_per_step(tx, params, h))}
  for preset in config.networks:
    out[preset] = cum(gj.time_per_step(tx, params, gj.network(preset), config.step_time, steps=h))
  return out


def node_data(dataset, parts: list[np.ndarray]) -> gj.data.NodeData:
  """`gj.data.node_data` with every node's index row padded to the whole training set's length, so that every
  partition has the same shapes (sampling reads only a node's first ``sizes[i]`` entries)."""
  data = gj.data.node_data(dataset.x_train, dataset.y_train, parts)
  width = len(dataset.x_train)
  index = np.stack([np.resize(np.asarray(p), width) for p in parts]).astype(np.int32)
  return data._replace(index=jnp.asarray(index))


def partition(dataset, split: str, n: int, seed: int) -> list[np.ndarray]:
  if split == "iid":
    return gj.data.partition_iid(np.arange(len(dataset.x_train)), n, seed)
  if split == "by_source":
    return gj.data.partition_by_source(dataset.sources, n, seed)
  raise ValueError(f"unknown partition {split!r}; choose iid or by_source")


class Programs:
  """The jitted programs of one node count: the init and the metrics of the model, and each method's chunk."""

  def __init__(self, config, n: int, dataset):
    self.config, self.n, self.model = config, n, make_model(config)
    self.x_test, self.y_test = jnp.asarray(dataset.x_test), jnp.asarray(dataset.y_test)
    model, x0 = self.model, self.x_test[:1]
    self.init = jax.jit(lambda key: gj.init_nodes(lambda k: model.init(k, x0), key, n))
    self.evaluate = jax.jit(self._evaluate)

  def _evaluate(self, params, x_test, y_test):
    loss = lambda p: cross_entropy(self.model.apply, p, x_test, y_test)
    node_loss = jax.vmap(loss)(params)
    finite = jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(params)]))
    return dict(node_test_loss_mean=jnp.mean(node_loss), node_test_loss_max=jnp.max(node_loss),
                test_loss=loss(gj.node_mean(params)), consensus_distance=gj.consensus_distance(params),
                finite=finite)

  def method(self, tx: optax.GradientTransformation):
    """``(init, chunk)`` of ``tx``: ``chunk(params, opt_state, data, batch_key, start)`` runs ``log_every`` steps."""
    config, model = self.config, self.model
    batch = config.global_batch // self.n

    def one_step(data, batch_key, carry, k):
      params, opt_state = carry
      xb, yb = gj.data.sample_batches(data, jax.random.fold_in(batch_key, k), batch)
      loss = lambda p, x, y: cross_entropy(model.apply, p, x, y)
      losses, grads = jax.vmap(jax.value_and_grad(loss))(params, xb, yb)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), losses

    @jax.jit
    def chunk(params, opt_state, data, batch_key, start):
      step = lambda carry, k: one_step(data, batch_key, carry, k)
      (params, opt_state), losses = lax.scan(step, (params, opt_state), start + jnp.arange(config.log_every))
      return params, opt_state, jnp.mean(losses)

    return jax.jit(tx.init), chunk


def run_one(programs: Programs, name: str, compiled, comm, split: str, seed: int, dataset) -> dict[str, Any]:
  """One run of method ``name`` (its ``compiled = (init, chunk)``) on ``split`` with ``seed``: a row every
  ``log_every`` steps, step 0 included."""
  config, n = programs.config, programs.n
  init, chunk = compiled
  data = node_data(dataset, partition(dataset, split, n, seed))
  key = jax.random.key(seed)
  params = programs.init(jax.random.fold_in(key, 0))
  opt_state = init(params)
  batch_key = jax.random.fold_in(key, 1)
  tokens_per_step = config.global_batch * config.context

  def row(step, train_loss):
    m = {k: v for k, v in programs.evaluate(params, programs.x_test, programs.y_test).items()}
    if not m.pop("finite"):
      gj.check_finite(params, step)  # raises, naming the nodes
    return dict(step=step, tokens=step * tokens_per_step, train_loss=train_loss,
                **{k: float(v) for k, v in m.items()}, bytes_sent=float(comm["bytes"][step]),
                sim_seconds={p: float(comm[p][step]) for p in config.networks})

  tic = time.perf_counter()
  history = [row(0, float("nan"))]
  for start in range(0, config.steps, config.log_every):
    params, opt_state, train_loss = chunk(params, opt_state, data, batch_key, jnp.asarray(start, jnp.int32))
    history.append(row(start + config.log_every, float(train_loss)))
  return dict(method=name, num_nodes=n, partition=split, seed=seed, history=history,
              seconds=time.perf_counter() - tic)


def check(config) -> None:
  if config.log_every % config.inner_steps or config.steps % config.log_every:
    raise ValueError(f"log_every ({config.log_every}) must be a multiple of inner_steps ({config.inner_steps}) "
                     f"and divide steps ({config.steps})")
  if any(config.global_batch % n for n in config.node_counts):
    raise ValueError(f"global_batch ({config.global_batch}) must split evenly over {config.node_counts} nodes")


def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Runs every method at every node count, split and seed; writes results.json, results.md and the figures."""
  check(config)
  os.makedirs(workdir, exist_ok=True)
  t0, runs, methods, num_params = time.perf_counter(), [], {}, 0
  dataset = gj.data.load_python_stdlib(context=config.context, max_bytes=config.max_bytes,
                                       test_windows=config.test_windows)
  for n in config.node_counts:
    programs = Programs(config, n, dataset)
    shapes = jax.eval_shape(programs.init, jax.random.key(0))
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    num_params = sum(x.size for x in jax.tree.leaves(params)) // n
    for name in config.methods:
      tx = make_method(name, config, n)
      comm = communication(tx, params, config)
      methods[name, n] = dict(method=name, num_nodes=n, bytes_sent=comm["bytes"].tolist(),
                              sim_seconds={p: comm[p].tolist() for p in config.networks})
      compiled = programs.method(tx)
      for split in config.partitions:
        for seed in config.seeds:
          runs.append(run_one(programs, name, compiled, comm, split, seed, dataset))
          last = runs[-1]["history"][-1]
          print(f"n={n:3d} {split:9s} seed {seed}  {LABELS[name]:17s} test loss {last['node_test_loss_mean']:.4f} "
                f"(mean model {last['test_loss']:.4f})  {last['bytes_sent'] / 1e6:8.2f} MB/node  "
                f"({runs[-1]['seconds']:.1f} s, {time.perf_counter() - t0:.0f} s in all)", flush=True)
  model = dict(parameters=int(num_params), model_bytes=4 * int(num_params),
               tokens_per_run=config.steps * config.global_batch * config.context,
               training_windows=len(dataset.x_train), test_windows=len(dataset.x_test))
  rows = summary(runs, config)
  results = dict(config=dataclasses.asdict(config), model=model, targets=targets(rows, config), summary=rows,
                 communication=list(methods.values()), runs=runs, seconds=time.perf_counter() - t0)
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(workdir, "results.md"), "w") as f:
    f.write(report(results, config))
  plot_steps_bytes(runs, config, os.path.join(workdir, "loss_steps_bytes.png"))
  plot_time(runs, config, results["targets"], os.path.join(workdir, "loss_time.png"))
  return results


def mean_curve(runs, key: str = "node_test_loss_mean") -> np.ndarray:
  return np.mean([[r[key] for r in run["history"]] for run in runs], axis=0)


def summary(runs, config) -> list[dict[str, Any]]:
  """Per node count, split and method: the final losses' mean and standard deviation over the seeds, the bytes
  a node sent and the simulated seconds of the whole run per preset (the same for every seed)."""
  out = []
  for n in config.node_counts:
    for split in config.partitions:
      for name in config.methods:
        mine = [r for r in runs if (r["num_nodes"], r["partition"], r["method"]) == (n, split, name)]
        last = [r["history"][-1] for r in mine]
        stat = lambda k: [float(np.mean([x[k] for x in last])), float(np.std([x[k] for x in last]))]
        out.append(dict(num_nodes=n, partition=split, method=name, seeds=len(mine),
                        node_test_loss=stat("node_test_loss_mean"), node_test_loss_max=stat("node_test_loss_max"),
                        test_loss=stat("test_loss"), consensus_distance=stat("consensus_distance"),
                        bytes_sent=last[0]["bytes_sent"], sim_seconds=last[0]["sim_seconds"],
                        curve=mean_curve(mine).tolist()))
  return out


def targets(rows, config) -> dict[str, float]:
  """Per node count and split, the target loss: the highest of the methods' final mean losses, which every
  method reaches."""
  return {f"{n}/{split}": max(r["node_test_loss"][0] for r in rows if (r["num_nodes"], r["partition"]) == (n, split))
          for n in config.node_counts for split in config.partitions}


def time_to(row, target: float, preset: str, config, runs) -> float:
  """Simulated seconds until the seeds' mean loss curve of ``row`` first reaches ``target`` (at a logged step)."""
  run = next(r for r in runs if (r["num_nodes"], r["partition"], r["method"]) ==
             (row["num_nodes"], row["partition"], row["method"]))
  i = next(i for i, v in enumerate(row["curve"]) if v <= target * (1 + 1e-9))
  return run["history"][i]["sim_seconds"][preset]


def seconds(s: float) -> str:
  return f"{s:.0f} s" if s < 600 else f"{s / 60:.0f} min" if s < 36000 else f"{s / 3600:.1f} h"


def report(results, config) -> str:
  """results.md: per node count and split, each method's final loss, bytes and simulated time to the target."""
  m, runs = results["model"], results["runs"]
  parts = [f"GPT of {m['parameters']:,} parameters ({m['model_bytes'] / 1e6:.2f} MB in float32), "
           f"{m['tokens_per_run']:,} tokens a run ({config.steps} steps of {config.global_batch} windows of "
           f"{config.context} bytes). Test loss: nats a byte of the nodes' own models, averaged over the nodes; "
           f"mean ± standard deviation over {len(config.seeds)} seeds; the mean model's beside it. Simulated time "
           f"to the target (the highest final loss of the methods, which all reach) and for the whole run, with "
           f"{config.step_time} s of compute a step."]
  for n in config.node_counts:
    for split in config.partitions:
      target = results["targets"][f"{n}/{split}"]
      head = (["method", "test loss (nodes)", "test loss (mean model)", "MB sent per node"]
              + [f"to {target:.3f}, {p}" for p in config.networks] + [f"{config.steps} steps, {p}"
                                                                     for p in config.networks])
      lines = [f"## {n} nodes, {split.replace('_', '-')} split", "", "| " + " | ".join(head) + " |",
               "|" + "---|" * len(head)]
      for r in (r for r in results["summary"] if (r["num_nodes"], r["partition"]) == (n, split)):
        cells = ([LABELS[r["method"]], "{:.3f} ± {:.3f}".format(*r["node_test_loss"]),
                  "{:.3f} ± {:.3f}".format(*r["test_loss"]), f"{r['bytes_sent'] / 1e6:.1f}"]
                 + [seconds(time_to(r, target, p, config, runs)) for p in config.networks]
                 + [seconds(r["sim_seconds"][p]) for p in config.networks])
        lines.append("| " + " | ".join(cells) + " |")
      parts.append("\n".join(lines))
  return "\n\n".join(parts) + "\n"


def _plt():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def _panels(config, cols: int, width: float = 4.6):
  plt = _plt()
  rows = [(n, s) for n in config.node_counts for s in config.partitions]
  fig, axes = plt.subplots(len(rows), cols, figsize=(width * cols, 3.4 * len(rows)), squeeze=False)
  return plt, fig, axes, rows


def _curves(ax, runs, n, split, config, x_of):
  for name in config.methods:
    mine = [r for r in runs if (r["num_nodes"], r["partition"], r["method"]) == (n, split, name)]
    loss = np.array([[h["node_test_loss_mean"] for h in r["history"]] for r in mine])
    x = np.array([x_of(h) for h in mine[0]["history"]])
    keep = x > 0 if ax.get_xscale() == "log" else np.ones(len(x), bool)
    ax.plot(x[keep], loss.mean(0)[keep], color=COLORS[name], label=LABELS[name])
    ax.fill_between(x[keep], loss.min(0)[keep], loss.max(0)[keep], color=COLORS[name], alpha=0.15, lw=0)
  ax.grid(alpha=0.3)


def _finish(plt, fig, axes, config, path):
  axes[0, -1].legend(fontsize=8)
  fig.suptitle(f"byte-level GPT, {config.layers} layers of width {config.width}, global batch {config.global_batch} "
               f"x {config.context} bytes: the nodes' mean test loss, mean over {len(config.seeds)} seeds, band "
               "min to max", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def plot_steps_bytes(runs, config, path: str) -> None:
  plt, fig, axes, rows = _panels(config, 2)
  for (n, split), (a, b) in zip(rows, axes):
    b.set_xscale("log")
    _curves(a, runs, n, split, config, lambda h: h["step"])
    _curves(b, runs, n, split, config, lambda h: h["bytes_sent"] / 1e6)
    a.set(xlabel="step", ylabel="test loss (nats a byte)", title=f"{n} nodes, {split}: per step")
    b.set(xlabel="MB sent per node", title=f"{n} nodes, {split}: per byte")
  _finish(plt, fig, axes, config, path)


def plot_time(runs, config, targets_, path: str) -> None:
  plt, fig, axes, rows = _panels(config, len(config.networks))
  for (n, split), row in zip(rows, axes):
    for ax, preset in zip(row, config.networks):
      ax.set_xscale("log")
      _curves(ax, runs, n, split, config, lambda h: h["sim_seconds"][preset])
      ax.axhline(targets_[f"{n}/{split}"], color="0.5", ls=":", lw=1)
      ax.set(xlabel=f"simulated seconds, {preset}", ylabel="test loss (nats a byte)", title=f"{n} nodes, {split}")
  _finish(plt, fig, axes, config, path)
