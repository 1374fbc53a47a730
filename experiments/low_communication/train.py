"""Low-communication training at equal bytes: DiLoCo and NoLoCo against gossip and all-reduce AdamW.

16 nodes train the main job's CNN (`gossipjax.train.CNN`) on scikit-learn's bundled digits (real
data, no network), split over the nodes with a Dirichlet label skew. Every method runs
AdamW with the same learning rate on every node; they differ in what crosses the network:

- ``allreduce_adamw``: every step, an all-reduce of the gradients, then AdamW (one model);
- ``dpsgd_adamw``: AdamW, then one gossip round (``gj.chain(adamw, gj.mix(W))``) every step;
- ``dsgd_pga_adamw``: the same, plus a global average every H steps (``gj.periodic_average``);
- ``diloco``: H AdamW steps per node, then an all-reduce and the outer Nesterov step (`gj.diloco`);
- ``noloco``: H AdamW steps per node, then one exchange with a random peer and NoLoCo's outer
  step (`gj.noloco` over ``gj.topology.random_pairs``).

Bytes are counted per node, for a float32 model of M bytes: a gossip message or a NoLoCo
exchange is M; an all-reduce is 2 (n - 1) / n * M, what a node sends in a ring all-reduce
(reduce-scatter, then all-gather). What is measured is each node's own model: the nodes' mean
training loss (on a fixed subset of the training set) and their mean test accuracy; the average model's
accuracy and the consensus distance are reported too.
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
from gossipjax.train import CNN

LABELS = {"allreduce_adamw": "AllReduce-AdamW", "dpsgd_adamw": "D-PSGD + AdamW", "dsgd_pga_adamw": "DSGD-PGA + AdamW",
          "diloco": "DiLoCo", "noloco": "NoLoCo"}


def make_method(name: str, config) -> optax.GradientTransformation:
  """The optax transform of method ``name`` over ``config.num_nodes`` stacked nodes."""
  n, h = config.num_nodes, config.inner_steps
  adamw = lambda: optax.adamw(config.learning_rate, weight_decay=config.weight_decay)
  gossip = getattr(gj.topology, config.gossip_topology)(n)
  if name == "allreduce_adamw":
    backend = gj.backend.simulate()
    return optax.chain(optax.stateless(lambda grads, params: backend.mean(grads)), adamw())
  if name == "dpsgd_adamw":
    return gj.chain(adamw(), gj.mix(gossip))
  if name == "dsgd_pga_adamw":
    return gj.chain(adamw(), gj.mix(gossip), gj.periodic_average(h))
  if name == "diloco":
    lr, mu = config.diloco_outer
    return gj.diloco(adamw(), inner_steps=h, outer_learning_rate=lr, outer_momentum=mu)
  if name == "noloco":
    lr, mu = config.noloco_outer
    return gj.noloco(adamw(), gj.topology.random_pairs(n, seed=config.seed), inner_steps=h, outer_learning_rate=lr,
                     outer_momentum=mu)
  raise ValueError(f"unknown method {name!r}; choose from {', '.join(LABELS)}")


def _messages_per_node(topology, step: int) -> float:
  """Messages a node sends at ``step`` of W's period, averaged over the nodes."""
  w = topology.sparse(step).tocoo()
  return float(np.count_nonzero(w.row != w.col)) / topology.num_nodes


def bytes_per_node(name: str, config, model_bytes: int, steps: int) -> float:
  """Bytes one node has sent after ``steps`` steps of method ``name`` (the averages over nodes)."""
  n, h = config.num_nodes, config.inner_steps
  allreduce = 2 * (n - 1) / n * model_bytes
  rounds = steps // h  # outer steps (and global averages) end the steps with k % h == h - 1
  if name == "allreduce_adamw":
    return steps * allreduce
  if name in ("dpsgd_adamw", "dsgd_pga_adamw"):
    gossip = getattr(gj.topology, config.gossip_topology)(n)
    sent = model_bytes * sum(_messages_per_node(gossip, k) for k in range(steps))
    return sent + (rounds * allreduce if name == "dsgd_pga_adamw" else 0.0)
  if name == "diloco":
    return rounds * allreduce
  if name == "noloco":
    pairs = gj.topology.random_pairs(n, seed=config.seed)
    return model_bytes * sum(_messages_per_node(pairs, r) for r in range(rounds))
  raise ValueError(f"unknown method {name!r}")


