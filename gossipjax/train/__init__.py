"""The main job: train a flax model on n simulated nodes and compare algorithms and topologies."""

from gossipjax.train._loop import RunConfig, TrainState, accuracy, cross_entropy, guarded, init_state, run, timed_run
from gossipjax.train._models import CNN, MLP
from gossipjax.train._registry import ALGORITHMS, TOPOLOGIES, make_algorithm, make_topology
from gossipjax.train._report import plot, result_table, write_metrics

__all__ = (
    "ALGORITHMS",
    "CNN",
    "MLP",
    "RunConfig",
    "TOPOLOGIES",
    "TrainState",
    "accuracy",
    "cross_entropy",
    "guarded",
    "init_state",
    "make_algorithm",
    "make_topology",
    "plot",
    "result_table",
    "run",
    "timed_run",
    "write_metrics",
)
