"""What the core install leaves out: the main job's dependencies, installed by the ``train`` extra.

``pip install gossipjax`` brings what the optimizers and topologies need (jax, optax, numpy,
scipy, lazy_loader). The main job and the studies (``gossipjax.train``, the CLI), checkpoints and the bundled
digits need more; ``pip install 'gossipjax[train]'`` (``make demo`` in a checkout) installs it.
"""

from __future__ import annotations

import importlib.util

INSTALL_TRAIN = "pip install 'gossipjax[train]'"

# The train extra in pyproject.toml: each module's import name and its distribution.
TRAIN_MODULES = {
    "flax": "flax",
    "sklearn": "scikit-learn",
    "matplotlib": "matplotlib",
    "tqdm": "tqdm",
    "orbax": "orbax-checkpoint",
}


def require_train_extra(needed_by: str, *modules: str) -> None:
  """Raises an ``ImportError`` naming the train extra when one of ``modules`` is not installed.

  Args:
    needed_by: what needs them, as the user calls it (``"gj.checkpoint.save"``).
    *modules: top-level import names of the train extra (default: all of them).

  Raises:
    ImportError: a module is missing; the message names its distribution and the install line.
  """
  missing = [m for m in modules or TRAIN_MODULES if importlib.util.find_spec(m) is None]
  if missing:
    names = ", ".join(TRAIN_MODULES[m] for m in missing)
    raise ImportError(f"{needed_by} needs {names}, which the core install of gossipjax leaves out: "
                      f"{INSTALL_TRAIN} installs them (`make demo` in a checkout)")
