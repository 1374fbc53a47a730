"""Low-communication training at equal bytes: DiLoCo, its streaming and compressed forms, and NoLoCo
against gossip and all-reduce AdamW, at 16 and 64 nodes over several seeds.

The nodes train the main job's CNN (`gossipjax.train.CNN`) on scikit-learn's bundled digits (real
data, no network), split over the nodes with a Dirichlet label skew; a step takes the same global
batch at every node count. Every method runs AdamW with the same learning rate on every node;
they differ in what crosses the network:

- ``allreduce_adamw``: every step, an all-reduce of the gradients, then AdamW (one model);
- ``dpsgd_adamw``: AdamW, then one gossip round (``gj.chain(adamw, gj.mix(W))``) every step;
- ``dsgd_pga_adamw``: the same, plus a global average every H steps (``gj.periodic_average``);
- ``diloco``: H AdamW steps per node, then an all-reduce and the outer Nesterov step (`gj.diloco`);
- ``streaming_diloco``: the same outer step on one of F fragments of the params every H / F
  steps, overlapping tau inner steps and merged with weight alpha (`gj.streaming_diloco`);
- ``streaming_diloco_sync``: the same fragments with no overlap and no merge (tau = alpha = 0),
  which separates what the fragments cost from what the overlap and the merge cost;
- ``diloco_qsgd``: DiLoCo with each pseudo-gradient quantized by QSGD with error feedback
  (``gj.diloco(..., compressor=gj.compress.qsgd(s))``), averaged as compressed pieces;
- ``noloco``: H AdamW steps per node, then one exchange with a random peer and NoLoCo's outer
  step (`gj.noloco` over ``gj.topology.random_pairs``).

Bytes are what `gj.bytes_per_step` counts for each transform, per node: a gossip message or a
NoLoCo exchange is one model (M bytes in float32), a compressed message its compact form, and an
all-reduce what a node sends in a ring all-reduce, 2 (n - 1) / n of it. What is measured is each
node's own model: the nodes' mean training loss (on a fixed subset of the training set) and their
mean test accuracy; the average model's accuracy and the consensus distance are reported too.
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
          "diloco": "DiLoCo", "streaming_diloco": "Streaming DiLoCo", "streaming_diloco_sync": "Streaming, τ = α = 0",
          "diloco_qsgd": "DiLoCo + QSGD",
          "noloco": "NoLoCo"}


def make_method(name: str, config, n: int, seed: int) -> optax.GradientTransformation:
  """The optax transform of method ``name`` over ``n`` stacked nodes."""
  h = config.inner_steps
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
  if name in ("streaming_diloco", "streaming_diloco_sync"):
    lr, mu = config.diloco_outer
    overlap, mixing = (config.overlap, config.mixing) if name == "streaming_diloco" else (0, 0.0)
    return gj.streaming_diloco(adamw(), num_fragments=config.fragments, inner_steps=h, overlap=overlap,
                               mixing=mixing, outer_learning_rate=lr, outer_momentum=mu)
  if name == "diloco_qsgd":
    lr, mu = config.diloco_outer
    return gj.diloco(adamw(), inner_steps=h, outer_learning_rate=lr, outer_momentum=mu,
                     compressor=gj.compress.qsgd(config.qsgd_levels), key=seed)
  if name == "noloco":
    lr, mu = config.noloco_outer
    return gj.noloco(adamw(), gj.topology.random_pairs(n, seed=seed), inner_steps=h, outer_learning_rate=lr,
                     outer_momentum=mu)
  raise ValueError(f"unknown method {name!r}; choose from {', '.join(LABELS)}")


def bytes_sent(tx: optax.GradientTransformation, params, steps: int) -> np.ndarray:
  """Bytes each node has sent after 0, 1, ..., ``steps`` steps of ``tx``, as `gj.bytes_per_step` counts them.

  Which exchanges run, and their sizes, do not depend on the gradients' values: the count
  runs ``tx`` on zero gradients.
  """
  return np.concatenate([[0.0], np.cumsum(gj.bytes_per_step(tx, params, steps))])


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


# The methods that send a message every step: they reach the equal-bytes budget within a few dozen steps.
PER_STEP = ("allreduce_adamw", "dpsgd_adamw", "dsgd_pga_adamw")


def run_method(name: str, config, n: int, seed: int, data, params, model, evaluate,
               sent: np.ndarray | None = None) -> dict[str, Any]:
  """Trains the ``n`` nodes from ``params`` with method ``name``; a metrics row every ``log_every`` steps, and for
  the per-step methods every ``chunk`` early on. ``sent``: the `bytes_sent` of the method, if counted already."""
  tx = make_method(name, config, n, seed)
  model_bytes = 4 * sum(x.size for x in jax.tree.leaves(params)) // n
  sent = bytes_sent(tx, params, config.steps) if sent is None else sent
  opt_state = jax.jit(tx.init)(params)  # run eagerly, every op of the init would compile on its own
  batch_key = jax.random.fold_in(jax.random.key(seed), 1)
  batch_size = config.global_batch // n
  ce = lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()

  def one_step(carry, k):
    params, opt_state = carry
    xb, yb = gj.data.sample_batches(data, jax.random.fold_in(batch_key, k), batch_size)
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
    if step % config.log_every and (step > config.early_steps or name not in PER_STEP):
      continue
    history.append(dict(step=step, bytes_per_node=float(sent[step]), **metrics(params, step)))
  return dict(method=name, num_nodes=n, seed=seed, model_bytes=model_bytes, peak_bytes_per_step=float(np.diff(sent).max()),
              history=history, seconds=time.perf_counter() - tic, sent=sent)


def at_budget(run: dict[str, Any], budget: float) -> dict[str, Any]:
  """The last metrics row of ``run`` whose bytes sent per node are within ``budget`` (step 0 sends none)."""
  return [r for r in run["history"] if r["bytes_per_node"] <= budget * (1 + 1e-9)][-1]


def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Runs every method of ``config.methods`` at every node count and seed; writes results.json, results.md and the
  figure."""
  if config.log_every % config.inner_steps or config.log_every % config.chunk or config.steps % config.chunk:
    raise ValueError(f"log_every ({config.log_every}) must be a multiple of inner_steps ({config.inner_steps}) "
                     f"and of chunk ({config.chunk}), and steps ({config.steps}) a multiple of chunk")
  if any(config.global_batch % n for n in config.node_counts):
    raise ValueError(f"global_batch ({config.global_batch}) must split evenly over {config.node_counts} nodes")
  os.makedirs(workdir, exist_ok=True)
  t0, runs, sent = time.perf_counter(), [], {}
  for n in config.node_counts:
    for seed in config.seeds:
      ds = gj.data.load_digits(seed=seed)
      if config.partition == "iid":
        parts = gj.data.partition_iid(ds.y_train, n, seed)
      else:
        parts = gj.data.partition_dirichlet(ds.y_train, n, config.alpha, seed)
      data = gj.data.node_data(ds.x_train, ds.y_train, parts)
      model = CNN(features=config.features, num_classes=ds.num_classes, image_shape=(8, 8, 1))
      evaluate = make_evaluate(config, ds, model)
      init = lambda key: gj.init_nodes(lambda k: model.init(k, jnp.asarray(ds.x_test[:1])), key, n)
      params = jax.jit(init)(jax.random.key(seed))  # every method starts from these models
      for name in config.methods:
        # What is sent does not depend on the seed (NoLoCo's matchings pair every node in every round).
        runs.append(run_method(name, config, n, seed, data, params, model, evaluate, sent.get((name, n))))
        sent[name, n] = runs[-1].pop("sent")
        last = runs[-1]["history"][-1]
        print(f"n={n:3d} seed {seed}  {LABELS[name]:18s} loss {last['train_loss']:.4f}  "
              f"acc {last['test_accuracy']:.4f}  {last['bytes_per_node'] / 1e6:8.3f} MB/node  "
              f"({runs[-1]['seconds']:.1f} s)", flush=True)
  budgets = {n: min(r["history"][-1]["bytes_per_node"] for r in runs if r["num_nodes"] == n)
             for n in config.node_counts}
  results = dict(config=dataclasses.asdict(config), budget_bytes_per_node={str(n): b for n, b in budgets.items()},
                 summary=summary(runs, budgets, config), runs=runs, seconds=time.perf_counter() - t0)
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(workdir, "results.md"), "w") as f:
    f.write(report(results["summary"], budgets, config))
  plot(runs, budgets, os.path.join(workdir, "low_communication.png"), config)
  return results


