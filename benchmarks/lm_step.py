"""Tokens per second of a 16-node byte-level GPT training step: the library against a plain ``jax.vmap``.

``gj.train.GPT`` (context 64, 2 layers, width 64, 4 heads), batch 16 per node, windows of the Python
standard library's sources (``gj.data.load_python_stdlib``). Every contender is one ``jax.jit`` of a
``lax.scan`` over a chunk of steps, as `gossipjax.train.run` runs them, with params and optimizer state
donated and the chunk's batches given as the scan's inputs (the same batches for all). The library's
steps take the per-node gradients with ``jax.vmap(jax.value_and_grad(loss))`` and then one stacked
optimizer update:

- ``d_adamw``: ``gj.chain(optax.adamw(3e-3), gj.mix(one_peer_exponential(16)))``;
- ``d_adamw_guarded``: the same behind ``gj.guard_finite``, as the main job runs every method;
- ``dmsgd``: ``gj.gossip_sgd(ring(16), beta=0.9, learning_rate=0.1)``.

Their baselines are what a JAX user writes for 16 independent models, no gossip: ``jax.vmap`` of the whole
one-node step (gradient, optax update, ``apply_updates``), with ``optax.adamw(3e-3)`` (``vmap_adamw``) and
with ``optax.sgd(0.1, momentum=0.9)`` (``vmap_sgd_momentum``, DmSGD's local rule). All five are interleaved;
the ratios are of medians within one run. For reference, `gossipjax.train.run` itself (``d_adamw`` on the
one-peer exponential graph) reports its ``tokens_per_second`` after the timed comparison, not interleaved.

Runs on whatever JAX's default device is; ``python -m benchmarks.lm_step --platform gpu`` (or ``cpu``)
chooses one.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import gossipjax as gj
from benchmarks import _timing

SIZES = {"context": 64, "num_layers": 2, "width": 64, "num_heads": 4}
ADAMW_LR, SGD_LR, BETA = 3e-3, 0.1, 0.9
BASELINE = {"d_adamw": "vmap_adamw", "d_adamw_guarded": "vmap_adamw", "dmsgd": "vmap_sgd_momentum"}


def problem(num_nodes: int, batch: int, steps: int, sizes: dict[str, int], seed: int = 0):
  """The model, its stacked params (every node from one init) and ``steps`` batches per node."""
  model = gpt(sizes)
  data = gj.data.load_python_stdlib(context=sizes["context"], max_bytes=1_000_000, test_windows=8)
  rng = np.random.default_rng(seed)
  rows = rng.integers(0, len(data.x_train), (steps, num_nodes, batch))
  xs, ys = jnp.asarray(data.x_train[rows]), jnp.asarray(data.y_train[rows])
  params = gj.init_nodes(lambda k: model.init(k, xs[0, 0]), jax.random.key(seed), num_nodes)
  return model, params, xs, ys


def gpt(sizes: dict[str, int], vocab_size: int = 256):
  """``gj.train.GPT`` of ``sizes`` (context, num_layers, width, num_heads)."""
  from gossipjax import train

  return train.GPT(vocab_size=vocab_size, context=sizes["context"], num_layers=sizes["num_layers"],
                   width=sizes["width"], num_heads=sizes["num_heads"])


def _loss_fn(model) -> Callable[..., jax.Array]:
  return lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()


def _scanned(step: Callable) -> Any:
  """``(params, state, xs, ys) -> (params, state, losses)``: ``step`` over the chunk, jitted and donated."""

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def chunk(params, state, xs, ys):
    def body(carry, batch):
      loss, params, state = step(*carry, *batch)
      return (params, state), loss

    (params, state), losses = lax.scan(body, (params, state), (xs, ys))
    return params, state, losses

  return chunk


def library_chunk(model, tx: optax.GradientTransformation) -> Any:
  """The library's step: stacked per-node gradients, then ``tx``'s stacked update."""
  loss_and_grad = jax.vmap(jax.value_and_grad(_loss_fn(model)))

  def step(params, state, x, y):
    loss, grads = loss_and_grad(params, x, y)
    updates, state = tx.update(grads, state, params)
    return loss, optax.apply_updates(params, updates), state

  return _scanned(step)


def vmapped_chunk(model, tx: optax.GradientTransformation) -> Any:
  """The baseline: ``jax.vmap`` of one node's whole step with ``tx``, no exchange."""
  loss_and_grad = jax.value_and_grad(_loss_fn(model))

  def one_node(params, state, x, y):
    loss, grads = loss_and_grad(params, x, y)
    updates, state = tx.update(grads, state, params)
    return loss, optax.apply_updates(params, updates), state

  return _scanned(jax.vmap(one_node))


