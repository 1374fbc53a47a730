"""Result table, metrics file and plot of the main job."""

from __future__ import annotations

import json
import os
from typing import Any


def result_table(results: dict[str, dict[str, Any]]) -> str:
  """A markdown table: one row per run, final metrics."""
  head = ["run", "train loss", "test acc (mean model)", "node acc mean", "node acc min", "consensus dist", "seconds"]
  rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for name, r in results.items():
    f = r["history"][-1]
    rows.append(
        f"| {name} | {f['train_loss']:.4f} | {f['test_accuracy']:.4f} | {f['node_accuracy_mean']:.4f} | "
        f"{f['node_accuracy_min']:.4f} | {f['consensus_distance']:.3e} | {r['seconds']:.1f} |"
    )
  return "\n".join(rows)


def write_metrics(path: str, config: dict[str, Any], results: dict[str, dict[str, Any]]) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump({"config": config, "runs": results}, f, indent=1)
  os.replace(tmp, path)


def plot(path: str, results: dict[str, dict[str, Any]], title: str = "") -> None:
  """Training loss, consensus distance and test accuracy of the mean model, per step."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  for name, r in results.items():
    steps = [h["step"] for h in r["history"]]
    axes[0].plot(steps, [h["train_loss"] for h in r["history"]], label=name)
    axes[1].plot(steps, [max(h["consensus_distance"], 1e-16) for h in r["history"]], label=name)
    axes[2].plot(steps, [h["test_accuracy"] for h in r["history"]], label=name)
  axes[0].set(yscale="log", xlabel="step", ylabel="training loss (mean over nodes)")
  axes[1].set(yscale="log", xlabel="step", ylabel="consensus distance  1/n sum ||x_i - x̄||²")
  axes[2].set(xlabel="step", ylabel="test accuracy of the mean model")
  for ax in axes:
    ax.grid(alpha=0.3)
  axes[2].legend(fontsize=8)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
