"""`gj.nodes`: a one-node optax transform mapped over node-stacked trees, the node axis named."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.core  # jax.core.Tracer: a type checker sees the submodule only where it is imported
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from gossipjax._axis import NodeAxis, mapped, mapping, settle_shared, shared_leaves, unguarded_under_gate
from gossipjax._validation import check_node_mask
from gossipjax.backend._base import mesh_of_explicit
from gossipjax.backend._sharded import conform, leaf_spec
from gossipjax.mixing import follow_placement, resolve_backend


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


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


# The extra arguments of gossipjax's own transforms that carry one value per node.
_PER_NODE_EXTRAS = frozenset({"up", "skip_nodes"})

# While a mapping decides its layout (one abstract init), the per-node argument names that the
# `gj.nodes` inside it declare: inside a mapping an inner `gj.nodes` is its transform itself, so
# the outer one maps those arguments over the nodes for it.
_DECLARED: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("gossipjax_declared_args", default=None)


@contextlib.contextmanager
def _collecting(names: set[str]) -> Iterator[None]:
  token = _DECLARED.set(names)
  try:
    yield
  finally:
    _DECLARED.reset(token)


class StateNotStackableError(TypeError):
  """A mapped transform's state has a leaf that is not an array, so it cannot be stacked over nodes."""


class _RaisedByInit(Exception):
  """Carries an error that the one-node transform's own ``init`` raised out of the mapping, untouched."""

  def __init__(self, error: BaseException):
    super().__init__(error)
    self.error = error


@dataclasses.dataclass(frozen=True)
class _Layout:
  """What `init` decides once for params of one structure: the state's structure and its shared leaves."""

  treedef: Any
  shared: tuple[bool, ...]
  one_node: tuple[tuple[int, ...], ...]  # each state leaf's shape for one node
  per_node_args: frozenset[str]  # the extra arguments a gj.nodes inside declares per node


