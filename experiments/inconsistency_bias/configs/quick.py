"""Under a minute on 2 CPU cores: the ring only, shorter sweeps, 20000 iterations."""

import dataclasses

from inconsistency_bias.configs import default


def get_config() -> default.Config:
  return dataclasses.replace(default.get_config(), topologies=("ring",), steps=20000,
                             lr_sweep=(0.02, 0.01, 0.005), beta_sweep=(0.0, 0.5, 0.9))
