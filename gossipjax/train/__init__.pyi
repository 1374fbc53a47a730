# The names of `gossipjax.train`, for type checkers and for the lazy loader of `__init__.py`.
from ._loop import (
    RunConfig, TrainState, accuracy, cross_entropy, guarded, init_state, run, timed_run)
from ._models import CNN, GPT, MLP
from ._names import ALGORITHM_NAMES, COMPRESSOR_NAMES, TOPOLOGY_NAMES
from ._registry import ALGORITHMS, TOPOLOGIES, make_algorithm, make_topology
from ._report import plot, result_table, write_metrics

__all__ = (
    "ALGORITHMS",
    "ALGORITHM_NAMES",
    "COMPRESSOR_NAMES",
    "CNN",
    "GPT",
    "MLP",
    "RunConfig",
    "TOPOLOGIES",
    "TOPOLOGY_NAMES",
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