def transforms(num_nodes: int) -> dict[str, tuple[optax.GradientTransformation, bool]]:
  """Each contender's optimizer, and whether it is the library's (stacked) or the vmapped baseline's."""
  d_adamw = gj.chain(optax.adamw(ADAMW_LR), gj.mix(gj.topology.one_peer_exponential(num_nodes)))
  return {
      "d_adamw": (d_adamw, True),
      "d_adamw_guarded": (gj.guard_finite(d_adamw, max_consecutive=10), True),
      "dmsgd": (gj.gossip_sgd(gj.topology.ring(num_nodes), beta=BETA, learning_rate=SGD_LR), True),
      "vmap_adamw": (optax.adamw(ADAMW_LR), False),
      "vmap_sgd_momentum": (optax.sgd(SGD_LR, momentum=BETA), False),
  }


def contenders(model, params, xs, ys, num_nodes: int):
  """One stateful closure per contender, compiled here (untimed); the seconds each call took; XLA's cost
  analysis of each compiled chunk (``flops``, ``bytes accessed``)."""
  steps: dict[str, Callable[[], object]] = {}
  seconds: dict[str, list[float]] = {}
  costs: dict[str, dict[str, float]] = {}
  for name, (tx, stacked) in transforms(num_nodes).items():
    chunk = (library_chunk if stacked else vmapped_chunk)(model, tx)
    p = jax.tree.map(jnp.copy, params)
    box = {"p": p, "s": tx.init(p) if stacked else jax.vmap(tx.init)(p)}
    compiled = chunk.lower(box["p"], box["s"], xs, ys).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    costs[name] = {k: float(cost.get(k, 0.0)) for k in ("flops", "bytes accessed")}
    seconds[name] = []

    def run(box=box, compiled=compiled, times=seconds[name]):
      t0 = time.perf_counter()
      box["p"], box["s"], _ = compiled(box["p"], box["s"], xs, ys)
      jax.block_until_ready(box["p"])
      times.append(time.perf_counter() - t0)

    steps[name] = run
  return steps, seconds, costs


def same_params(steps: int = 2) -> float:
  """Largest |difference| between ``gj.chain(optax.adamw)`` (stacked, no mix) and the vmapped AdamW step."""
  sizes = {"context": 8, "num_layers": 1, "width": 16, "num_heads": 2}
  model, params, xs, ys = problem(4, 2, steps, sizes)
  tx = optax.adamw(ADAMW_LR)
  stacked = gj.chain(tx)
  p1, _, _ = library_chunk(model, stacked)(jax.tree.map(jnp.copy, params), stacked.init(params), xs, ys)
  p2, _, _ = vmapped_chunk(model, tx)(jax.tree.map(jnp.copy, params), jax.vmap(tx.init)(params), xs, ys)
  return max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)))


def main_job_tokens_per_second(num_nodes: int, batch: int, chunk_steps: int, chunks: int,
                               sizes: dict[str, int]) -> list[int]:
  """`gossipjax.train.run`'s own ``tokens_per_second`` rows for ``d_adamw`` on the one-peer exponential graph."""
  from gossipjax import train

  cfg = train.RunConfig(algorithm="d_adamw", topology="one_peer_exponential", num_nodes=num_nodes,
                        steps=chunks * chunk_steps, batch_size=batch, learning_rate=ADAMW_LR, beta=BETA,
                        partition="by_source", log_every=chunk_steps, model="gpt")
  dataset = gj.data.load_python_stdlib(context=sizes["context"])
  tx = train.make_algorithm(cfg.algorithm, train.make_topology("one_peer_exponential", num_nodes),
                            cfg.learning_rate, cfg.beta)
  _, history = train.run(cfg, dataset, gpt(sizes, dataset.num_classes), tx)
  return [row["tokens_per_second"] for row in history]


