"""`gj.nodes`: a one-node optax transform mapped over node-stacked trees, the node axis named."""

from __future__ import annotations

from typing import Any

import jax
import jax.core  # jax.core.Tracer: a type checker sees the submodule only where it is imported
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from gossipjax._axis import AXIS, Mapping, mapped, mapping
from gossipjax.backend._base import mesh_of_explicit
from gossipjax.backend._sharded import conform, leaf_spec
from gossipjax.mixing import follow_placement, resolve_backend
from gossipjax.mixing._named import varies_over_nodes

def _leading(tree: Any, where: str) -> int:
  """The node count of a node-stacked tree (its leaves' common leading axis)."""
  sizes = {int(jnp.shape(x)[0]) if jnp.ndim(x) else None for x in jax.tree.leaves(tree)}
  if not sizes:
    raise ValueError(f"{where}: the params have no leaves")
  if None in sizes or len(sizes) != 1:
    path, leaf = next((p, x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
                      if not jnp.ndim(x) or jnp.shape(x)[0] != max(s or 0 for s in sizes))
    got = "no node axis (a scalar)" if not jnp.ndim(leaf) else f"a leading axis of {jnp.shape(leaf)[0]}"
    raise ValueError(f"{where}: leaf {jax.tree_util.keystr(path) or '<root>'} has {got}, where the others have "
                     f"{max(s or 0 for s in sizes)} nodes; stack every node's values on axis 0 (gj.init_nodes)")
  (n,) = sizes
  assert n is not None
  return n


def _materialize(params: Any) -> Any:
  """Zeros for abstract leaves (``jax.ShapeDtypeStruct``), placed as their sharding says."""

  def leaf(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      return jnp.zeros(x.shape, x.dtype, device=x.sharding)
    return x

  return jax.tree.map(leaf, params)


def _mesh_of(backend: Any) -> Any:
  mesh = getattr(backend, "mesh", None)
  return mesh if isinstance(mesh, jax.sharding.Mesh) else None


def _axes(flags: list[bool], treedef: Any) -> Any:
  return jax.tree.unflatten(treedef, [0 if f else None for f in flags])


def nodes(tx: optax.GradientTransformation, *, backend: Any = None,
          where: str = "gj.nodes") -> optax.GradientTransformationExtraArgs:
  """Maps a one-node optax transform over node-stacked trees, with the node axis named ``"nodes"``.

  ``tx`` is written for one node: any optax transform or combinator (``optax.chain``,
  ``masked``, ``inject_hyperparams``, ``MultiSteps``, ``apply_if_finite``, ...) around or
  inside gossipjax's own. Communication is a collective over the axis ``"nodes"``: inside
  the mapping `gj.mix` and the methods' gossip rounds exchange with the neighbours, and the
  all-reduce methods take the mean over all nodes. Everything else runs on each node alone,
  so ``clip_by_global_norm`` clips each node by its own norm and ``apply_if_finite`` skips
  only the node whose gradient is NaN.

  The mapped transform takes and returns stacked trees (a leading node axis on every leaf),
  as every gossipjax transform does. Its state stacks what differs from node to node
  (moments, trackers) on the node axis and keeps what every node holds alike (a step count,
  an injected hyperparameter) as one value, as optax's own state would be. A value given to
  ``optax.tree_utils.tree_set`` may be a scalar (every node takes it) or have shape (n,)
  (one per node); extra arguments of ``update`` with a leading axis of n are per node, the
  rest shared.

  How the nodes are mapped: ``jax.vmap(..., axis_name="nodes")`` over the arrays the
  backend's transforms see (all n nodes when simulating or sharded, where the compiler keeps
  each node's work on its device; a rank's own nodes under MPI; a device's block inside a
  ``jax.pmap``, where the node axis is left unnamed if the pmap axis is itself named
  ``"nodes"``); the collectives run the backend's stacked mixer and mean.

  Args:
    tx: an optax transform written for one node's params.
    backend: where the nodes live (default: the ``gj.backend.use`` block's, else simulate);
      every gossipjax transform inside ``tx`` must have been built for the same one.
    where: the public name used in error messages.

  Returns:
    An optax transform over node-stacked trees. Called for one node (inside another
    mapping) it is ``tx`` itself.

  Raises:
    ValueError: a leaf lacks the node axis, a state was not made by this transform's
      ``init``, or a transform inside was built for another backend.

  Example:
    >>> import jax.numpy as jnp, optax, gossipjax as gj
    >>> W = gj.topology.complete(2)
    >>> mask = {"w": True, "b": False}  # gossip the kernel only
    >>> tx = gj.nodes(optax.chain(optax.sgd(1.0), optax.masked(gj.mix(W), mask)))
    >>> x = {"w": jnp.zeros((2, 2)), "b": jnp.zeros((2, 1))}
    >>> g = {"w": jnp.array([[1.0, 1.0], [3.0, 3.0]]), "b": jnp.array([[1.0], [3.0]])}
    >>> u, _ = tx.update(g, tx.init(x), x)
    >>> u["w"].tolist(), u["b"].tolist()  # w averaged over both nodes, b local
    ([[-2.0, -2.0], [-2.0, -2.0]], [[-1.0], [-3.0]])
  """
  if not _is_transform(tx):
    raise TypeError(f"{where}: expected an optax transform, got {tx!r}"
                    + (" (a function: call it, e.g. optax.adam(1e-3))" if callable(tx) else ""))
  backend = resolve_backend(backend)
  inner = optax.with_extra_args_support(tx)
  mesh = _mesh_of(backend)

  compiled: dict[Any, Any] = {}
  # The node axis is named "nodes" for the user's own collectives, unless the backend's exchanges
  # already run over an enclosing axis of that name (a pmap's): an inner name would hide it.
  axis_name = None if getattr(backend, "axis_name", None) == AXIS else AXIS

  def place(args, in_axes):
    """On a mesh, every mapped leaf laid out over the node axis (vmap wants them alike)."""
    if mesh is None:
      return args
    axis, where_ = getattr(backend, "axis", AXIS), f"{where} on {backend!r}"

    def put(a, sub):
      if a is None:
        return sub
      return jax.tree.map(lambda x: conform(x, mesh, leaf_spec(x, mesh, axis, where_) or P(axis)), sub)

    return tuple(jax.tree.map(put, a, arg, is_leaf=lambda v: v is None) for a, arg in zip(in_axes, args))

  def run(fn, in_axes, out_axes, args, n) -> Any:
    def one(index, *a):
      with mapped(Mapping(backend, n, where, index)):
        return fn(*a)

    in_axes = tuple(in_axes) if isinstance(in_axes, tuple) else (in_axes,) * len(args)
    args = place(args, in_axes)
    call = jax.vmap(one, in_axes=(0, *in_axes), out_axes=out_axes, axis_name=axis_name)
    # Each node's index on the mapped axis, placed like the nodes (lax.axis_index would be an
    # unplaced iota, which an Explicit mesh refuses to mix with the node-sharded values).
    like = next((x for x in jax.tree.leaves(args) if jnp.ndim(x) and jnp.shape(x)[0] == n), None)
    index = follow_placement(jnp.arange(n, dtype=jnp.int32), like) if like is not None else jnp.arange(n)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
      return call(index, *args)  # inside the caller's jit (or eval_shape): traced once with it
    # Called eagerly: one compiled program per layout, not op by op at every call. On an
    # Explicit mesh vmap's broadcasts of per-node values are placed through the mesh context.
    is_axis = lambda a: a is None
    flat = lambda axes: (tuple(jax.tree.leaves(axes, is_leaf=is_axis)), jax.tree.structure(axes, is_leaf=is_axis))
    key = (fn, flat(in_axes), flat(out_axes), n)
    jitted = compiled.get(key)
    if jitted is None:
      jitted = compiled[key] = jax.jit(call)
    with mesh_of_explicit(mesh, args):
      out = jitted(index, *args)
    return out

  def flags_of(fn, in_axes, args, n, part=lambda out: out):
    """Which leaves of ``part(fn(...))`` vary over the nodes (traced once, abstractly)."""
    found: list[bool] = []

    def probe(*a):
      out = fn(*a)
      found.extend(varies_over_nodes(part(out)))
      return out

    jax.eval_shape(lambda *a: run(probe, in_axes, 0, a, n), *args)
    return found

  def init_state(params, n):
    flags = flags_of(inner.init, 0, (params,), n)
    treedef = jax.tree.structure(jax.eval_shape(lambda p: run(inner.init, 0, 0, (p,), n), params))
    layout = flags
    # A leaf shared at init that the first update makes per node (apply_if_finite's counters)
    # is stacked from the start, so the state keeps one structure from step to step.
    for _ in range(3):
      state = jax.eval_shape(lambda p, lay=layout: run(inner.init, 0, _axes(lay, treedef), (p,), n), params)
      try:
        grown = _update_flags(params, state, params, {}, n)[1]
      except Exception:  # noqa: BLE001 - an update that needs extra args cannot be traced here
        break
      merged = [a or b for a, b in zip(layout, grown)]
      if merged == layout:
        break
      layout = merged
    return run(inner.init, 0, _axes(layout, treedef), (params,), n)

  def init_fn(params):
    if mapping() is not None:
      return inner.init(params)
    params = _materialize(params)
    n = _leading(params, where)
    try:
      # The per-node state sits where the params' nodes sit (an Auto mesh's compiler would
      # otherwise be free to put all of it on one device).
      return follow_placement(init_state(params, n), params)
    except TypeError as e:
      raise TypeError(f"{where}: the state of this transform cannot be stacked over nodes ({str(e).splitlines()[0]}); "
                      "a transform mapped over nodes needs a state whose leaves are arrays") from e

  def state_axes(state, params, n):
    full = jax.eval_shape(lambda p: run(inner.init, 0, 0, (p,), n), params)
    if jax.tree.structure(state) != jax.tree.structure(full):
      raise ValueError(f"{where}: this state was not made by this transform's init (its structure differs: "
                       f"{_short(jax.tree.structure(state))} against {_short(jax.tree.structure(full))}); "
                       "pass the state that tx.init returned")

    def axis(path, x, f):
      shape = tuple(jnp.shape(x))
      if shape == tuple(f.shape):
        return 0
      if shape == tuple(f.shape[1:]):
        return None
      raise ValueError(f"{where}: state leaf {jax.tree_util.keystr(path)} has shape {shape}; expected "
                       f"{tuple(f.shape)} (one value per node) or {tuple(f.shape[1:])} (one for every node)")

    return jax.tree_util.tree_map_with_path(axis, state, full)

  def step(updates, state, params, extra):
    return inner.update(updates, state, params, **extra)

  def _update_flags(updates, state, params, extra, n):
    axes_s = state_axes(state, updates if params is None else params, n)
    axes_e = jax.tree.map(lambda x: 0 if jnp.ndim(x) and jnp.shape(x)[0] == n else None, extra)
    in_axes = (0, axes_s, None if params is None else 0, axes_e)
    return in_axes, flags_of(step, in_axes, (updates, state, params, extra), n, part=lambda out: out[1])

  def update_fn(updates, state, params=None, **extra_args):
    if mapping() is not None:
      return inner.update(updates, state, params, **extra_args)
    n = _leading(updates, where)
    in_axes, flags = _update_flags(updates, state, params, extra_args, n)
    shared_in = [a is None for a in jax.tree.leaves(in_axes[1], is_leaf=lambda a: a is None)]
    out_state = [0 if f or not s else None for f, s in zip(flags, shared_in)]
    out_axes = (0, jax.tree.unflatten(jax.tree.structure(state), out_state))
    return run(step, in_axes, out_axes, (updates, state, params, extra_args), n)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _is_transform(tx: Any) -> bool:
  """An optax transform, or an object with its two methods (``optax.MultiSteps``)."""
  return callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))


