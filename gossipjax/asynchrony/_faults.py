"""Faults: nodes that drop out and rejoin, and lost messages.

A dropped node neither computes, sends nor receives; its params stay frozen at the value
they had when it dropped and it rejoins with them. Around it the live nodes keep valid
weights:

* Gossip rounds (`faulty_mix`): entry ``W[i, j]`` survives only when both i and j are up
  and j's message to i was delivered; each row puts the weight it lost back on the node
  itself, ``W'[i, i] = 1 - sum_{j != i} W'[i, j]``, so every row still sums to one (a
  convex combination: params stay finite and inside the hull of the live models). A lost
  message is therefore treated as not sent: the receiver keeps its own weight for that
  share. When W is symmetric and losses are symmetric (both directions of an edge fail
  together), W' is doubly stochastic over the live nodes and their average is preserved;
  a one-way loss makes W' only row stochastic and the average drifts (it stays a convex
  combination).
* Pairwise averaging (AD-PSGD in `gj.asynchrony.adpsgd`): a node picks its peer among the
  nodes that are up; a lost message cancels the whole pair average (both keep their own
  model), so the sum over live nodes is preserved by every averaging step.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.core  # jax.core.Tracer: a type checker sees the submodule only where it is imported
import jax.numpy as jnp
import numpy as np
import optax

from gossipjax.backend._table import mix_from_table, plan_table
from gossipjax.mixing import float_leaves_only
from gossipjax.mixing._stacked_adapter import stacked_transform


class Faults(NamedTuple):
  """Down intervals and a message-loss probability (a pytree of arrays).

  Attributes:
    node: int32 (m,), the node of each down interval (a last sentinel interval on node -1
      keeps the arrays non-empty).
    start: float (m,), when each interval begins: the node is down for simulated times in
      ``[start, end)``.
    end: float (m,), when each interval ends (the node is up again at ``end``).
    loss_prob: probability that any one message (or pair exchange) is lost.
  """

  node: jax.Array
  start: jax.Array
  end: jax.Array
  loss_prob: jax.Array


def faults(down: Sequence[tuple[int, float, float]] = (), loss_prob: float = 0.0) -> Faults:
  """Builds a `Faults` from ``(node, start, end)`` down intervals and a loss probability.

  Args:
    down: ``(node, start, end)`` triples: node is down for simulated times in
      ``[start, end)``. A node may have several intervals.
    loss_prob: probability in [0, 1) that any one message (or pair exchange) is lost.

  Returns:
    A `Faults`, to pass to `adpsgd`, `synchronous` or `is_up`.

  Raises:
    ValueError: ``loss_prob`` is outside [0, 1), a node is not a non-negative integer, a
      time is NaN (an ``end`` of ``inf`` is an outage for good), or an interval ends before
      it starts.

  Example:
    >>> import gossipjax as gj
    >>> f = gj.asynchrony.faults(down=[(3, 10.0, 50.0)], loss_prob=0.1)
    >>> gj.asynchrony.is_up(f, 20.0, 4).tolist()
    [True, True, True, False]
  """
  if not 0.0 <= loss_prob < 1.0:
    raise ValueError(f"faults: loss_prob must be in [0, 1), got {loss_prob}")
  dtype = jnp.zeros([]).dtype
  rows = np.asarray(list(down), np.float64).reshape(-1, 3)
  nodes = rows[:, 0]
  bad = ~(np.isfinite(nodes) & (nodes >= 0) & (nodes == np.round(nodes)))
  if bad.any():
    raise ValueError(f"faults: every down interval's node must be a non-negative integer, got {nodes[bad][:5].tolist()}")
  if np.isnan(rows[:, 1:]).any():
    raise ValueError("faults: a down interval's start and end must be numbers, not NaN (an end of inf is for good)")
  if (rows[:, 2] < rows[:, 1]).any():
    raise ValueError("faults: every down interval needs start <= end")
  # A sentinel interval on node -1 keeps the arrays non-empty (no node matches it).
  rows = np.concatenate([rows, [[-1, 0.0, 0.0]]])
  return Faults(jnp.asarray(rows[:, 0], jnp.int32), jnp.asarray(rows[:, 1], dtype),
                jnp.asarray(rows[:, 2], dtype), jnp.asarray(loss_prob, dtype))


def check_fault_nodes(f: Faults | None, num_nodes: int, name: str) -> None:
  """Raises ``ValueError`` when ``f`` puts an outage on a node that is not one of ``num_nodes``."""
  if f is None or isinstance(f.node, jax.core.Tracer):
    return
  nodes = np.asarray(f.node)
  beyond = sorted(set(nodes[nodes >= num_nodes].tolist()))
  if beyond:
    raise ValueError(f"{name}: the faults name node(s) {beyond[:5]}, but the cluster has {num_nodes} nodes "
                     f"(0 to {num_nodes - 1})")


def next_up(f: Faults, t: jax.Array, num_nodes: int) -> jax.Array:
  """The earliest time after ``t`` at which a node that is down at ``t`` comes back (``inf``: none ever does).

  A node's outages that cover ``t`` end at the latest of their ends; the earliest of those
  over the nodes is when the first one rejoins (it may start another outage then).
  """
  down = (f.start <= t) & (t < f.end) & (f.node >= 0)
  ends = jnp.full(num_nodes, -jnp.inf, f.end.dtype).at[jnp.where(down, f.node, num_nodes)].max(f.end, mode="drop")
  return jnp.min(jnp.where(ends > t, ends, jnp.inf))


def is_up(f: Faults, t: jax.Array, num_nodes: int) -> jax.Array:
  """bool (n,): which nodes are up at simulated time ``t`` (O(n + outages)).

  Args:
    f: the faults.
    t: a simulated time (traced or not).
    num_nodes: n.

  Returns:
    A bool (n,) array, False for the nodes inside one of their down intervals at ``t``.

  Example:
    >>> import gossipjax as gj
    >>> f = gj.asynchrony.faults(down=[(1, 0.0, 5.0), (2, 3.0, 4.0)])
    >>> gj.asynchrony.is_up(f, 3.5, 3).tolist(), gj.asynchrony.is_up(f, 5.0, 3).tolist()
    ([True, False, False], [True, True, True])
  """
  down = (f.start <= t) & (t < f.end)
  where = jnp.where(down & (f.node >= 0), f.node, num_nodes)  # num_nodes: out of range, dropped
  return ~jnp.zeros(num_nodes, bool).at[where].set(True, mode="drop")


def down_during(f: Faults, node: jax.Array, t0: jax.Array, t1: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Whether ``node`` was down at some time in ``(t0, t1]``, and the latest end of those outages."""
  hit = (f.node == node) & (f.start <= t1) & (f.end > t0)
  return hit.any(), jnp.max(jnp.where(hit, f.end, t0))