def make_evaluate(config, dataset, model):
  """The jitted metrics of node-stacked params (shared by every method: one compilation)."""
  x_test, y_test = jnp.asarray(dataset.x_test), jnp.asarray(dataset.y_test)
  # The training loss is measured on a fixed subset: evaluation would otherwise cost more than training.
  x_train, y_train = (jnp.asarray(a[:config.train_eval_samples]) for a in (dataset.x_train, dataset.y_train))
  ce = lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()

  @jax.jit
  def evaluate(params):
    acc = lambda p: jnp.mean(jnp.argmax(model.apply(p, x_test), -1) == y_test)
    node_acc = jax.vmap(acc)(params)
    finite = jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(params)]))
    return dict(train_loss=jnp.mean(jax.vmap(ce, in_axes=(0, None, None))(params, x_train, y_train)),
                test_accuracy=jnp.mean(node_acc), node_accuracy_min=jnp.min(node_acc),
                mean_model_accuracy=acc(gj.node_mean(params)), consensus_distance=gj.consensus_distance(params),
                finite=finite)

  return evaluate


def run_method(name: str, config, data, params, model, evaluate) -> dict[str, Any]:
  """Trains the nodes from ``params`` with method ``name``; a metrics row every ``log_every`` steps, every
  ``chunk`` early on."""
  tx = make_method(name, config)
  model_bytes = 4 * sum(x.size for x in jax.tree.leaves(params)) // config.num_nodes
  opt_state = jax.jit(tx.init)(params)  # run eagerly, every op of the init would compile on its own
  batch_key = jax.random.fold_in(jax.random.key(config.seed), 1)
  ce = lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()

  def one_step(carry, k):
    params, opt_state = carry
    xb, yb = gj.data.sample_batches(data, jax.random.fold_in(batch_key, k), config.batch_size)
    grads = jax.vmap(jax.grad(ce))(params, xb, yb)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), None

  @jax.jit
  def chunk(params, opt_state, start):
    (params, opt_state), _ = lax.scan(one_step, (params, opt_state), start + jnp.arange(config.chunk))
    return params, opt_state

  def metrics(params, step):
    m = evaluate(params)
    if not m.pop("finite"):
      gj.check_finite(params, step)  # raises, naming the nodes
    return {k: float(v) for k, v in m.items()}

  tic = time.perf_counter()
  history = [dict(step=0, bytes_per_node=0.0, **metrics(params, 0))]
  for start in range(0, config.steps, config.chunk):
    params, opt_state = chunk(params, opt_state, jnp.asarray(start, jnp.int32))
    step = start + config.chunk
    if step % config.log_every and step > config.early_steps:
      continue
    history.append(dict(step=step, bytes_per_node=bytes_per_node(name, config, model_bytes, step),
                        **metrics(params, step)))
  return dict(method=name, model_bytes=model_bytes, history=history, seconds=time.perf_counter() - tic)


def at_budget(run: dict[str, Any], budget: float) -> dict[str, Any]:
  """The last metrics row of ``run`` whose bytes sent per node are within ``budget`` (step 0 sends none)."""
  return [r for r in run["history"] if r["bytes_per_node"] <= budget * (1 + 1e-9)][-1]


