"""The inconsistency bias on full-batch linear regression: the numerical verification of Kun Yuan,
"Decentralized Optimization Algorithms for Large-Scale Deep Neural Network Training" (lecture,
Zhejiang University, 2021).

Node i holds ``f_i(x) = 1/(2m) ||A_i x - b_i||^2`` with its own minimiser
(``b_i = A_i (x0 + h z_i) + noise``), so the local optima disagree; ``x*`` minimises the
average ``(1/n) sum_i f_i`` and comes from the normal equations. Every method takes the
exact local gradient (full batch, no sampling noise), so whatever error is left at the
end, ``sum_i ||x_i^k - x*||^2``, is the inconsistency bias alone. Everything runs in
float64 (``jax.enable_x64``), so the exact methods can be seen reaching round-off.

Why the limits are what they are: D-PSGD's fixed point solves ``x = W(x - lr grad f(x))``;
DmSGD's is D-PSGD's at the rate ``lr / (1 - beta)`` (at rest ``m = g / (1 - beta)``);
DecentLaM's is D-PSGD's (at rest ``x^k - x^{k-1} = 0``, so its momentum term vanishes).
For quadratics each is one linear solve (`predicted_limit`), which the runs are checked against.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gossipjax as gj


class Problem(NamedTuple):
  """``f_i(x) = 1/(2m) ||a[i] x - b[i]||^2``; ``x_star`` minimises their average."""

  a: np.ndarray  # (n, m, d)
  b: np.ndarray  # (n, m)
  x_star: np.ndarray  # (d,)

  @property
  def hessians(self) -> np.ndarray:
    return np.einsum("nmd,nme->nde", self.a, self.a) / self.a.shape[1]

  @property
  def linear_terms(self) -> np.ndarray:
    return np.einsum("nmd,nm->nd", self.a, self.b) / self.a.shape[1]


def make_problem(config) -> Problem:
  rng = np.random.default_rng(config.seed)
  n, m, d = config.num_nodes, config.samples_per_node, config.dim
  a = rng.normal(size=(n, m, d))
  local_optima = rng.normal(size=d) + config.heterogeneity * rng.normal(size=(n, d))
  b = np.einsum("nmd,nd->nm", a, local_optima) + config.noise * rng.normal(size=(n, m))
  x_star = np.linalg.solve(np.einsum("nmd,nme->de", a, a), np.einsum("nmd,nm->d", a, b))
  return Problem(a, b, x_star)


def problem_facts(problem: Problem, topology: gj.topology.Topology) -> dict[str, float]:
  """The quantities of Yuan's bias formulas: b^2 = (1/n) sum_i ||grad f_i(x*)||^2, rho, L, mu."""
  h = problem.hessians
  grads_at_opt = np.einsum("nde,e->nd", h, problem.x_star) - problem.linear_terms
  return dict(heterogeneity_b2=float(np.mean(np.sum(grads_at_opt**2, axis=1))),
              rho=gj.topology.rho(topology),
              smoothness_L=float(max(np.linalg.eigvalsh(hi).max() for hi in h)),
              strong_convexity_mu=float(np.linalg.eigvalsh(h.mean(axis=0)).min()),
              x_star_norm2=float(problem.x_star @ problem.x_star))


TOPOLOGIES: dict[str, Callable[[int], gj.topology.Topology]] = {
    "ring": gj.topology.ring,
    "symmetric_exponential": lambda n: gj.topology.exponential(n, symmetric=True),
}

# (topology, learning rate, beta) -> the optax transform.
ALGORITHMS: dict[str, Callable[[gj.topology.Topology, float, float], optax.GradientTransformation]] = {
    "d-psgd": lambda topo, lr, beta: gj.gossip_sgd(topo, learning_rate=lr),
    "dmsgd": lambda topo, lr, beta: gj.gossip_sgd(topo, beta=beta, learning_rate=lr),
    "decentlam": lambda topo, lr, beta: gj.decentlam(topo, beta=beta, learning_rate=lr),
    "gradient_tracking": lambda topo, lr, beta: gj.gradient_tracking(topo, learning_rate=lr),
    "exact_diffusion": lambda topo, lr, beta: gj.exact_diffusion(topo, learning_rate=lr),
    "extra": lambda topo, lr, beta: gj.extra(topo, learning_rate=lr),
}
EXACT = frozenset({"gradient_tracking", "exact_diffusion", "extra"})
MOMENTUM = frozenset({"dmsgd", "decentlam"})


