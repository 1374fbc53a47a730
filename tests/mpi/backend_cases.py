"""Shared by the backend tests and the launched scripts: one problem, the algorithms, the topologies.

Every backend runs the same transforms on the same least-squares problem; the tests hold
each backend's trajectory against the simulate backend's (float64, to ~1e-12).
"""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gossipjax as gj
from gossipjax import topology as T

D, STEPS, LR, BETA = 3, 8, 0.05, 0.9


def problem(n, seed=0, m=6):
  """Heterogeneous least squares, ``f_i(x) = 1/(2m) ||A_i x - b_i||^2``, and a start x0 (numpy)."""
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(n, m, D))
  b = rng.normal(size=(n, m)) + np.arange(n)[:, None]
  x0 = rng.normal(size=(n, D))
  return x0, a, b


def grads(x, a, b):
  """Per-node gradients for any leading block of nodes."""
  return jax.vmap(jax.grad(lambda xi, ai, bi: 0.5 * jnp.mean((ai @ xi - bi) ** 2)))(x, a, b)


def topologies(n):
  """Static circulant, time-varying, and non-circulant (torus, random) graphs on n nodes."""
  side = int(round(np.sqrt(n)))
  torus = T.torus(side, n // side) if side * (n // side) == n and side >= 3 else T.torus(2, n // 2)
  return [T.ring(n), T.one_peer_exponential(n), torus, T.erdos_renyi(n, 0.4, seed=1)]


ALGORITHMS = {
    "mix": lambda topo, be: optax.chain(optax.sgd(LR), gj.mix(topo, backend=be)),
    "gossip_sgd": lambda topo, be: gj.gossip_sgd(topo, beta=BETA, learning_rate=LR, backend=be),
    "decentlam": lambda topo, be: gj.decentlam(topo, beta=BETA, learning_rate=LR, backend=be),
    "allreduce_sgd": lambda topo, be: gj.allreduce_sgd(learning_rate=LR, beta=BETA, backend=be),
}
CORE = tuple(ALGORITHMS)
# The other algorithms of the library, each with the settings its own tests use.
ALGORITHMS.update({
    "gradient_tracking": lambda topo, be: gj.gradient_tracking(topo, learning_rate=LR, backend=be),
    "exact_diffusion": lambda topo, be: gj.exact_diffusion(topo, learning_rate=LR, backend=be),
    "extra": lambda topo, be: gj.extra(topo, learning_rate=LR, backend=be),
    "sgp": lambda topo, be: gj.sgp(topo, learning_rate=LR, beta=BETA, backend=be),
    "choco_sgd": lambda topo, be: gj.choco_sgd(topo, gj.compress.top_k(0.5), learning_rate=LR, consensus_step=0.5, backend=be),
    # A random compressor: each node's key comes from its global index, so every backend draws the same bits.
    "choco_sgd_random_k": lambda topo, be: gj.choco_sgd(topo, gj.compress.random_k(0.5), learning_rate=LR, consensus_step=0.5,
                                                        seed=3, backend=be),
    "qg_dmsgd": lambda topo, be: gj.qg_dmsgd(topo, beta=BETA, learning_rate=LR, backend=be),
    "easgd": lambda topo, be: gj.easgd(learning_rate=LR, backend=be),
    "periodic_average": lambda topo, be: optax.chain(optax.sgd(LR), gj.periodic_average(3, backend=be)),
})
STATIC_ONLY = ("exact_diffusion", "extra")
SYMMETRIC_ONLY = ("decentlam",)


def applies(name, topology):
  """Which algorithms accept which graphs (EXTRA / exact diffusion: static W; DecentLaM: symmetric W)."""
  if name in STATIC_ONLY and topology.is_time_varying:
    return False
  return name not in SYMMETRIC_ONLY or all(np.allclose(m, m.T) for m in topology.matrices)


def cases(n):
  """(algorithm, topology) pairs: the core algorithms on every topology they accept, the others on
  a time-varying (where accepted) and a random graph."""
  topos = topologies(n)
  pairs = [(name, topo) for topo in topos for name in CORE if applies(name, topo)]
  for name in ALGORITHMS:
    if name not in CORE:
      pairs += [(name, topo) for topo in (topos[1] if applies(name, topos[1]) else topos[0], topos[3])]
  return pairs


def algorithm(name, topology, backend):
  return ALGORITHMS[name](topology, backend)


def make_step(tx):
  def step(x, state, a, b):
    updates, state = tx.update(grads(x, a, b), state, x)
    return optax.apply_updates(x, updates), state

  return step


def trajectory(tx, x0, a, b, steps=STEPS, wrap=jax.jit):
  """Params after each step, stacked (steps, *x0.shape), as host numpy arrays."""
  step = wrap(make_step(tx))
  x, state = x0, wrap(tx.init)(x0)
  out = []
  for _ in range(steps):
    x, state = step(x, state, a, b)
    out.append(np.asarray(x))
  return np.stack(out)


def reference(name, topology, x0, a, b, steps=STEPS):
  """The simulate backend's trajectory of algorithm ``name``."""
  tx = algorithm(name, topology, gj.backend.simulate())
  return trajectory(tx, jnp.asarray(x0), jnp.asarray(a), jnp.asarray(b), steps)


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example_numbers(stdout):
  """(loss, consensus distance) from each report line an example printed."""
  found = re.findall(r"loss\(mean model\) = ([\d.e+-]+), consensus distance = ([\d.e+-]+)", stdout)
  return [(float(a), float(b)) for a, b in found]
