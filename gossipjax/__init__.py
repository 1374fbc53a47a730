"""gossipjax: decentralized (gossip) optimization for JAX, as optax transforms.

Every algorithm is an ``optax.GradientTransformation`` over params whose leaves carry a
leading node axis; a topology (the mixing matrix W) says who averages with whom.
"""

from gossipjax import asynchrony, backend, checkpoint, compress, data, topology
from gossipjax._src.allreduce import all_reduce, allreduce_sgd
from gossipjax._src.choco import ChocoState, choco_sgd
from gossipjax._src.decentlam import DecentLaMState, decentlam
from gossipjax._src.easgd import EASGDState, easgd
from gossipjax._src.exact_diffusion import ExactDiffusionState, exact_diffusion
from gossipjax._src.extra import ExtraState, extra
from gossipjax._src.fault import abort_on_error
from gossipjax._src.gossip_sgd import gossip_sgd
from gossipjax._src.gradient_tracking import GradientTrackingState, gradient_tracking
from gossipjax._src.guard import GuardFiniteState, check_guard, guard_finite, nonfinite_counts
from gossipjax._src.mix import MixState, mix
from gossipjax._src.nodes import (
    check_finite,
    consensus_distance,
    evaluate_mean,
    evaluate_nodes,
    init_nodes,
    node_mean,
    nonfinite_nodes,
    per_node,
)
from gossipjax._src.periodic_average import PeriodicAverageState, periodic_average
from gossipjax._src.qg_dmsgd import QGMomentumState, qg_dmsgd
from gossipjax._src.sgp import SGPState, sgp
from gossipjax.topology import random_pairs

__version__ = "0.1.0"

__all__ = (
    "ChocoState",
    "DecentLaMState",
    "EASGDState",
    "ExactDiffusionState",
    "ExtraState",
    "GradientTrackingState",
    "GuardFiniteState",
    "MixState",
    "PeriodicAverageState",
    "QGMomentumState",
    "SGPState",
    "abort_on_error",
    "all_reduce",
    "allreduce_sgd",
    "asynchrony",
    "backend",
    "check_finite",
    "check_guard",
    "checkpoint",
    "choco_sgd",
    "compress",
    "consensus_distance",
    "data",
    "decentlam",
    "easgd",
    "evaluate_mean",
    "evaluate_nodes",
    "exact_diffusion",
    "extra",
    "gossip_sgd",
    "gradient_tracking",
    "guard_finite",
    "init_nodes",
    "mix",
    "node_mean",
    "nonfinite_counts",
    "nonfinite_nodes",
    "per_node",
    "periodic_average",
    "qg_dmsgd",
    "random_pairs",
    "sgp",
    "topology",
)
