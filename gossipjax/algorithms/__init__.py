"""The decentralized optimizers, one module per method, each an optax transform.

Every algorithm takes its topology and hyperparameters, gets a mixer from
`gossipjax.mixing.make_mixer` and never imports a backend: which backend runs it is the
caller's ``backend=`` argument.
"""

from gossipjax.algorithms._allreduce_sgd import allreduce_sgd
from gossipjax.algorithms._choco import ChocoState, choco_sgd
from gossipjax.algorithms._decentlam import DecentLaMState, decentlam
from gossipjax.algorithms._diloco import diloco
from gossipjax.algorithms._easgd import EASGDState, easgd
from gossipjax.algorithms._exact_diffusion import ExactDiffusionState, exact_diffusion
from gossipjax.algorithms._extra import ExtraState, extra
from gossipjax.algorithms._gossip_sgd import gossip_sgd
from gossipjax.algorithms._gradient_tracking import GradientTrackingState, gradient_tracker, gradient_tracking
from gossipjax.algorithms._noloco import noloco
from gossipjax.algorithms._outer_optimizer import OuterState, outer_optimizer
from gossipjax.algorithms._periodic_average import PeriodicAverageState, periodic_average
from gossipjax.algorithms._qg_dmsgd import QGMomentumState, qg_dmsgd
from gossipjax.algorithms._sgp import SGPState, sgp
from gossipjax.algorithms._streaming import StreamingDiLoCoState, streaming_diloco

__all__ = (
    "ChocoState",
    "DecentLaMState",
    "EASGDState",
    "ExactDiffusionState",
    "ExtraState",
    "GradientTrackingState",
    "OuterState",
    "PeriodicAverageState",
    "QGMomentumState",
    "SGPState",
    "StreamingDiLoCoState",
    "allreduce_sgd",
    "choco_sgd",
    "decentlam",
    "diloco",
    "easgd",
    "exact_diffusion",
    "extra",
    "gossip_sgd",
    "gradient_tracker",
    "gradient_tracking",
    "noloco",
    "outer_optimizer",
    "periodic_average",
    "qg_dmsgd",
    "sgp",
    "streaming_diloco",
)
