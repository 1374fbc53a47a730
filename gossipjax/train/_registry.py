"""Names the command line and configs use for topologies and algorithms."""

from __future__ import annotations

import math
from typing import Callable

import optax

from gossipjax import topology as T
from gossipjax.backend import Backend
from gossipjax._src.allreduce import allreduce_sgd
from gossipjax._src.decentlam import decentlam
from gossipjax._src.exact_diffusion import exact_diffusion
from gossipjax._src.extra import extra
from gossipjax._src.gossip_sgd import gossip_sgd
from gossipjax._src.gradient_tracking import gradient_tracking
from gossipjax._src.qg_dmsgd import qg_dmsgd


def _square_factors(n: int) -> tuple[int, int]:
  r = int(math.isqrt(n))
  while n % r:
    r -= 1
  return r, n // r


TOPOLOGIES: dict[str, Callable[[int], T.Topology]] = {
    "ring": T.ring,
    "exponential": T.exponential,
    "symmetric_exponential": lambda n: T.exponential(n, symmetric=True),
    "one_peer_exponential": T.one_peer_exponential,
    "torus": lambda n: T.torus(*_square_factors(n)),
    "grid": lambda n: T.grid(*_square_factors(n), weights="metropolis"),
    "star": lambda n: T.star(n, weights="metropolis"),
    "hypercube": T.hypercube,
    "complete": T.complete,
}

# (topology or None, learning rate, beta, backend) -> optax transform. None: needs no topology.
ALGORITHMS: dict[str, Callable[..., optax.GradientTransformation]] = {
    "allreduce": lambda topo, lr, beta, be: allreduce_sgd(lr, beta=beta, backend=be),
    "dpsgd": lambda topo, lr, beta, be: gossip_sgd(topo, beta=0.0, learning_rate=lr, backend=be),
    "dmsgd": lambda topo, lr, beta, be: gossip_sgd(topo, beta=beta, learning_rate=lr, backend=be),
    "decentlam": lambda topo, lr, beta, be: decentlam(topo, beta=beta, learning_rate=lr, backend=be),
    "qg_dmsgd": lambda topo, lr, beta, be: qg_dmsgd(topo, beta=beta, learning_rate=lr, backend=be),
    "gradient_tracking": lambda topo, lr, beta, be: gradient_tracking(topo, learning_rate=lr, backend=be),
    "exact_diffusion": lambda topo, lr, beta, be: exact_diffusion(topo, learning_rate=lr, backend=be),
    "extra": lambda topo, lr, beta, be: extra(topo, learning_rate=lr, backend=be),
}

NEEDS_NO_TOPOLOGY = frozenset({"allreduce"})


def make_topology(name: str, n: int) -> T.Topology:
  if name not in TOPOLOGIES:
    raise ValueError(f"unknown topology {name!r}; choose from {', '.join(TOPOLOGIES)}")
  return TOPOLOGIES[name](n)


def make_algorithm(name: str, topo: T.Topology | None, lr: optax.ScalarOrSchedule, beta: float,
                   backend: Backend | None = None):
  if name not in ALGORITHMS:
    raise ValueError(f"unknown algorithm {name!r}; choose from {', '.join(ALGORITHMS)}")
  return ALGORITHMS[name](topo, lr, beta, backend)
