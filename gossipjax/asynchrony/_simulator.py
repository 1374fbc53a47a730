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
import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.core  # jax.core.Tracer: a type checker sees the submodule only where it is imported
import jax.numpy as jnp
import optax
from jax import lax

from gossipjax._validation import check_finite_nonnegative, check_learning_rate, check_node_axis, check_positive_int
from gossipjax.asynchrony._cluster import Cluster, compute_time, transfer_time
from gossipjax.asynchrony._faults import Faults, check_fault_nodes, down_during, is_up, next_up
from gossipjax.asynchrony._plans import peer_lists
from gossipjax.data import NodeData, sample_batches

LossFn = Callable[[Any, tuple[jax.Array, jax.Array]], jax.Array]


class Simulator(NamedTuple):
  """A simulation as a pair of pure functions, ``init`` and ``run``.

  Built by `adpsgd`, `synchronous` and `sgp_bounded_staleness`, in the shape of an optax
  ``GradientTransformation``.

  Attributes:
    init: ``init(params, key) -> state``, from stacked params (a leading node axis) and a
      PRNG key.
    run: ``run(state, num_steps) -> state``, jitted: advances the simulation by
      ``num_steps`` events, rounds or steps (a static number).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, gossipjax as gj
    >>> x = np.linspace(-1.0, 1.0, 16)  # y = 2 x, split over 4 nodes
    >>> data = gj.data.node_data(x, 2 * x, gj.data.partition_iid(x, 4))
    >>> loss = lambda w, batch: jnp.mean((w[0] * batch[0] - batch[1]) ** 2)
    >>> sim = gj.asynchrony.adpsgd(loss, data, gj.asynchrony.cluster(4), learning_rate=0.5, batch_size=4)
    >>> state = sim.init(jnp.zeros((4, 1)), jax.random.key(0))
    >>> state = sim.run(state, 100)
    >>> int(state.events), float(state.clock)
    (100, 25.0)
  """

  init: Callable[..., Any]
  run: Callable[..., Any]


