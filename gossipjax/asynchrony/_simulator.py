"""Event-driven training of n nodes in simulated time, inside ``jit``.

Two simulators share one shape, an optax-like pair of pure functions
``Simulator(init, run)``: ``state = sim.init(params, key)`` with stacked params (a leading
node axis), then ``state = sim.run(state, num_steps)``, a jitted ``lax.scan`` over events
(AD-PSGD) or rounds (synchronous methods). The training is real: every event draws a
minibatch from the node's own data and takes the gradient of the real loss; only time is
simulated, from the `Cluster` model.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from gossipjax.asynchrony._cluster import Cluster, compute_time, transfer_time
from gossipjax.asynchrony._faults import Faults, delivered_mask, down_during, is_up
from gossipjax.data import NodeData, sample_batches
from gossipjax.topology import as_topology

LossFn = Callable[[Any, tuple[jax.Array, jax.Array]], jax.Array]


class Simulator(NamedTuple):
  """``init(params, key) -> state`` and ``run(state, num_steps) -> state`` (jitted)."""

  init: Callable[..., Any]
  run: Callable[..., Any]


class AsyncState(NamedTuple):
  """State of the AD-PSGD simulation.

  Attributes:
    params: the nodes' models x_i (leading node axis).
    read: the model each node read when it started its current gradient (so its
      gradient may be stale by the time it is applied).
    started, next_finish: float (n,), simulated start and finish time of each node's
      current gradient.
    clock: simulated time of the last event.
    events: gradients applied so far; ``counts`` (n,) per node.
    samples: training samples processed (``events * batch_size``).
    averages: pair averages done; ``lost``: pair exchanges lost or skipped.
    key: PRNG key.
  """

  params: Any
  read: Any
  started: jax.Array
  next_finish: jax.Array
  clock: jax.Array
  events: jax.Array
  counts: jax.Array
  samples: jax.Array
  averages: jax.Array
  lost: jax.Array
  key: jax.Array


class SyncState(NamedTuple):
  """State of a synchronous simulation (rounds with a barrier)."""

  params: Any
  opt_state: Any
  clock: jax.Array
  rounds: jax.Array
  samples: jax.Array
  key: jax.Array


def _node_batch(data: NodeData, key: jax.Array, node: jax.Array, batch_size: int):
  """``batch_size`` samples of ``node``'s own data, with replacement (as `sample_batches`)."""
  size = data.sizes[node]
  pos = jnp.minimum((jax.random.uniform(key, (batch_size,)) * size).astype(jnp.int32), size - 1)
  rows = data.index[node][pos]
  return data.inputs[rows], data.targets[rows]


def _peer_mask(topology: Any, n: int) -> np.ndarray:
  if topology is None:
    return ~np.eye(n, dtype=bool)
  topo = as_topology(topology)
  adj = np.zeros((n, n), bool)
  for k in range(topo.period):
    adj |= topo.matrix(k) != 0
  adj |= adj.T
  np.fill_diagonal(adj, False)
  return adj


def adpsgd(
    loss_fn: LossFn,
    data: NodeData,
    cluster: Cluster,
    learning_rate: float,
    batch_size: int,
    topology: Any = None,
    model_bytes: float = 0.0,
    faults: Faults | None = None,
) -> Simulator:
  r"""Asynchronous decentralized parallel SGD (AD-PSGD; Lian, Zhang, Zhang, Liu 2018).

  Each node loops on its own clock with no global barrier: it reads its model
  :math:`\hat x_i = x_i`, computes a stochastic gradient on it (taking
  ``compute_time`` simulated seconds, during which peers may average into :math:`x_i`),
  then atomically averages with one peer j and applies its possibly stale gradient:

  .. math::
    x_i, x_j \leftarrow \tfrac12 (x_i + x_j), \qquad
    x_i \leftarrow x_i - \gamma \nabla F_i(\hat x_i; \xi_i).

  The event loop lives inside ``jit``: the state keeps each node's next finish time, and
  every ``lax.scan`` step takes the argmin (the next event on the simulated clock), so the
  events are processed in time order. One event is one node's gradient; a node's cycle
  costs its compute time plus one pair exchange (``latency + model_bytes / bandwidth``).
  A slow node simply has fewer events: the others never wait for it, and its rare stale
  gradient is one ordinary-sized SGD step (its model, averaged into by its peers while it
  computed, is not stale).

  Faults (see `gj.asynchrony.faults`): a node whose gradient overlaps one of its down
  intervals loses that gradient and starts afresh when it rejoins, with the model it had;
  peers are picked among the nodes that are up; a lost exchange cancels the pair average
  (both keep their models), so averaging preserves the sum over live nodes.

  Args:
    loss_fn: ``loss_fn(params_of_one_node, (inputs, targets)) -> scalar``.
    data: the nodes' data (``gj.data.node_data``).
    cluster: the timing model (``gj.asynchrony.cluster``).
    learning_rate: gamma.
    batch_size: samples per gradient.
    topology: peers are the neighbours in this graph (any ``gj.topology``; the paper uses
      a bipartite ring-like graph to avoid deadlocks of real locks, which cannot happen
      here); ``None``: a uniform random peer among all other nodes.
    model_bytes: size of a model, for the link time of a pair exchange.
    faults: optional node outages and message losses.

  Returns:
    A `Simulator`; ``run(state, num_events)`` processes ``num_events`` events.
  """
  n = cluster.num_nodes
  if data.num_nodes != n:
    raise ValueError(f"adpsgd: data has {data.num_nodes} nodes, cluster {n}")
  peers = jnp.asarray(_peer_mask(topology, n))
  comm = transfer_time(cluster, model_bytes)
  grad_fn = jax.grad(loss_fn)

  def init(params, key):
    key, sub = jax.random.split(key)
    finish = compute_time(cluster, sub) + comm
    zero = jnp.zeros([], jnp.int32)
    return AsyncState(params, params, jnp.zeros_like(finish), finish, jnp.zeros_like(comm), zero,
                      jnp.zeros(n, jnp.int32), zero, zero, zero, key)

  def event(s: AsyncState, _):
    i = jnp.argmin(s.next_finish)
    t = s.next_finish[i]
    key, k_batch, k_peer, k_loss, k_time = jax.random.split(s.key, 5)
    take = lambda tree, k: jax.tree.map(lambda x: x[k], tree)
    g = grad_fn(take(s.read, i), _node_batch(data, k_batch, i, batch_size))

    if faults is None:
      crashed, restart = jnp.array(False), t
      cand = peers[i]
      exchange_ok = jnp.array(True)
    else:
      crashed, restart = down_during(faults, i, s.started[i], t)
      cand = peers[i] & is_up(faults, t, n)
      exchange_ok = jax.random.uniform(k_loss) >= faults.loss_prob
    j = jax.random.categorical(k_peer, jnp.where(cand, 0.0, -jnp.inf))
    do_avg = cand.any() & exchange_ok & ~crashed

    def update(x):
      xi, xj = x[i], x[j]
      avg = jnp.where(do_avg, 0.5 * (xi + xj), xi)
      x = x.at[j].set(jnp.where(do_avg, avg, xj))
      return x, avg

    def leaf(x, gi):
      x, avg = update(x)
      return x.at[i].set(jnp.where(crashed, x[i], avg - learning_rate * gi).astype(x.dtype))

    params = jax.tree.map(leaf, s.params, g)
    read = jax.tree.map(lambda r, x: r.at[i].set(x[i]), s.read, params)
    start = jnp.where(crashed, restart, t)
    finish = start + compute_time(cluster, k_time, i) + comm
    ok = (~crashed).astype(jnp.int32)
    return AsyncState(
        params, read, s.started.at[i].set(start), s.next_finish.at[i].set(finish), t,
        s.events + ok, s.counts.at[i].add(ok), s.samples + ok * batch_size,
        s.averages + do_avg.astype(jnp.int32), s.lost + (~do_avg & ~crashed).astype(jnp.int32), key), None

  @functools.partial(jax.jit, static_argnums=1)
  def run(state, num_events):
    return lax.scan(event, state, None, length=num_events)[0]

  return Simulator(init, run)