def error_curve(problem: Problem, tx: optax.GradientTransformation, steps: int) -> np.ndarray:
  """``sum_i ||x_i^k - x*||^2`` for k = 0..steps from ``x^0 = 0``, in one jitted scan."""
  a, b = jnp.asarray(problem.a), jnp.asarray(problem.b)
  x_star = jnp.broadcast_to(jnp.asarray(problem.x_star), (a.shape[0], a.shape[2]))
  local_grads = jax.vmap(jax.grad(lambda x, ai, bi: 0.5 * jnp.mean((ai @ x - bi) ** 2)))

  def body(carry, _):
    x, state = carry
    updates, state = tx.update(local_grads(x, a, b), state, x)
    x = optax.apply_updates(x, updates)
    return (x, state), jnp.sum((x - x_star) ** 2)

  x0 = jnp.zeros_like(x_star)
  _, errors = jax.jit(lambda c: jax.lax.scan(body, c, None, steps))((x0, tx.init(x0)))
  return np.concatenate([[float(jnp.sum(x_star**2))], np.asarray(errors)])


def dpsgd_fixed_point(problem: Problem, w: np.ndarray, lr: float) -> np.ndarray:
  """The x with ``x = W(x - lr grad f(x))``: one (n d) x (n d) linear solve for quadratics."""
  n, _, d = problem.a.shape
  hess = np.zeros((n * d, n * d))
  for i, hi in enumerate(problem.hessians):
    hess[i * d:(i + 1) * d, i * d:(i + 1) * d] = hi
  wk = np.kron(w, np.eye(d))
  x = np.linalg.solve(np.eye(n * d) - wk @ (np.eye(n * d) - lr * hess), lr * wk @ problem.linear_terms.ravel())
  return x.reshape(n, d)


def predicted_limit(problem: Problem, w: np.ndarray, algorithm: str, lr: float, beta: float) -> float:
  """``sum_i ||x_i - x*||^2`` at the algorithm's fixed point (0 for the exact methods)."""
  if algorithm in EXACT:
    return 0.0
  rate = lr / (1 - beta) if algorithm == "dmsgd" else lr
  return float(np.sum((dpsgd_fixed_point(problem, w, rate) - problem.x_star) ** 2))


def settle_steps(curve: np.ndarray, limit: float, rel: float = 0.1) -> int:
  """The first k after which the error stays within ``rel * limit`` of ``limit``."""
  off = np.flatnonzero(np.abs(curve - limit) > rel * limit)
  return 0 if off.size == 0 else int(off[-1] + 1)


def steps_below(curve: np.ndarray, tolerance: float) -> int | None:
  hit = np.flatnonzero(curve <= tolerance)
  return int(hit[0]) if hit.size else None


def run(config, problem: Problem, topology_name: str, algorithm: str, lr: float, beta: float,
        kind: str) -> tuple[dict[str, Any], np.ndarray]:
  topo = TOPOLOGIES[topology_name](config.num_nodes)
  tic = time.perf_counter()
  curve = error_curve(problem, ALGORITHMS[algorithm](topo, lr, beta), config.steps)
  wall = time.perf_counter() - tic
  limit = float(curve[-1])
  tail = curve[int(0.9 * config.steps):]
  row = dict(kind=kind, topology=topology_name, algorithm=algorithm, learning_rate=lr,
             beta=beta if algorithm in MOMENTUM else None, limit=limit,
             predicted_limit=predicted_limit(problem, topo.matrix(), algorithm, lr, beta),
             # how much the error still moves over the last 10% of the run, relative to where it ends
             tail_relative_spread=float((tail.max() - tail.min()) / max(limit, 1e-300)),
             steps_to_settle=None if algorithm in EXACT else settle_steps(curve, limit),
             steps_to_tolerance=steps_below(curve, config.exact_tolerance),
             min_error=float(curve.min()), wall_seconds=wall)
  return row, curve


