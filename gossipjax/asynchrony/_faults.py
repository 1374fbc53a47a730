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
import jax.numpy as jnp
import numpy as np
import optax

from gossipjax.topology import as_topology


class Faults(NamedTuple):
  """Down intervals and a message-loss probability (a pytree of arrays).

  Attributes:
    node: int32 (m,), the node of each down interval.
    start, end: float (m,), the node is down for simulated times in ``[start, end)``.
    loss_prob: probability that any one message (or pair exchange) is lost.
  """

  node: jax.Array
  start: jax.Array
  end: jax.Array
  loss_prob: jax.Array


def faults(down: Sequence[tuple[int, float, float]] = (), loss_prob: float = 0.0) -> Faults:
  """Builds a `Faults` from ``(node, start, end)`` down intervals and a loss probability.

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
  if (rows[:, 2] < rows[:, 1]).any():
    raise ValueError("faults: every down interval needs start <= end")
  # A sentinel interval on node -1 keeps the arrays non-empty (no node matches it).
  rows = np.concatenate([rows, [[-1, 0.0, 0.0]]])
  return Faults(jnp.asarray(rows[:, 0], jnp.int32), jnp.asarray(rows[:, 1], dtype),
                jnp.asarray(rows[:, 2], dtype), jnp.asarray(loss_prob, dtype))


def is_up(f: Faults, t: jax.Array, num_nodes: int) -> jax.Array:
  """bool (n,): which nodes are up at simulated time ``t``."""
  down = (f.start <= t) & (t < f.end)
  hit = (f.node[None, :] == jnp.arange(num_nodes)[:, None]) & down[None, :]
  return ~hit.any(axis=1)


def down_during(f: Faults, node: jax.Array, t0: jax.Array, t1: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Whether ``node`` was down at some time in ``(t0, t1]``, and the latest end of those outages."""
  hit = (f.node == node) & (f.start <= t1) & (f.end > t0)
  return hit.any(), jnp.max(jnp.where(hit, f.end, t0))


def delivered_mask(f: Faults, key: jax.Array, num_nodes: int, symmetric: bool = True) -> jax.Array:
  """bool (n, n): entry ``[i, j]`` says j's message to i got through this round."""
  ok = jax.random.uniform(key, (num_nodes, num_nodes)) >= f.loss_prob
  if symmetric:
    ok = jnp.triu(ok, 1)
    ok = ok | ok.T
  return ok | jnp.eye(num_nodes, dtype=bool)


def renormalize(w: jax.Array, up: jax.Array, delivered: jax.Array | None = None) -> jax.Array:
  """``W'``: drops the entries of down nodes and lost messages, and gives each row's lost
  weight back to its diagonal (rows still sum to one; a down node's row is the identity)."""
  n = w.shape[0]
  keep = (up[:, None] & up[None, :]) & ~jnp.eye(n, dtype=bool)
  if delivered is not None:
    keep = keep & delivered
  off = jnp.where(keep, w, 0.0)
  return off + jnp.diag(1.0 - off.sum(axis=1))


def faulty_mix(topology: Any) -> optax.GradientTransformationExtraArgs:
  r"""``gj.mix`` that tolerates down nodes and lost messages (dense, for simulation).

  With ``up`` (bool (n,)) and ``delivered`` (bool (n, n)) passed to ``update`` as keyword
  arguments, a down node keeps its params (its update is dropped) and the live nodes mix
  with the renormalized matrix of `renormalize`:

  .. math:: x^{k+1} = W'^{(k)} (x^k + \mathrm{diag}(\mathrm{up})\, u^k)

  Without them it is ``x^{k+1} = W^{(k)}(x^k + u^k)``, the rule of ``gj.mix``.
  ``chain(scale_by_learning_rate(lr), faulty_mix(W))`` is D-PSGD with faults.

  Args:
    topology: a ``gj.topology`` (or a matrix / networkx graph), possibly time-varying.
  """
  topo = as_topology(topology)
  mats = np.stack([topo.matrix(k) for k in range(topo.period)])

  def init_fn(params):
    del params
    return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, *, up=None, delivered=None, **extra):
    del extra
    if params is None:
      raise ValueError("faulty_mix needs params")
    n = mats.shape[1]
    up = jnp.ones(n, bool) if up is None else up
    w = jnp.asarray(mats)[state.count % mats.shape[0]]
    w = renormalize(w.astype(jnp.result_type(*jax.tree.leaves(params))), up, delivered)

    def leaf(x, u):
      u = jnp.where(up.reshape((n,) + (1,) * (u.ndim - 1)), u, jnp.zeros_like(u))
      x_half = x + u
      mixed = jnp.tensordot(w, x_half, axes=1)
      return (mixed - x).astype(x.dtype)

    return jax.tree.map(leaf, params, updates), optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