def synchronous(
    loss_fn: LossFn,
    data: NodeData,
    cluster: Cluster,
    tx: optax.GradientTransformation,
    batch_size: int,
    comm_time: float = 0.0,
    faults: Faults | None = None,
) -> Simulator:
  r"""Synchronous rounds (D-PSGD, AllReduce-SGD, any stacked-node optax transform).

  Every round all live nodes compute a gradient on their own minibatch, then ``tx`` (e.g.
  ``gj.gossip_sgd(W, ...)`` or ``gj.allreduce_sgd(...)``) exchanges and updates. The round
  ends at a barrier, so it lasts as long as the slowest live node:

  .. math:: T_{k+1} = T_k + \max_i c_i^k + t_\mathrm{comm}.

  With ``faults``, down nodes skip the round (their gradient is zeroed) and ``tx.update``
  receives ``up`` (bool (n,)) and ``delivered`` (bool (n, n)) as keyword arguments, which
  `gj.asynchrony.faulty_mix` uses to renormalize W; other transforms ignore them.

  Args:
    loss_fn: ``loss_fn(params_of_one_node, (inputs, targets)) -> scalar``.
    data: the nodes' data.
    cluster: the timing model.
    tx: the stacked-node optimizer.
    batch_size: samples per node per round.
    comm_time: simulated seconds of the exchange in each round (`allreduce_time`, or
      `transfer_time` times the rounds of a gossip plan).
    faults: optional outages and message losses.

  Returns:
    A `Simulator`; ``run(state, num_rounds)`` runs ``num_rounds`` rounds.
  """
  n = cluster.num_nodes
  grad_fn = jax.vmap(jax.grad(loss_fn))

  def init(params, key):
    zero = jnp.zeros([], jnp.int32)
    return SyncState(params, tx.init(params), jnp.zeros_like(cluster.latency), zero, zero, key)

  def round_(s: SyncState, _):
    key, k_batch, k_time, k_loss = jax.random.split(s.key, 4)
    grads = grad_fn(s.params, sample_batches(data, k_batch, batch_size))
    times = compute_time(cluster, k_time)
    extra = {}
    if faults is None:
      up = jnp.ones(n, bool)
    else:
      up = is_up(faults, s.clock, n)
      bcast = lambda g: jnp.where(up.reshape((n,) + (1,) * (g.ndim - 1)), g, jnp.zeros_like(g))
      grads = jax.tree.map(bcast, grads)
      extra = dict(up=up, delivered=delivered_mask(faults, k_loss, n))
    updates, opt_state = tx.update(grads, s.opt_state, s.params, **extra)
    params = optax.apply_updates(s.params, updates)
    length = jnp.max(jnp.where(up, times, 0.0)) + comm_time
    return SyncState(params, opt_state, s.clock + length, s.rounds + 1,
                     s.samples + batch_size * up.sum().astype(jnp.int32), key), None

  @functools.partial(jax.jit, static_argnums=1)
  def run(state, num_rounds):
    return lax.scan(round_, state, None, length=num_rounds)[0]

  return Simulator(init, run)