class AsyncState(NamedTuple):
  """State of the AD-PSGD simulation.

  Attributes:
    params: the nodes' models x_i (leading node axis).
    read: the model each node read when it started its current gradient (so its
      gradient may be stale by the time it is applied).
    started: float (n,), simulated time at which each node started its current gradient.
    next_finish: float (n,), simulated time at which it will finish it (the next events).
    clock: simulated time of the last event.
    events: gradients applied so far, over all nodes.
    counts: int32 (n,), gradients applied so far by each node.
    samples: training samples processed (``events * batch_size``).
    averages: pair averages done.
    lost: pair exchanges lost or skipped (no peer up, or the message lost).
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
  """State of a synchronous simulation (rounds with a barrier).

  Attributes:
    params: the nodes' models (leading node axis).
    opt_state: the state of the stacked-node optimizer ``tx``.
    clock: simulated time at the end of the last round.
    rounds: rounds run so far.
    samples: training samples processed (``batch_size`` per live node per round).
    key: PRNG key.
  """

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
  rows = data.index[node, pos]
  return data.inputs[rows], data.targets[rows]


class _EventQueue(NamedTuple):
  """A tournament tree over the nodes' finish times: the next event in O(log n).

  ``winner`` is a heap-ordered array of 2 * size - 1 node indices (size: n rounded up to a
  power of two; position 0 is the root, the children of position p are 2p + 1 and 2p + 2,
  the last ``size`` positions are the leaves, leaf k holding node k). An inner position
  holds the node with the earliest finish time below it, the lower index on a tie, so the
  root is exactly ``argmin(finish)``; padding leaves (k >= n) never win. ``node`` and
  ``time`` are the root's winner and its finish time, kept as scalars so that an event
  does not read them back from arrays it writes (a read that XLA may schedule after a
  write to the same buffer makes it copy the whole buffer, every event).
  """

  winner: jax.Array
  node: jax.Array
  time: jax.Array

  @staticmethod
  def build(finish: jax.Array) -> "_EventQueue":
    n = finish.shape[0]
    size = 1 << max(n - 1, 0).bit_length()
    time = jnp.concatenate([finish, jnp.full(size - n, jnp.inf, finish.dtype)])
    level, levels = jnp.arange(size, dtype=jnp.int32), []
    while True:
      levels.append(level)
      if level.shape[0] == 1:
        break
      left, right = level[0::2], level[1::2]
      level = jnp.where(time[right] < time[left], right, left)
    return _EventQueue(jnp.concatenate(levels[::-1]), level[0], time[level[0]])

  def update(self, finish: jax.Array, node: jax.Array, node_time: jax.Array) -> "_EventQueue":
    """The queue after ``finish[node]`` became ``node_time``: replays the matches on node's path.

    Only the path from node's leaf to the root changes, and each match on it is against the
    unchanged winner of the sibling subtree: the siblings are read in one gather and the
    path written in one scatter (interleaved reads and writes would make XLA copy the array).
    """
    n = finish.shape[0]
    size = (self.winner.shape[0] + 1) // 2
    depth = size.bit_length() - 1
    if depth == 0:
      return _EventQueue(self.winner, node, node_time)
    # 1-based heap numbering: the leaf of node is node + size, the parent of p is p >> 1.
    path = (node + size) >> jnp.arange(depth, dtype=node.dtype)
    sibling = self.winner[(path ^ 1) - 1]
    sibling_time = jnp.where(sibling < n, finish[jnp.minimum(sibling, n - 1)], jnp.inf)
    win, best, wins = node, node_time, []
    for level in range(depth):  # a few scalar ops per level, unrolled
      own_is_left = path[level] % 2 == 0
      # A tie goes to the left subtree, which holds the lower node indices.
      sib_wins = jnp.where(own_is_left, sibling_time[level] < best, sibling_time[level] <= best)
      win, best = jnp.where(sib_wins, sibling[level], win), jnp.minimum(best, sibling_time[level])
      wins.append(win)
    winner = self.winner.at[(path >> 1) - 1].set(jnp.stack(wins), unique_indices=True)
    return _EventQueue(winner, win, best)


def check_sizes(name: str, cluster: Cluster, data: NodeData, *, topology_nodes: int | None = None,
                faults: Faults | None = None) -> None:
  """Raises ``ValueError`` unless the data, the topology and the faults are of the cluster's n nodes."""
  n = cluster.num_nodes
  if data.num_nodes != n:
    raise ValueError(f"{name}: data has {data.num_nodes} nodes, cluster {n}")
  if topology_nodes is not None and topology_nodes != n:
    raise ValueError(f"{name}: the topology has {topology_nodes} nodes, the cluster {n}")
  check_fault_nodes(faults, n, name)


def _check_params(params: Any, n: int, name: str) -> None:
  check_node_axis(params, n, name, f"the cluster of {n} nodes")


def _stalled(name: str, clock: Any) -> None:
  warnings.warn(f"{name}: no node can compute after simulated time {float(clock):g}: every node is down for good "
                "(its outage ends at inf), so the run stopped there; the steps asked for beyond it did nothing",
                RuntimeWarning, stacklevel=3)


def _down_at(f: Faults, node: jax.Array, t: jax.Array) -> jax.Array:
  """Whether ``node`` is down at time ``t``: O(outages), where `is_up` is O(n * outages)."""
  return ((f.node == node) & (f.start <= t) & (t < f.end)).any()


def _set_row(x: jax.Array, row: jax.Array, value: jax.Array) -> jax.Array:
  """``x.at[row].set(value)`` as a one-row scatter, which XLA does in place in a scan."""
  return x.at[row].set(value.astype(x.dtype), unique_indices=True)


def _row(x: jax.Array, row: jax.Array) -> jax.Array:
  return lax.dynamic_index_in_dim(x, row, 0, keepdims=False)


