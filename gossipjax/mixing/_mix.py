"""``mix``: the gossip step as an optax transform."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gossipjax._guard import SkipNodes, zero_skipped
from gossipjax._validation import check_node_axis, check_period, require_params
from gossipjax.mixing._contract import float_leaves_only, make_mixer, next_count
from gossipjax.backend._base import Backend


class MixState(NamedTuple):
  """State of `mix`.

  Attributes:
    count: int32 scalar, the number of steps taken; selects W(k) for time-varying
      topologies (gossip round ``count // every``).

  The class attribute ``zeroes_skipped_nodes = True`` tells ``gj.guard_finite`` that `mix`
  zeroes the local update of the nodes it skips before mixing (see ``gj.SkipNodes``).
  """

  shared_over_nodes = ("count",)  # the step count every node holds alike (it picks W(k) and the rounds)

  count: jax.Array  # steps taken; selects W(k) for time-varying topologies

  zeroes_skipped_nodes = True  # tells gj.guard_finite that mix zeroes its skipped nodes' local updates
  # Sends the params' entry in place of a non-finite entry of x + u: a per-node gate around it
  # (optax.apply_if_finite inside gj.chain) keeps a skipped node's NaN from its neighbours.
  guards_what_it_sends = True


def _as(x: jax.Array, dtype: Any) -> jax.Array:
  return x if x.dtype == dtype else x.astype(dtype)


def _add(x: jax.Array, u: jax.Array) -> jax.Array:
  """``x + u`` with JAX's promotion; one primitive to trace where the dtypes agree (the common case)."""
  return lax.add(x, u) if x.dtype == u.dtype and jnp.shape(x) == jnp.shape(u) else x + u


def _gossip_round(mix: Any, tree: tuple[Any, Any], step: Any) -> Any:
  """``W(x + u) - x`` over node-stacked ``(x, u)``, rounded to x's dtype.

  A non-finite entry of ``x + u`` is sent as x's and kept in the node's own step, so a NaN
  never reaches a neighbour (and a per-node gate such as ``apply_if_finite`` still sees it).
  Entry by entry: no reduction over a node that spans devices.
  """
  params, updates = tree
  x_half = jax.tree.map(_add, params, updates)
  finite = jax.tree.map(lax.is_finite, x_half)
  sent = jax.tree.map(lambda x, h, f: lax.select(f, h, _as(x, h.dtype)), params, x_half, finite)
  mixed = mix(sent, step)
  return jax.tree.map(lambda m, x, h, f: lax.sub(lax.select(f, _as(m, x.dtype), _as(h, x.dtype)), x),
                      mixed, params, x_half, finite)


def mix(topology: Any, every: int = 1, *, backend: Backend | None = None) -> optax.GradientTransformationExtraArgs:
  r"""Turns a local update ``u`` into a gossiped one: ``u' = W(x + u) - x``.

  Applied after a local optimizer, ``x + u' = W(x + u)``: every node takes its local step,
  then averages with its neighbours. Where ``mix`` sits in an ``optax.chain`` is the
  algorithm: ``chain(trace(beta), scale(-lr), mix(W))`` is DmSGD and
  ``chain(adam(lr), mix(W))`` is decentralized Adam.

  .. math:: x^{k+1} = W^{(k)} (x^k + u^k)

  Args:
    topology: a ``gj.topology`` (doubly stochastic), a dense matrix or a networkx graph.
    every: a positive integer: gossip every ``every`` steps and apply ``u`` locally in between (local SGD);
      W advances one step of its period per gossip round. Under
      ``optax.inject_hyperparams`` it may be a traced integer (it can change between steps).
    backend: where the nodes live (default: ``gj.backend.simulate()``).

  A non-finite entry of ``x + u`` (a NaN or inf in a node's ``u``) is sent as the entry of
  ``x`` and kept in that node's own step (``x + u - x``), so a NaN never reaches a neighbour; a per-node
  gate around the method (``optax.apply_if_finite`` inside ``gj.chain``) then skips that node.

  Under ``gj.guard_finite`` the update takes the extra arg ``skip_nodes`` (a
  ``gj.SkipNodes``): those nodes' local updates are zeroed before mixing (they send their
  current params and receive their neighbours'). `MixState` declares it
  (``zeroes_skipped_nodes``), which is how the guard knows.

  Returns:
    An optax transform of updates (its ``update`` needs ``params``) whose state is a
    `MixState`; non-float leaves' updates pass through unchanged. The update is the mixed
    model rounded once to the params' dtype, minus ``x``: an update wider than the params
    (a float32 momentum for bfloat16 params) is mixed in its own dtype.

  Example:
    >>> import jax.numpy as jnp, optax, gossipjax as gj
    >>> tx = gj.chain(optax.sgd(0.1), gj.mix(gj.topology.ring(4)))
    >>> x = jnp.arange(4.0)[:, None]
    >>> u, _ = tx.update(jnp.zeros_like(x), tx.init(x), x)
    >>> [round(float(v), 4) for v in (x + u).ravel()]  # each node: mean of itself and its two ring neighbours
    [1.3333, 1.0, 2.0, 1.6667]

  References:
    Lian, Zhang, Zhang, Hsieh, Zhang, Liu (2017), Can Decentralized Algorithms Outperform
    Centralized Algorithms? A Case Study for Decentralized Parallel Stochastic Gradient
    Descent, NeurIPS (``chain(sgd(lr), mix(W))`` is its D-PSGD).

    Xiao, Boyd (2004), Fast Linear Iterations for Distributed Averaging, Systems & Control
    Letters 53(1).
  """
  return mix_named("gj.mix", topology, every, backend)


def mix_named(name: str, topology: Any, every: int = 1,
              backend: Backend | None = None) -> optax.GradientTransformationExtraArgs:
  """`mix`, with ``name`` (the public function called, e.g. ``"gj.gossip_sgd"``) in its error messages."""
  period = check_period(every, name)
  mixer = make_mixer(topology, backend, name=name)

  def init_fn(params):
    del params
    return MixState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, skip_nodes: SkipNodes | None = None, **extra_args):
    del extra_args
    require_params(params, name)
    check_node_axis(params, mixer.local_nodes, name, mixer.topology.name)
    updates = zero_skipped(updates, skip_nodes)

    def gossip(params, updates):
      return mixer.call_stacked(_gossip_round, (params, updates), state.count // period, lambda t: t[0])

    if isinstance(period, int) and period == 1:
      new_updates = gossip(params, updates)
    else:
      local = jax.tree.map(lambda u, x: u.astype(x.dtype), updates, params)  # both branches: params' dtypes
      new_updates = lax.cond(state.count % period == period - 1, gossip, lambda *_: local, params, updates)
    return new_updates, MixState(count=next_count(state.count))

  return float_leaves_only(optax.GradientTransformationExtraArgs(init_fn, update_fn), keep_other_updates=True)