def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Runs every method of ``config.methods``; writes results.json, results.md and the figure."""
  if config.log_every % config.inner_steps or config.log_every % config.chunk or config.steps % config.chunk:
    raise ValueError(f"log_every ({config.log_every}) must be a multiple of inner_steps ({config.inner_steps}) "
                     f"and of chunk ({config.chunk}), and steps ({config.steps}) a multiple of chunk")
  os.makedirs(workdir, exist_ok=True)
  ds = gj.data.load_digits(seed=config.seed)
  if config.partition == "iid":
    parts = gj.data.partition_iid(ds.y_train, config.num_nodes, config.seed)
  else:
    parts = gj.data.partition_dirichlet(ds.y_train, config.num_nodes, config.alpha, config.seed)
  data = gj.data.node_data(ds.x_train, ds.y_train, parts)
  model = CNN(num_classes=ds.num_classes, image_shape=(8, 8, 1))

  t0, runs, evaluate = time.perf_counter(), [], make_evaluate(config, ds, model)
  init = lambda key: gj.init_nodes(lambda k: model.init(k, jnp.asarray(ds.x_test[:1])), key, config.num_nodes)
  params = jax.jit(init)(jax.random.key(config.seed))  # every method starts from these models
  for name in config.methods:
    runs.append(run_method(name, config, data, params, model, evaluate))
    last = runs[-1]["history"][-1]
    print(f"{LABELS[name]:18s} loss {last['train_loss']:.4f}  acc {last['test_accuracy']:.4f}  "
          f"{last['bytes_per_node'] / 1e6:8.2f} MB/node  ({runs[-1]['seconds']:.1f} s)", flush=True)
  budget = min(r["history"][-1]["bytes_per_node"] for r in runs)
  results = dict(config=dataclasses.asdict(config), budget_bytes_per_node=budget, runs=runs,
                 seconds=time.perf_counter() - t0)
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(workdir, "results.md"), "w") as f:
    f.write(f"At equal bytes: each method when it has sent at most {budget / 1e6:.3f} MB per node\n\n"
            + table([(r["method"], at_budget(r, budget)) for r in runs]) + "\n\n"
            + f"At equal steps: after {config.steps} steps\n\n"
            + table([(r["method"], r["history"][-1]) for r in runs]) + "\n")
  plot(runs, budget, os.path.join(workdir, "low_communication.png"), config)
  return results


def table(rows) -> str:
  head = ["method", "step", "MB sent per node", "train loss (nodes)", "test acc (nodes)", "min node acc",
          "test acc (mean model)", "consensus dist"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for name, r in rows:
    lines.append(f"| {LABELS[name]} | {r['step']} | {r['bytes_per_node'] / 1e6:.3f} | {r['train_loss']:.4f} | "
                 f"{r['test_accuracy']:.4f} | {r['node_accuracy_min']:.4f} | {r['mean_model_accuracy']:.4f} | "
                 f"{r['consensus_distance']:.2e} |")
  return "\n".join(lines)


def plot(runs, budget: float, path: str, config) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
  for r in runs:
    h = r["history"]
    # One point per amount sent: the first row after each exchange (a local method's models then
    # drift until the next one); the log axis leaves out step 0.
    sent = [x for i, x in enumerate(h) if x["bytes_per_node"] > h[i - 1]["bytes_per_node"]] if len(h) > 1 else []
    for row, key in enumerate(("train_loss", "test_accuracy")):
      axes[row, 0].plot([x["bytes_per_node"] / 1e6 for x in sent], [x[key] for x in sent], label=LABELS[r["method"]])
      axes[row, 1].plot([x["step"] for x in h], [x[key] for x in h], label=LABELS[r["method"]])
  for row, what in enumerate(("training loss (mean over the nodes' models)", "test accuracy (mean over the nodes)")):
    axes[row, 0].set(xscale="log", xlabel="MB sent per node", ylabel=what)
    axes[row, 0].axvline(budget / 1e6, color="0.6", ls=":", lw=1)
    axes[row, 1].set(xlabel="step", ylabel=what)
  for ax in axes[0]:
    ax.set_yscale("log")
  for ax in axes.ravel():
    ax.grid(alpha=0.3)
  axes[0, 0].set_title(f"{config.num_nodes} nodes, digits CNN, Dirichlet({config.alpha}) split: per byte")
  axes[0, 1].set_title(f"per step (H = {config.inner_steps})")
  axes[1, 1].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
