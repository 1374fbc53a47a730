"""gossipjax: decentralized (gossip) optimization for JAX, as optax transforms.

Every algorithm is an ``optax.GradientTransformation`` over params whose leaves carry a
leading node axis; a topology (the mixing matrix W) says who averages with whom.
"""

from gossipjax import asynchrony, backend, data, topology
from gossipjax._src.allreduce import all_reduce, allreduce_sgd
from gossipjax._src.decentlam import DecentLaMState, decentlam
from gossipjax._src.gossip_sgd import gossip_sgd
from gossipjax._src.mix import MixState, mix
from gossipjax._src.nodes import (
    check_finite,
    consensus_distance,
    evaluate_mean,
    evaluate_nodes,
    init_nodes,
    node_mean,
    nonfinite_nodes,
)

__version__ = "0.1.0"

__all__ = (
    "DecentLaMState",
    "MixState",
    "all_reduce",
    "allreduce_sgd",
    "asynchrony",
    "backend",
    "check_finite",
    "consensus_distance",
    "data",
    "decentlam",
    "evaluate_mean",
    "evaluate_nodes",
    "gossip_sgd",
    "init_nodes",
    "mix",
    "node_mean",
    "nonfinite_nodes",
    "topology",
)
