"""Result table, metrics file and plot of the main job."""

from __future__ import annotations

import json
import os
from typing import Any


def result_table(results: dict[str, dict[str, Any]]) -> str:
  """A markdown table: one row per run, final metrics.

  A language model's runs (rows with ``test_bits_per_token``) report the test loss of the
  mean model in nats and bits a token, the nodes' own test losses (mean and worst), the
  tokens per second and the simulated seconds instead of accuracies.

  Args:
    results: ``{run name: {"history": metrics rows of `run`, "seconds": float}}``; the
      last row of each history is reported.

  Returns:
    The table as a markdown string.

  Example:
    >>> from gossipjax import train
    >>> row = {"train_loss": 0.5, "test_accuracy": 0.9, "node_accuracy_mean": 0.88,
    ...        "node_accuracy_min": 0.8, "consensus_distance": 1e-3}
    >>> print(train.result_table({"dpsgd/ring": {"history": [row], "seconds": 1.5}}))
    | run | train loss | test acc (mean model) | node acc mean | node acc min | consensus dist | seconds |
    |---|---|---|---|---|---|---|
    | dpsgd/ring | 0.5000 | 0.9000 | 0.8800 | 0.8000 | 1.000e-03 | 1.5 |
  """
  if any("test_bits_per_token" in r["history"][-1] for r in results.values()):
    return _sequence_table(results)
  head = ["run", "train loss", "test acc (mean model)", "node acc mean", "node acc min", "consensus dist", "seconds"]
  rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for name, r in results.items():
    f = r["history"][-1]
    rows.append(
        f"| {name} | {f['train_loss']:.4f} | {f['test_accuracy']:.4f} | {f['node_accuracy_mean']:.4f} | "
        f"{f['node_accuracy_min']:.4f} | {f['consensus_distance']:.3e} | {r['seconds']:.1f} |"
    )
  return "\n".join(rows)


def _sequence_table(results: dict[str, dict[str, Any]]) -> str:
  head = ["run", "train loss", "test loss (mean model)", "bits/token", "node test loss mean", "node test loss max",
          "consensus dist", "MB sent", "sim seconds", "tokens/s", "seconds"]
  rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for name, r in results.items():
    f = r["history"][-1]
    rows.append(
        f"| {name} | {f['train_loss']:.4f} | {f['test_loss']:.4f} | {f['test_bits_per_token']:.3f} | "
        f"{f['node_test_loss_mean']:.4f} | {f['node_test_loss_max']:.4f} | {f['consensus_distance']:.3e} | "
        f"{f.get('bytes_sent', 0.0) / 1e6:.3g} | {f.get('sim_seconds', 0.0):.4g} | "
        f"{f.get('tokens_per_second', 0):,} | {r['seconds']:.1f} |")
  return "\n".join(rows)


def write_metrics(path: str, config: dict[str, Any], results: dict[str, dict[str, Any]]) -> None:
  """Writes ``{"config": config, "runs": results}`` as JSON, atomically (a temporary file renamed).

  A reader sees the previous file or the new one, whole, even when the writer is killed.

  Args:
    path: the JSON file (its directory is created if missing).
    config: the job's configuration, plain values.
    results: the runs, plain values (as `result_table` takes them).

  Returns:
    None.

  Example:
    >>> import json, os, tempfile
    >>> from gossipjax import train
    >>> path = os.path.join(tempfile.mkdtemp(), "out", "metrics.json")
    >>> train.write_metrics(path, {"steps": 20}, {"dpsgd/ring": {"seconds": 1.5}})
    >>> with open(path) as f:
    ...   json.load(f)["runs"]
    {'dpsgd/ring': {'seconds': 1.5}}
  """
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = f"{path}.tmp-{os.getpid()}"  # a writer of its own: two writers never share a half-written file
  try:
    with open(tmp, "w") as f:
      json.dump({"config": config, "runs": results}, f, indent=1)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


# Consensus distances below this are exact consensus up to round-off (AllReduce keeps the nodes
# equal): drawn on a log axis they would stretch it over ten decades and flatten every other curve.
EXACT_CONSENSUS = 1e-10


def _label(config: dict[str, Any]) -> str:
  """The algorithm with the momentum it really runs with (D-PSGD: none, whatever --beta says)."""
  from gossipjax.train._registry import MOMENTUM

  algorithm = config["algorithm"]
  if config.get("outer_momentum") is not None:  # DiLoCo, NoLoCo: beta is the inner AdamW's b1
    return f"{algorithm} (outer μ = {config['outer_momentum']:g}, inner b1 = {config.get('beta'):g})"
  beta = MOMENTUM.get(algorithm, config.get("beta"))
  if beta is None:  # a method without momentum, or a config that names none
    return algorithm
  return f"{algorithm} (β = {beta:g})"