METRICS = ("step", "bytes_per_node", "train_loss", "test_accuracy", "node_accuracy_min", "mean_model_accuracy",
           "consensus_distance")


def summary(runs, budgets: dict[int, float], config) -> list[dict[str, Any]]:
  """Per node count and method, at equal bytes and after the last step: each metric's mean and standard
  deviation over the seeds."""
  out = []
  for n in config.node_counts:
    for name in config.methods:
      mine = [r for r in runs if r["num_nodes"] == n and r["method"] == name]
      for when, rows in (("budget", [at_budget(r, budgets[n]) for r in mine]),
                         ("end", [r["history"][-1] for r in mine])):
        stats = {k: (float(np.mean([x[k] for x in rows])), float(np.std([x[k] for x in rows]))) for k in METRICS}
        out.append(dict(num_nodes=n, method=name, at=when, seeds=len(rows), model_bytes=mine[0]["model_bytes"],
                        peak_bytes_per_step=mine[0]["peak_bytes_per_step"], **stats))
  return out


def at_seeds(stat: tuple[float, float], fmt: str) -> str:
  mean, std = stat
  return f"{mean:{fmt}} ± {std:{fmt}}"


def table(rows, seeds: int) -> str:
  head = ["method", "step", "MB sent per node", "peak KB a step", "train loss (nodes)", "test acc (nodes)",
          "min node acc", "test acc (mean model)", "consensus dist"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    step = f"{r['step'][0]:.0f}" if r["step"][1] == 0 else at_seeds(r["step"], ".0f")
    lines.append(f"| {LABELS[r['method']]} | {step} | {r['bytes_per_node'][0] / 1e6:.3f} | "
                 f"{r['peak_bytes_per_step'] / 1e3:.2f} | {at_seeds(r['train_loss'], '.3f')} | "
                 f"{at_seeds(r['test_accuracy'], '.3f')} | {at_seeds(r['node_accuracy_min'], '.3f')} | "
                 f"{at_seeds(r['mean_model_accuracy'], '.3f')} | {r['consensus_distance'][0]:.2e} |")
  return "\n".join(lines)


def headline(rows, budgets: dict[int, float], config) -> str:
  """One row per method: its bytes, and the nodes' test accuracy at equal bytes and after the run, per node count."""
  get = lambda n, name, at: next(r for r in rows if (r["num_nodes"], r["method"], r["at"]) == (n, name, at))
  ns = config.node_counts
  head = (["method"] + [f"MB a node, {n} nodes" for n in ns] + [f"peak KB a step, {ns[0]} nodes"]
          + [f"acc at {budgets[n] / 1e6:.3f} MB, {n} nodes" for n in ns]
          + [f"acc after {config.steps} steps, {n} nodes" for n in ns])
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for name in config.methods:
    cells = ([LABELS[name]] + [f"{get(n, name, 'end')['bytes_per_node'][0] / 1e6:.3f}" for n in ns]
             + [f"{get(ns[0], name, 'end')['peak_bytes_per_step'] / 1e3:.2f}"]
             + [at_seeds(get(n, name, "budget")["test_accuracy"], ".3f") for n in ns]
             + [at_seeds(get(n, name, "end")["test_accuracy"], ".3f") for n in ns])
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def report(rows, budgets: dict[int, float], config) -> str:
  """results.md: the headline table, then per node count the equal-bytes table and the equal-steps table."""
  seeds = len(config.seeds)
  parts = [f"Mean ± standard deviation over {seeds} seeds ({', '.join(map(str, config.seeds))}); bytes are the same "
           "for every seed; consensus distance: the mean. Accuracy: the nodes' own models' mean test accuracy; at "
           "equal bytes, each method when it has sent at most the cheapest method's bytes of the whole run.",
           headline(rows, budgets, config)]
  for n in config.node_counts:
    mine = [r for r in rows if r["num_nodes"] == n]
    parts += [f"## {n} nodes",
              f"At equal bytes: each method when it has sent at most {budgets[n] / 1e6:.3f} MB per node",
              table([r for r in mine if r["at"] == "budget"], seeds),
              f"At equal steps: after {config.steps} steps", table([r for r in mine if r["at"] == "end"], seeds)]
  return "\n\n".join(parts) + "\n"


def plot(runs, budgets: dict[int, float], path: str, config) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  cols = len(config.node_counts)
  fig, axes = plt.subplots(2, cols, figsize=(5.8 * cols, 8), squeeze=False)
  colors = {name: f"C{i}" for i, name in enumerate(LABELS)}
  for c, n in enumerate(config.node_counts):
    for name in config.methods:
      mine = [r["history"] for r in runs if r["num_nodes"] == n and r["method"] == name]
      h = mine[0]  # the rows fall at the same steps, with the same bytes, for every seed
      acc = np.array([[x["test_accuracy"] for x in hist] for hist in mine])
      mean, low, high = acc.mean(0), acc.min(0), acc.max(0)
      # Per byte, one point per amount sent: the first row after each exchange (a local method's models
      # then drift until the next one); the log axis leaves out step 0.
      first = [i for i in range(1, len(h)) if h[i]["bytes_per_node"] > h[i - 1]["bytes_per_node"]]
      mb = [h[i]["bytes_per_node"] / 1e6 for i in first]
      steps = [x["step"] for x in h]
      for row, (x, idx) in enumerate(((mb, first), (steps, list(range(len(h)))))):
        ax = axes[row, c]
        ax.plot(x, mean[idx], color=colors[name], label=LABELS[name])
        ax.fill_between(x, low[idx], high[idx], color=colors[name], alpha=0.15, lw=0)
    axes[0, c].set(xscale="log", xlabel="MB sent per node", ylabel="test accuracy (mean over the nodes)",
                   title=f"{n} nodes: per byte")
    axes[0, c].axvline(budgets[n] / 1e6, color="0.6", ls=":", lw=1)
    axes[1, c].set(xlabel="step", ylabel="test accuracy (mean over the nodes)",
                   title=f"{n} nodes: per step (H = {config.inner_steps})")
  for ax in axes.ravel():
    ax.grid(alpha=0.3)
    ax.set_ylim(0, 1)
  axes[1, -1].legend(fontsize=8, loc="lower right")
  fig.suptitle(f"digits CNN, Dirichlet({config.alpha}) split, global batch {config.global_batch}: mean over "
               f"{len(config.seeds)} seeds, band min to max", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