def _short(treedef: Any) -> str:
  text = str(treedef)
  return text if len(text) <= 120 else text[:117] + "..."


def per_node(tx: optax.GradientTransformation, *, backend: Any = None) -> optax.GradientTransformationExtraArgs:
  """Wraps an optax transform so that ``init`` and ``update`` act on each node on its own: `nodes`.

  A transform that reduces over the whole tree sees the stacked node axis as part of one
  model when used bare: ``optax.clip_by_global_norm(1.0)`` then takes one norm over every
  node's gradient, and ``optax.apply_if_finite`` skips every node's step when one node's
  gradient is NaN. Under ``per_node`` each node has its own norm and its own skip counter.
  It is `gj.nodes` under the name that says what it does to a local transform.

  Args:
    tx: any ``optax.GradientTransformation``, written for one node's params.
    backend: where the nodes live (default: the ``gj.backend.use`` block's, else simulate).

  Returns:
    A transform over node-stacked trees (see `nodes`).

  Example:
    >>> import jax.numpy as jnp, optax, gossipjax as gj
    >>> g = jnp.array([[3.0, 4.0], [0.3, 0.4]])          # node 0's norm is 5, node 1's is 0.5
    >>> clip = gj.per_node(optax.clip_by_global_norm(1.0))
    >>> u, _ = clip.update(g, clip.init(g))
    >>> [[round(float(v), 2) for v in node] for node in u]    # only node 0 is clipped
    [[0.6, 0.8], [0.3, 0.4]]
    >>> bare = optax.clip_by_global_norm(1.0)                 # one norm over both nodes
    >>> u, _ = bare.update(g, bare.init(g))
    >>> [[round(float(v), 2) for v in node] for node in u]
    [[0.6, 0.8], [0.06, 0.08]]
  """
  return nodes(tx, backend=backend, where="gj.per_node")


