"""gossipjax: decentralized (gossip) optimization for JAX, as optax transforms.

Every algorithm is an ``optax.GradientTransformation`` over params whose leaves carry a
leading node axis; a topology (the mixing matrix W) says who averages with whom.
"""

from gossipjax import algorithms, asynchrony, backend, checkpoint, compress, data, mixing, topology
from gossipjax._guard import GuardFiniteState, SkipNodes, check_guard, guard_finite, nonfinite_counts, zero_skipped
from gossipjax._nodes import (
    check_finite,
    consensus_distance,
    evaluate_mean,
    evaluate_nodes,
    init_nodes,
    node_mean,
    nonfinite_nodes,
    per_node,
)
from gossipjax.algorithms import (
    ChocoState,
    DecentLaMState,
    EASGDState,
    ExactDiffusionState,
    ExtraState,
    GradientTrackingState,
    PeriodicAverageState,
    QGMomentumState,
    SGPState,
    allreduce_sgd,
    choco_sgd,
    decentlam,
    easgd,
    exact_diffusion,
    extra,
    gossip_sgd,
    gradient_tracking,
    periodic_average,
    qg_dmsgd,
    sgp,
)
from gossipjax.mixing import MixState, mix

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
    "SkipNodes",
    "algorithms",
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
    "mixing",
    "node_mean",
    "nonfinite_counts",
    "nonfinite_nodes",
    "per_node",
    "periodic_average",
    "qg_dmsgd",
    "sgp",
    "topology",
    "zero_skipped",
)
