"""The main job: train a flax model on n simulated nodes and compare algorithms and topologies.

It needs the train extra (``pip install 'gossipjax[train]'``): flax, scikit-learn, matplotlib,
tqdm and orbax-checkpoint.
"""

from gossipjax._extras import require_train_extra

require_train_extra("gossipjax.train")  # one message naming the extra, not the first missing module

import lazy_loader  # noqa: E402

# Each name (listed, with its module, in __init__.pyi) is imported on first use: the command line
# lists the algorithms (`ALGORITHM_NAMES`, from `_names`) without importing JAX.
__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
