"""Communication graphs and their mixing matrices W (rows receive: x_i <- sum_j W[i, j] x_j)."""

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
from gossipjax.topology._topology import MixingPlan, Round, Topology, is_strongly_connected, rho, spectral_gap

__all__ = (
    "MixingPlan",
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
    "ring",
    "spectral_gap",
    "star",
    "torus",
    "weights_from_adjacency",
)