EARLY_WINDOW = 2000  # iterations shown in the figure's left panels, where the biased methods settle


def _sample_indices(steps: int) -> np.ndarray:
  """Iterations at which results.json stores the curves: every 4th over the early window, then log-spaced."""
  early = np.arange(0, min(steps, EARLY_WINDOW) + 1, 4)
  return np.unique(np.concatenate([early, np.round(np.logspace(0, np.log10(steps), 300)).astype(int), [steps]]))


def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Runs the figure's runs and the two sweeps; writes results.json, table.md, bias.png and sweeps.png."""
  os.makedirs(workdir, exist_ok=True)
  tic = time.perf_counter()
  with jax.enable_x64(True):
    problem = make_problem(config)
    facts = {name: problem_facts(problem, TOPOLOGIES[name](config.num_nodes)) for name in config.topologies}
    index = _sample_indices(config.steps)
    rows, curves = [], []
    for topology_name in config.topologies:
      for lr in (config.learning_rate, config.learning_rate / 2):
        for algorithm in config.algorithms:
          row, curve = run(config, problem, topology_name, algorithm, lr, config.beta, "figure")
          rows.append(row)
          curves.append(dict(topology=topology_name, algorithm=algorithm, learning_rate=lr,
                             error=curve[index].tolist()))
          _print(row)
      for lr in config.lr_sweep:
        for algorithm in ("d-psgd", "dmsgd", "decentlam"):
          rows.append(_print(run(config, problem, topology_name, algorithm, lr, config.beta, "lr_sweep")[0]))
      for beta in config.beta_sweep:
        for algorithm in ("dmsgd", "decentlam"):
          rows.append(_print(run(config, problem, topology_name, algorithm, config.learning_rate, beta,
                                 "beta_sweep")[0]))
    dpsgd_law = {name: dpsgd_limit_vs_rate(problem, TOPOLOGIES[name](config.num_nodes), config)
                 for name in config.topologies}
  results = dict(facts=facts, rows=rows, halving=halving_table(rows, config), dpsgd_limit_vs_rate=dpsgd_law,
                 curve_steps=index.tolist(), curves=curves, wall_seconds=time.perf_counter() - tic,
                 config=dataclasses.asdict(config))
  with open(os.path.join(workdir, "results.json"), "w") as f:
    f.write(dump_json(results))
  with open(os.path.join(workdir, "table.md"), "w") as f:
    f.write(markdown_table(results))
  plot_curves(results, os.path.join(workdir, "bias.png"))
  plot_sweeps(results, os.path.join(workdir, "sweeps.png"))
  return results


def dpsgd_limit_vs_rate(problem: Problem, topology: gj.topology.Topology, config, points: int = 40) -> dict[str, list]:
  """D-PSGD's closed-form limiting bias over the rates the sweeps reach (DmSGD sits at lr / (1 - beta))."""
  rates = [config.learning_rate / (1 - b) for b in config.beta_sweep] + list(config.lr_sweep)
  grid = np.logspace(np.log10(min(rates)), np.log10(max(rates)), points)
  return dict(learning_rate=grid.tolist(),
              limit=[predicted_limit(problem, topology.matrix(), "d-psgd", float(r), 0.0) for r in grid])


def dump_json(results: dict[str, Any]) -> str:
  """Indented JSON, with each list of plain values (the curves) on one line instead of one line per number."""
  return re.sub(r"\[([^\[\]{}\"]*)\]", lambda m: "[" + " ".join(m.group(1).split()) + "]",
                json.dumps(results, indent=1))


def halving_table(rows: list[dict[str, Any]], config) -> list[dict[str, Any]]:
  """Limit at lr and at lr/2 for each biased method: D-PSGD's bias is O(lr^2), so about 4x smaller."""
  table = []
  for topology_name in config.topologies:
    for algorithm in config.algorithms:
      if algorithm in EXACT:
        continue
      get = lambda lr: next(r for r in rows if r["kind"] == "figure" and r["topology"] == topology_name
                            and r["algorithm"] == algorithm and r["learning_rate"] == lr)
      full, half = get(config.learning_rate), get(config.learning_rate / 2)
      table.append(dict(topology=topology_name, algorithm=algorithm, limit_lr=full["limit"],
                        limit_half_lr=half["limit"], ratio=full["limit"] / half["limit"],
                        predicted_ratio=full["predicted_limit"] / half["predicted_limit"]))
  return table


