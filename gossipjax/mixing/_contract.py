"""The contract between algorithms and backends.

An algorithm turns its topology into a mixer with `make_mixer` and calls ``mixer.mix``;
per-node work and the all-reduce mean come from the backend object it was given
(`resolve_backend`). It never imports a backend: which one runs is the caller's choice.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from gossipjax.backend import Backend, Mixer, simulate
from gossipjax.topology import as_topology
from gossipjax.topology._topology import Stochasticity


def resolve_backend(backend: Backend | None) -> Backend:
  """The backend a transform runs on: the one given, else ``gj.backend.simulate()``."""
  return simulate() if backend is None else backend


def make_mixer(topology: Any, backend: Backend | None = None, stochastic: Stochasticity = "doubly") -> Mixer:
  """Validates the topology for what the algorithm needs and builds the backend's mixer."""
  topo = as_topology(topology).check(stochastic=stochastic)
  return resolve_backend(backend).mixer(topo)


def _is_float(leaf: Any) -> bool:
  dtype = getattr(leaf, "dtype", None)
  return dtype is None or jnp.issubdtype(dtype, jnp.inexact)


def float_leaves_only(tx: optax.GradientTransformation, keep_other_updates: bool = False
                      ) -> optax.GradientTransformationExtraArgs:
  """``tx`` on the floating-point leaves of the params; integer, bool and PRNG-key leaves are left alone.

  Such a leaf (a step counter, a flax RNG count) is not a quantity to average: gossip
  would mix node i's counter with its neighbours', and a method that divides by the
  learning rate turns it into garbage. It is neither mixed nor kept in ``tx``'s state.
  Its update is zero, or with ``keep_other_updates`` the incoming update passed on
  unchanged (for transforms of updates, such as ``mix``, that sit inside a chain, as
  optax's own transforms leave it to the chain). Params with only floating-point
  leaves go to ``tx`` as they are, so its state is unchanged.
  """
  tx = optax.with_extra_args_support(tx)

  def all_float(tree):
    return all(_is_float(x) for x in jax.tree.leaves(tree))

  def mask(tree, like):
    return jax.tree.map(lambda p, x: x if _is_float(p) else optax.MaskedNode(), like, tree)

  def init_fn(params):
    return tx.init(params if all_float(params) else mask(params, params))

  def update_fn(updates, state, params=None, **extra_args):
    like = updates if params is None else params
    if all_float(like):
      return tx.update(updates, state, params, **extra_args)
    new, state = tx.update(mask(updates, like), state, None if params is None else mask(params, like), **extra_args)

    def fill(p, new, old):
      if _is_float(p):
        return new
      return old if keep_other_updates else jnp.zeros_like(p)

    return jax.tree.map(fill, like, new, updates), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
