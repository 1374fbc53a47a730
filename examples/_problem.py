"""The problem every example trains: 16 nodes, each with its own least-squares data.

Shared so that the five scripts differ only in where the nodes live; run any two and
compare the printed numbers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gossipjax as gj

NUM_NODES, DIM, SAMPLES, STEPS = 16, 8, 32, 60


def topology():
  """One-peer exponential graph: one message per node per step, W changes every step."""
  return gj.topology.one_peer_exponential(NUM_NODES)


def optimizer(backend):
  """The same transform for every mode: only ``backend`` changes."""
  return gj.gossip_sgd(topology(), beta=0.9, learning_rate=0.02, backend=backend)


def data():
  """Node i's ``(A_i, b_i)``, heterogeneous across nodes, and a common start ``x0`` (NumPy)."""
  rng = np.random.default_rng(0)
  a = rng.normal(size=(NUM_NODES, SAMPLES, DIM)).astype(np.float32)
  b = (rng.normal(size=(NUM_NODES, SAMPLES)) + np.arange(NUM_NODES)[:, None] / 4).astype(np.float32)
  return np.zeros((NUM_NODES, DIM), np.float32), a, b


def node_loss(x, a, b):
  return 0.5 * jnp.mean((a @ x - b) ** 2)


def make_step(tx, backend):
  """One optimizer step, the same on every backend: each node's gradient where the node lives, then the gossip."""
  grad_fn = backend.map(jax.grad(node_loss))  # vmap over the nodes this device / rank / process holds

  def step(x, state, a, b):
    grads = grad_fn(x, a, b)
    updates, state = tx.update(grads, state, x)
    return optax.apply_updates(x, updates), state

  return step


def report(mode, x, a, b):
  """Prints the global loss at the average model and the consensus distance of all n nodes."""
  x, a, b = np.asarray(x, np.float64), np.asarray(a, np.float64), np.asarray(b, np.float64)
  mean = x.mean(axis=0)
  loss = np.mean([0.5 * np.mean((a[i] @ mean - b[i]) ** 2) for i in range(len(a))])
  consensus = np.mean(np.sum((x - mean) ** 2, axis=1))
  print(f"{mode:>10}: {STEPS} steps on {NUM_NODES} nodes, loss(mean model) = {loss:.6f}, "
        f"consensus distance = {consensus:.3e}", flush=True)