def markdown_table(results: dict[str, Any]) -> str:
  """Per topology: each method's limit at lr and lr/2, the closed form, and how fast it gets there."""
  config = results["config"]
  lr, half = config["learning_rate"], config["learning_rate"] / 2
  rows = {(r["topology"], r["algorithm"], r["learning_rate"]): r for r in results["rows"] if r["kind"] == "figure"}
  ratios = {(h["topology"], h["algorithm"]): h["ratio"] for h in results["halving"]}
  out = []
  for t in config["topologies"]:
    f = results["facts"][t]
    out += [f"{t}({config['num_nodes']}): rho = {f['rho']:.4f}, b^2 = {f['heterogeneity_b2']:.3f}, "
            f"L = {f['smoothness_L']:.3f}, mu = {f['strong_convexity_mu']:.3f}, beta = {config['beta']:g}", "",
            f"| method | limit (last iteration), lr={lr:g} | limit, lr={half:g} | ratio | closed form (lr; lr/2) "
            f"| steps to settle (lr; lr/2) | steps to {config['exact_tolerance']:.0e} (lr; lr/2) |",
            "| --- " * 7 + "|"]
    for a in config["algorithms"]:
      r1, r2 = rows[t, a, lr], rows[t, a, half]
      ratio = f"{ratios[t, a]:.3f}" if (t, a) in ratios else "-"
      settle = "-" if a in EXACT else f"{r1['steps_to_settle']}; {r2['steps_to_settle']}"
      reach = "-" if r1["steps_to_tolerance"] is None else f"{r1['steps_to_tolerance']}; {r2['steps_to_tolerance']}"
      closed = "0; 0" if a in EXACT else f"{r1['predicted_limit']:.4e}; {r2['predicted_limit']:.4e}"
      lowest = f" (lowest {r1['min_error']:.1e})" if a in EXACT else ""
      out.append(f"| {LABELS[a]} | {r1['limit']:.4e}{lowest} | {r2['limit']:.4e} | {ratio} | {closed} | {settle} "
                 f"| {reach} |")
    out.append("")
  return "\n".join(out)


def _print(row: dict[str, Any]) -> dict[str, Any]:
  beta = "" if row["beta"] is None else f" beta {row['beta']:g}"
  print(f"{row['kind']:10s} {row['topology']:21s} {row['algorithm']:17s} lr {row['learning_rate']:<8g}{beta:10s}"
        f" limit {row['limit']:.4e} (predicted {row['predicted_limit']:.4e})  settle {row['steps_to_settle']}"
        f"  to {row['steps_to_tolerance']}", flush=True)
  return row


COLORS = {"d-psgd": "C0", "dmsgd": "C1", "decentlam": "C2", "gradient_tracking": "C3", "exact_diffusion": "C4",
          "extra": "C5"}
LABELS = {"d-psgd": "D-PSGD", "dmsgd": "DmSGD", "decentlam": "DecentLaM", "gradient_tracking": "gradient tracking",
          "exact_diffusion": "exact diffusion", "extra": "EXTRA"}


