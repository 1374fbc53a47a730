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

from gossipjax.backend import Backend, simulate
from gossipjax.backend._base import current
from gossipjax.backend._cpu_threads import check_placed_threads
from gossipjax._axis import mapping
from gossipjax.backend._precision import accumulation_dtype as accumulation_dtype  # the algorithms sum through here
from gossipjax.mixing._node_mixer import NodeMixer
from gossipjax.topology import as_topology
from gossipjax.topology._topology import Stochasticity


def next_count(count: jax.Array) -> jax.Array:
  """``count + 1`` for a transform's step counter, held at the dtype's maximum as optax holds it."""
  return jnp.asarray(optax.safe_increment(count))


def resolve_backend(backend: Backend | None) -> Backend:
  """The backend a transform runs on: the one given, else the innermost ``gj.backend.use`` block's, else simulate.

  Args:
    backend: a backend (``gj.backend.*`` or any class with ``mixer``, ``mean``,
      ``local_nodes`` and ``map``), or ``None``.

  Returns:
    ``backend``; for ``None``, the backend of the enclosing ``with gj.backend.use(...)``
    block, or a new ``gj.backend.simulate()``.

  Raises:
    TypeError: ``backend`` lacks a method of the backend protocol.

  Example:
    >>> import gossipjax as gj
    >>> gj.mixing.resolve_backend(None)
    Simulate()
  """
  if backend is None:
    backend = current()
    return simulate() if backend is None else backend
  if not isinstance(backend, Backend):
    raise TypeError(f"gj: backend={backend!r} is not a backend: it needs the methods mixer, mean, local_nodes and "
                    "map (gj.backend.simulate(), sharded(mesh), pmapped(), mpi(), or a class of your own)")
  return backend


def make_mixer(topology: Any, backend: Backend | None = None, stochastic: Stochasticity = "doubly", *,
               name: str | None = None, connected: bool = True) -> NodeMixer:
  """Validates the topology for what the algorithm needs and builds the backend's mixer.

  How an algorithm gets its gossip step: it calls ``make_mixer`` once, when the transform
  is built, and ``mixer.mix(tree, step)`` in its ``update``; it never imports a backend.

  Args:
    topology: a ``gj.topology`` topology, a dense matrix or a networkx graph.
    backend: where the nodes live (default: ``gj.backend.simulate()``).
    stochastic: what the algorithm needs of W: ``"doubly"`` (rows and columns sum to 1,
      gossip averaging), ``"column"`` (push-sum, as `gj.sgp`), ``"row"`` or ``"none"``.
    name: the public name of the transform being built (``"gj.my_method"``); a refusal
      starts with it, as the library's own transforms' do.
    connected: require the graph to be connected over its period. A method that splits its
      graph into parts, each mixed alone (`gj.choco_sgd` on a time-varying graph mixes the
      rounds of the union graph one at a time), passes ``False`` for the parts.

  Returns:
    The backend's `Mixer` for the validated topology, as a `NodeMixer`: on stacked trees its
    ``mix`` is the backend's; inside ``gj.nodes`` (one node) it is a collective over the
    node axis that the mapping binds (gossipjax's own axis, not a string name, so an axis
    of the user's named ``"nodes"`` is never taken for it), implemented by the same stacked
    mixer.

  Raises:
    ValueError: the topology is not ``stochastic`` as asked, or not connected.

  Example:
    >>> import jax.numpy as jnp, gossipjax as gj
    >>> mixer = gj.mixing.make_mixer(gj.topology.ring(4))
    >>> mixer.local_nodes
    4
    >>> [round(float(v), 4) for v in mixer.mix(jnp.arange(4.0), 0)]  # W(0) x
    [1.3333, 1.0, 2.0, 1.6667]
  """
  try:
    topo = as_topology(topology).check(stochastic=stochastic, connected=connected)
  except (TypeError, ValueError) as e:
    if name is None:
      raise
    raise type(e)(f"{name}: {e}") from e
  backend = resolve_backend(backend)
  return NodeMixer(backend.mixer(topo), backend, name or "gj.mixing.make_mixer")


def _is_float(leaf: Any) -> bool:
  dtype = getattr(leaf, "dtype", None)
  return dtype is None or jnp.issubdtype(dtype, jnp.inexact)


def float_leaves_only(tx: optax.GradientTransformation,
                      keep_other_updates: bool = False) -> optax.GradientTransformationExtraArgs:
  """``tx`` on the floating-point leaves of the params; integer, bool and PRNG-key leaves are left alone.

  Such a leaf (a step counter, a flax RNG count) is not a quantity to average: gossip
  would mix node i's counter with its neighbours', and a method that divides by the
  learning rate turns it into garbage. It is neither mixed nor kept in ``tx``'s state.
  Its update is zero, or with ``keep_other_updates`` the incoming update passed on
  unchanged (for transforms of updates, such as ``mix``, that sit inside a chain, as
  optax's own transforms leave it to the chain). Params with only floating-point
  leaves go to ``tx`` as they are, so its state is unchanged.

  Args:
    tx: an optax transform over node-stacked params.
    keep_other_updates: pass the incoming update of a non-float leaf on unchanged,
      instead of zeroing it.

  Returns:
    A transform with extra-args support that runs ``tx`` on the float leaves only.

  Example:
    >>> import jax.numpy as jnp, optax, gossipjax as gj
    >>> tx = gj.mixing.float_leaves_only(optax.scale(-1.0))
    >>> params = {"w": jnp.ones((4, 2)), "step": jnp.zeros((4,), jnp.int32)}
    >>> u, _ = tx.update(params, tx.init(params), params)
    >>> u["w"][0].tolist(), u["step"].tolist()
    ([-1.0, -1.0], [0, 0, 0, 0])
  """
  tx = optax.with_extra_args_support(tx)

  def all_float(tree):
    return all(_is_float(x) for x in jax.tree.leaves(tree))

  def mask(tree, like):
    return jax.tree.map(lambda p, x: x if _is_float(p) else optax.MaskedNode(), like, tree)

  def init_fn(params):
    # The first look at the params as the user placed them: on several CPU devices, every step is a
    # program over them, refused here where the client lacks the threads (not a deadlock 32 steps on).
    check_placed_threads(params, "gj: tx.init")
    return tx.init(params if all_float(params) else mask(params, params))

  def update_fn(updates, state, params=None, **extra_args):
    like = updates if params is None else params
    _check_state(state, like)
    if all_float(like):
      return tx.update(updates, state, params, **extra_args)
    new, state = tx.update(mask(updates, like), state, None if params is None else mask(params, like), **extra_args)

    def fill(p, new, old):
      if _is_float(p):
        return new
      return old if keep_other_updates else jnp.zeros_like(p)

    return jax.tree.map(fill, like, new, updates), state

  def _check_state(state, like):
    """A state made by another transform's ``init`` is refused in one line (not an AttributeError later)."""
    if mapping() is not None:
      return  # gj.nodes has checked the whole state
    made = jax.eval_shape(init_fn, like)
    if jax.tree.structure(state) != jax.tree.structure(made):
      raise ValueError(f"gj: the state passed to update is a {type(state).__name__} that this transform's init did "
                       f"not make (it makes a {type(made).__name__} of another structure); pass the state that "
                       "tx.init returned")

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
