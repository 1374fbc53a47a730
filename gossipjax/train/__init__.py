"""The main job: train a flax model on n simulated nodes and compare algorithms and topologies.

It needs the train extra (``pip install 'gossipjax[train]'``): flax, scikit-learn, matplotlib,
tqdm and orbax-checkpoint.
"""

from gossipjax._extras import require_train_extra

require_train_extra("gossipjax.train")  # one message naming the extra, not the first missing module

from gossipjax.train._loop import (  # noqa: E402
    RunConfig, TrainState, accuracy, cross_entropy, guarded, init_state, run, timed_run)
from gossipjax.train._models import CNN, GPT, MLP  # noqa: E402
from gossipjax.train._registry import ALGORITHMS, TOPOLOGIES, make_algorithm, make_topology  # noqa: E402
from gossipjax.train._report import plot, result_table, write_metrics  # noqa: E402

__all__ = (
    "ALGORITHMS",
    "CNN",
    "GPT",
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