def plot(path: str, results: dict[str, dict[str, Any]], title: str = "", x: str = "step") -> None:
  """Training loss, consensus distance and test accuracy of the mean model, per step or per byte sent.

  One colour per algorithm (its legend entry gives the momentum it runs with) and one line
  style per topology. Runs at exact consensus (AllReduce) are left off the consensus panel's
  log axis, and the panel says so.

  Args:
    path: the image file to write (its format from the suffix, e.g. ``.png``).
    results: ``{run name: {"history": metrics rows of `run`, "config": RunConfig as a
      dict}}``; without a config, the run's name stands for its algorithm.
    title: the figure's title.
    x: the x-axis: ``"step"``; ``"bytes"``, the MB each node has sent (the rows'
      ``bytes_sent``), to compare methods at equal communication; or ``"time"``, the
      simulated wall clock (the rows' ``sim_seconds``). Bytes and time are drawn on log
      scales, where methods that send little would otherwise crowd the first pixels.
      A language model's third panel is the mean model's test loss, not its accuracy.

  Returns:
    None.

  Example:
    >>> import os, tempfile
    >>> from gossipjax import train
    >>> rows = [{"step": s, "train_loss": 2.0 / s, "consensus_distance": 0.1 / s, "test_accuracy": 0.5}
    ...         for s in (10, 20)]
    >>> path = os.path.join(tempfile.mkdtemp(), "runs.png")
    >>> train.plot(path, {"dpsgd/ring": {"history": rows, "config": {"algorithm": "dpsgd", "topology": "ring"}}})
    >>> os.path.getsize(path) > 0
    True
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.lines import Line2D

  configs = {name: r.get("config", {"algorithm": name, "topology": None}) for name, r in results.items()}
  algorithms = list(dict.fromkeys(c["algorithm"] for c in configs.values()))
  topologies = list(dict.fromkeys(c.get("topology") for c in configs.values() if c.get("topology")))
  colours = {a: plt.get_cmap("tab10")(i % 10) for i, a in enumerate(algorithms)}
  styles = {t: s for t, s in zip(topologies, ["-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1))] * 4)}
  sequence = any("test_bits_per_token" in h for r in results.values() for h in r["history"][-1:])
  position = {"step": lambda h: h["step"], "bytes": lambda h: h.get("bytes_sent", 0.0) / 1e6,
              "time": lambda h: h.get("sim_seconds", 0.0)}[x]
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
  exact = []
  for name, r in results.items():
    c = configs[name]
    # A run with no topology (all-reduce, DiLoCo) gets a line style of its own, not the first topology's.
    style = styles.get(c.get("topology"), "-") if c.get("topology") or not topologies else (0, (1, 1))
    look = {"color": colours[c["algorithm"]], "linestyle": style, "linewidth": 1.6}
    steps = [position(h) for h in r["history"]]
    axes[0].plot(steps, [h["train_loss"] for h in r["history"]], **look)
    distance = [h["consensus_distance"] for h in r["history"]]
    if max(distance) < EXACT_CONSENSUS:
      exact.append(name)
    else:
      axes[1].plot(steps, [max(d, EXACT_CONSENSUS) for d in distance], **look)
    axes[2].plot(steps, [h["test_loss" if sequence else "test_accuracy"] for h in r["history"]], **look)
  xlabel = {"step": "step", "bytes": "MB sent per node (an all-reduce as a ring sends it)",
            "time": "simulated seconds (synchronous, on the job's --network)"}[x]
  axes[0].set(yscale="log", xlabel=xlabel, ylabel="training loss (mean over nodes)")
  axes[1].set(yscale="log", xlabel=xlabel, ylabel="consensus distance  1/n sum ||x_i - x̄||²")
  if exact:
    axes[1].text(0.98, 0.98, f"not drawn (exact consensus, < {EXACT_CONSENSUS:g}):\n" + ", ".join(exact),
                 transform=axes[1].transAxes, ha="right", va="top", fontsize=8, color="0.35")
  axes[2].set(xlabel=xlabel, ylabel="test loss of the mean model (nats a token)" if sequence
              else "test accuracy of the mean model")
  for ax in axes:
    ax.grid(alpha=0.3)
    if x != "step":  # symlog: a run's first rows may have sent nothing yet (DiLoCo before its first round)
      ax.set_xscale("symlog", linthresh=_smallest_positive(ax))
  handles = [Line2D([], [], color=colours[a], linewidth=2,
                    label=_label(next(c for c in configs.values() if c["algorithm"] == a))) for a in algorithms]
  handles += [Line2D([], [], color="0.3", linestyle=styles[t], label=t) for t in topologies]
  if any(not c.get("topology") for c in configs.values()) and topologies:
    handles.append(Line2D([], [], color="0.3", linestyle=(0, (1, 1)), label="no topology (all-reduce)"))
  axes[2].legend(handles=handles, fontsize=8, loc="lower right")
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _smallest_positive(ax: Any) -> float:
  """The smallest positive x of an axes' lines (a symlog axis's linear range below it), 1 when there is none."""
  xs = [x for line in ax.get_lines() for x in line.get_xdata() if x > 0]
  return float(min(xs)) if xs else 1.0