def run(quick: bool = False, reps: int | None = None) -> dict[str, Any]:
  """Times the five steps interleaved, then the main job's loop; seconds are per training step."""
  if quick:
    n, batch, chunk_steps, default_reps, sizes = 4, 2, 2, 3, {"context": 8, "num_layers": 1, "width": 16,
                                                                "num_heads": 2}
  else:
    n, batch, chunk_steps, default_reps, sizes = 16, 16, 4, 15, SIZES
  reps = reps or default_reps
  model, params, xs, ys = problem(n, batch, chunk_steps, sizes)
  steps, call_seconds, costs = contenders(model, params, xs, ys, n)
  warmup = 1
  medians = _timing.interleaved(steps, reps=reps, warmup=warmup)
  tokens = n * batch * sizes["context"]
  result: dict[str, Any] = {
      "num_nodes": n, "batch_per_node": batch, "sizes": sizes, "steps_per_call": chunk_steps, "reps": reps,
      "tokens_per_step": tokens, "platform": jax.devices()[0].platform,
      "params_per_node": sum(int(np.prod(x.shape[1:])) for x in jax.tree.leaves(params)),
  }
  result["seconds_per_step"] = {k: t / chunk_steps for k, t in medians.items()}
  result["min_seconds_per_step"] = {k: min(ts[warmup:]) / chunk_steps for k, ts in call_seconds.items()}
  result["tokens_per_second"] = {k: tokens / t for k, t in result["seconds_per_step"].items()}
  result["ratio_to_baseline"] = {k: result["seconds_per_step"][k] / result["seconds_per_step"][b]
                                 for k, b in BASELINE.items()}
  result["min_ratio_to_baseline"] = {k: result["min_seconds_per_step"][k] / result["min_seconds_per_step"][b]
                                     for k, b in BASELINE.items()}
  result["call_seconds"] = {k: ts[warmup:] for k, ts in call_seconds.items()}
  # XLA's cost analysis counts a while loop's body once: these are one step's (and the chunk's few extras).
  result["flops_per_step"] = {k: c["flops"] for k, c in costs.items()}
  result["bytes_accessed_per_step"] = {k: c["bytes accessed"] for k, c in costs.items()}
  result["flops_ratio_to_baseline"] = {k: costs[k]["flops"] / costs[b]["flops"] for k, b in BASELINE.items()}
  result["bytes_ratio_to_baseline"] = {k: costs[k]["bytes accessed"] / costs[b]["bytes accessed"]
                                       for k, b in BASELINE.items()}
  result["max_abs_param_diff_chain_adamw_vs_vmap"] = same_params()
  result["main_job_tokens_per_second"] = main_job_tokens_per_second(n, batch, chunk_steps, 3, sizes)
  return result


def table(r: dict) -> list[str]:
  s = r["sizes"]
  rows = [f"GPT step, {r['num_nodes']} nodes, context {s['context']}, {s['num_layers']} layers, width {s['width']}, "
          f"{s['num_heads']} heads, batch {r['batch_per_node']}/node ({r['tokens_per_step']} tokens a step; "
          f"scans of {r['steps_per_call']} steps, median of {r['reps']}, {r['platform']})"]
  for k, t in r["seconds_per_step"].items():
    ratio = (f"  x{r['ratio_to_baseline'][k]:.3f} of {BASELINE[k]} (min x{r['min_ratio_to_baseline'][k]:.3f}; "
             f"FLOPs x{r['flops_ratio_to_baseline'][k]:.4f}, bytes x{r['bytes_ratio_to_baseline'][k]:.3f})"
             if k in BASELINE else "")
    rows.append(f"  {k:18s} {t * 1e3:8.2f} ms  {r['tokens_per_second'][k]:10,.0f} tokens/s{ratio}")
  rows.append(f"  gj.chain(adamw) vs vmapped adamw params: max |diff| {r['max_abs_param_diff_chain_adamw_vs_vmap']:.2e}")
  rows.append("  gossipjax.train.run d_adamw tokens/s by chunk: "
              + ", ".join(f"{v:,}" for v in r["main_job_tokens_per_second"]))
  return rows


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.lm_step", description=str(__doc__).splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
  parser.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 15)")
  parser.add_argument("--platform", default=None,
                      help="the JAX platform to run on (cpu, gpu, tpu; default: JAX's default device)")
  parser.add_argument("--json", default=str(pathlib.Path(__file__).parent / "results" / "results_lm_step.json"))
  args = parser.parse_args(argv)
  if args.platform:
    jax.config.update("jax_platforms", args.platform)  # before the first computation picks a backend
  result = {"machine": _timing.machine(), "lm_step": run(quick=args.quick, reps=args.reps)}
  print("\n".join(table(result["lm_step"])))
  pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(args.json).write_text(json.dumps(result, indent=2, default=float) + "\n")
  print(f"wrote {args.json}")
  return result


if __name__ == "__main__":
  main()
