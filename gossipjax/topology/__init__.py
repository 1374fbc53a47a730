"""Communication graphs and their mixing matrices W (rows receive: x_i <- sum_j W[i, j] x_j).

A topology is stored as its sparse plans (self weights, exchange rounds and, for hubs and exact
averaging, rank-one terms u v^T; O(n * degree));
``Topology.sparse(step)`` gives W as a ``scipy.sparse`` matrix and ``Topology.matrix(step)``
as a dense one, up to ``MAX_DENSE_NODES`` nodes. ``rho`` and ``spectral_gap`` measure how fast one
W mixes, ``rho_per_period`` how fast a time-varying topology mixes per step over its period.
"""

from gossipjax.topology._dynamic import (
    directed_exponential,
    one_peer_directed_exponential,
    one_peer_exponential,
    random_pairs,
)
from gossipjax.topology._families import (
    as_topology,
    complete,
    erdos_renyi,
    exponential,
    from_adjacency,
    from_matrix,
    from_networkx,
    grid,
    hypercube,
    ring,
    star,
    torus,
    weights_from_adjacency,
)
from gossipjax.topology._plan import MAX_DENSE_NODES, MixingPlan, RankOne, Round
from gossipjax.topology._spectral import rho, rho_per_period, spectral_gap
from gossipjax.topology._topology import Topology, is_strongly_connected

__all__ = (
    "MAX_DENSE_NODES",
    "MixingPlan",
    "RankOne",
    "Round",
    "Topology",
    "as_topology",
    "complete",
    "directed_exponential",
    "erdos_renyi",
    "exponential",
    "from_adjacency",
    "from_matrix",
    "from_networkx",
    "grid",
    "hypercube",
    "is_strongly_connected",
    "one_peer_directed_exponential",
    "one_peer_exponential",
    "random_pairs",
    "rho",
    "rho_per_period",
    "ring",
    "spectral_gap",
    "star",
    "torus",
    "weights_from_adjacency",
)