def delivered_edges(f: Faults, key: jax.Array, dst: jax.Array, src: jax.Array, symmetric: bool = True) -> jax.Array:
  """bool, shaped as ``dst``: whether ``src[e]``'s message to ``dst[e]`` got through this round.

  Each link draws its own uniform number from ``key`` and its two end points, so a round
  over a sparse graph draws one number per edge, and the same link gets the same draw
  wherever it is asked for (`delivered_mask` is this function on every pair). With
  ``symmetric`` both directions of a link share one draw: they are lost together.

  Args:
    f: the faults (only ``loss_prob`` is read).
    key: the round's PRNG key.
    dst: int receivers, any shape.
    src: int senders, broadcastable against ``dst``.
    symmetric: whether the two directions of a link share one draw.

  Returns:
    A bool array of the broadcast shape of ``dst`` and ``src``; always True where
    ``dst == src`` (a node's own share is never lost).

  Example:
    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> f = gj.asynchrony.faults(loss_prob=0.5)
    >>> ok = gj.asynchrony.delivered_edges(f, jax.random.key(0), jnp.array([0, 1, 2]), jnp.array([1, 0, 2]))
    >>> bool(ok[0] == ok[1]), bool(ok[2])  # 1 -> 0 and 0 -> 1 share a draw; 2 -> 2 is kept
    (True, True)
  """
  return _delivered(key, f.loss_prob, dst, src, symmetric)


