"""``gj.layers.conv_general_dilated``'s forms against XLA's convolution: residuals, temporaries, compile time, speed.

Every figure is a ratio to ``lax.conv_general_dilated`` (``weight_grad="xla"``) in the same run:

- ``residuals``: the bytes reverse mode saves for one 3x3 convolution (batch 32, 32x32x16 -> 16), the leaves of
  ``jax.vjp``'s function, read abstractly with ``jax.eval_shape``;
- ``four_layers_temp``: ``compiled.memory_analysis().temp_size_in_bytes`` of the jitted, vmapped gradient of four
  3x3 convolution layers (4 nodes, batch 8, 32x32x16);
- ``stem_compile`` and ``stem_temp``: compile time (best of two fresh compilations) and temporaries of the
  vmapped gradient of a 7x7 stride-2 stem (8 nodes, batch 4, 64x64x3 -> 64);
- ``mnist_step``: flax's MNIST CNN (two 3x3 convolutions of 32 and 64 channels, each followed by a 2x2 average
  pool, dense 256, dense 10), SGD with momentum, 8 nodes of batch 128: one jitted ``jax.vmap`` of the step over
  the nodes against a Python loop over the 8 models' own jitted steps (flax's default convolution), interleaved,
  the best of three rounds' medians. Below 1 the vmapped step is the faster. ``loop_auto_over_loop`` is the loop
  again with ``gj.layers.conv_general_dilated``'s default, what one model a process (no ``vmap``) pays for it.

Each form is forced with ``weight_grad``; ``auto`` is what the platform this runs on gets.
``python -m benchmarks.per_node_conv [--quick]`` runs it alone.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax

import gossipjax as gj
from benchmarks import _timing

DN = ("NHWC", "HWIO", "NHWC")


def _conv(form: str):
  if form == "xla":
    return lax.conv_general_dilated
  return functools.partial(gj.layers.conv_general_dilated, weight_grad=form)


def residual_bytes(form: str, x: jax.Array, w: jax.Array) -> int:
  """Bytes of what ``jax.vjp`` keeps for the backward pass of one convolution."""
  conv = functools.partial(_conv(form), window_strides=(1, 1), padding="SAME", dimension_numbers=DN)
  return _timing.tree_bytes(jax.eval_shape(lambda x, w: jax.vjp(conv, x, w)[1], x, w))


def _four_layers(form: str):
  conv = _conv(form)

  def loss(ws, x):
    for w in ws:
      x = jnp.tanh(conv(x, w, (1, 1), "SAME", dimension_numbers=DN))
    return jnp.sum(x ** 2)
  return jax.jit(jax.vmap(jax.grad(loss)))


def _stem(form: str):
  conv = _conv(form)
  loss = lambda w, x: jnp.sum(jnp.tanh(conv(x, w, (2, 2), "SAME", dimension_numbers=DN)) ** 2)
  return jax.jit(jax.vmap(jax.grad(loss)))


def _compiled(make, args, repeats: int = 2) -> tuple[float, int]:
  """Best compile time of ``repeats`` fresh jits, and the compiled program's temporary bytes."""
  best, temp = float("inf"), 0
  for _ in range(repeats):
    lowered = make().lower(*args)
    t0 = time.perf_counter()
    compiled = lowered.compile()
    best = min(best, time.perf_counter() - t0)
    temp = compiled.memory_analysis().temp_size_in_bytes
  return best, temp


class MnistCNN(nn.Module):
  """flax's ``examples/mnist`` CNN, its convolution a field."""

  conv: object = lax.conv_general_dilated

  @nn.compact
  def __call__(self, x):
    x = nn.avg_pool(nn.relu(nn.Conv(32, (3, 3), conv_general_dilated=self.conv)(x)), (2, 2), (2, 2))
    x = nn.avg_pool(nn.relu(nn.Conv(64, (3, 3), conv_general_dilated=self.conv)(x)), (2, 2), (2, 2))
    x = nn.relu(nn.Dense(256)(x.reshape((x.shape[0], -1))))
    return nn.Dense(10)(x)


