"""Shared plumbing for algorithms: topology + backend -> mixer, and node-axis checks."""

from __future__ import annotations

from typing import Any

import jax

from gossipjax.backend import Backend, Mixer, simulate
from gossipjax.topology import Topology, as_topology
from gossipjax.topology._topology import Stochasticity


def make_mixer(topology: Any, backend: Backend | None = None, stochastic: Stochasticity = "doubly") -> Mixer:
  """Validates the topology for what the algorithm needs and builds the backend's mixer."""
  topo = as_topology(topology).check(stochastic=stochastic)
  return (backend or simulate()).mixer(topo)


def check_node_axis(tree: Any, expected: int, topology_name: str, what: str = "params") -> None:
  """Raises ``ValueError`` naming both sizes when a leaf's leading axis is not ``expected``.

  Shapes are static under ``jit``, so this costs nothing at run time.
  """
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    shape = getattr(leaf, "shape", ())
    if len(shape) == 0 or shape[0] != expected:
      got = "no node axis (a scalar)" if len(shape) == 0 else f"a leading node axis of {shape[0]}"
      raise ValueError(
          f"{what}{jax.tree_util.keystr(path)} has {got}, but {topology_name} expects {expected} "
          "nodes on the leading axis (stack every node's params, e.g. with gj.init_nodes)"
      )


def require_params(params: Any, name: str) -> None:
  if params is None:
    raise ValueError(f"{name} needs the current params: call tx.update(updates, state, params)")