def chain(*transforms: optax.GradientTransformation, backend: Any = None) -> optax.GradientTransformationExtraArgs:
  """``optax.chain`` for node-stacked params: ``gj.nodes(optax.chain(*transforms))``.

  Every transform is written for one node; gossipjax's (`mix`, the methods, the averages,
  `guard_finite`) communicate over the named node axis wherever they sit, also inside an
  optax wrapper (``optax.masked``, ``inject_hyperparams``, ``MultiSteps``, a nested
  ``optax.chain``). A transform that reduces over the whole tree (``clip_by_global_norm``,
  ``apply_if_finite``, ``lamb``) reduces over one node's tree.

  Args:
    *transforms: optax transforms, in order, as for ``optax.chain``.
    backend: where the nodes live (default: the ``gj.backend.use`` block's, else simulate);
      the gossipjax transforms in the chain must have been built for the same one.

  Returns:
    The chained transform over node-stacked trees (see `nodes`).

  Example:
    >>> import jax.numpy as jnp, optax, gossipjax as gj
    >>> g = jnp.array([[3.0, 4.0], [0.3, 0.4]])      # node 0's norm is 5, node 1's is 0.5
    >>> tx = gj.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0), gj.mix(gj.topology.complete(2)))
    >>> x = jnp.zeros((2, 2))
    >>> u, _ = tx.update(g, tx.init(x), x)
    >>> [round(float(v), 2) for v in u[0]]          # the average of -[0.6, 0.8] and -[0.3, 0.4]
    [-0.45, -0.6]
  """
  for i, t in enumerate(transforms):
    if not _is_transform(t):
      hint = " (a function: call it, e.g. optax.adam(1e-3))" if callable(t) else ""
      raise TypeError(f"gj.chain: argument {i} is not an optax transform, got {t!r}{hint}")
  parts = [t if isinstance(t, optax.GradientTransformation) else optax.GradientTransformationExtraArgs(t.init, t.update)
           for t in transforms]
  return nodes(optax.chain(*parts), backend=backend, where="gj.chain")