def _delivered(key: jax.Array, loss_prob: jax.Array, dst: Any, src: Any, symmetric: bool = True) -> jax.Array:
  dst, src = jnp.broadcast_arrays(jnp.asarray(dst, jnp.int32), jnp.asarray(src, jnp.int32))
  first, second = (jnp.minimum(dst, src), jnp.maximum(dst, src)) if symmetric else (src, dst)
  loss_prob = jnp.asarray(loss_prob)
  draw = lambda a, b: jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, a), b), dtype=loss_prob.dtype)
  u = jax.vmap(draw)(first.ravel(), second.ravel()).reshape(dst.shape)
  return (u >= loss_prob) | (dst == src)


def delivered_mask(f: Faults, key: jax.Array, num_nodes: int, symmetric: bool = True) -> jax.Array:
  """bool (n, n): entry ``[i, j]`` says j's message to i got through this round.

  The dense view of `delivered_edges` (n^2 draws): for analysis and tests at small n.

  Args:
    f: the faults (only ``loss_prob`` is read).
    key: the round's PRNG key.
    num_nodes: n.
    symmetric: whether the two directions of a link share one draw.

  Returns:
    A bool (n, n) array with a True diagonal; symmetric when ``symmetric`` is.

  Example:
    >>> import jax, gossipjax as gj
    >>> f = gj.asynchrony.faults(loss_prob=0.5)
    >>> mask = gj.asynchrony.delivered_mask(f, jax.random.key(0), 4)
    >>> bool((mask == mask.T).all()), bool(mask.diagonal().all())
    (True, True)
  """
  nodes = jnp.arange(num_nodes)
  return delivered_edges(f, key, nodes[:, None], nodes[None, :], symmetric)


def renormalize(w: jax.Array, up: jax.Array, delivered: jax.Array | None = None) -> jax.Array:
  r"""``W'``: the mixing matrix without down nodes and lost messages, rows renormalized.

  Drops the entries of down nodes and lost messages, and gives each row's lost weight back
  to its diagonal (rows still sum to one; a down node's row is the identity).

  Dense, for analysis and as the reference of `faulty_mix`, which applies the same W' on
  the sparse plans:

  .. math::
    W'_{ij} = W_{ij}\, \mathrm{up}_i\, \mathrm{up}_j\, \mathrm{delivered}_{ij} \ (i \ne j),
    \qquad W'_{ii} = 1 - \sum_{j \ne i} W'_{ij}.

  Args:
    w: the (n, n) mixing matrix (rows receive).
    up: bool (n,), which nodes are up.
    delivered: bool (n, n), ``[i, j]``: j's message to i got through (`delivered_mask`);
      ``None``: every message of the live nodes does.

  Returns:
    ``W'`` (n, n), row stochastic.

  Example:
    Node 2 of three fully connected nodes is down:

    >>> import jax.numpy as jnp, numpy as np, gossipjax as gj
    >>> w = jnp.full((3, 3), 1 / 3)
    >>> print(np.round(np.asarray(gj.asynchrony.renormalize(w, jnp.array([True, True, False]))), 3))
    [[0.667 0.333 0.   ]
     [0.333 0.667 0.   ]
     [0.    0.    1.   ]]
  """
  n = w.shape[0]
  keep = (up[:, None] & up[None, :]) & ~jnp.eye(n, dtype=bool)
  if delivered is not None:
    keep = keep & delivered
  off = jnp.where(keep, w, 0.0)
  return off + jnp.diag(1.0 - off.sum(axis=1))