def adpsgd(
    loss_fn: LossFn,
    data: NodeData,
    cluster: Cluster,
    topology: Any = None,
    *,
    learning_rate: float,
    batch_size: int,
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
  every ``lax.scan`` step takes the earliest (the next event on the simulated clock), so the
  events are processed in time order. One event is one node's gradient; a node's cycle
  costs its compute time plus one pair exchange (``latency + model_bytes / bandwidth``).
  A slow node simply has fewer events: the others never wait for it, and its rare stale
  gradient is one ordinary-sized SGD step (its model, averaged into by its peers while it
  computed, is not stale).

  An event costs O(d + log n) for d parameters per node: the next event comes from a
  tournament tree over the finish times (rebuilt in O(n) at the start of each ``run``), the
  peer from the node's own list of neighbours, and the two models change in place.

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
    topology: peers are the neighbours in this graph (any ``gj.topology``, its edges over
      one period taken in both directions; the paper uses a bipartite ring-like graph to
      avoid deadlocks of real locks, which cannot happen here); ``None``: a uniform random
      peer among all other nodes.
    model_bytes: size of a model, for the link time of a pair exchange.
    faults: optional node outages and message losses.

  Returns:
    A `Simulator`; ``run(state, num_events)`` processes ``num_events`` events.

  A node down for good (an outage that ends at ``inf``) computes no more; once every node
  is, the remaining events do nothing (the clock stays at the last real event) and ``run``
  warns that the run stopped there.

  Raises:
    ValueError: ``data``, ``topology``, ``faults`` and ``cluster`` disagree on the number of
      nodes (``init``: the params' leading axis too), or ``learning_rate``, ``batch_size`` or
      ``model_bytes`` is out of range.

  Example:
    Node 0 is ten times slower: the others do not wait for it.

    >>> import jax, jax.numpy as jnp, numpy as np, gossipjax as gj
    >>> x = np.linspace(-1.0, 1.0, 16)  # y = 2 x, split over 4 nodes
    >>> data = gj.data.node_data(x, 2 * x, gj.data.partition_iid(x, 4))
    >>> loss = lambda w, batch: jnp.mean((w[0] * batch[0] - batch[1]) ** 2)
    >>> cluster = gj.asynchrony.straggler_cluster(4, slowdown=10.0)
    >>> sim = gj.asynchrony.adpsgd(loss, data, cluster, learning_rate=0.5, batch_size=4)
    >>> state = sim.run(sim.init(jnp.zeros((4, 1)), jax.random.key(0)), 200)
    >>> state.counts.tolist(), float(state.clock)
    ([6, 65, 65, 64], 65.0)
    >>> print(np.round(np.asarray(state.params[:, 0]), 3))
    [2. 2. 2. 2.]

  References:
    Lian, Zhang, Zhang, Liu (2018), Asynchronous Decentralized Parallel Stochastic Gradient
    Descent, ICML.
  """
  name = "gj.asynchrony.adpsgd"
  n = cluster.num_nodes
  lists = None if topology is None else peer_lists(topology)
  check_sizes(name, cluster, data, topology_nodes=None if lists is None else len(lists[0]) - 1, faults=faults)
  check_learning_rate(learning_rate, name)
  check_positive_int(batch_size, name, "batch_size")
  check_finite_nonnegative(model_bytes, name, "model_bytes")
  comm = transfer_time(cluster, model_bytes)
  grad_fn = jax.grad(loss_fn)

  if lists is None:
    degree = lambda i: jnp.asarray(n - 1, jnp.int32)
    peer = lambda i, k: k + (k >= i).astype(k.dtype)  # the k-th node other than i
  else:
    indptr, indices = (jnp.asarray(a) for a in lists)
    degree = lambda i: indptr[i + 1] - indptr[i]
    peer = lambda i, k: indices[jnp.minimum(indptr[i] + k, indices.shape[0] - 1)]

  def draw_peer(key, i, t):
    """A uniform peer of i among those up at t, and whether there is one."""
    deg = degree(i)
    if faults is None:
      k = jax.random.randint(key, (), 0, jnp.maximum(deg, 1), jnp.int32)
      return peer(i, k), deg > 0
    outages = faults  # not None here, also in the closures below
    # Is any peer up? Scan i's peers until one is: O(1 + outages) steps unless most are down.
    down = lambda k: _down_at(outages, peer(i, k), t)
    first = lax.while_loop(lambda k: (k < deg) & down(k), lambda k: k + 1, jnp.zeros([], jnp.int32))
    found = first < deg

    # Rejection sampling is exactly uniform over the peers that are up.
    def draw(c):
      key, _, _ = c
      key, sub = jax.random.split(key)
      j = peer(i, jax.random.randint(sub, (), 0, jnp.maximum(deg, 1), jnp.int32))
      return key, j, ~_down_at(outages, j, t)

    _, j, _ = lax.while_loop(lambda c: ~c[2], draw, (key, i, ~found))
    return j, found

  def init(params, key):
    _check_params(params, n, name)
    key, sub = jax.random.split(key)
    finish = compute_time(cluster, sub) + comm
    zero = jnp.zeros([], jnp.int32)
    return AsyncState(params, params, jnp.zeros_like(finish), finish, jnp.zeros_like(comm), zero,
                      jnp.zeros(n, jnp.int32), zero, zero, zero, key)

  def event(carry, _):
    s, queue = carry
    i, t = queue.node, queue.time
    key, k_batch, k_peer, k_loss, k_time = jax.random.split(s.key, 5)
    g = grad_fn(jax.tree.map(lambda r: _row(r, i), s.read), _node_batch(data, k_batch, i, batch_size))

    if faults is None:
      crashed, restart = jnp.array(False), t
      exchange_ok = jnp.array(True)
    else:
      crashed, restart = down_during(faults, i, s.started[i], t)
      # t = inf: every node is down for good, and this event does nothing (its node stays at inf).
      crashed = crashed | jnp.isinf(t)
      exchange_ok = jax.random.uniform(k_loss) >= faults.loss_prob
    j, has_peer = draw_peer(k_peer, i, t)
    do_avg = has_peer & exchange_ok & ~crashed

    # Both rows change in one scatter: two dynamic-update-slices in a row, the second
    # writing a value computed from the buffer before the first, make XLA copy the whole
    # (n, ...) buffer every event. Row j's write is dropped (index n) when there is no average.
    rows = jnp.stack([jnp.where(do_avg, j, n), i])

    def leaf(x, gi):
      xi, xj = _row(x, i), _row(x, j)
      avg = jnp.where(do_avg, 0.5 * (xi + xj), xi)
      new = jnp.stack([avg, jnp.where(crashed, xi, avg - learning_rate * gi)]).astype(x.dtype)
      return x.at[rows].set(new, mode="drop", unique_indices=True)

    params = jax.tree.map(leaf, s.params, g)
    read = jax.tree.map(lambda r, x: _set_row(r, i, _row(x, i)), s.read, params)
    start = jnp.where(crashed, restart, t)
    finish = start + compute_time(cluster, k_time, i) + comm
    ok = (~crashed).astype(jnp.int32)
    next_finish = _set_row(s.next_finish, i, finish)
    s = AsyncState(
        params, read, _set_row(s.started, i, start), next_finish, jnp.where(jnp.isinf(t), s.clock, t),
        s.events + ok, _set_row(s.counts, i, s.counts[i] + ok), s.samples + ok * batch_size,
        s.averages + do_avg.astype(jnp.int32), s.lost + (~do_avg & ~crashed).astype(jnp.int32), key)
    return (s, queue.update(s.next_finish, i, finish)), None

  @functools.partial(jax.jit, static_argnums=1)
  def run_events(state, num_events):
    return lax.scan(event, (state, _EventQueue.build(state.next_finish)), None, length=num_events)[0][0]

  def run(state, num_events):
    state = run_events(state, num_events)
    if faults is not None and not isinstance(state.clock, jax.core.Tracer) and bool(jnp.isinf(state.next_finish).all()):
      _stalled(name, state.clock)
    return state

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
  receives ``up`` (bool (n,)), ``loss_key`` and ``loss_prob`` as keyword arguments, which
  `gj.asynchrony.faulty_mix` uses to drop the lost messages (one draw per link, see
  `gj.asynchrony.delivered_edges`) and renormalize W; other transforms ignore them. A round
  in which every node is down changes no model and waits until the first node comes back; once
  every node is down for good (outages that end at ``inf``), rounds stop counting, the clock
  stays, and ``run`` warns that the run stopped there.

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

  Raises:
    ValueError: ``data``, ``faults`` and ``cluster`` disagree on the number of nodes
      (``init``: the params' leading axis too), or ``batch_size`` or ``comm_time`` is out of
      range.

  Example:
    D-PSGD on a ring, where every round waits for the node ten times slower:

    >>> import jax, jax.numpy as jnp, numpy as np, gossipjax as gj
    >>> x = np.linspace(-1.0, 1.0, 16)  # y = 2 x, split over 4 nodes
    >>> data = gj.data.node_data(x, 2 * x, gj.data.partition_iid(x, 4))
    >>> loss = lambda w, batch: jnp.mean((w[0] * batch[0] - batch[1]) ** 2)
    >>> cluster = gj.asynchrony.straggler_cluster(4, slowdown=10.0)
    >>> tx = gj.gossip_sgd(gj.topology.ring(4), learning_rate=0.5)
    >>> sim = gj.asynchrony.synchronous(loss, data, cluster, tx, batch_size=4, comm_time=0.5)
    >>> state = sim.run(sim.init(jnp.zeros((4, 1)), jax.random.key(0)), 20)
    >>> int(state.rounds), float(state.clock)  # 20 rounds of 10 + 0.5 seconds
    (20, 210.0)
    >>> print(np.round(np.asarray(state.params[:, 0]), 3))
    [2. 2. 2. 2.]

  References:
    Lian, Zhang, Zhang, Hsieh, Zhang, Liu (2017), Can Decentralized Algorithms Outperform
    Centralized Algorithms? A Case Study for Decentralized Parallel Stochastic Gradient
    Descent, NeurIPS.
  """
  name = "gj.asynchrony.synchronous"
  n = cluster.num_nodes
  check_sizes(name, cluster, data, faults=faults)
  check_positive_int(batch_size, name, "batch_size")
  check_finite_nonnegative(comm_time, name, "comm_time")
  grad_fn = jax.vmap(jax.grad(loss_fn))

  def init(params, key):
    _check_params(params, n, name)
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
      extra = dict(up=up, loss_key=k_loss, loss_prob=faults.loss_prob)
    updates, opt_state = tx.update(grads, s.opt_state, s.params, **extra)
    params = optax.apply_updates(s.params, updates)
    length = jnp.max(jnp.where(up, times, 0.0)) + comm_time
    rounds = s.rounds + 1
    if faults is not None:
      # Nobody up: no model changes, and the round lasts until the first node is back (a
      # barrier with no live node would otherwise take no time, and the clock would never move).
      anyone = up.any()
      params, opt_state = lax.cond(anyone, lambda: (params, opt_state), lambda: (s.params, s.opt_state))
      back = next_up(faults, s.clock, n)
      length = jnp.where(anyone, length, jnp.where(jnp.isinf(back), 0.0, back - s.clock))
      rounds = jnp.where(anyone | ~jnp.isinf(back), rounds, s.rounds)
    return SyncState(params, opt_state, s.clock + length.astype(s.clock.dtype), rounds,
                     s.samples + batch_size * up.sum().astype(jnp.int32), key), None

  @functools.partial(jax.jit, static_argnums=1)
  def run_rounds(state, num_rounds):
    return lax.scan(round_, state, None, length=num_rounds)[0]

  def run(state, num_rounds):
    state = run_rounds(state, num_rounds)
    if faults is not None and not isinstance(state.clock, jax.core.Tracer):
      if not bool(is_up(faults, state.clock, n).any()) and bool(jnp.isinf(next_up(faults, state.clock, n))):
        _stalled(name, state.clock)
    return state

  return Simulator(init, run)
