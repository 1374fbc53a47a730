"""Names the command line and configs use for topologies and algorithms."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import optax

import gossipjax as gj
from gossipjax import compress
from gossipjax import topology as T
from gossipjax.backend import Backend


def _square_factors(n: int) -> tuple[int, int]:
  r = int(math.isqrt(n))
  while n % r:
    r -= 1
  return r, n // r


#: The topologies by the names the command line and configs use: ``name -> (n -> Topology)``.
#: ``torus`` and ``grid`` take the most square factorisation of n; ``grid`` and ``star`` use
#: Metropolis weights.
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
    "random_pairs": T.random_pairs,
}

COMPRESSORS: dict[str, Callable[[float], compress.Compressor]] = {
    "top_k": compress.top_k,
    "random_k": compress.random_k,
    "sign": lambda fraction: compress.sign(),
    "qsgd": lambda fraction: compress.qsgd(levels=16),
    "threshold_mean": lambda fraction: compress.threshold_mean(),
    "identity": lambda fraction: compress.identity(),
}


@dataclasses.dataclass(frozen=True)
class AlgorithmOptions:
  """What some algorithms take beyond the learning rate and momentum (the main job's flags).

  Attributes:
    compressor: CHOCO-SGD's compressor, a name in ``COMPRESSORS``.
    compress_fraction: the fraction of entries ``top_k`` and ``random_k`` keep.
    consensus_step: CHOCO-SGD's consensus step size, in (0, 1].
    average_every: DmSGD with periodic global averaging: steps between all-reduces.
    inner_steps: DiLoCo and NoLoCo: local steps per round, H.
    outer_learning_rate: DiLoCo and NoLoCo: the outer learning rate.
    outer_momentum: DiLoCo and NoLoCo: the outer momentum; ``None`` takes each method's
      default (0.9, Nesterov, for DiLoCo and Streaming DiLoCo; 0.5 for NoLoCo).
    num_fragments: Streaming DiLoCo: F, the fragments that synchronise in turn.
    overlap: Streaming DiLoCo: tau, the inner steps a fragment's communication overlaps.
    mixing: Streaming DiLoCo: alpha, the weight of the local params when a fragment's result
      is merged in.
    fragment_split: Streaming DiLoCo: ``"layers"`` (whole leaves) or ``"balanced"`` (equal
      bytes, cutting leaves).
  """

  compressor: str = "top_k"
  compress_fraction: float = 0.1
  consensus_step: float = 0.3
  average_every: int = 10
  inner_steps: int = 10
  outer_learning_rate: float = 0.7
  outer_momentum: float | None = None
  num_fragments: int = 4
  overlap: int = 1
  mixing: float = 0.5
  fragment_split: str = "layers"


def _outer_momentum(o: AlgorithmOptions, default: float) -> dict:
  return {"outer_learning_rate": o.outer_learning_rate,
          "outer_momentum": default if o.outer_momentum is None else o.outer_momentum}


#: The algorithms by the names the command line and configs use: ``name -> (topology or None,
#: learning rate, beta, backend, options) -> optax transform``; ``allreduce``, ``easgd``,
#: ``diloco`` and ``streaming_diloco`` take no topology. Build one with `make_algorithm`.
ALGORITHMS: dict[str, Callable[..., optax.GradientTransformation]] = {
    "allreduce": lambda topo, lr, beta, be, o: gj.allreduce_sgd(beta, learning_rate=lr, backend=be),
    "dpsgd": lambda topo, lr, beta, be, o: gj.gossip_sgd(topo, beta=0.0, learning_rate=lr, backend=be),
    "dmsgd": lambda topo, lr, beta, be, o: gj.gossip_sgd(topo, beta=beta, learning_rate=lr, backend=be),
    "decentlam": lambda topo, lr, beta, be, o: gj.decentlam(topo, beta=beta, learning_rate=lr, backend=be),
    "qg_dmsgd": lambda topo, lr, beta, be, o: gj.qg_dmsgd(topo, beta=beta, learning_rate=lr, backend=be),
    "gradient_tracking": lambda topo, lr, beta, be, o: gj.gradient_tracking(topo, learning_rate=lr, backend=be),
    "exact_diffusion": lambda topo, lr, beta, be, o: gj.exact_diffusion(topo, learning_rate=lr, backend=be),
    "extra": lambda topo, lr, beta, be, o: gj.extra(topo, learning_rate=lr, backend=be),
    "sgp": lambda topo, lr, beta, be, o: gj.sgp(topo, learning_rate=lr, beta=beta, backend=be),
    "choco": lambda topo, lr, beta, be, o: gj.choco_sgd(
        topo, COMPRESSORS[o.compressor](o.compress_fraction), learning_rate=lr, consensus_step=o.consensus_step,
        backend=be),
    "dmsgd_pga": lambda topo, lr, beta, be, o: gj.chain(
        gj.gossip_sgd(topo, beta=beta, learning_rate=lr, backend=be), gj.periodic_average(o.average_every, backend=be),
        backend=be),
    "d_adam": lambda topo, lr, beta, be, o: gj.chain(optax.adam(lr, b1=beta), gj.mix(topo, backend=be), backend=be),
    # The language-model baselines: AdamW (weight decay 1e-4, optax's default) on the all-reduced gradient
    # (data parallel), and decentralized AdamW, each node's AdamW step gossiped.
    "allreduce_adamw": lambda topo, lr, beta, be, o: gj.chain(
        optax.stateless(lambda u, p: gj.node_mean(u)), optax.adamw(lr, b1=beta), backend=be),
    "d_adamw": lambda topo, lr, beta, be, o: gj.chain(optax.adamw(lr, b1=beta), gj.mix(topo, backend=be), backend=be),
    "easgd": lambda topo, lr, beta, be, o: gj.easgd(learning_rate=lr, backend=be),
    # Local training with an outer optimizer: inner AdamW at lr (the main job's --inner-lr), b1 = --beta,
    # H = --inner-steps.
    "diloco": lambda topo, lr, beta, be, o: gj.diloco(
        optax.adamw(lr, b1=beta), inner_steps=o.inner_steps, backend=be, **_outer_momentum(o, 0.9)),
    "noloco": lambda topo, lr, beta, be, o: gj.noloco(
        optax.adamw(lr, b1=beta), topo, inner_steps=o.inner_steps, backend=be, **_outer_momentum(o, 0.5)),
    "streaming_diloco": lambda topo, lr, beta, be, o: gj.streaming_diloco(
        optax.adamw(lr, b1=beta), num_fragments=o.num_fragments, inner_steps=o.inner_steps, overlap=o.overlap,
        mixing=o.mixing, fragment_split=o.fragment_split, backend=be, **_outer_momentum(o, 0.9)),
}

# The momentum each algorithm runs with, for legends: the --beta flag, none, or a fixed value.
MOMENTUM = {"dpsgd": 0.0, "gradient_tracking": None, "exact_diffusion": None, "extra": None, "choco": None,
            "easgd": None}

NEEDS_NO_TOPOLOGY = frozenset({"allreduce", "allreduce_adamw", "easgd", "diloco", "streaming_diloco"})

#: Algorithms that run on a topology of their own unless --topologies names some: NoLoCo pairs
#: the nodes at random in every round.
OWN_TOPOLOGY = {"noloco": "random_pairs"}


def make_topology(name: str, n: int) -> T.Topology:
  """The topology named ``name`` (a key of `TOPOLOGIES`) on ``n`` nodes.

  Args:
    name: ``"ring"``, ``"exponential"``, ``"torus"``, ... (the keys of `TOPOLOGIES`).
    n: the number of nodes.

  Returns:
    The `gossipjax.topology.Topology`.

  Raises:
    ValueError: ``name`` is not a key of `TOPOLOGIES`.

  Example:
    >>> from gossipjax import train
    >>> print(train.make_topology("ring", 4).matrix()[0].round(3))
    [0.333 0.333 0.    0.333]
    >>> train.make_topology("torus", 12).num_nodes  # a 3 x 4 torus
    12
  """
  if name not in TOPOLOGIES:
    raise ValueError(f"unknown topology {name!r}; choose from {', '.join(TOPOLOGIES)}")
  return TOPOLOGIES[name](n)


def make_algorithm(name: str, topo: T.Topology | None, lr: optax.ScalarOrSchedule, beta: float,
                   backend: Backend | None = None, options: AlgorithmOptions | None = None):
  """The algorithm named ``name`` (a key of `ALGORITHMS`) as an optax transform.

  Args:
    name: ``"dmsgd"``, ``"dpsgd"``, ``"allreduce"``, ``"choco"``, ... (the keys of
      `ALGORITHMS`).
    topo: the topology (``None`` for ``allreduce``, ``easgd``, ``diloco`` and ``streaming_diloco``).
    lr: the learning rate, a float or an optax schedule.
    beta: the momentum, for the algorithms that take one (D-PSGD ignores it).
    backend: where the nodes live (default: simulate).
    options: what some algorithms take beyond the learning rate and momentum (CHOCO's
      compressor and consensus step, the period of periodic global averaging, DiLoCo's and
      NoLoCo's inner steps and outer optimizer, Streaming DiLoCo's fragments).

  Returns:
    An ``optax.GradientTransformation`` over stacked (node-axis) params.

  Raises:
    ValueError: ``name`` is not a key of `ALGORITHMS`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from gossipjax import train
    >>> tx = train.make_algorithm("dmsgd", train.make_topology("ring", 4), 0.1, 0.9)
    >>> x = jnp.ones((4, 3))
    >>> updates, _ = tx.update(x, tx.init(x), x)
    >>> optax.apply_updates(x, updates).shape
    (4, 3)
  """
  if name not in ALGORITHMS:
    raise ValueError(f"unknown algorithm {name!r}; choose from {', '.join(ALGORITHMS)}")
  return ALGORITHMS[name](topo, lr, beta, backend, options or AlgorithmOptions())