class FaultyMixState(NamedTuple):
  """State of `faulty_mix`: the step count, one value for every node, which picks W(k)."""

  shared_over_nodes = ("count",)  # the step count every node holds alike (it picks W(k))

  count: jax.Array


def faulty_mix(topology: Any) -> optax.GradientTransformationExtraArgs:
  r"""``gj.mix`` that tolerates down nodes and lost messages, on the topology's sparse plans.

  With ``up`` (bool (n,)) passed to ``update`` as a keyword argument, and the lost messages
  given either as ``loss_key`` and ``loss_prob`` (each link's fate drawn by
  `delivered_edges`; what `gj.asynchrony.synchronous` passes) or as a dense ``delivered``
  (bool (n, n), small n), a down node keeps its params (its update is dropped) and the live
  nodes mix with the renormalized matrix of `renormalize`:

  .. math:: x^{k+1} = W'^{(k)} (x^k + \mathrm{diag}(\mathrm{up})\, u^k)

  Without them it is ``x^{k+1} = W^{(k)}(x^k + u^k)``, the rule of ``gj.mix``.
  ``chain(scale_by_learning_rate(lr), faulty_mix(W))`` is D-PSGD with faults. A step costs
  O(degree * n * d) and draws one number per edge, as the exchange rounds do. It mixes
  through the kernel of the simulate backend's tables, under the same rules as ``gj.mix``:
  16-bit floats are summed in float32 and rounded once, and a leaf that is not a float (a
  step counter) is neither mixed nor moved (its incoming update is passed on).

  Args:
    topology: a ``gj.topology`` (or a matrix / networkx graph), possibly time-varying.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` needs ``params`` and
    takes ``up``, ``delivered``, ``loss_key`` and ``loss_prob`` as keyword arguments.

  Example:
    Node 2 is down: its update is dropped and the other two mix without it.

    >>> import jax.numpy as jnp, gossipjax as gj
    >>> tx = gj.asynchrony.faulty_mix(jnp.full((3, 3), 1 / 3))
    >>> x = jnp.array([[0.0], [3.0], [6.0]])
    >>> u, _ = tx.update(jnp.ones_like(x), tx.init(x), x, up=jnp.array([True, True, False]))
    >>> [round(float(v), 4) for v in (x + u)[:, 0]]
    [2.0, 3.0, 6.0]
  """
  table = plan_table(topology)
  period, _, n = table.src.shape

  def init_fn(params):
    del params
    return FaultyMixState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, *, up=None, delivered=None, loss_key=None, loss_prob=None, **extra):
    del extra
    if params is None:
      raise ValueError("faulty_mix needs params")
    up = jnp.ones(n, bool) if up is None else up
    k = state.count % period
    # The weights stay in the table's float dtype; the kernel casts them to each leaf's sum dtype.
    src, weight = jnp.asarray(table.src)[k], jnp.asarray(table.weight)[k]
    receiver = jnp.arange(n)
    keep = up[None, :] & up[src] & (weight != 0) & (src != receiver[None, :])
    if delivered is not None:
      keep = keep & delivered[receiver[None, :], src]
    elif loss_key is not None:
      keep = keep & _delivered(loss_key, jnp.asarray(loss_prob, weight.dtype), receiver[None, :], src)
    coef = jnp.where(keep, weight, 0.0)
    self_coef = 1.0 - coef.sum(axis=0)

    def leaf(x, u):
      x_half = x + jnp.where(up.reshape((n,) + (1,) * (u.ndim - 1)), u, jnp.zeros_like(u))
      return (mix_from_table(self_coef, src, coef, x_half) - x).astype(x.dtype)

    return jax.tree.map(leaf, params, updates), FaultyMixState(count=jnp.asarray(optax.safe_increment(state.count)))

  # Its own code reads the node axis (which nodes are up, who sent what): inside gj.chain it
  # runs on the stacked nodes as a collective.
  return stacked_transform(float_leaves_only(optax.GradientTransformationExtraArgs(init_fn, update_fn),
                                             keep_other_updates=True), "ga.faulty_mix")