def plot_curves(results: dict[str, Any], path: str) -> None:
  """Per topology: Yuan's two figures (D-PSGD / DmSGD / DecentLaM at lr and lr/2), then all six methods."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  config = results["config"]
  lr, topologies = config["learning_rate"], config["topologies"]
  fig, axes = plt.subplots(len(topologies), 2, figsize=(12, 4.2 * len(topologies)), squeeze=False)
  steps = np.asarray(results["curve_steps"])
  window = min(EARLY_WINDOW, config["steps"])
  for row, topology_name in enumerate(topologies):
    rho = results["facts"][topology_name]["rho"]
    title = f"{topology_name}({config['num_nodes']}), rho={rho:.3f}, beta={config['beta']:g}"
    left, right = axes[row]
    for c in results["curves"]:
      if c["topology"] != topology_name:
        continue
      error, name = np.asarray(c["error"]), LABELS[c["algorithm"]]
      if c["algorithm"] not in EXACT:
        early = steps <= window
        half = c["learning_rate"] != lr
        left.plot(steps[early], error[early], "--" if half else "-", color=COLORS[c["algorithm"]],
                  lw=1.2 if half else 1.8, label=f"{name}, lr={c['learning_rate']:g}")
      if c["learning_rate"] == lr:  # D-PSGD drawn wide: DecentLaM's curve ends on top of it
        right.plot(steps, error, "--" if c["algorithm"] in EXACT else "-", color=COLORS[c["algorithm"]], label=name,
                   lw=3.5 if c["algorithm"] == "d-psgd" else 1.5)
    left.set(yscale="log", xlabel="iteration k", ylabel=r"$\sum_i \|x_i^k - x^\star\|^2$",
             title=title + ": lr and lr/2")
    right.set(yscale="log", xlabel="iteration k", ylabel=r"$\sum_i \|x_i^k - x^\star\|^2$",
              title=title + f", lr={lr:g}")
    for ax in (left, right):
      ax.grid(True, which="major", alpha=0.3)
      ax.legend(fontsize=8, ncol=2 if ax is left else 1)
  fig.suptitle("Full-batch heterogeneous linear regression, error to the exact global optimum x*", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_sweeps(results: dict[str, Any], path: str) -> None:
  """Per topology: the limiting bias against lr, and against DmSGD's effective rate lr / (1 - beta)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  config = results["config"]
  topologies = config["topologies"]
  fig, axes = plt.subplots(len(topologies), 2, figsize=(12, 4.2 * len(topologies)), squeeze=False)
  markers = {"d-psgd": ("o", 8), "dmsgd": ("s", 6), "decentlam": ("x", 7)}
  for row, topology_name in enumerate(topologies):
    ax1, ax2 = axes[row]
    law = results["dpsgd_limit_vs_rate"][topology_name]
    title = f"{topology_name}({config['num_nodes']})"
    lr_rows = [r for r in results["rows"] if r["kind"] == "lr_sweep" and r["topology"] == topology_name]
    for algorithm in ("d-psgd", "dmsgd", "decentlam"):
      rs = sorted((r for r in lr_rows if r["algorithm"] == algorithm), key=lambda r: r["learning_rate"])
      m, ms = markers[algorithm]
      ax1.plot([r["learning_rate"] for r in rs], [r["limit"] for r in rs], marker=m, ms=ms, ls="-",
               color=COLORS[algorithm], label=LABELS[algorithm], mfc="none" if m == "o" else None)
    if lr_rows:
      lrs = np.array(sorted({r["learning_rate"] for r in lr_rows}))
      low = next(r["limit"] for r in lr_rows if r["algorithm"] == "d-psgd" and r["learning_rate"] == lrs[0])
      ax1.plot(lrs, low * (lrs / lrs[0]) ** 2, "k:", label=r"$\propto$ lr$^2$ (from the smallest lr)")
    ax1.set(xscale="log", yscale="log", xlabel="learning rate lr", ylabel="limiting bias",
            title=f"{title}, beta={config['beta']:g}: bias against lr")
    beta_rows = [r for r in results["rows"] if r["kind"] == "beta_sweep" and r["topology"] == topology_name]
    ax2.plot(law["learning_rate"], law["limit"], "-", color=COLORS["d-psgd"], lw=1,
             label="D-PSGD at rate lr' (closed form)")
    for algorithm in ("dmsgd", "decentlam"):
      rs = sorted((r for r in beta_rows if r["algorithm"] == algorithm), key=lambda r: r["beta"])
      m, ms = markers[algorithm]
      ax2.plot([r["learning_rate"] / (1 - r["beta"]) for r in rs], [r["limit"] for r in rs], marker=m, ms=ms,
               ls="none", color=COLORS[algorithm], label=f"{LABELS[algorithm]}, beta in {config['beta_sweep']}")
    ax2.set(xscale="log", yscale="log", xlabel="lr' = lr / (1 - beta)", ylabel="limiting bias",
            title=f"{title}, lr={config['learning_rate']:g}: bias against lr / (1 - beta)")
    for ax in (ax1, ax2):
      ax.legend(fontsize=8)
      ax.grid(True, which="major", alpha=0.3)
      ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