class _NodeMap:
  """`gj.nodes`'s transform: ``tx`` for one node, mapped over node-stacked trees with `jax.vmap`."""

  def __init__(self, tx: Any, backend: Any, per_node_args: Sequence[str], where: str, local: bool = False):
    self.inner = _with_extra_args(tx)
    self.backend = backend
    self.axis = NodeAxis(backend, where, local)
    self.where = where
    self.per_node_args = frozenset(per_node_args) | _PER_NODE_EXTRAS
    self.mesh = _mesh_of(backend)
    self._layouts: dict[Any, _Layout] = {}
    self._compiled: dict[Any, Any] = {}

  # -- the mapped call ---------------------------------------------------------------------------

  def _mapped(self, fn: Callable[..., Any], in_axes: Any, out_axes: Any) -> Callable[..., Any]:
    def one(*args):
      with mapped(self.axis):
        try:
          return fn(*args)
        except NameError as e:
          if "unbound axis name" not in str(e):
            raise
          raise ValueError(f"{self.where}: a collective over an axis that is not bound here "
                           f"({str(e).splitlines()[0]}); the node axis has no string name: for the mean over all "
                           "nodes call gj.node_mean(x) (every backend), for a gossip round gj.mix") from e

    return jax.vmap(one, in_axes=in_axes, out_axes=out_axes, axis_name=self.axis)

  def _place(self, args: tuple[Any, ...], in_axes: tuple[Any, ...]) -> tuple[Any, ...]:
    """On a mesh, every mapped leaf laid out over the node axis (vmap wants them alike)."""
    if self.mesh is None:
      return args
    axis, where = getattr(self.backend, "axis", "nodes"), f"{self.where} on {self.backend!r}"

    def put(a, sub):
      if a is None:
        return sub
      return jax.tree.map(lambda x: conform(x, self.mesh, leaf_spec(x, self.mesh, axis, where) or P(axis)), sub)

    return tuple(jax.tree.map(put, a, arg, is_leaf=lambda v: v is None) for a, arg in zip(in_axes, args))

  def _run(self, fn: Callable[..., Any], in_axes: tuple[Any, ...], out_axes: Any, args: tuple[Any, ...],
           key: Any) -> Any:
    args = self._place(args, in_axes)
    call = self._mapped(fn, in_axes, out_axes)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
      with mesh_of_explicit(self.mesh, args):  # inside the caller's jit (or eval_shape): traced once with it
        return call(*args)
    # Called eagerly: one compiled program per layout, not op by op at every call. On an
    # Explicit mesh vmap's broadcasts of per-node values are placed through the mesh context.
    try:
      jitted = self._compiled.get(key)
    except TypeError:  # an unhashable static extra argument: compiled for this call alone
      key, jitted = None, None
    if jitted is None:
      jitted = jax.jit(call)
      if key is not None:
        self._compiled[key] = jitted
    with mesh_of_explicit(self.mesh, args):  # the backend's mesh, or the one the params are placed on
      out = jitted(*args)
    return out

  # -- the state's layout, decided once by init ---------------------------------------------------

  def _init_user(self, params: Any) -> Any:
    # A TypeError from the user's own init is theirs, not one of stacking the state it returns.
    try:
      return self.inner.init(params)
    except TypeError as e:
      raise _RaisedByInit(e) from None

  def _init_one(self, params: Any) -> Any:
    state = self._init_user(params)
    return settle_shared(state, shared_leaves(state))

  def layout(self, params: Any) -> _Layout:
    """The state's structure and which of its leaves every node holds alike, from one abstract `init`."""
    key = (jax.tree.structure(params), tuple((tuple(jnp.shape(x)), jnp.result_type(x)) for x in jax.tree.leaves(params)))
    found = self._layouts.get(key)
    if found is None:
      declared: set[str] = set()
      with _collecting(declared), mesh_of_explicit(self.mesh, params):
        stacked = jax.eval_shape(self._mapped(self._init_user, 0, 0), params)
      unguarded = unguarded_under_gate(stacked)
      if unguarded and not self.axis.local:
        raise ValueError(f"{self.where}: optax.apply_if_finite around a gossipjax method whose exchange would pass "
                         f"a skipped node's NaN to its neighbours ({', '.join(sorted(set(unguarded)))}); put the "
                         "method under gj.guard_finite instead, which skips a node's step for every method")
      leaves, treedef = jax.tree.flatten(stacked)
      found = self._layouts[key] = _Layout(treedef, tuple(shared_leaves(stacked)),
                                           tuple(tuple(x.shape[1:]) for x in leaves), frozenset(declared))
    return found

  def init(self, params: Any) -> Any:
    if mapping() is not None:
      declared = _DECLARED.get()
      if declared is not None:
        declared.update(self.per_node_args)
      return self.inner.init(params)
    params = _materialize(params)
    _leading(params, self.where)
    try:
      lay = self.layout(params)
      out_axes = jax.tree.unflatten(lay.treedef, [None if s else 0 for s in lay.shared])
      state = self._run(self._init_one, (0,), out_axes, (params,), ("init", lay))
    except _RaisedByInit as e:
      raise e.error from None
    except TypeError as e:
      raise StateNotStackableError(f"{self.where}: the state of this transform cannot be stacked over nodes "
                                   f"({str(e).splitlines()[0]}); a transform mapped over nodes needs a state whose "
                                   "leaves are arrays") from e
    # The per-node state sits where the params' nodes sit (an Auto mesh's compiler would
    # otherwise be free to put all of it on one device).
    return follow_placement(state, params)

  # -- update ---------------------------------------------------------------------------------------

  def _state_axes(self, state: Any, lay: _Layout, n: int) -> list[Any]:
    if jax.tree.structure(state) != lay.treedef:
      raise ValueError(f"{self.where}: this state was not made by this transform's init (its structure differs: "
                       f"{_short(jax.tree.structure(state))} against {_short(lay.treedef)}); "
                       "pass the state that tx.init returned")
    axes = []
    for (path, x), shared, one in zip(jax.tree_util.tree_leaves_with_path(state), lay.shared, lay.one_node):
      shape = tuple(jnp.shape(x))
      if shape == one:
        axes.append(None)  # one value for every node (a shared count, or a value tree_set for all)
      elif shape == (n,) + one and not shared:
        axes.append(0)
      else:
        want = f"{one}" if shared else f"{(n,) + one} (one value per node) or {one} (one for every node)"
        raise ValueError(f"{self.where}: state leaf {jax.tree_util.keystr(path)} has shape {shape}; expected {want}")
    return axes

  def _extra_axes(self, extra: dict[str, Any], n: int,
                  per_node_args: frozenset[str]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Extra arguments split into mapped ones (with their in_axes) and static ones (passed through)."""
    arrays, axes, static = {}, {}, {}
    for name, value in extra.items():
      leaves = jax.tree.leaves(value)
      if not leaves or not all(_is_array(x) for x in leaves):
        static[name] = value  # a function (lbfgs's value_fn), None, a string: passed as it is
        continue
      if name not in per_node_args:
        arrays[name], axes[name] = jax.tree.map(jnp.asarray, value), jax.tree.map(lambda _: None, value)
        continue
      if isinstance(value, (list, tuple)) and all(np.ndim(v) == 0 for v in value):
        value = jnp.asarray(value)  # a list of one entry per node, as the stacked transforms take it
      value = jax.tree.map(jnp.asarray, value)
      if name == "up" and isinstance(value, jax.Array):
        check_node_mask(value, (n,), self.where)  # the participation mask: one bool per node, as bare methods take it
      for path, x in jax.tree_util.tree_leaves_with_path(value):
        if not jnp.ndim(x) or jnp.shape(x)[0] != n:
          raise ValueError(f"{self.where}: the extra argument {name}{jax.tree_util.keystr(path)} is one value per "
                           f"node, so it needs a leading axis of {n} (shape ({n}, ...)); got shape {jnp.shape(x)}")
      arrays[name], axes[name] = value, jax.tree.map(lambda _: 0, value)
    return arrays, axes, static

  def _undeclared_per_node(self, error: Exception, arrays: dict[str, Any], declared: frozenset[str], n: int) -> None:
    """On a failed update, names a shared extra argument that looks like one value per node (leading axis n)."""
    names = [name for name, value in arrays.items() if name not in declared
             and all(jnp.ndim(x) and jnp.shape(x)[0] == n for x in jax.tree.leaves(value))]
    if names:
      one = len(names) == 1
      shapes = ", ".join(f"{name} (shape {jnp.shape(jax.tree.leaves(arrays[name])[0])})" for name in names)
      quoted = ", ".join(f'"{name}"' for name in names) + ("," if one else "")
      raise ValueError(f"{self.where}: the update failed ({str(error).splitlines()[0]}); the extra argument"
                       f"{'' if one else 's'} {shapes}, whose leading axis is the node count, "
                       f"{'is' if one else 'are'} not declared per node, so every node got {'it' if one else 'them'} "
                       f"whole; if {'it holds' if one else 'they hold'} one value per node, declare "
                       f"{'it' if one else 'them'}: `per_node_args=({quoted})`") from error

  def _update_one(self, static: tuple[tuple[str, Any], ...], treedef: Any, updates: Any, state: Any, params: Any,
                  extra: dict[str, Any]) -> Any:
    new, state = self.inner.update(updates, state, params, **extra, **dict(static))
    if jax.tree.structure(state) != treedef:
      raise ValueError(f"{self.where}: {_changed_state(jax.tree.unflatten(treedef, [0] * treedef.num_leaves), state)}"
                       "; a transform mapped over nodes must keep its state's structure from step to step "
                       "(init must return the structure that update returns)")
    return new, settle_shared(state, shared_leaves(state))

  def update(self, updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
    if mapping() is not None:
      return self.inner.update(updates, state, params, **extra_args)
    n = _leading(updates, self.where)
    lay = self.layout(updates if params is None else params)
    state_axes = jax.tree.unflatten(lay.treedef, self._state_axes(state, lay, n))
    declared = self.per_node_args | lay.per_node_args
    arrays, extra_axes, static = self._extra_axes(extra_args, n, declared)
    in_axes = (0, state_axes, None if params is None else 0, extra_axes)
    out_axes = (0, jax.tree.unflatten(lay.treedef, [None if s else 0 for s in lay.shared]))
    statics = tuple(sorted(static.items()))
    fn = functools.partial(self._update_one, statics, lay.treedef)
    is_axis = lambda a: a is None
    key = ("update", statics, lay, jax.tree.structure(in_axes, is_leaf=is_axis),
           tuple(jax.tree.leaves(in_axes, is_leaf=is_axis)))
    try:
      new, state = self._run(fn, in_axes, out_axes, (updates, state, params, arrays), key)
    except (TypeError, ValueError) as e:
      self._undeclared_per_node(e, arrays, declared, n)
      raise
    # As after init: a per-node leaf that one node's code computes from shapes alone (a message's
    # bit count) leaves the mapping unplaced, and the next step would see a state laid out anew.
    return new, follow_placement(state, updates if params is None else params)

  def transform(self) -> optax.GradientTransformationExtraArgs:
    return optax.GradientTransformationExtraArgs(self.init, self.update)


def _with_extra_args(tx: Any) -> optax.GradientTransformationExtraArgs:
  """``tx`` as a transform whose ``update`` takes extra arguments, passing them on where ``tx`` takes them.

  ``optax.with_extra_args_support`` drops them for an object that is not an optax transform but has
  its two methods (``optax.MultiSteps``, whose ``update`` passes them to the optimizer it wraps).
  """
  if isinstance(tx, optax.GradientTransformation):
    return optax.with_extra_args_support(tx)
  return optax.GradientTransformationExtraArgs(tx.init, tx.update)


def _is_transform(tx: Any) -> bool:
  """An optax transform, or an object with its two methods (``optax.MultiSteps``)."""
  return callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))


def _changed_state(before: Any, after: Any) -> str:
  """Where a state's structure changed in an update, and the state class that holds that part."""
  owner, where = None, ""

  def level(t):
    return jax.tree.structure(t, is_leaf=lambda x: x is not t)

  def children(t):
    return jax.tree_util.tree_flatten_with_path(t, is_leaf=lambda x: x is not t)[0]

  while level(before) == level(after) and jax.tree.structure(before) != jax.tree.structure(after):
    if type(before) not in (tuple, list, dict):
      owner, where = before, ""
    (path, before), after = next(((p, b), a) for (p, b), (_, a) in zip(children(before), children(after))
                                 if jax.tree.structure(b) != jax.tree.structure(a))
    where += jax.tree_util.keystr(path)
  holder = f"the transform whose state is {type(owner).__name__}" if owner is not None else "this transform"
  return (f"{holder} changes its state's structure in update (at {where or '<root>'}: "
          f"{_short(jax.tree.structure(before))} after init, {_short(jax.tree.structure(after))} after update)")


def _short(treedef: Any) -> str:
  text = str(treedef)
  return text if len(text) <= 120 else text[:117] + "..."


def _check_transform(tx: Any, where: str) -> None:
  if not _is_transform(tx):
    raise TypeError(f"{where}: expected an optax transform, got {tx!r}"
                    + (" (a function: call it, e.g. optax.adam(1e-3))" if callable(tx) else ""))


def nodes(tx: optax.GradientTransformation, *, backend: Any = None,
          per_node_args: Sequence[str] = ()) -> optax.GradientTransformationExtraArgs:
  """Maps a one-node optax transform over node-stacked trees.

  ``tx`` is written for one node: any optax transform or combinator (``optax.chain``,
  ``masked``, ``inject_hyperparams``, ``MultiSteps``, ...) around or inside gossipjax's own.
  Communication is a collective over the node axis that the mapping binds: inside it `gj.mix`
  and the methods' gossip rounds exchange with the neighbours, and the all-reduce methods take
  the mean over all nodes. Everything else runs on each node alone, so
  ``clip_by_global_norm`` clips each node by its own norm. The node axis is gossipjax's own
  (not a string), so it never meets an axis of the user's, ``"nodes"`` included.

  The mapped transform is ``jax.vmap`` of ``tx`` over the leading node axis, with these
  rules, each decided from the inputs:

  - **State.** ``init`` returns one node's state stacked over the nodes: every leaf has the
    node axis, as ``jax.vmap(tx.init)`` would give, except the leaves a gossipjax state class
    declares one value for every node (the step count that picks W(k) and the gossip rounds),
    which stay one value so that every node gossips on the same steps. The layout is decided
    once, by ``init``, and is the same after every step, so a jitted step compiles once and a
    ``lax.scan`` over steps keeps its carry. A leaf set with ``optax.tree_utils.tree_set`` may
    have the node axis (one value per node) or not (the same value for every node).
  - **Extra arguments** of ``update`` are the same for every node unless named in
    ``per_node_args`` (then each has a leading node axis), whatever their shape; those of
    gossipjax's own methods that are per node (``up=``, ``skip_nodes=``) are always per node.
    The names a `gj.nodes` or `gj.chain` inside ``tx`` declares are per node here too.
    An argument that is not an array (``optax.lbfgs``'s ``value_fn``) is passed as it is.
  - **Per-node gates.** A wrapper that skips a node's step (``optax.apply_if_finite``,
    ``optax.MultiSteps``) around a transform that gossips still runs the gossip for every
    node (a collective has no per-node branch), on the schedule of the shared step count.
    `gj.mix`, and the methods built on it (`gj.gossip_sgd`, ``gj.chain(adam, gj.mix(W))``),
    send the params' entry in place of a non-finite entry of ``x + u``, so a gated node's NaN
    never reaches its neighbours. ``optax.apply_if_finite`` around any other gossipjax method
    (whose exchange would pass the NaN on) is refused at ``init`` in one line that points to
    `gj.guard_finite`, which skips a node's step for every method.

  Args:
    tx: an optax transform written for one node's params.
    backend: where the nodes live (default: the ``gj.backend.use`` block's, else simulate);
      every gossipjax transform inside ``tx`` must have been built for the same one.
    per_node_args: names of ``update``'s extra arguments that carry one value per node
      (e.g. ``("value",)`` for ``optax.contrib.reduce_on_plateau`` on each node's loss).

  Returns:
    An optax transform over node-stacked trees. Called for one node (inside another
    mapping) it is ``tx`` itself.

  Raises:
    ValueError: a leaf lacks the node axis, a state was not made by this transform's
      ``init``, a per-node extra argument lacks the node axis, a transform inside was
      built for another backend, ``optax.apply_if_finite`` wraps a method whose exchange
      would pass a skipped node's NaN on, a raw collective names an axis that is not
      bound (``lax.pmean(x, "nodes")``: use `gj.node_mean`), an update fails with an extra
      argument not in ``per_node_args`` whose leading axis is the node count (the error
      names it), or ``tx``'s state changes structure in ``update`` (``optax.monitor``).

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
  _check_transform(tx, "gj.nodes")
  return _NodeMap(tx, resolve_backend(backend), per_node_args, "gj.nodes").transform()


def per_node(tx: optax.GradientTransformation, *, backend: Any = None) -> optax.GradientTransformationExtraArgs:
  """Wraps an optax transform so that ``init`` and ``update`` act on each node on its own: `nodes`.

  A transform that reduces over the whole tree sees the stacked node axis as part of one
  model when used bare: ``optax.clip_by_global_norm(1.0)`` then takes one norm over every
  node's gradient, and ``optax.apply_if_finite`` skips every node's step when one node's
  gradient is NaN. Under ``per_node`` each node has its own norm and its own skip counter.

  ``tx`` is local: it is mapped as `nodes` maps a transform, and a gossipjax transform that
  communicates (`gj.mix`, a method's gossip) inside it is refused, naming `gj.chain` / `gj.nodes`,
  which map a transform that gossips.

  Args:
    tx: any ``optax.GradientTransformation``, written for one node's params.
    backend: where the nodes live (default: the ``gj.backend.use`` block's, else simulate).

  Returns:
    A transform over node-stacked trees (see `nodes`).

  Raises:
    ValueError: a transform inside ``tx`` communicates (on its first update).

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
  _check_transform(tx, "gj.per_node")
  return _NodeMap(tx, resolve_backend(backend), (), "gj.per_node", local=True).transform()


def chain(*transforms: optax.GradientTransformation, backend: Any = None,
          per_node_args: Sequence[str] = ()) -> optax.GradientTransformationExtraArgs:
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
    per_node_args: names of ``update``'s extra arguments that carry one value per node
      (see `nodes`).

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
  return _NodeMap(optax.chain(*map(_with_extra_args, transforms)), resolve_backend(backend), per_node_args, "gj.chain").transform()