def _mnist_steps(forms: tuple[str, ...], n: int, batch: int, reps: int, rounds: int) -> dict[str, float]:
  """Seconds per step, best of ``rounds`` interleaved medians: each form vmapped over ``n`` nodes, and the loop."""
  tx = optax.sgd(0.1, momentum=0.9)
  x = jax.random.normal(jax.random.key(1), (n, batch, 28, 28, 1))
  y = jax.random.randint(jax.random.key(2), (n, batch), 0, 10)

  def one_step(conv):
    model = MnistCNN(conv)

    def step(p, s, x, y):
      g = jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean())(p)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s
    return step

  params = jax.vmap(lambda k: MnistCNN().init(k, x[0]))(jax.random.split(jax.random.key(0), n))
  state = jax.vmap(tx.init)(params)
  steps = {}
  for form in forms:
    f = jax.jit(jax.vmap(one_step(_conv(form))))
    steps[form] = functools.partial(lambda f: jax.block_until_ready(f(params, state, x, y)), f)
  nodes = [jax.tree.map(lambda a, i=i: a[i], (params, state, x, y)) for i in range(n)]
  for name, conv in (("loop", lax.conv_general_dilated), ("loop_auto", gj.layers.conv_general_dilated)):
    single = jax.jit(one_step(conv))
    steps[name] = functools.partial(lambda single: jax.block_until_ready([single(*node) for node in nodes]), single)
  best: dict[str, float] = {}
  for _ in range(rounds):
    for name, t in _timing.interleaved(steps, reps=reps).items():
      best[name] = min(best.get(name, float("inf")), t)
  return best


def run(quick: bool = False) -> dict:
  forms = tuple(f for f in gj.layers.WEIGHT_GRADS if f != "xla") + ("xla",)
  key = jax.random.key(0)
  one = (jax.random.normal(key, (8 if quick else 32, 32, 32, 16)), jax.random.normal(key, (3, 3, 16, 16)))
  layers = (tuple(jax.random.normal(key, (4, 3, 3, 16, 16)) for _ in range(4)),
            jax.random.normal(key, (4, 2 if quick else 8, 32, 32, 16)))
  stem = (jax.random.normal(key, (8, 7, 7, 3, 64)), jax.random.normal(key, (8, 1 if quick else 4, 64, 64, 3)))
  out: dict = {"platform": jax.devices()[0].platform, "forms": forms, "bytes": {}, "compile_s": {}}
  for form in forms:
    stem_s, stem_temp = _compiled(functools.partial(_stem, form), stem, repeats=1 if quick else 2)
    out["bytes"][form] = {"residuals": residual_bytes(form, *one),
                          "four_layers_temp": _compiled(functools.partial(_four_layers, form), layers, 1)[1],
                          "stem_temp": stem_temp}
    out["compile_s"][form] = {"stem": stem_s}
  n, batch, reps, rounds = (8, 8, 2, 1) if quick else (8, 128, 5, 3)
  out["mnist"] = {"num_nodes": n, "batch": batch,
                  "step_s": _mnist_steps(forms, n, batch, reps, rounds)}
  out["loop_auto_over_loop"] = out["mnist"]["step_s"]["loop_auto"] / out["mnist"]["step_s"]["loop"]
  xla = out["bytes"]["xla"]
  out["ratios"] = {form: {"residuals": out["bytes"][form]["residuals"] / xla["residuals"],
                          "four_layers_temp": out["bytes"][form]["four_layers_temp"] / max(xla["four_layers_temp"], 1),
                          "stem_temp": out["bytes"][form]["stem_temp"] / max(xla["stem_temp"], 1),
                          "stem_compile": out["compile_s"][form]["stem"] / out["compile_s"]["xla"]["stem"],
                          "mnist_step_over_loop": out["mnist"]["step_s"][form] / out["mnist"]["step_s"]["loop"]}
                   for form in forms}
  return out


def table(r: dict) -> list[str]:
  rows = [f"Per-node convolution on {r['platform']}, each form against XLA's (weight_grad='xla'); "
          f"MNIST CNN x {r['mnist']['num_nodes']} nodes vmapped against a loop "
          f"({r['mnist']['step_s']['loop'] * 1e3:.0f} ms a step)",
          f"  {'form':8s} {'residuals':>10s} {'4-layer temp':>13s} {'stem temp':>10s} {'stem compile':>13s} "
          f"{'MNIST step / loop':>18s}"]
  for form, q in r["ratios"].items():
    rows.append(f"  {form:8s} {q['residuals']:9.2f}x {q['four_layers_temp']:12.2f}x {q['stem_temp']:9.2f}x "
                f"{q['stem_compile']:12.2f}x {q['mnist_step_over_loop']:17.2f}x")
  rows.append(f"  the loop itself with the default (auto) convolution: {r['loop_auto_over_loop']:.2f}x")
  return rows


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
  parser.add_argument("--json", default=None, help="also write the figures here")
  args = parser.parse_args()
  result = run(quick=args.quick)
  print("\n".join(table(result)))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2, default=float)
