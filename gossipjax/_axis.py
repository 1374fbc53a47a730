"""The named node axis: whether a transform is running for one node inside `gj.nodes`, or on stacked trees.

A gossipjax transform runs in one of two places. Called on node-stacked trees (every leaf with
a leading node axis), it computes for all nodes at once. Called inside `gj.nodes` (and so
inside `gj.chain`, under any optax combinator), it sees one node's values, and its
communication is a collective over the axis named ``"nodes"``. `gj.nodes` records the mapping
here while it traces the mapped function; a transform reads it to know which place it is in.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator

AXIS = "nodes"  # the name `gj.nodes` binds to the node axis (``jax.vmap(..., axis_name=AXIS)``)


@dataclasses.dataclass(frozen=True)
class Mapping:
  """What a one-node transform needs to know about the mapping it runs under.

  Attributes:
    backend: the backend of the `gj.nodes` transform that maps it.
    num_nodes: the size of the mapped node axis where it runs (all n nodes, or an MPI rank's
      block).
    where: the public name of the mapping transform (``"gj.chain"``, ``"gj.nodes"``), for errors.
    index: this node's index on the mapped axis (traced: it differs from node to node).
  """

  backend: Any
  num_nodes: int
  where: str
  index: Any


_MAPPING: contextvars.ContextVar[Mapping | None] = contextvars.ContextVar("gossipjax_mapping", default=None)


def mapping() -> Mapping | None:
  """The mapping a transform is being traced under, or ``None`` on stacked trees."""
  return _MAPPING.get()


@contextlib.contextmanager
def mapped(value: Mapping | None) -> Iterator[None]:
  """Within the block, transforms see one node under ``value`` (``None``: stacked trees again)."""
  token = _MAPPING.set(value)
  try:
    yield
  finally:
    _MAPPING.reset(token)


_PIECES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("gossipjax_pieces", default=())


def piece_axes() -> tuple[str, ...]:
  """Inside a backend's per-node map, the mesh axes a node's leaves may be split over (a model over a node's
  devices, not a batch's data axis); ``()`` elsewhere."""
  return _PIECES.get()


@contextlib.contextmanager
def pieces_over(axes: tuple[str, ...]) -> Iterator[None]:
  """Within the block, per-node code may find a node's leaves split over ``axes``."""
  token = _PIECES.set(tuple(axes))
  try:
    yield
  finally:
    _PIECES.reset(token)
