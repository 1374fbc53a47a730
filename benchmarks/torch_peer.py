"""The same DmSGD step written the way a PyTorch user would: ``torch.func`` over stacked params.

``vmap(grad(loss))`` over a functional ``nn.Sequential`` (``torch.func.functional_call``),
then momentum, local step and ring average with ``torch.roll``, eager and under
``torch.compile``. PyTorch is an optional dependency of the benchmarks only
(``pip install gossipjax[bench]``, the CPU build ``torch==2.13.0``).
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from benchmarks import dmsgd_step


def available() -> str | None:
  """``None`` when torch can be imported, else why not."""
  try:
    import torch  # noqa: F401
  except ImportError as e:
    return f"skipped: torch is not installed ({e}); pip install 'gossipjax[bench]'"
  return None


def _torch_problem(num_nodes: int, batch: int, sizes):
  """The JAX benchmark's params and batch, as torch tensors (weights transposed to (out, in))."""
  import torch

  params, (x, y) = dmsgd_step.problem(num_nodes, batch, sizes)
  tp = {}
  for i in range(len(sizes) - 1):
    tp[f"{2 * i}.weight"] = torch.from_numpy(np.ascontiguousarray(np.swapaxes(np.asarray(params[f"w{i}"]), 1, 2)))
    tp[f"{2 * i}.bias"] = torch.from_numpy(np.array(params[f"b{i}"]))
  return tp, torch.from_numpy(np.array(x)), torch.from_numpy(np.array(y)).long()


def make_step(sizes, beta: float = dmsgd_step.BETA, lr: float = dmsgd_step.LR):
  """``(params, momentum, x, y) -> (params, momentum)`` over dicts of stacked tensors."""
  import torch
  from torch import nn
  from torch.func import functional_call, grad, vmap

  layers = []
  for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
    layers.append(nn.Linear(a, b))
    if i < len(sizes) - 2:
      layers.append(nn.ReLU())
  model = nn.Sequential(*layers).to("meta")

  def loss(p, x, y):
    return nn.functional.cross_entropy(functional_call(model, p, (x,)), y)

  grads = vmap(grad(loss))

  def step(params, momentum, x, y):
    g = grads(params, x, y)
    new_p, new_m = {}, {}
    with torch.no_grad():
      for k in params:
        m = beta * momentum[k] + g[k]
        z = params[k] - lr * m
        new_p[k] = (z + torch.roll(z, 1, 0) + torch.roll(z, -1, 0)) * (1.0 / 3.0)
        new_m[k] = m
    return new_p, new_m

  return step


def stateful_steps(num_nodes: int, batch: int, sizes) -> tuple[dict[str, Callable[[], object]], str | None]:
  """Eager and compiled one-call closures; empty with a note when torch is missing."""
  why = available()
  if why:
    print(f"[torch_peer] {why}")
    return {}, why
  import torch

  params, x, y = _torch_problem(num_nodes, batch, sizes)
  eager = make_step(sizes)
  compiled = torch.compile(make_step(sizes))
  states = {
      "torch_eager": [dict(params), {k: torch.zeros_like(v) for k, v in params.items()}],
      "torch_compile": [dict(params), {k: torch.zeros_like(v) for k, v in params.items()}],
  }

  def runner(name, fn):
    def run():
      states[name][0], states[name][1] = fn(states[name][0], states[name][1], x, y)
    return run

  note = f"torch {torch.__version__}, {torch.get_num_threads()} threads"
  return {"torch_eager": runner("torch_eager", eager), "torch_compile": runner("torch_compile", compiled)}, note


def same_params(num_nodes: int = 8, batch: int = 4, sizes=(12, 8, 8, 3), steps: int = 3) -> float:
  """Largest |difference| between the torch step's and the library's params (float32)."""
  import torch

  params, (x, y) = dmsgd_step.problem(num_nodes, batch, sizes)
  tx, lib = dmsgd_step.library_step(__import__("gossipjax").topology.ring(num_nodes))
  p, s = jax.tree.map(lambda a: a.copy(), params), tx.init(params)
  tp, tx_, ty = _torch_problem(num_nodes, batch, sizes)
  tm = {k: torch.zeros_like(v) for k, v in tp.items()}
  step = make_step(sizes)
  for _ in range(steps):
    p, s = lib(p, s, x, y)
    tp, tm = step(tp, tm, tx_, ty)
  diff = 0.0
  for i in range(len(sizes) - 1):
    diff = max(diff, float(np.max(np.abs(np.swapaxes(np.asarray(p[f"w{i}"]), 1, 2) - tp[f"{2 * i}.weight"].numpy()))))
    diff = max(diff, float(np.max(np.abs(np.asarray(p[f"b{i}"]) - tp[f"{2 * i}.bias"].numpy()))))
  return diff


def run(quick: bool = False) -> dict:
  """The full comparison (library, hand-fused JAX, torch eager, torch.compile) in one run."""
  why = available()
  if why:
    print(f"[torch_peer] {why}")
    return {"skipped": why}
  result = dmsgd_step.run(quick=quick, include_torch=True)
  result["max_abs_param_diff_torch_vs_gossipjax"] = same_params()
  return result
