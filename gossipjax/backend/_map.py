"""What every backend's ``map`` shares: reading ``in_axes`` as ``jax.vmap`` does, and checking node axes.

``backend.map(fn, in_axes)`` applies ``fn`` to each node's slice of its arguments. The node
axis is always the leading one, so an entry of ``in_axes`` is ``0`` (the argument, or that
part of it, carries the node axis) or ``None`` (it is broadcast to every node: shared data,
a shared PRNG key), and ``in_axes`` is either one of those for all arguments or a tuple with
one pytree prefix per positional argument, as in ``jax.vmap``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

InAxes = Any  # 0, None, or a tuple of per-argument pytree prefixes of 0 / None


def _is_axis(a: Any) -> bool:
  return a is None or (isinstance(a, int) and not isinstance(a, bool))


def per_argument_axes(in_axes: InAxes, args: Sequence[Any], where: str) -> tuple[Any, ...]:
  """``in_axes`` as a tuple with one pytree prefix of 0 / None per positional argument."""
  if _is_axis(in_axes):
    axes = (in_axes,) * len(args)
  elif isinstance(in_axes, (tuple, list)):
    if len(in_axes) != len(args):
      raise ValueError(f"{where}: in_axes has {len(in_axes)} entries but the function got {len(args)} "
                       "positional arguments (one entry per argument, as in jax.vmap)")
    axes = tuple(in_axes)
  else:
    raise TypeError(f"{where}: in_axes must be 0, None or a tuple with one entry per argument, got {in_axes!r}")
  for a in jax.tree.leaves(axes, is_leaf=lambda x: x is None):
    if a is not None and a != 0:
      raise ValueError(f"{where}: in_axes entries must be 0 (the leading node axis) or None (broadcast), "
                       f"got {a!r}; move the node axis to the front with jnp.moveaxis")
  return axes


def mapped_leaves(axes: tuple[Any, ...], args: Sequence[Any], where: str) -> list[tuple[str, Any]]:
  """``(path, leaf)`` for every leaf that carries the node axis (``in_axes`` 0), in argument order."""
  found = []
  for i, (axis, arg) in enumerate(zip(axes, args)):
    try:
      pairs = jax.tree.map(lambda a, sub: (a, sub), axis, arg, is_leaf=lambda x: x is None)
    except ValueError as e:
      raise ValueError(f"{where}: in_axes[{i}] = {axis!r} is not a pytree prefix of argument {i}: {e}") from e
    for prefix_path, (a, sub) in jax.tree_util.tree_flatten_with_path(
        pairs, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and _is_axis(x[0]))[0]:
      if a is None:
        continue
      for path, leaf in jax.tree_util.tree_flatten_with_path(sub)[0]:
        found.append((f"argument {i}{jax.tree_util.keystr(prefix_path)}{jax.tree_util.keystr(path)}", leaf))
  return found


def check_node_axes(axes: tuple[Any, ...], args: Sequence[Any], expected: int | None, where: str,
                    divisor: int = 1, divisor_what: str = "") -> int:
  """Checks every mapped leaf's leading axis; returns the node count it holds.

  Args:
    expected: the leading-axis size every mapped leaf must have; ``None`` takes the first
      mapped leaf's and requires the others to agree with it.
    divisor: the leading axis must also split evenly over this many devices.

  Raises:
    ValueError: naming the leaf, its shape and the expected size.
  """
  leaves = mapped_leaves(axes, args, where)
  if not leaves:
    raise ValueError(f"{where}: no argument carries the node axis (every in_axes entry is None); "
                     "map at least one argument over its leading axis with in_axes=0")
  source = ""  # where the expected size comes from, when it is inferred
  for name, leaf in leaves:
    shape = tuple(getattr(leaf, "shape", ()))
    if not shape:
      raise ValueError(f"{where}: {name} is a scalar, with no node axis to map over; "
                       "pass it with in_axes=None to give every node the same value")
    if expected is None:
      expected, source = shape[0], f" (as {name} has)"
    if divisor > 1 and shape[0] % divisor:
      raise ValueError(f"{where}: {name} has shape {shape}, whose leading node axis ({shape[0]}) does not "
                       f"split evenly over the {divisor} {divisor_what}; use a multiple of {divisor} nodes")
    if shape[0] != expected:
      raise ValueError(f"{where}: {name} has shape {shape} but its leading node axis must be {expected}"
                       f"{source}; stack every node's values on axis 0, or pass shared values with in_axes=None")
  assert expected is not None  # set by the first leaf, and there is one
  return expected


def vmap_nodes(fn: Callable[..., Any], in_axes: InAxes, expected: int | None, where: str) -> Callable[..., Any]:
  """``jax.vmap(fn, in_axes)`` over the leading node axis, after checking every mapped leaf."""

  def mapped(*args):
    axes = per_argument_axes(in_axes, args, where)
    check_node_axes(axes, args, expected, where)
    return jax.vmap(fn, in_axes=axes)(*args)

  return mapped
