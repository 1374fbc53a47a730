"""The bytes a transform sends: every backend's gossip round and all-reduce report theirs while a count runs.

What is counted is what each node sends, the same on every backend: a gossip round sends
node j's message (its compact form where the algorithm gives one, e.g. CHOCO-SGD's) once to
each node i with ``W(step)[i, j] != 0``; an all-reduce of M bytes per node is counted as a ring
all-reduce sends it, ``2 (n - 1) / n * M`` per node (reduce-scatter, then all-gather), at the
dtype it is summed in (float32 for 16-bit leaves). Nothing is counted unless a `Traffic` count
is running while the step is traced; the count is then made as the step runs (a host
callback in each exchange), so an exchange in a branch that is not taken (DiLoCo's outer step
between rounds) counts nothing. Each exchange is also recorded as an `Exchange` (its kind,
message size, messages, n and overlap), from which ``gj.time_per_step`` and
``gj.simulated_seconds`` (``backend/_network.py``) make a simulated time.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import math
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gossipjax._overlap import current_overlap
from gossipjax.backend._precision import accumulation_dtype

_COUNT: contextvars.ContextVar["Traffic | None"] = contextvars.ContextVar("gossipjax_traffic", default=None)


class Exchange(NamedTuple):
  """One exchange as it ran, from this process's nodes' side.

  Attributes:
    kind: ``"gossip"`` (a message to each out-neighbour of W(step)), ``"all_reduce"`` (a
      ring all-reduce), ``"all_gather"`` (a ring all-gather) or ``"all_to_all"``.
    message_bytes: the bytes of one message: a node's gossip message, a ring all-reduce's
      chunk (M / n of M bytes reduced per node), a node's part of an all-gather, one piece
      of an all-to-all.
    messages: how many messages this process's nodes send in it (``message_bytes *
      messages`` is what it adds to ``Traffic.total``, to round-off).
    num_nodes: n, the nodes taking part (gossip: the topology's).
    out_degree: gossip: the largest out-degree among this process's nodes (0 for the
      collectives).
    overlap: the steps of compute the exchange overlaps (Streaming DiLoCo's tau), else 0.
  """

  kind: str
  message_bytes: float
  messages: int
  num_nodes: int
  out_degree: int = 0
  overlap: int = 0


class Traffic:
  """A running count of the bytes the nodes of this process send (see the module docstring).

  Attributes:
    total: bytes sent so far, summed over the nodes of this process.
    events: each distinct `Exchange` run since the count began or was last drained, and how
      many times it ran (a ``collections.Counter``, so a long run keeps only a few entries).
  """

  def __init__(self) -> None:
    self.total = 0.0
    self.events: collections.Counter[Exchange] = collections.Counter()

  def add(self, num_bytes: float) -> None:
    self.total += float(num_bytes)

  def record(self, exchange: Exchange, num_bytes: float) -> None:
    """Counts ``num_bytes`` sent by ``exchange``, and the exchange among the events."""
    self.add(num_bytes)
    self.events[exchange] += 1

  def drain(self) -> collections.Counter[Exchange]:
    """The events recorded since the last drain (or the start), which the count then forgets.

    ``total`` keeps counting: a training loop drains after each chunk of steps and gives the
    chunk's events to ``gj.simulated_seconds``.
    """
    events, self.events = self.events, collections.Counter()
    return events


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
  overlap = current_overlap()

  def tally(step, first):
    degrees = _out_degrees(topology, int(step) % topology.period)
    first = int(first)
    mine = degrees[first:first + local]
    messages = int(mine.sum())
    if message and messages:
      traffic.record(Exchange("gossip", message, messages, topology.num_nodes, int(mine.max()), overlap),
                     message * messages)
    else:
      traffic.add(message * messages)

  jax.debug.callback(tally, jnp.asarray(step), jnp.asarray(first_node))


def _note(tree: Any, sent_by: Callable[[list[Any]], tuple[float, Exchange]], min_ndim: int = 1) -> None:
  """Adds the bytes ``sent_by(leaves)`` gives (of the local block's array leaves) and its exchange to the count
  when the step runs."""
  traffic = _COUNT.get()
  if traffic is None:
    return
  leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype") and jnp.ndim(x) >= min_ndim]
  if not leaves:
    return
  sent, exchange = sent_by(leaves)
  if sent:
    jax.debug.callback(lambda: traffic.record(exchange, sent))


def note_gather(tree: Any, num_nodes: int) -> None:
  """Counts one all-gather of the local block ``tree`` over ``num_nodes`` nodes: each node's part, to the ``n - 1`` others."""

  def sent_by(leaves):
    local, part = jnp.shape(leaves[0])[0], _bytes_per_node(leaves)
    return local * (num_nodes - 1) * part, Exchange("all_gather", part, local * (num_nodes - 1), num_nodes,
                                                    overlap=current_overlap())

  _note(tree, sent_by)


def note_all_to_all(tree: Any) -> None:
  """Counts one all-to-all of the local block ``tree`` (leaves ``(b, n, ...)``): each node's n - 1 pieces for others."""

  def sent_by(leaves):
    local, n = jnp.shape(leaves[0])[:2]
    piece = sum(math.prod(jnp.shape(x)[2:]) * jnp.dtype(x.dtype).itemsize for x in leaves)
    return local * (n - 1) * piece, Exchange("all_to_all", piece, local * (n - 1), n, overlap=current_overlap())

  _note(tree, sent_by, min_ndim=2)


def note_mean(tree: Any, num_nodes: int) -> None:
  """Counts one all-reduce mean over ``num_nodes`` nodes of the local block ``tree``, as a ring sends it."""

  def sent_by(leaves):
    size = sum(math.prod(jnp.shape(x)[1:]) * np.dtype(accumulation_dtype(np.dtype(x.dtype))).itemsize for x in leaves)
    local = jnp.shape(leaves[0])[0]
    return local * 2 * (num_nodes - 1) / num_nodes * size, Exchange(
        "all_reduce", size / num_nodes, local * 2 * (num_nodes - 1), num_nodes, overlap=current_overlap())

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
  local = next((jnp.shape(x)[0] for x in jax.tree.leaves(params) if jnp.ndim(x)), 1)
  return np.asarray([sent / local for sent, _ in each_step(tx, params, steps, updates)], dtype=np.float64)


def each_step(tx: optax.GradientTransformation, params: Any, steps: int,
              updates: Any = None) -> list[tuple[float, collections.Counter[Exchange]]]:
  """Runs ``tx`` for ``steps`` jitted steps from ``tx.init(params)`` under a count: each step's bytes and events."""
  updates = jax.tree.map(jnp.zeros_like, params) if updates is None else updates
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
      out.append((traffic.total - before, traffic.drain()))
  return out
