"""A 64-node DmSGD training step: the library against a hand-fused JAX step (and PyTorch).

Ring topology, MLP 3072-256-256-10, batch 32 per node, stacked params, one ``jit`` per step,
params and optimizer state donated in both. The hand-fused step is what a JAX expert
writes without the library: ``vmap(grad)`` and then the whole update, momentum,
local step and ring average, as one expression of ``jnp.roll`` s.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

import gossipjax as gj
from benchmarks import _models, _timing

SIZES = (3072, 256, 256, 10)
BETA = 0.9
LR = 0.05


def problem(num_nodes: int, batch: int, sizes: tuple[int, ...] = SIZES, seed: int = 0):
  """Stacked params (every node from one init) and one fixed batch per node."""
  key = jax.random.key(seed)
  params = gj.init_nodes(lambda k: _models.mlp_init(k, sizes), key, num_nodes)
  data = _models.synthetic_batch(jax.random.fold_in(key, 1), num_nodes, batch, sizes[0], sizes[-1])
  return params, data


def _grads(params, x, y):
  return jax.vmap(jax.grad(_models.cross_entropy))(params, x, y)


def library_step(topology: gj.topology.Topology, beta: float = BETA, lr: float = LR):
  """``(params, opt_state, x, y) -> (params, opt_state)`` with ``gj.gossip_sgd``, jitted and donated."""
  tx = gj.gossip_sgd(topology, beta=beta, learning_rate=lr)

  def step(params, opt_state, x, y):
    updates, opt_state = tx.update(_grads(params, x, y), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return tx, jax.jit(step, donate_argnums=(0, 1))


def fused_ring_step(beta: float = BETA, lr: float = LR):
  """The same step written by hand for a uniform ring: ``m <- beta m + g``, ``x <- W(x - lr m)``."""

  def update(p, m, g):
    m = beta * m + g
    y = p - lr * m
    return (y + jnp.roll(y, 1, axis=0) + jnp.roll(y, -1, axis=0)) * (1.0 / 3.0), m

  def step(params, momentum, x, y):
    out = jax.tree.map(update, params, momentum, _grads(params, x, y))
    is_pair = lambda t: isinstance(t, tuple)
    return (jax.tree.map(lambda t: t[0], out, is_leaf=is_pair), jax.tree.map(lambda t: t[1], out, is_leaf=is_pair))

  return jax.jit(step, donate_argnums=(0, 1))


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def stateful_jax_steps(num_nodes: int, batch: int, sizes: tuple[int, ...] = SIZES) -> dict[str, Callable[[], object]]:
  """One-call closures for the library and the hand-fused step, each owning its buffers."""
  params, (x, y) = problem(num_nodes, batch, sizes)
  tx, lib = library_step(gj.topology.ring(num_nodes))
  fused = fused_ring_step()
  lib_state = {"p": _copy(params), "s": tx.init(params)}
  fused_state = {"p": _copy(params), "m": jax.tree.map(jnp.zeros_like, params)}

  def run_lib():
    lib_state["p"], lib_state["s"] = lib(lib_state["p"], lib_state["s"], x, y)
    jax.block_until_ready(lib_state["p"])

  def run_fused():
    fused_state["p"], fused_state["m"] = fused(fused_state["p"], fused_state["m"], x, y)
    jax.block_until_ready(fused_state["p"])

  return {"gossipjax": run_lib, "hand_fused_jax": run_fused}


def same_params(num_nodes: int = 8, batch: int = 4, sizes: tuple[int, ...] = (12, 8, 8, 3), steps: int = 3) -> float:
  """Largest |difference| between the library's and the hand-fused params after ``steps`` steps."""
  params, (x, y) = problem(num_nodes, batch, sizes)
  tx, lib = library_step(gj.topology.ring(num_nodes))
  fused = fused_ring_step()
  p1, s1 = _copy(params), tx.init(params)
  p2, m2 = _copy(params), jax.tree.map(jnp.zeros_like, params)
  for _ in range(steps):
    p1, s1 = lib(p1, s1, x, y)
    p2, m2 = fused(p2, m2, x, y)
  return max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)))


def run(quick: bool = False, include_torch: bool = True, reps: int | None = None) -> dict:
  """Times the library, the hand-fused JAX step and (when installed) the PyTorch peers."""
  n, batch, sizes, default_reps = (8, 8, (96, 32, 32, 10), 3) if quick else (64, 32, SIZES, 9)
  reps = reps or default_reps
  steps = stateful_jax_steps(n, batch, sizes)
  result = {"num_nodes": n, "batch_per_node": batch, "sizes": list(sizes), "reps": reps}
  torch_note = None
  if include_torch:
    from benchmarks import torch_peer

    peers, torch_note = torch_peer.stateful_steps(n, batch, sizes)
    steps.update(peers)
  times = _timing.interleaved(steps, reps=reps, warmup=2)
  ref = times["hand_fused_jax"]
  result["seconds"] = times
  result["ratio_to_hand_fused"] = {k: t / ref for k, t in times.items()}
  result["node_steps_per_s"] = {k: n / t for k, t in times.items()}
  result["max_abs_param_diff_vs_hand_fused"] = same_params()
  if "torch_compile" in times:
    result["gossipjax_speedup_over_torch_compile"] = times["torch_compile"] / times["gossipjax"]
  if torch_note:
    result["torch"] = torch_note
  return result


def table(r: dict) -> list[str]:
  rows = [f"DmSGD step, {r['num_nodes']} nodes, MLP {'-'.join(map(str, r['sizes']))}, batch {r['batch_per_node']}/node"]
  for k, t in r["seconds"].items():
    rows.append(f"  {k:18s} {t * 1e3:8.1f} ms  x{r['ratio_to_hand_fused'][k]:.3f} of hand-fused  "
                f"{r['node_steps_per_s'][k]:8.1f} node-steps/s")
  rows.append(f"  library vs hand-fused params: max |diff| {r['max_abs_param_diff_vs_hand_fused']:.2e}")
  if "gossipjax_speedup_over_torch_compile" in r:
    rows.append(f"  gossipjax is {r['gossipjax_speedup_over_torch_compile']:.3f}x the speed of torch.compile")
  if "torch" in r:
    rows.append(f"  torch: {r['torch']}")
  return rows
