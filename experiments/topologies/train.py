"""The topology table of Kun Yuan, "Decentralized Optimization Algorithms for Large-Scale Deep Neural Network
Training" (lecture, Zhejiang University, 2021): messages per step, rho, gossip decay, and D-PSGD's steps
to a target accuracy.

The spectral columns (`spectra`) cover every size; the training column runs D-PSGD
(``gj.gossip_sgd``, no momentum) on an MLP over scikit-learn's bundled digits through the
main job's loop (``gj.train.run``) at ``config.train_sizes`` only, next to an AllReduce
baseline. "Steps to target" is the first logged step at which the nodes' own models,
averaged over nodes, reach ``target_accuracy`` on the test set; the average model's is
reported beside it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from typing import Any

import numpy as np

import gossipjax as gj
import gossipjax.train  # noqa: F401  (gj.train: the main job's loop)

from topologies import spectra

ALLREDUCE = "allreduce"  # the baseline row of the training column: exact averaging, no topology

LABELS = {"ring": "ring", "star": "star", "grid": "2D grid", "torus": "2D torus", "half_random": "1/2-random graph",
          "static_exponential": "static exp.", "one_peer_exponential": "one-peer exp.", ALLREDUCE: "AllReduce"}
COLORS = {name: f"C{i}" for i, name in enumerate(LABELS)}


def _first_step(history: list[dict[str, float]], key: str, target: float) -> int | None:
  return next((int(h["step"]) for h in history if h[key] >= target), None)


def train_run(config, name: str, n: int, partition: str, seed: int, dataset) -> dict[str, Any]:
  """D-PSGD over topology ``name`` (or the AllReduce baseline) on n simulated nodes."""
  if name == ALLREDUCE:
    tx, algorithm = gj.allreduce_sgd(learning_rate=config.learning_rate), "allreduce"
  else:
    tx, algorithm = gj.gossip_sgd(spectra.TOPOLOGIES[name](n, config.seed), learning_rate=config.learning_rate), "dpsgd"
  cfg = gj.train.RunConfig(algorithm=algorithm, topology=name, num_nodes=n, steps=config.train_steps,
                           batch_size=config.batch_size, learning_rate=config.learning_rate, beta=0.0,
                           partition=partition, alpha=config.dirichlet_alpha, hidden=tuple(config.hidden),
                           seed=seed, log_every=config.log_every)
  model = gj.train.MLP(tuple(config.hidden), dataset.num_classes)
  _, history, wall = gj.train.timed_run(cfg, dataset, model, tx)
  last = history[-1]
  return dict(topology=name, n=n, partition=partition, seed=seed,
              steps_to_target=_first_step(history, "node_accuracy_mean", config.target_accuracy),
              steps_to_target_mean_model=_first_step(history, "test_accuracy", config.target_accuracy),
              final_node_accuracy=last["node_accuracy_mean"], final_node_accuracy_min=last["node_accuracy_min"],
              final_mean_model_accuracy=last["test_accuracy"], final_consensus_distance=last["consensus_distance"],
              final_train_loss=last["train_loss"], wall_seconds=wall,
              curve=dict(step=[h["step"] for h in history],
                         node_accuracy=[round(h["node_accuracy_mean"], 5) for h in history],
                         mean_model_accuracy=[round(h["test_accuracy"], 5) for h in history],
                         consensus_distance=[float(f"{h['consensus_distance']:.5g}") for h in history]))


def _median_steps(values: list[int | None]) -> float | None:
  """Median with "not reached" as +infinity; None when the median run did not reach the target."""
  v = np.median([np.inf if s is None else s for s in values])
  return None if not np.isfinite(v) else float(v)


def summarize_training(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
  groups: dict[tuple, list[dict[str, Any]]] = {}
  for r in runs:
    groups.setdefault((r["partition"], r["n"], r["topology"]), []).append(r)
  return [dict(partition=p, n=n, topology=t, seeds=[r["seed"] for r in rs],
               steps_to_target=[r["steps_to_target"] for r in rs],
               median_steps_to_target=_median_steps([r["steps_to_target"] for r in rs]),
               median_steps_to_target_mean_model=_median_steps([r["steps_to_target_mean_model"] for r in rs]),
               final_node_accuracy=float(np.mean([r["final_node_accuracy"] for r in rs])),
               final_mean_model_accuracy=float(np.mean([r["final_mean_model_accuracy"] for r in rs])))
          for (p, n, t), rs in groups.items()]


def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """The spectral table at every size and the training column; writes results.json, table.md and figures."""
  os.makedirs(workdir, exist_ok=True)
  tic = time.perf_counter()
  spectral, decays = [], []
  for n in config.sizes:
    for name in config.topologies:
      row, decay = spectra.analyse(name, n, config)
      spectral.append(row)
      keep = _decay_steps(len(decay) - 1)
      decays.append(dict(topology=name, n=n, step=keep.tolist(), decay=[float(f"{v:.6g}") for v in decay[keep]]))
      print(f"{name:21s} n={n:5d}  messages max {row['messages_max']:4d} mean {row['messages_mean']:7.2f}"
            f"  rho {row['rho']:.6f}  per period {row['rho_period']:.3g}  measured {row['measured_rate']}"
            f"  steps to {config.decay_target:g}: {row['steps_to_target']}"
            f" (rho bound {row['steps_to_target_from_rho']})"
            f"  [{row['build_seconds'] + row['rho_seconds'] + row['decay_seconds']:.1f}s]", flush=True)
  dataset = gj.data.load_digits(seed=config.seed)
  runs = []
  for partition in config.partitions:
    for n in config.train_sizes:
      for name in config.topologies + (ALLREDUCE,):
        for i, seed in enumerate(config.train_seeds):
          run = train_run(config, name, n, partition, seed, dataset)
          if i > 0:
            del run["curve"]  # one curve per (partition, n, topology) is enough for the figure
          runs.append(run)
          print(f"{partition:9s} n={n:3d} {name:21s} seed {seed}  steps to {config.target_accuracy:.0%}: "
                f"{run['steps_to_target']} (mean model {run['steps_to_target_mean_model']})  final node acc "
                f"{run['final_node_accuracy']:.3f}  [{run['wall_seconds']:.1f}s]", flush=True)
  results = dict(spectral=spectral, decays=decays, training=summarize_training(runs), training_runs=runs,
                 wall_seconds=time.perf_counter() - tic, config=dataclasses.asdict(config))
  with open(os.path.join(workdir, "results.json"), "w") as f:
    f.write(dump_json(results))
  with open(os.path.join(workdir, "table.md"), "w") as f:
    f.write(markdown_table(results))
  plot_decay(results, os.path.join(workdir, "decay.png"))
  plot_rho(results, os.path.join(workdir, "rho.png"))
  plot_training(results, os.path.join(workdir, "training.png"))
  return results


def _decay_steps(steps: int) -> np.ndarray:
  """The gossip steps whose error results.json keeps: every one up to 200, then every 5th."""
  return np.unique(np.concatenate([np.arange(min(steps, 200) + 1), np.arange(200, steps + 1, 5), [steps]]))


def dump_json(results: dict[str, Any]) -> str:
  """Indented JSON, with each list of plain values (the curves) on one line instead of one line per number."""
  return re.sub(r"\[([^\[\]{}\"]*)\]", lambda m: "[" + " ".join(m.group(1).split()) + "]",
                json.dumps(results, indent=1))


def _fmt_rho(r: dict[str, Any]) -> str:
  if r["period"] == 1:
    return f"{r['rho']:.6f}"
  period = "exact average" if r["rho_period"] < 1e-12 else f"{r['rho_period']:.3g}"
  return f"{r['rho']:.3g} per step; {period} after one period ({r['period']} steps)"


def _fmt_steps(v: float | None, cap: int) -> str:
  return f"> {cap}" if v is None else f"{v:.0f}"


# Yuan's table: per-iteration communication and transient iterations (iid data), as printed there.
YUAN_TABLE = {"ring": ("Ω(2)", "Ω(n^7)"), "star": ("Ω(n)", "Ω(n^7)"), "grid": ("Ω(4)", "Ω(n^5 log2^2(n))"),
              "torus": ("Ω(4)", "Ω(n^5)"), "half_random": ("Ω(n/2)", "Ω(n^3)"),
              "static_exponential": ("Ω~(1)", "Ω~(n^3)"), "one_peer_exponential": ("Ω(1)", "Ω~(n^3)")}


def markdown_table(results: dict[str, Any]) -> str:
  """Yuan's table from this run: spectra per n, gossip decay per n, D-PSGD steps to target."""
  config = results["config"]
  sizes = config["sizes"]
  spec = {(r["topology"], r["n"]): r for r in results["spectral"]}
  per_n = " / ".join(str(n) for n in sizes)
  lines = [f"| topology | Yuan (2021): comm. / transient iters. | messages per node per step, max (n = {per_n}) "
           f"| mean | " + " | ".join(f"rho, n={n}" for n in sizes) + " |", "| --- " * (4 + len(sizes)) + "|"]
  for name in config["topologies"]:
    rs = [spec[name, n] for n in sizes]
    rhos = [_fmt_rho(r) for r in rs]
    seed = " / ".join(YUAN_TABLE.get(name, ("", "")))
    most = " / ".join(str(r["messages_max"]) for r in rs)
    mean = " / ".join(f"{r['messages_mean']:.3g}" for r in rs)
    lines.append(f"| {LABELS[name]} | {seed} | {most} | {mean} | " + " | ".join(rhos) + " |")
  lines += ["", "Pure gossip from a random start: steps until ||x - mean|| shrank "
            f"{1 / config['decay_target']:g}-fold, "
            f"measured (and from the rho bound; '-': rho = 1 gives no bound); measured rate per step over the "
            f"tail / rho:", "",
            "| topology | " + " | ".join(f"n={n}: steps" for n in sizes) + " | "
            + " | ".join(f"n={n}: rate / rho" for n in sizes) + " |", "| --- " * (1 + 2 * len(sizes)) + "|"]
  for name in config["topologies"]:
    rs = [spec[name, n] for n in sizes]
    steps = [f"{_fmt_steps(r['steps_to_target'], config['decay_steps'])} "
             f"({'-' if r['steps_to_target_from_rho'] is None else r['steps_to_target_from_rho']})" for r in rs]
    rates = ["-" if r["measured_rate"] is None else f"{r['measured_rate']:.6f} / {r['rate_per_step']:.6f}" for r in rs]
    lines.append(f"| {LABELS[name]} | " + " | ".join(steps) + " | " + " | ".join(rates) + " |")
  lines += ["", f"D-PSGD steps to {config['target_accuracy']:.0%} test accuracy (the nodes' own models, averaged "
            f"over nodes; median over seeds {list(config['train_seeds'])}; in brackets: the average model):", ""]
  train = {(r["partition"], r["n"], r["topology"]): r for r in results["training"]}
  cols = [(p, n) for p in config["partitions"] for n in config["train_sizes"]]
  lines.append("| topology | " + " | ".join(f"{p}, n={n}" for p, n in cols) + " |")
  lines.append("| --- " * (1 + len(cols)) + "|")
  for name in list(config["topologies"]) + [ALLREDUCE]:
    cells = [f"{_fmt_steps(train[c + (name,)]['median_steps_to_target'], config['train_steps'])} "
             f"({_fmt_steps(train[c + (name,)]['median_steps_to_target_mean_model'], config['train_steps'])})"
             for c in cols]
    lines.append(f"| {LABELS[name]} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def _plt():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def plot_decay(results: dict[str, Any], path: str) -> None:
  """Measured consensus error of pure gossip (solid) against the rho^k bound (dashed), one panel per n."""
  plt = _plt()
  sizes = results["config"]["sizes"]
  cols = 2 if len(sizes) > 1 else 1
  rows = (len(sizes) + cols - 1) // cols
  fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False)
  spec = {(r["topology"], r["n"]): r for r in results["spectral"]}
  for ax, n in zip(axes.ravel(), sizes):
    for d in results["decays"]:
      if d["n"] != n:
        continue
      r, k = spec[d["topology"], n], np.asarray(d["step"])
      ax.plot(k, np.maximum(d["decay"], 1e-17), color=COLORS[d["topology"]], label=LABELS[d["topology"]])
      bound = spectra.per_step_bound(r, k[-1] + 1)[k]
      ax.plot(k, np.maximum(bound, 1e-17), "--", lw=1, color=COLORS[d["topology"]])
    ax.set(yscale="log", ylim=(1e-16, 2), xlabel="gossip step k", ylabel=r"$\|x^k - \bar x\| / \|x^0 - \bar x\|$",
           title=f"n = {n}: measured (solid) vs rho^k (dashed)")
    ax.grid(True, alpha=0.3)
  axes.ravel()[0].legend(fontsize=8, loc="lower left")
  for ax in axes.ravel()[len(sizes):]:
    ax.set_visible(False)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_rho(results: dict[str, Any], path: str) -> None:
  plt = _plt()
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
  for name in results["config"]["topologies"]:
    rs = sorted((r for r in results["spectral"] if r["topology"] == name), key=lambda r: r["n"])
    ns = [r["n"] for r in rs]
    ax1.plot(ns, [r["rho"] for r in rs], "o-", color=COLORS[name], label=LABELS[name])
    if rs[0]["period"] > 1:
      ax1.plot(ns, [r["rate_per_step"] for r in rs], "o:", color=COLORS[name], mfc="none",
               label=f"{LABELS[name]}: rho(period)^(1/period)")
    ax2.plot(ns, [max(1 - r["rate_per_step"], 1e-17) for r in rs], "o-", color=COLORS[name], label=LABELS[name])
  ns = np.array(sorted({r["n"] for r in results["spectral"]}), float)
  ring = {r["n"]: 1 - r["rho"] for r in results["spectral"] if r["topology"] == "ring"}
  if ring:
    ax2.plot(ns, ring[ns[0]] * (ns / ns[0]) ** -2.0, "k:", lw=1, label=r"$\propto n^{-2}$")
    ax2.plot(ns, 2 * ring[ns[0]] * (ns / ns[0]) ** -1.0, "k--", lw=1, label=r"$\propto n^{-1}$")
  ax1.set(xscale="log", xlabel="n", ylabel=r"$\rho = \|W - 11^T/n\|_2$ (per step)", title="rho against n")
  ax2.set(xscale="log", yscale="log", xlabel="n", ylabel=r"$1 - \rho$ (per step; one-peer: per-period rate)",
          title="spectral gap against n")
  for ax in (ax1, ax2):
    ax.set_xticks(ns, [str(int(n)) for n in ns])
    ax.minorticks_off()
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_training(results: dict[str, Any], path: str) -> None:
  """Per partition: the nodes' mean accuracy against steps (largest training n), and steps to target per n."""
  plt = _plt()
  config = results["config"]
  partitions, n_curve = config["partitions"], max(config["train_sizes"])
  fig, axes = plt.subplots(len(partitions), 2, figsize=(13, 4.2 * len(partitions)), squeeze=False)
  names = list(config["topologies"]) + [ALLREDUCE]
  cap = config["train_steps"]
  for (ax1, ax2), partition in zip(axes, partitions):
    for run in results["training_runs"]:
      if run["partition"] == partition and run["n"] == n_curve and "curve" in run:
        c = run["curve"]
        ax1.plot(c["step"], c["node_accuracy"], color=COLORS[run["topology"]], label=LABELS[run["topology"]],
                 ls="--" if run["topology"] == ALLREDUCE else "-")
    ax1.axhline(config["target_accuracy"], color="k", lw=0.8, ls=":")
    ax1.set(xlabel="step", ylabel="test accuracy of the nodes' own models (mean)", ylim=(0, 1),
            title=f"D-PSGD, {partition} split, n = {n_curve} (seed {config['train_seeds'][0]})")
    ax1.legend(fontsize=7, loc="lower right")
    summary = {(r["n"], r["topology"]): r for r in results["training"] if r["partition"] == partition}
    width = 0.8 / len(config["train_sizes"])
    for j, n in enumerate(config["train_sizes"]):
      values = [summary[n, t]["median_steps_to_target"] for t in names]
      x = np.arange(len(names)) + (j - (len(config["train_sizes"]) - 1) / 2) * width
      bars = ax2.bar(x, [cap if v is None else v for v in values], width, label=f"n = {n}", color=f"C{j}",
                     alpha=0.8)
      for b, v in zip(bars, values):
        if v is None:
          b.set_hatch("//")
          b.set_alpha(0.35)
    ax2.set_xticks(np.arange(len(names)), [LABELS[t] for t in names], rotation=25, fontsize=8)
    ax2.set(ylabel=f"steps to {config['target_accuracy']:.0%} (hatched: not reached in {cap})",
            title=f"{partition} split: D-PSGD steps to target (median over seeds)")
    from matplotlib.patches import Patch
    handles = [Patch(color=f"C{j}", alpha=0.8, label=f"n = {n}") for j, n in enumerate(config["train_sizes"])]
    ax2.legend(handles=handles, fontsize=8)
    ax2.grid(True, axis="y", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
