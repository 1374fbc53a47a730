"""The bytes a transform sends: every backend's gossip round and all-reduce report theirs while a count runs.

What is counted is what each node sends, the same on every backend: a gossip round sends
node j's message (its compact form where the algorithm gives one, e.g. CHOCO-SGD's) once to
each node i with ``W(step)[i, j] != 0``; an all-reduce of M bytes per node is counted as a ring
all-reduce sends it, ``2 (n - 1) / n * M`` per node (reduce-scatter, then all-gather), at the
dtype it is summed in (float32 for 16-bit leaves). Nothing is counted unless a `Traffic` count
is running while the step is traced; the count is then made as the step runs (a host
callback in each exchange), so an exchange in a branch that is not taken (DiLoCo's outer step
between rounds) counts nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gossipjax.backend._precision import accumulation_dtype

_COUNT: contextvars.ContextVar["Traffic | None"] = contextvars.ContextVar("gossipjax_traffic", default=None)
# While set: an all-reduce mean traced in the block is of decoded compact messages of this many bytes per node.


class Traffic:
  """A running count of the bytes the nodes of this process send (see the module docstring).

  Attributes:
    total: bytes sent so far, summed over the nodes of this process.
  """

  def __init__(self) -> None:
    self.total = 0.0

  def add(self, num_bytes: float) -> None:
    self.total += float(num_bytes)


@contextlib.contextmanager
def counting(traffic: Traffic) -> Iterator[Traffic]:
  """Steps traced inside the block add the bytes they send to ``traffic`` whenever they run."""
  token = _COUNT.set(traffic)
  try:
    yield traffic
  finally:
    _COUNT.reset(token)


def _bytes_per_node(tree: Any) -> float:
  leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype") and jnp.ndim(x)]
  if not leaves:
    return 0.0
  return sum(math.prod(jnp.shape(x)) * jnp.dtype(x.dtype).itemsize for x in leaves) / jnp.shape(leaves[0])[0]


@functools.lru_cache(maxsize=64)
def _out_degrees(topology: Any, k: int) -> np.ndarray:
  """How many other nodes node j sends to in W(k): the off-diagonal non-zeros of column j."""
  w = topology.sparse(k).tocoo()
  off = (w.row != w.col) & (w.data != 0)
  return np.bincount(w.col[off], minlength=topology.num_nodes)


def note_gossip(topology: Any, tree: Any, step: Any, wire: Any, first_node: Any) -> None:
  """Counts one gossip round of the local block ``tree`` (nodes ``first_node, ...``) when it runs."""
  traffic = _COUNT.get()
  if traffic is None:
    return
  parts = tree if wire is None else wire.parts
  message = _bytes_per_node(parts)
  local = jnp.shape(jax.tree.leaves(parts)[0])[0] if jax.tree.leaves(parts) else 0

  def tally(step, first):
    degrees = _out_degrees(topology, int(step) % topology.period)
    first = int(first)
    traffic.add(message * int(degrees[first:first + local].sum()))

  jax.debug.callback(tally, jnp.asarray(step), jnp.asarray(first_node))


def _note(tree: Any, sent_by: Callable[[list[Any]], float], min_ndim: int = 1) -> None:
  """Adds ``sent_by(leaves)`` bytes (of the local block's array leaves) to the count when the step runs."""
  traffic = _COUNT.get()
  if traffic is None:
    return
  leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype") and jnp.ndim(x) >= min_ndim]
  sent = sent_by(leaves) if leaves else 0
  if sent:
    jax.debug.callback(lambda: traffic.add(sent))


def note_gather(tree: Any, num_nodes: int) -> None:
  """Counts one all-gather of the local block ``tree`` over ``num_nodes`` nodes: each node's part, to the ``n - 1`` others."""
  _note(tree, lambda leaves: jnp.shape(leaves[0])[0] * (num_nodes - 1) * _bytes_per_node(leaves))


def note_all_to_all(tree: Any) -> None:
  """Counts one all-to-all of the local block ``tree`` (leaves ``(b, n, ...)``): each node's n - 1 pieces for others."""

  def sent_by(leaves):
    local, n = jnp.shape(leaves[0])[:2]
    return local * (n - 1) * sum(math.prod(jnp.shape(x)[2:]) * jnp.dtype(x.dtype).itemsize for x in leaves)

  _note(tree, sent_by, min_ndim=2)


def note_mean(tree: Any, num_nodes: int) -> None:
  """Counts one all-reduce mean over ``num_nodes`` nodes of the local block ``tree``, as a ring sends it."""

  def sent_by(leaves):
    size = sum(math.prod(jnp.shape(x)[1:]) * np.dtype(accumulation_dtype(np.dtype(x.dtype))).itemsize for x in leaves)
    return jnp.shape(leaves[0])[0] * 2 * (num_nodes - 1) / num_nodes * size

  _note(tree, sent_by)


def bytes_per_step(tx: optax.GradientTransformation, params: Any, steps: int = 1,
                   updates: Any = None) -> np.ndarray:
  """The bytes each node sends in each of the first ``steps`` steps of ``tx``, on average over the nodes.

  Runs ``tx`` for ``steps`` steps from ``tx.init(params)`` (with zero gradients unless
  ``updates`` are given) and counts what its gossip rounds and all-reduces send: a message
  to each out-neighbour of W(step), in the compact form where the method sends one, and an
  all-reduce of M bytes per node as a ring all-reduce sends it, ``2 (n - 1) / n * M``. The
  count is the same on every backend (under MPI, of this rank's nodes).

  Args:
    tx: a gossipjax transform (or a chain holding some) over node-stacked params.
    params: the node-stacked params (this process's nodes under MPI).
    steps: how many steps to count.
    updates: the gradients given at every step (default: zeros like ``params``).

  Returns:
    A float array of shape ``(steps,)``: bytes sent per node at each step.

  Example:
    DiLoCo sends nothing for H - 1 steps, then all-reduces one model (4 nodes of 10 float32:
    2 * 3/4 * 40 bytes); gossip on a ring sends one model to each of 2 neighbours every step:

    >>> import jax.numpy as jnp, optax, gossipjax as gj
    >>> x = jnp.zeros((4, 10), jnp.float32)
    >>> gj.bytes_per_step(gj.diloco(optax.sgd(0.1), inner_steps=3), x, steps=3).tolist()
    [0.0, 0.0, 60.0]
    >>> gj.bytes_per_step(gj.gossip_sgd(gj.topology.ring(4), learning_rate=0.1), x).tolist()
    [80.0]
  """
  updates = jax.tree.map(jnp.zeros_like, params) if updates is None else updates
  local = next((jnp.shape(x)[0] for x in jax.tree.leaves(params) if jnp.ndim(x)), 1)
  traffic = Traffic()
  state = tx.init(params)
  out = []
  with counting(traffic):

    @jax.jit
    def step(params, state, updates):
      u, state = tx.update(updates, state, params)
      return optax.apply_updates(params, u), state

    for _ in range(steps):
      before = traffic.total
      params, state = step(params, state, updates)
      jax.block_until_ready(params)
      jax.effects_barrier()
      out.append((traffic.total - before) / local)
  return np.asarray(out, dtype=np.float64)
