"""A method's hyperparameter with one value per node, on stacked trees as inside `gj.chain`.

Inside `gj.chain` a hyperparameter injected with ``optax.inject_hyperparams`` is one value per
node (the mapping's state layout). On stacked trees the same method takes the same form: a
hyperparameter given as an array of shape (n,), one entry per node, runs the method as
`gj.nodes` runs it, each node with its own value. So
``optax.inject_hyperparams(gj.gossip_sgd)(W, learning_rate=rates)`` and the same transform
inside `gj.chain` take the same ``rates`` and give the same numbers.

Each entry is checked as the method checks a scalar, and a refusal names the node: at
construction, and at every ``optax.inject_hyperparams`` update where the values are concrete
(eager). Traced values (an update under ``jit``) are not checked, as for scalars.
"""

from __future__ import annotations

import collections
import functools
import inspect
from typing import Any, Callable, TypeVar

import jax
import jax.core  # jax.core.Tracer: a type checker sees the submodule only where it is imported
import jax.numpy as jnp
import numpy as np
import optax

from gossipjax._axis import mapping
from gossipjax._mapping import _NodeMap
from gossipjax._validation import checking_node
from gossipjax.mixing import resolve_backend

F = TypeVar("F", bound=Callable[..., Any])

# The extra argument that carries each node's hyperparameters into the mapped one-node method.
_HYPER = "node_hyperparameters"


def _per_node(value: Any) -> bool:
  return not callable(value) and hasattr(value, "shape") and np.ndim(value) == 1


class _OneNode:
  """The method for one node, built from that node's hyperparameters (an extra argument of ``update``)."""

  def __init__(self, factory: Callable[..., Any], arguments: dict[str, Any], first: dict[str, Any]):
    self.factory, self.arguments, self.first = factory, arguments, first

  def build(self, values: dict[str, Any]) -> Any:
    return optax.with_extra_args_support(self.factory(**{**self.arguments, **values}))

  def init(self, params: Any) -> Any:
    return self.build(self.first).init(params)

  def update(self, updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
    values = extra.pop(_HYPER)
    return self.build(values).update(updates, state, params, **extra)


class _Built:
  """A mapping built lately, the other arguments it was built with (held alive), and the per-node values checked."""

  def __init__(self, rest: dict[str, Any], mapped: _NodeMap):
    self.rest, self.mapped = rest, mapped
    self.checked: set[Any] = set()


# The mappings built lately: ``optax.inject_hyperparams`` rebuilds the method at every update with
# the same other arguments, and the mapping found here keeps its compiled programs (an eager step
# compiles once, not at every call).
_BUILT: collections.OrderedDict[Any, _Built] = collections.OrderedDict()
_KEEP = 16


def _built(factory: Callable[..., Any], rest: dict[str, Any], per_node: dict[str, Any], where: str) -> _Built:
  key = (factory, tuple(sorted(per_node)), tuple((k, id(v)) for k, v in rest.items()))
  found = _BUILT.get(key)
  if found is not None and all(found.rest[k] is v for k, v in rest.items()):  # the same objects, held alive
    _BUILT.move_to_end(key)
    return found
  one = _OneNode(factory, rest, {k: v[0] for k, v in per_node.items()})
  mapped = _NodeMap(optax.GradientTransformationExtraArgs(one.init, one.update), resolve_backend(rest.get("backend")),
                    (_HYPER,), where)
  found = _BUILT[key] = _Built(rest, mapped)
  while len(_BUILT) > _KEEP:
    _BUILT.popitem(last=False)
  return found


def _check_entries(factory: Callable[..., Any], built: _Built, per_node: dict[str, Any]) -> None:
  """Builds the method once per distinct node's values, so that its own checks read each entry as a scalar.

  A refusal names the node (`checking_node`). Traced values are left, as the checks leave a
  traced scalar; values checked once for these arguments are not checked again (an eager
  ``inject_hyperparams`` update rebuilds the method with the same values at every step).
  """
  if any(isinstance(v, jax.core.Tracer) for v in per_node.values()):
    return
  columns = {k: np.asarray(v) for k, v in per_node.items()}
  signature = tuple((k, c.dtype.str, c.tobytes()) for k, c in sorted(columns.items()))
  if signature in built.checked:
    return
  seen = set()
  for node in range(min(len(c) for c in columns.values())):  # other lengths are refused at update, by count
    values = {k: c[node] for k, c in columns.items()}
    row = tuple(v.item() for v in values.values())
    if row in seen:
      continue
    seen.add(row)
    with checking_node(node):
      factory(**{**built.rest, **values})
  built.checked.add(signature)


def node_hyperparameters(*names: str) -> Callable[[F], F]:
  """Lets a method's hyperparameters ``names`` be one value per node on stacked trees.

  The decorated factory is unchanged for scalars and schedules. Given an array of shape
  (n,) for one of ``names`` outside any mapping, it returns the method mapped over the nodes
  with `gj.nodes`, each node built with its own entry: the state is the mapping's (as inside
  `gj.chain`), and an entry count other than the params' node count is refused there. Each
  concrete entry is checked first, as the factory checks a scalar.
  """

  def wrap(factory: F) -> F:
    signature = inspect.signature(factory)
    where = f"gj.{factory.__name__}"

    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> Any:
      bound = signature.bind(*args, **kwargs)
      per_node = {k: jnp.asarray(bound.arguments[k]) for k in names
                  if k in bound.arguments and _per_node(bound.arguments[k])}
      if not per_node or mapping() is not None:
        return factory(*args, **kwargs)
      rest = {k: v for k, v in bound.arguments.items() if k not in per_node}
      built = _built(factory, rest, per_node, where)
      _check_entries(factory, built, per_node)
      mapped = built.mapped

      def update(updates, state, params=None, **extra_args):
        leaves = jax.tree.leaves(updates)
        n = int(jnp.shape(leaves[0])[0]) if leaves and jnp.ndim(leaves[0]) else None
        for k, v in per_node.items():
          if v.shape[0] != n:
            raise ValueError(f"{where}: {k} has {v.shape[0]} values, one per node, but the updates have "
                             f"{'no node axis' if n is None else f'{n} nodes'}; pass a scalar or one value per node")
        return mapped.update(updates, state, params, **{_HYPER: per_node}, **extra_args)

      return optax.GradientTransformationExtraArgs(mapped.init, update)

    return build  # type: ignore[return-value]

  return wrap
