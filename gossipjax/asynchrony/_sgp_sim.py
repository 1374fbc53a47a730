"""SGP with bounded staleness (Overlap SGP) in simulated time, inside ``jit``."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gossipjax._validation import check_finite_nonnegative, check_learning_rate, check_node_axis, check_positive_int
from gossipjax.asynchrony._cluster import Cluster, compute_time, transfer_time
from gossipjax.asynchrony._plans import column_sums, plan_table
from gossipjax.asynchrony._simulator import LossFn, Simulator, check_sizes
from gossipjax.data import NodeData, sample_batches
from gossipjax.topology import as_topology


class SGPSimState(NamedTuple):
  """State of the SGP simulation.

  Attributes:
    z: push-sum numerators (leading node axis); the model of node i is ``z_i / w_i``.
    w: float (n,), push-sum weights.
    start: float (n,), simulated time at which each node starts its next step.
    sent_z: the last ``tau + 1`` steps' outgoing numerators of every sender, shape
      (tau + 1, n, ...), slot ``s % (tau + 1)`` for step s.
    sent_w: the matching outgoing weights, (tau + 1, n).
    source: int32 (tau + 1, rounds, n), the sender of the message that receiver i gets in
      each exchange round of that step's plan (``topology.plans()``).
    share: (tau + 1, rounds, n), that message's weight ``P^{(s)}[i, source]``.
    arrival: (tau + 1, rounds, n), when it reaches i.
    pending: bool (tau + 1, rounds, n), messages sent but not yet delivered.
    step: steps taken (by every node; nodes differ in time, not in step).
    clock: simulated time at which the last step finished on every node.
    samples: training samples processed.
    waited: simulated seconds nodes spent blocked on a late message, summed over nodes.
    late: messages used after more than one step.
    key: PRNG key.
  """

  z: Any
  w: jax.Array
  start: jax.Array
  sent_z: Any
  sent_w: jax.Array
  source: jax.Array
  share: jax.Array
  arrival: jax.Array
  pending: jax.Array
  step: jax.Array
  clock: jax.Array
  samples: jax.Array
  waited: jax.Array
  late: jax.Array
  key: jax.Array


def sgp_bounded_staleness(
    loss_fn: LossFn,
    data: NodeData,
    cluster: Cluster,
    topology: Any,
    *,
    learning_rate: float,
    batch_size: int,
    tau: int = 1,
    model_bytes: float = 0.0,
    link_slowdown: Any = None,
) -> Simulator:
  r"""Stochastic Gradient Push with messages up to ``tau`` steps late (Assran et al. 2019).

  Each node runs on its own clock. At step k node i folds in every push-sum message that
  has reached it, takes an SGD step on its de-biased model and pushes shares of
  :math:`(z_i, w_i)` along the column-stochastic :math:`P^{(k)}`:

  .. math::
    z_i \leftarrow z_i + \sum_{(s, j)\ \mathrm{arrived}} P^{(s)}_{ij} z_j^{(s)},\quad
    w_i \leftarrow w_i + \sum P^{(s)}_{ij} w_j^{(s)}, \\
    z_i^{(k)} = z_i - \gamma \nabla F_i(z_i / w_i), \qquad
    z_i \leftarrow P^{(k)}_{ii} z_i^{(k)}, \quad w_i \leftarrow P^{(k)}_{ii} w_i
    \quad (\text{and } P^{(k)}_{ji} (z_i^{(k)}, w_i) \text{ sent to each } j).

  Bounded staleness: node i may start step k without the messages of steps
  ``k - tau .. k - 1``, but waits for those of step ``k - 1 - tau`` (``tau = 0`` is
  synchronous SGP, which equals ``gj.sgp`` with ``beta = 0``). Overlap: a message travels
  while its sender computes its next steps, so link time up to ``tau`` steps is hidden.
  Because push-sum only ever adds mass, a late message is still exact: sum(z) and
  sum(w) = n are conserved by delivery, whenever it happens.

  Timing is exact (start of step k+1 = max(own finish, arrival of the step k - tau
  messages)); delivery is conservative: a message is used at the first step the receiver
  starts after it arrives, but never before the step after it was sent (the scan advances
  all nodes one step at a time), so in a run where one node is many steps ahead its
  messages may be used a step later than a real system could.

  The messages in flight are kept per edge of the topology's sparse plans, so a step costs
  O(tau * degree * n * d), not the O(tau * n^2 * d) of dense (n, n) mixing matrices.

  Args:
    loss_fn: ``loss_fn(params_of_one_node, (inputs, targets)) -> scalar``.
    data: the nodes' data.
    cluster: the timing model (compute times, link latency and bandwidth).
    topology: column-stochastic mixing, possibly time-varying
      (``gj.topology.one_peer_directed_exponential(n)``, as in the paper).
    learning_rate: gamma.
    batch_size: samples per node per step.
    tau: staleness bound in steps (>= 0).
    model_bytes: message size for the link time.
    link_slowdown: optional factors on the link time: (n, n), ``[i, j]`` for j -> i (only
      the entries on the graph's edges are read), or (n,), one per sender.

  Returns:
    A `Simulator`; ``run(state, num_steps)`` advances every node ``num_steps`` steps.

  Raises:
    ValueError: ``tau`` is not an integer >= 0, ``topology`` is not column stochastic,
      ``data``, ``topology`` and ``cluster`` disagree on the number of nodes (``init``: the
      params' leading axis too), or ``link_slowdown`` is not (n,) or (n, n) of finite
      positive factors.

  Example:
    Links take twice a compute step; with ``tau = 2`` the nodes never wait for them:

    >>> import jax, jax.numpy as jnp, numpy as np, gossipjax as gj
    >>> x = np.linspace(-1.0, 1.0, 16)  # y = 2 x, split over 4 nodes
    >>> data = gj.data.node_data(x, 2 * x, gj.data.partition_iid(x, 4))
    >>> loss = lambda w, batch: jnp.mean((w[0] * batch[0] - batch[1]) ** 2)
    >>> cluster = gj.asynchrony.cluster(4, latency=2.0)
    >>> topology = gj.topology.one_peer_directed_exponential(4)
    >>> for tau in (0, 2):
    ...   sim = gj.asynchrony.sgp_bounded_staleness(loss, data, cluster, topology, learning_rate=0.5,
    ...                                              batch_size=4, tau=tau)
    ...   state = sim.run(sim.init(jnp.zeros((4, 1)), jax.random.key(0)), 20)
    ...   print(tau, float(state.clock), np.round(np.asarray(gj.asynchrony.sgp_params(state)[:, 0]), 3))
    0 58.0 [2. 2. 2. 2.]
    2 20.0 [2. 2. 2. 2.]

  References:
    Assran, Loizou, Ballas, Rabbat (2019), Stochastic Gradient Push for Distributed Deep
    Learning, ICML.
  """
  name = "gj.asynchrony.sgp_bounded_staleness"
  if isinstance(tau, bool) or not isinstance(tau, (int, np.integer)) or tau < 0:
    raise ValueError(f"{name}: tau must be an integer >= 0, got {tau!r}")
  tau = int(tau)
  n, slots = cluster.num_nodes, tau + 1
  topo = as_topology(topology)
  check_sizes(name, cluster, data, topology_nodes=topo.num_nodes)
  check_learning_rate(learning_rate, name)
  check_positive_int(batch_size, name, "batch_size")
  check_finite_nonnegative(model_bytes, name, "model_bytes")
  table = plan_table(topo)
  if not np.allclose(column_sums(table), 1.0):
    raise ValueError(f"{name}: {topo.name} is not column stochastic")
  period, num_rounds, _ = table.src.shape
  # Slow-link factors at the plan's edges only: [k, r, i] for the message src[k, r, i] -> i.
  slow = np.ones(table.src.shape)
  if link_slowdown is not None:
    factors = np.asarray(link_slowdown, np.float64)
    if factors.shape not in ((n,), (n, n)):
      raise ValueError(f"{name}: link_slowdown must be of shape ({n},) or ({n}, {n}), got {factors.shape}")
    if not (np.isfinite(factors) & (factors > 0)).all():
      raise ValueError(f"{name}: every link_slowdown factor must be finite and positive")
    receiver = np.broadcast_to(np.arange(n), table.src.shape)
    slow = factors[table.src] if factors.ndim == 1 else factors[receiver, table.src]
  link = transfer_time(cluster, model_bytes) * jnp.asarray(slow)
  src_table, weight_table, self_table = (jnp.asarray(a) for a in (table.src, table.weight, table.self_weight))
  grad_fn = jax.vmap(jax.grad(loss_fn))

  def init(params, key):
    check_node_axis(params, n, name, f"the cluster of {n} nodes")
    dtype = jnp.result_type(*jax.tree.leaves(params))
    buf = lambda x: jnp.zeros((slots,) + x.shape, x.dtype)
    edges = (slots, num_rounds, n)
    zero = jnp.zeros([], jnp.int32)
    return SGPSimState(params, jnp.ones(n, dtype), jnp.zeros(n, dtype), jax.tree.map(buf, params),
                       jnp.zeros((slots, n), dtype), jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), edges),
                       jnp.zeros(edges, dtype), jnp.zeros(edges, dtype), jnp.zeros(edges, bool), zero,
                       jnp.zeros([], dtype), zero, jnp.zeros([], dtype), zero, key)

  def step_(s: SGPSimState, _):
    key, k_batch, k_time = jax.random.split(s.key, 3)
    k = s.step
    sent_step = k - 1 - ((k - 1 - jnp.arange(slots)) % slots)  # the step each slot holds
    forced = (sent_step == k - 1 - tau)[:, None, None]
    deliver = s.pending & ((s.arrival <= s.start[None, None, :]) | forced)
    late = deliver & (sent_step < k - 1)[:, None, None]
    z, w = _receive(s.z, s.w, jnp.where(deliver, s.share, 0.0), s.source, s.sent_z, s.sent_w)

    per_node = lambda v, x: v.astype(x.dtype).reshape((n,) + (1,) * (x.ndim - 1))
    x = jax.tree.map(lambda zi: zi / per_node(w, zi), z)
    grads = grad_fn(x, sample_batches(data, k_batch, batch_size))
    z_half = jax.tree.map(lambda zi, g: zi - learning_rate * g.astype(zi.dtype), z, grads)
    finish = s.start + compute_time(cluster, k_time)

    p, slot = k % period, k % slots
    src, weight, keep = src_table[p], weight_table[p].astype(w.dtype), self_table[p].astype(w.dtype)
    sent = (weight != 0) & (src != jnp.arange(n)[None, :])
    pending = (s.pending & ~deliver).at[slot].set(sent)
    arrival = s.arrival.at[slot].set(finish[src] + link[p])
    share = s.share.at[slot].set(weight)
    source = s.source.at[slot].set(src)
    sent_z = jax.tree.map(lambda b, zh: b.at[slot].set(zh), s.sent_z, z_half)
    sent_w = s.sent_w.at[slot].set(w)
    z = jax.tree.map(lambda zh: zh * per_node(keep, zh), z_half)
    w = w * keep

    # Step k+1 waits for the messages of step k - tau (slot (k - tau) % slots).
    must = pending[(k - tau) % slots] & (k - tau >= 0)
    need = jnp.max(jnp.where(must, arrival[(k - tau) % slots], -jnp.inf), axis=0)
    start = jnp.maximum(finish, need)
    return SGPSimState(z, w, start, sent_z, sent_w, source, share, arrival, pending, k + 1, jnp.max(finish),
                       s.samples + n * batch_size, s.waited + jnp.sum(start - finish),
                       s.late + late.sum().astype(jnp.int32), key), None

  @functools.partial(jax.jit, static_argnums=1)
  def run(state, num_steps):
    return lax.scan(step_, state, None, length=num_steps)[0]

  return Simulator(init, run)


def _receive(z: Any, w: jax.Array, coef: jax.Array, source: jax.Array, sent_z: Any, sent_w: jax.Array):
  """Folds in the messages with weight ``coef`` (slots, rounds, n): receiver i adds
  ``coef[s, r, i] * sent[s, source[s, r, i]]``. O(slots * rounds * n * d)."""
  gather = jax.vmap(lambda sent, src: jnp.take(sent, src, axis=0))  # over slots: (slots, rounds, n, ...)

  def fold(zi, sz):
    c = coef.astype(zi.dtype).reshape(coef.shape + (1,) * (zi.ndim - 1))
    return zi + jnp.sum(c * gather(sz, source), axis=(0, 1))

  return jax.tree.map(fold, z, sent_z), w + jnp.sum(coef * gather(sent_w, source), axis=(0, 1))


def sgp_params(state: SGPSimState, in_flight: bool = True) -> Any:
  """The de-biased models ``z_i / w_i`` of an SGP simulation (leading node axis).

  Args:
    state: an `SGPSimState`.
    in_flight: fold in the messages still travelling to each node (the models the nodes
      will have once those land; with ``tau = 0`` this is the model of ``gj.sgp`` after
      the same number of steps); ``False``: the nodes' current estimates.

  Returns:
    The models, a pytree like the simulated params (leading node axis).

  Example:
    One step of pure averaging (``learning_rate = 0``) on a one-peer exponential graph: each
    node has pushed half its mass to the next, and the messages have not landed yet.

    >>> import jax, jax.numpy as jnp, numpy as np, gossipjax as gj
    >>> x = np.linspace(-1.0, 1.0, 16)  # y = 2 x, split over 4 nodes
    >>> data = gj.data.node_data(x, 2 * x, gj.data.partition_iid(x, 4))
    >>> loss = lambda w, batch: jnp.mean((w[0] * batch[0] - batch[1]) ** 2)
    >>> sim = gj.asynchrony.sgp_bounded_staleness(
    ...     loss, data, gj.asynchrony.cluster(4, latency=2.0),
    ...     gj.topology.one_peer_directed_exponential(4), learning_rate=0.0, batch_size=4, tau=1)
    >>> state = sim.run(sim.init(jnp.arange(4.0).reshape(4, 1), jax.random.key(0)), 1)
    >>> print(np.asarray(gj.asynchrony.sgp_params(state, in_flight=False)[:, 0]))
    [0. 1. 2. 3.]
    >>> print(np.asarray(gj.asynchrony.sgp_params(state)[:, 0]))
    [1.5 0.5 1.5 2.5]
  """
  n = state.w.shape[0]
  z, w = state.z, state.w
  if in_flight:
    z, w = _receive(z, w, jnp.where(state.pending, state.share, 0.0), state.source, state.sent_z, state.sent_w)
  return jax.tree.map(lambda zi: zi / w.astype(zi.dtype).reshape((n,) + (1,) * (zi.ndim - 1)), z)
